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


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt"),
    out: Path = typer.Option(..., "--out", help="PNG file to write (index appended when several)"),
    model: str = typer.Option(..., "--model", help="served model name"),
    url: str = typer.Option("127.0.0.1:8001", "--url", help="host:port of the chosen protocol"),
    protocol: str = typer.Option("grpc", "--protocol", help="grpc or http"),
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
                                         help="image-to-image: the starting picture (PNG, JPEG, ...)"),
    strength: Optional[float] = typer.Option(None, "--strength",
                                             help="image-to-image: how much is redrawn, 0-1 (default 0.6)"),
) -> None:
    """Generate an image through a served pipeline and save it as PNG."""
    import time

    import numpy as np
    from PIL import Image

    from machgen.client import GenerationError, MachgenClient

    picture = None if image is None else np.asarray(Image.open(image).convert("RGB"))

    try:
        with MachgenClient(url, protocol=protocol) as client:
            start = time.perf_counter()
            images, stats = client.generate_with_stats(
                model, prompt, negative_prompt=negative_prompt, seed=seed, num_inference_steps=steps,
                guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale, height=height, width=width,
                cache_policy=cache_policy, cache_threshold=cache_threshold, image=picture, strength=strength)
            seconds = time.perf_counter() - start
    except GenerationError as err:
        typer.secho(f"error ({err.status}): {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out] if len(images) == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(len(images))]
    for path, image in zip(paths, images):
        Image.fromarray(image).save(path)
    typer.echo(f"wrote {', '.join(map(str, paths))} ({images.shape[2]}x{images.shape[1]}, {seconds:.2f} s, "
               f"{stats['denoiser_tail_calls']}/{stats['steps']} steps ran the full denoiser, "
               f"cache {stats['cache_policy']})")


if __name__ == "__main__":  # pragma: no cover
    app()
