"""machgen: serve a model repository, and generate images from a served model."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Serve diffusion pipelines on Triton and call them.", no_args_is_help=True,
                  add_completion=False)


def _interrupt(signum, frame) -> None:
    # SIGTERM takes the same clean shutdown path as Ctrl-C.
    raise KeyboardInterrupt


@app.command()
def serve(
    repository: Path = typer.Argument(..., exists=True, file_okay=False, help="model repository"),
    http_port: int = typer.Option(8000, "--http-port"),
    grpc_port: int = typer.Option(8001, "--grpc-port"),
    metrics_port: int = typer.Option(8002, "--metrics-port"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0 for all)"),
    verbose: bool = typer.Option(False, "--verbose", help="verbose server log (per-step progress)"),
) -> None:
    """Start tritonserver on REPOSITORY; Ctrl-C or SIGTERM stops it cleanly."""
    from machgen.server import Ports, ServerError, TritonServer

    server = TritonServer(repository, Ports(http_port, grpc_port, metrics_port), host=host, verbose=verbose)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        typer.echo(f"starting tritonserver on {repository} ...")
        server.start()
        typer.echo(f"ready: HTTP {host}:{http_port}  gRPC {host}:{grpc_port}  metrics {host}:{metrics_port}")
        typer.echo(f"server log: {server.log_file}")
        code = server.wait()
        typer.secho(f"tritonserver exited with code {code}:\n{server.log_tail()}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code or 1)
    except KeyboardInterrupt:
        typer.echo("stopping tritonserver ...")
    except ServerError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    finally:
        server.stop()


# An image model's frames written as MP4 (it reports no frame rate of its own).
DEFAULT_FPS = 16
# What each task sends besides the prompt: (needs an --image, needs --reference-image, makes video).
TASKS = {"t2i": (False, False, False), "i2i": (True, False, False), "t2v": (False, False, True),
         "i2v": (True, False, True), "r2v": (False, True, True)}


def _family_flags_help() -> str:
    """The family inputs' options, from their declarations (shown by --help)."""
    from machgen.families.registry import family_inputs

    lines = ["Model families' own inputs (the model's family must take them; --input NAME=VALUE sends any input):"]
    for declared, families in family_inputs().values():
        repeat = " (repeatable)" if declared.repeatable else ""
        lines.append(f"{declared.flag} {declared.tensor.triton_dtype}{repeat}: {declared.tensor.doc} "
                     f"[{', '.join(families)}]")
    return "\n\n".join(lines)


def _family_options(extra: list[str], pairs: list[str]) -> dict[str, object]:
    """The family inputs given as their own flags (``extra``: what typer did
    not parse) or as ``--input NAME=VALUE``, typed as their families declare them."""
    from machgen.families.registry import family_inputs

    declared = {d.name: d for d, _ in family_inputs().values()}
    by_flag = {d.flag: d for d in declared.values()}
    values: dict[str, list[str]] = {}
    words = list(extra)
    while words:
        flag = words.pop(0)
        name, _, value = flag.partition("=")
        if name not in by_flag:
            raise typer.BadParameter(f"no such option: {name}", param_hint="OPTIONS")
        if not value:
            if not words:
                raise typer.BadParameter(f"{name} needs a value", param_hint=name)
            value = words.pop(0)
        values.setdefault(by_flag[name].name, []).append(value)
    for pair in pairs:
        name, separator, value = pair.partition("=")
        if not separator:
            raise typer.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--input")
        values.setdefault(name, []).extend(value.split(","))

    def typed(text: str, triton_dtype: str):
        try:
            return {"FP32": float, "INT32": int, "INT64": int}.get(triton_dtype, str)(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a {triton_dtype} value") from None

    options: dict[str, object] = {}
    for name, texts in values.items():
        if name not in declared:  # not a family's: the server's metadata types it
            options[name] = texts if len(texts) > 1 else texts[0]
            continue
        dtype = declared[name].tensor.triton_dtype
        items = [typed(text, dtype) for text in texts]
        options[name] = items if declared[name].repeatable else items[-1]
    return options


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog=_family_flags_help())
def generate(
    ctx: typer.Context,
    prompt: str = typer.Option(..., "--prompt"),
    out: Path = typer.Option(..., "--out", help="file to write: .mp4 for video (all frames, with its sound), "
                                                ".wav for the sound alone, else an image (PNG; an index is "
                                                "appended when there are several frames)"),
    model: str = typer.Option(..., "--model", help="served model name"),
    url: str = typer.Option("127.0.0.1:8001", "--url", help="host:port of the chosen protocol"),
    protocol: str = typer.Option("grpc", "--protocol", help="grpc or http"),
    task: Optional[str] = typer.Option(None, "--task", help="t2i, i2i, t2v, i2v or r2v: checks that the inputs "
                                                            "it needs are given (default: as the inputs imply)"),
    negative_prompt: Optional[str] = typer.Option(None, "--negative-prompt"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    steps: Optional[int] = typer.Option(None, "--steps"),
    guidance_scale: Optional[float] = typer.Option(None, "--guidance-scale"),
    true_cfg_scale: Optional[float] = typer.Option(None, "--true-cfg-scale"),
    height: Optional[int] = typer.Option(None, "--height"),
    width: Optional[int] = typer.Option(None, "--width"),
    cache_policy: Optional[str] = typer.Option(None, "--cache-policy", help="none, fbcache or magcache"),
    cache_threshold: Optional[float] = typer.Option(None, "--cache-threshold"),
    image: Optional[Path] = typer.Option(None, "--image", exists=True, dir_okay=False,
                                         help="image-to-image or image-to-video: the starting picture "
                                              "(PNG, JPEG, ...)"),
    strength: Optional[float] = typer.Option(None, "--strength",
                                             help="image-to-image: how much is redrawn, 0-1 (default 0.6)"),
    num_frames: Optional[int] = typer.Option(None, "--num-frames", help="video: frames to generate"),
    fps: Optional[int] = typer.Option(None, "--fps", help="video: frames per second (default: the model's)"),
    reference_images: Optional[list[Path]] = typer.Option(None, "--reference-image", exists=True, dir_okay=False,
                                                          help="reference-to-video: a picture (repeatable)"),
    inputs: Optional[list[str]] = typer.Option(None, "--input", help="NAME=VALUE: any input of the model, a "
                                                                     "vector as comma-separated values "
                                                                     "(repeatable)"),
) -> None:
    """Generate an image or a video through a served pipeline and save it (PNG, MP4; WAV: the sound alone)."""
    import time

    import numpy as np
    from PIL import Image

    from machgen.client import GenerationError, MachgenClient

    if task is not None:
        if task not in TASKS:
            raise typer.BadParameter(f"{task!r} is not one of {', '.join(TASKS)}", param_hint="--task")
        needs_image, needs_references, video = TASKS[task]
        if needs_image != (image is not None):
            raise typer.BadParameter(f"{task} {'needs' if needs_image else 'takes no'} --image", param_hint="--task")
        if needs_references != bool(reference_images):
            raise typer.BadParameter(f"{task} {'needs' if needs_references else 'takes no'} --reference-image",
                                     param_hint="--task")
        if video != (out.suffix.lower() in (".mp4", ".wav")):
            raise typer.BadParameter(f"{task} writes {'an .mp4' if video else 'an image'} file", param_hint="--out")
    family_options = _family_options(ctx.args, inputs or [])
    picture = None if image is None else np.asarray(Image.open(image).convert("RGB"))
    references = (np.stack([np.asarray(Image.open(path).convert("RGB")) for path in reference_images])
                  if reference_images else None)

    try:
        with MachgenClient(url, protocol=protocol) as client:
            start = time.perf_counter()
            generated = client.generate_all(
                model, prompt, negative_prompt=negative_prompt, seed=seed, num_inference_steps=steps,
                guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale, height=height, width=width,
                cache_policy=cache_policy, cache_threshold=cache_threshold, image=picture, strength=strength,
                num_frames=num_frames, fps=fps, reference_images=references, **family_options)
            seconds = time.perf_counter() - start
    except GenerationError as err:
        typer.secho(f"error ({err.status}): {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    except TypeError as err:  # an input the model does not declare
        raise typer.BadParameter(str(err), param_hint="--input") from None
    images, audio, stats = generated.images, generated.audio, generated.stats
    out.parent.mkdir(parents=True, exist_ok=True)
    sound = f", sound {audio.shape[1] / stats['sample_rate']:.2f} s" if audio is not None else ""
    if out.suffix.lower() == ".wav":
        from machgen.client.video import write_wav

        if audio is None:
            typer.secho(f"error: {model} makes no sound to write to {out}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        write_wav(audio, out, stats["sample_rate"])
        paths = [out]
        written = f"{audio.shape[0]} channels at {stats['sample_rate']} Hz{sound}"
    elif out.suffix.lower() == ".mp4":
        from machgen.client.video import write_mp4

        rate = fps or stats.get("fps") or DEFAULT_FPS
        write_mp4(images, out, fps=rate, audio=audio, sample_rate=stats.get("sample_rate"))
        paths = [out]
        written = f"{len(images)} frames at {rate} fps{sound}"
    else:
        paths = [out] if len(images) == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}")
                                                for i in range(len(images))]
        for path, frame in zip(paths, images):
            Image.fromarray(frame).save(path)
        written = f"{len(images)} image{'s' if len(images) > 1 else ''}"
    typer.echo(f"wrote {', '.join(map(str, paths))} ({written}, {images.shape[2]}x{images.shape[1]}, "
               f"{seconds:.2f} s, {stats['denoiser_tail_calls']}/{stats['steps']} steps ran the full denoiser, "
               f"cache {stats['cache_policy']})")


if __name__ == "__main__":  # pragma: no cover
    app()
