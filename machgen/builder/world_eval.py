"""Steering accuracy of the world model (``models/shapes-world``) through machgen's own streaming engine, in
process: held-out sessions steered by a random walk of actions, every chunk read back by the world-shapes
detector (machgen/datasets/world_shapes.py).

    python -m machgen.builder.world_eval --checkpoint training/world      # its latest checkpoint's EMA
    python -m machgen.builder.world_eval --model models/shapes-world
    python -m machgen.builder.world_eval --model models/shapes-world --streaming '{"chunk_frames": 1}'  # other chunks
    python -m machgen.builder.world_eval --repository REPO --name shapes-world
    python -m machgen.builder.world_eval --url 127.0.0.1:8001 --name shapes-world   # served (world_served.py)

A session opens with its subject as the prompt ("a red circle"); before each chunk the walk picks an action
among those whose whole chunk keeps the shape (where the detector last saw it, taken at the largest size)
inside the walls, and steers the session with it (the engine switches to the action's prompt: the card's
template around the subject). With chunks of one latent frame the first chunk is one frame, which can only show
the shape still: its action is stop.
A chunk is steered when the detector reads its action (``stop``: it stays still); the first chunk after a
key is the first that counts. Reported: the share of chunks steered and with the subject's colour and shape
kept, over all chunks and over chunks 1-8 and 17-24 (drift); each key's lag (chunks from the key to the
first chunk that shows it; missed when none does before the next key); and per action.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from machgen.builder.world_scores import SessionRecord, last_centre, score
from machgen.datasets import world_shapes

# The walk takes every shape at the dataset's largest size, with a pixel to spare, as the detector's centre of a
# generated shape may be a pixel off.
_WALK_SIZE = 22 + 2


def run_sessions(engine, sessions: list[tuple[world_shapes.Subject, int]], chunks: int, rows: int,
                 size: tuple[int, int] = (64, 64), keep_frames: bool = False,
                 log=print) -> list[SessionRecord]:
    """Plays the sessions ``rows`` at a time (their chunks batched in the engine's calls)."""
    settings = engine.settings
    records = [SessionRecord(subject, seed) for subject, seed in sessions]
    lengths = world_shapes.chunk_lengths(chunks, settings.chunk_frames)
    for first in range(0, len(records), rows):
        group = records[first:first + rows]
        walks = {id(r): np.random.default_rng([r.seed, 1]) for r in group}
        last = {id(r): None for r in group}
        for record in group:
            engine.open(f"s{record.seed}", record.subject.phrase, record.seed, *size)
        started = time.monotonic()
        for chunk in range(chunks):
            for record in group:
                moves = lengths[chunk] - (chunk == 0)
                centre = last_centre(last[id(record)])
                if not moves:  # a first chunk of one frame (chunks of one latent frame) can only stay still
                    allowed = ["stop"]
                elif centre is not None:
                    allowed = world_shapes.allowed_actions(centre, _WALK_SIZE, moves)
                else:
                    allowed = list(world_shapes.ACTIONS)
                action = allowed[walks[id(record)].integers(len(allowed))]
                record.actions.append(action)
                engine.change(f"s{record.seed}", action=action)
                engine.want(f"s{record.seed}")
            while any(engine.session(f"s{r.seed}").wants for r in group):
                engine.step({f"s{r.seed}" for r in group})
            for record in group:
                result = engine.session(f"s{record.seed}").outbox.pop(0)
                frames = np.asarray(result.frames)
                before = last[id(record)][-1] if last[id(record)] is not None else None
                record.readings.append(world_shapes.detect_chunk(frames, before))
                last[id(record)] = frames
                if keep_frames:
                    record.frames.append(frames)
        for record in group:
            engine.close(f"s{record.seed}")
        log(f"sessions {first + 1}-{first + len(group)}: {chunks} chunks in {time.monotonic() - started:.1f} s")
    return records


def key_latency(engine, chunks: int, size: tuple[int, int] = (64, 64)) -> dict:
    """One session alone: the wall time from a key (a prompt switch, re-caching the kept chunks) to the frames
    of the chunk that shows it, for ``chunks`` keys in a row, each a different action than the one before."""
    subject = world_shapes.Subject("red", "circle")
    engine.open("latency", subject.phrase, 0, *size)
    engine.next_chunk("latency")
    cycle = ["right", "stop", "left", "stop", "down", "stop", "up", "stop"]
    times = []
    for index in range(chunks):
        started = time.perf_counter()
        engine.change("latency", action=cycle[index % len(cycle)])
        engine.next_chunk("latency")
        times.append(time.perf_counter() - started)
    engine.close("latency")
    ms = np.array(times) * 1000
    return {"keys": chunks, "median_ms": round(float(np.median(ms)), 1), "p90_ms": round(float(np.percentile(ms, 90)), 1),
            "max_ms": round(float(ms.max()), 1)}


def frame_strip(record: SessionRecord, every: int = 4):
    """uint8 picture: every ``every``-th frame of a session, one row per chunk group, captioned by nothing
    (the actions go beside it in the card)."""
    frames = np.concatenate(record.frames)[::every]
    per_row = 16
    rows = -(-len(frames) // per_row)
    pad = rows * per_row - len(frames)
    frames = np.concatenate([frames, np.zeros((pad, *frames.shape[1:]), np.uint8)])
    return frames.reshape(rows, per_row, *frames.shape[1:]).transpose(0, 2, 1, 3, 4).reshape(
        rows * frames.shape[1], per_row * frames.shape[2], 3)


def _repository(args, log) -> tuple[Path, str]:
    from machgen.builder.build import build_repository

    if args.repository:
        return Path(args.repository), args.name
    model = Path(args.model) if args.model else None
    if args.checkpoint:
        from machgen.builder.world_training import export_checkpoint

        model = export_checkpoint(Path(args.checkpoint), Path(args.work) / "model")
        log(f"exported {args.checkpoint}'s checkpoint to {model}")
    repository = Path(args.work) / "repository"
    build_repository(model, args.name, repository, log=lambda line: None, preview=False, discard_changes=True,
                     streaming=_streaming(model, args.streaming))
    log(f"built {repository}")
    return repository, args.name


def _streaming(model: Path, override: str | None):
    """The model card's streaming section with ``override``'s fields (inline JSON or a JSON file) in place of
    its own, e.g. '{"chunk_frames": 1}'; None (the card's as it is) without one."""
    from machgen.builder.model_folder import SERVING_FILE
    from machgen.contract.streaming import StreamingSettings

    if override is None:
        return None
    card = json.loads((model / SERVING_FILE).read_text()).get("streaming", {})
    try:
        fields = json.loads(override if override.lstrip().startswith("{") else Path(override).read_text())
        return StreamingSettings.from_json({**card, **fields})
    except (ValueError, TypeError, OSError) as err:
        raise SystemExit(f"--streaming: {err}") from None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a world training folder: its latest checkpoint's EMA weights")
    source.add_argument("--model", help="a world model folder (diffusers, with its machgen.json)")
    source.add_argument("--repository", help="a built repository (with --name)")
    source.add_argument("--url", help="host:port of a Triton (gRPC) serving the model (with --name): the "
                                      "sessions played through it, paced to real time")
    parser.add_argument("--name", default="shapes-world")
    parser.add_argument("--work", default="build/world-eval", help="where the export and the build go")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--rows", type=int, default=8, help="sessions batched in one denoiser call")
    parser.add_argument("--seed", type=int, default=4048, help="the held-out sessions' seed")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--strip", help="write the first session's frame strip (PNG) here")
    parser.add_argument("--latency", type=int, default=0, help="also time this many keys of one session alone")
    parser.add_argument("--streaming", metavar="JSON", help="with --model or --checkpoint: these fields of the "
                        "streaming mode (JSON or a JSON file) in place of the card's, e.g. '{\"chunk_frames\": 1}'")
    args = parser.parse_args(argv)
    if args.streaming is not None and (args.repository or args.url):
        parser.error("--streaming needs --model or --checkpoint (a built repository has its streaming mode)")
    if args.url:
        from machgen.builder.world_served import served_figures

        started = time.monotonic()
        figures = served_figures(args.url, args.name, world_shapes.evaluation_sessions(args.sessions, args.seed),
                                 args.chunks, args.rows, _WALK_SIZE, args.latency)
        return _report({**figures, "seconds": round(time.monotonic() - started, 1)}, args.out)

    import torch

    from machgen.runtime.local import LocalPipeline

    torch.set_num_threads(1)
    started = time.monotonic()
    repository, name = _repository(args, print)
    sessions = world_shapes.evaluation_sessions(args.sessions, args.seed)
    with LocalPipeline(repository, name, intra_op_threads=1) as local:
        engine = local.streaming(max_sessions=max(args.rows, 8), max_rows=args.rows)
        records = run_sessions(engine, sessions, args.chunks, args.rows, keep_frames=bool(args.strip))
        latency = key_latency(engine, args.latency) if args.latency else None
    figures = {**score(records), "seconds": round(time.monotonic() - started, 1)}
    if latency:
        figures["key_to_frames"] = latency
    if args.strip:
        from PIL import Image

        Image.fromarray(frame_strip(records[0])).save(args.strip)
        figures["strip_actions"] = records[0].actions
    return _report(figures, args.out)


def _report(figures: dict, out: str | None) -> dict:
    print(json.dumps(figures, indent=2))
    if out:
        Path(out).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
