"""``machgen session``: plays a realtime session of a served model (one built with a streaming mode) through
Triton's gRPC and writes its frames to an MP4 file as they come, steered at the chunks the command names."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def parse_steering(steps: list[str]) -> dict[int, dict[str, str]]:
    """``CHUNK:ACTION`` or ``CHUNK:prompt=TEXT`` items, by chunk: what to switch to before that chunk."""
    steering: dict[int, dict[str, str]] = {}
    for item in steps:
        chunk, separator, what = item.partition(":")
        if not separator or not chunk.isdigit() or not what:
            raise typer.BadParameter(f"{item!r} is not CHUNK:ACTION or CHUNK:prompt=TEXT", param_hint="--steer")
        if int(chunk) == 0:
            raise typer.BadParameter("chunk 0 starts from --prompt or --action", param_hint="--steer")
        steering[int(chunk)] = {"prompt": what[len("prompt="):]} if what.startswith("prompt=") else {"action": what}
    return steering


def session(
    model: str = typer.Option(..., "--model", help="served model name (built with a streaming mode)"),
    out: Path = typer.Option(..., "--out", help="the MP4 file the frames go to as they come"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="what the session starts from"),
    action: Optional[str] = typer.Option(None, "--action", help="or one of the model's actions (its prompt)"),
    chunks: int = typer.Option(8, "--chunks", min=1, help="chunks to play"),
    steer: Optional[list[str]] = typer.Option(None, "--steer", help="CHUNK:ACTION or CHUNK:prompt=TEXT: switch "
                                                                    "before that chunk (repeatable)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="noise seed (random when absent)"),
    height: Optional[int] = typer.Option(None, "--height"),
    width: Optional[int] = typer.Option(None, "--width"),
    url: str = typer.Option("127.0.0.1:8001", "--url", help="host:port of Triton's gRPC endpoint"),
    quiet: bool = typer.Option(False, "--quiet", help="no line per chunk"),
) -> None:
    """Play a realtime session: frames to an MP4 as each chunk arrives, one line of stats per chunk."""
    from machgen.client import GenerationError, MachgenClient
    from machgen.client.video import Mp4Writer

    if (prompt is None) == (action is None):
        raise typer.BadParameter("give --prompt or --action (one of them)", param_hint="--prompt")
    steering = parse_steering(steer or [])
    if any(chunk >= chunks for chunk in steering):
        raise typer.BadParameter(f"a chunk to steer at is past --chunks {chunks}", param_hint="--steer")
    stops = sorted(steering) + [chunks]
    try:
        with MachgenClient(url) as client:
            played = client.open_session(model, prompt=prompt, action=action, seed=seed, height=height,
                                         width=width, chunks=stops[0])
            writer = None
            try:
                done = 0
                for stop in stops:
                    if done:
                        played.interact(**steering[done])
                        played = played.play(chunks=stop - done)
                    for chunk in played:
                        writer = writer or Mp4Writer(out, chunk.fps)
                        writer.write(chunk.frames)
                        if not quiet:
                            stats = chunk.stats
                            typer.echo(f"chunk {chunk.chunk}: {len(chunk.frames)} frames, {stats['wait_ms']:.0f} ms "
                                       f"(denoise {stats['denoise_ms']:.0f}, decode {stats['decode_ms']:.0f}, "
                                       f"{stats['rows']} sessions a call)")
                    done = stop
            finally:
                if writer is not None:
                    writer.close()
                try:
                    played.stop()
                except GenerationError:
                    pass  # the error that ended the session says more
    except GenerationError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {out} ({writer.frames_written} frames at {writer.fps} fps)")
