"""Image-to-image on the tiny Flux: the served pipeline against diffusers'
FluxImg2ImgPipeline on the same model, image, seed and settings."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PIPELINE_NAME

PROMPT = "a red circle"


def _image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth test picture (gradients and a disc), uint8 [H, W, 3]."""
    rows, cols = np.mgrid[0:height, 0:width] / max(height, width)
    disc = ((rows - 0.4) ** 2 + (cols - 0.6) ** 2 < 0.06).astype(np.float64)
    rng = np.random.default_rng(seed)
    picture = np.stack([rows, cols, disc], axis=-1) * 200 + rng.integers(0, 40, (height, width, 3))
    return picture.clip(0, 255).astype(np.uint8)


def _diffusers_img2img(pipeline, image: np.ndarray, seed: int, strength: float, **call) -> np.ndarray:
    import diffusers
    import torch
    from PIL import Image

    img2img = diffusers.FluxImg2ImgPipeline.from_pipe(pipeline)
    img2img.set_progress_bar_config(disable=True)
    out = img2img(PROMPT, image=Image.fromarray(image), generator=torch.Generator().manual_seed(seed),
                  strength=strength, height=image.shape[0], width=image.shape[1], output_type="np", **call).images
    return (out * 255).round().astype(np.int16)


@pytest.fixture(scope="module")
def local(built_repository):
    from machgen.runtime.local import LocalPipeline

    repository, _ = built_repository
    return LocalPipeline(repository, PIPELINE_NAME)


@pytest.mark.parametrize("strength, seed", [(0.6, 0), (1.0, 1), (0.3, 2)])
def test_in_process_image_to_image_equals_diffusers(local, tiny_flux_pipeline, strength, seed):
    defaults = local.manifest.defaults.to_json()
    image = _image(defaults["height"], defaults["width"], seed)
    served, stats = local.generate(PROMPT, image=image, strength=strength, seed=seed, cache_policy="none")
    expected = _diffusers_img2img(tiny_flux_pipeline, image, seed, strength,
                                  num_inference_steps=defaults["num_inference_steps"],
                                  guidance_scale=defaults["guidance_scale"],
                                  max_sequence_length=defaults["max_sequence_length"])
    assert np.abs(served.astype(np.int16) - expected).max() <= 2
    steps = defaults["num_inference_steps"]
    assert stats.steps == steps - int(steps - steps * strength)  # diffusers' get_timesteps: 3, 4 and 2 of 4


@pytest.mark.integration
def test_served_image_to_image_equals_diffusers(triton_server, local, tiny_flux_pipeline):
    from machgen.client import MachgenClient

    defaults = local.manifest.defaults.to_json()
    image = _image(defaults["height"] * 2, defaults["width"], seed=5)  # not the default size: taken from the image
    with MachgenClient(triton_server.grpc_url) as client:
        served, stats = client.generate_with_stats(PIPELINE_NAME, PROMPT, image=image, strength=0.75, seed=5,
                                                   cache_policy="none")
    expected = _diffusers_img2img(tiny_flux_pipeline, image, 5, 0.75,
                                  num_inference_steps=defaults["num_inference_steps"],
                                  guidance_scale=defaults["guidance_scale"],
                                  max_sequence_length=defaults["max_sequence_length"])
    assert served.shape == (1, *image.shape)
    assert np.abs(served.astype(np.int16) - expected).max() <= 2
    assert stats["steps"] == 3
