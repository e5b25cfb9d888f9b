"""Latent previews: milliseconds per preview on one CPU core, and how close
the projection comes to the VAE decode.

Times ``LatentPreview.render`` (random weights) on a 1024x1024 Flux image's
latents [16, 1, 128, 128] and a Wan 2.1 480p 81-frame video's [16, 21, 60,
104] (4 of its 21 frames drawn). Given a model repository (built from
models/shapes-flux, say), also fits the projection on that pipeline's
generations as the build does and prints its PSNR against the downsampled
decode, on the fit's generations and on others.

    python perf/bench_preview.py
    python perf/bench_preview.py model_repository --name shapes
"""

from __future__ import annotations

import os

# One core: BLAS and OpenMP read these when numpy loads.
for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from machgen.runtime.preview import LatentPreview, preview_psnr  # noqa: E402

SHAPES = {"flux 1024x1024": (16, 1, 128, 128), "wan 480p 81 frames": (16, 21, 60, 104)}
BUDGET_MS = 1.0


def median_ms(preview: LatentPreview, latents: np.ndarray, repeats: int) -> float:
    for _ in range(10):
        preview.render(latents)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        preview.render(latents)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def bench_render(repeats: int) -> None:
    rng = np.random.default_rng(0)
    preview = LatentPreview(rng.normal(0, 20, (16, 3)), rng.uniform(100, 150, 3))
    for label, shape in SHAPES.items():
        latents = rng.normal(0, 1, shape).astype(np.float32)
        shown = preview.render(latents).shape
        print(f"render {label}: latents {list(shape)} -> preview {list(shown)}: "
              f"{median_ms(preview, latents, repeats):.3f} ms median (budget {BUDGET_MS:g} ms)")


def bench_fit(repository: Path, name: str, held_out: int) -> None:
    from machgen.builder.preview_fit import FIT_GENERATIONS, fit_samples
    from machgen.contract.manifest import pipeline_dir
    from machgen.runtime.local import LocalPipeline

    pipeline = LocalPipeline(repository, name)
    temporal = pipeline.sampler.runtime.frame_multiple
    stored = LatentPreview.load(pipeline_dir(repository, name))
    if stored is not None:
        print(f"{name}: stored preview.json: PSNR {stored.psnr:.1f} dB on {stored.generations} generations")
    start = time.perf_counter()
    latent_list, frames_list = fit_samples(pipeline, FIT_GENERATIONS)
    preview = LatentPreview.fit(latent_list, frames_list, temporal)
    print(f"{name}: fitted on {FIT_GENERATIONS} generations ({time.perf_counter() - start:.2f} s): "
          f"PSNR {preview.psnr:.1f} dB on them, latents {list(latent_list[0].shape)}")
    steps = int(pipeline.manifest.defaults.num_inference_steps)
    for label, fit_steps in (("the fit's 4 steps", 4), (f"the served {steps} steps", steps)):
        others = fit_samples(pipeline, held_out, first_seed=100, steps=fit_steps)
        print(f"{name}: held out, {held_out} generations at {label}: "
              f"PSNR {preview_psnr(preview, *others, temporal):.1f} dB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repository", type=Path, nargs="?", help="a built model repository (optional)")
    parser.add_argument("--name", default="shapes", help="the pipeline in it")
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--held-out", type=int, default=8, help="generations the fit never saw, to score it on")
    args = parser.parse_args()
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError):  # not Linux: the thread settings alone
        pass
    bench_render(args.repeats)
    if args.repository is not None:
        bench_fit(args.repository, args.name, args.held_out)


if __name__ == "__main__":
    main()
