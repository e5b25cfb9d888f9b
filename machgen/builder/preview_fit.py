"""Fit a built repository's preview projection (runtime/preview.py) on its own decodes.

A few generations at the served defaults (the size and frame count users
see) with few steps: the projection maps latents to colours, which a short
schedule's latents teach as well as a long one's, and a tiny model's build
gains well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from machgen.runtime.preview import LatentPreview

FIT_GENERATIONS = 3
FIT_STEPS = 4
# Varied content: one the shapes model was trained on, the rest generic.
FIT_PROMPTS = ("a red circle at the top left", "a mountain lake at dawn, pine trees",
               "a bowl of fruit on a wooden table", "a city street at night, neon lights")


def fit_samples(pipeline, count: int = FIT_GENERATIONS, first_seed: int = 0, steps: int = FIT_STEPS
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(latents [C, F, h, w], decoded frames uint8 [N, H, W, 3]) of ``count``
    generations of ``pipeline`` (a LocalPipeline) at its served defaults, but
    at most FIT_MAX_SIDE pixels a side."""
    from machgen.contract.api import input_array

    sampler, defaults = pipeline.sampler, pipeline.manifest.defaults
    # An image-to-video model needs a starting picture.
    needs_image = not any(task.startswith("text-to-") for task in sampler.runtime.family.capabilities.tasks)
    multiple = sampler.runtime.size_multiple
    latent_list, frames_list = [], []
    for index in range(count):
        seed = first_seed + index
        options = {"prompt": FIT_PROMPTS[seed % len(FIT_PROMPTS)], "seed": seed,
                   "num_inference_steps": min(int(defaults.num_inference_steps), steps),
                   "height": _fit_side(defaults.height, multiple), "width": _fit_side(defaults.width, multiple)}
        if needs_image:
            options["image"] = _starting_picture(options.pop("height"), options.pop("width"), seed)
        arrays = {name: input_array(pipeline.inputs[name], value) for name, value in options.items()}
        generation = sampler.generate(sampler.parse_request(arrays.get, defaults))
        latent_list.append(np.asarray(sampler.runtime.preview_latents(generation.latents), dtype=np.float32))
        frames_list.append(sampler.decode(generation.latents))
    return latent_list, frames_list


def fit_repository_preview(repository: Path, name: str, log: Callable[[str], None] = print,
                           generations: int = FIT_GENERATIONS) -> LatentPreview:
    """Fit the pipeline ``name``'s projection and save it beside its manifest."""
    from machgen.contract.manifest import pipeline_dir
    from machgen.runtime.local import LocalPipeline

    pipeline = LocalPipeline(repository, name)
    latent_list, frames_list = fit_samples(pipeline, generations)
    preview = LatentPreview.fit(latent_list, frames_list, pipeline.sampler.runtime.frame_multiple)
    preview.save(pipeline_dir(repository, name))
    log(f"preview: latent-to-RGB projection fitted on {preview.generations} generations, PSNR {preview.psnr:.1f} dB "
        f"against the VAE decode ({preview.channels} channels -> RGB)")
    return preview


# The projection maps one latent pixel to its RGB (the VAE's local colour map), so a small picture fits it as a
# large one would, at a fraction of the cost (a 1024x1024 generation at build time, or the tiny HiDream's 256x256
# default on a CPU: 13 s a build).
FIT_MAX_SIDE = 128


def _fit_side(side: int, multiple: int) -> int:
    """A side of the fit's generations: the served default, at most FIT_MAX_SIDE (a multiple of the model's)."""
    return max(multiple, min(int(side), FIT_MAX_SIDE) // multiple * multiple)


def _starting_picture(height: int, width: int, seed: int) -> np.ndarray:
    """uint8 [H, W, 3]: smooth colour gradients, different per seed."""
    rows, cols = np.mgrid[0:height, 0:width] / max(height, width)
    tint = np.random.default_rng(seed).uniform(0.2, 1.0, 3)
    return (np.stack([rows, cols, 1 - rows * cols], axis=-1) * tint * 255).astype(np.uint8)
