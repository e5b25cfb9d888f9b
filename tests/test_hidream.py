"""Text-to-image on the tiny HiDream-I1: the served pipeline against
diffusers' HiDreamImagePipeline on the same model, seed and settings
(square and padded non-square sizes, CFG on and off), its exportable
mixture of experts against diffusers' own, and cache reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import build_tiny_repository, levels, load_diffusers, serving, write_tiny

MAX_PIXEL_DIFF = 2  # of 255
NAME = "hidream"
PROMPT = "a red cat at the top"


@pytest.fixture(scope="module")
def tiny_hidream_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "hidream")


@pytest.fixture(scope="module")
def hidream_pipeline(tiny_hidream_dir):
    return load_diffusers(tiny_hidream_dir)


@pytest.fixture(scope="module")
def hidream_repository(tiny_hidream_dir, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_hidream_dir, NAME)


@pytest.fixture(scope="module")
def local_hidream(hidream_repository):
    from machgen.runtime.local import LocalPipeline

    return LocalPipeline(hidream_repository, NAME)


def diffusers_image(pipe, defaults, seed: int, **call) -> np.ndarray:
    """HiDreamImagePipeline's image as uint8 levels (int16), [H, W, 3]."""
    import torch

    settings = {key: defaults[key] for key in ("height", "width", "num_inference_steps", "guidance_scale",
                                               "max_sequence_length")}
    return levels(pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), output_type="np",
                       **{**settings, **call}).images[0])


def test_dense_mixture_of_experts_equals_diffusers_routing():
    """The exportable form adds the same terms in the same order as MOEFeedForwardSwiGLU.moe_infer."""
    import torch
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    from machgen.families.hidream.export import DenseMixture as dense_mixture

    torch.manual_seed(0)
    mixture = MOEFeedForwardSwiGLU(dim=32, hidden_dim=128, num_routed_experts=4, num_activated_experts=2).eval()
    x = torch.randn(2, 50, 32)
    with torch.no_grad():
        chosen, _, _ = mixture.gate(x)
        expected, dense = mixture(x), dense_mixture(mixture)(x)
    assert len(chosen.unique()) == 4  # every expert routes some tokens
    assert (dense - expected).abs().max() <= 1e-6 * expected.abs().max()


@pytest.mark.parametrize("call", [
    {},  # the served defaults: 256 x 256 (the tiny pipeline's rendered size), 4 steps, CFG 5
    # Rendered at 220 x 292 (the aspect ratio kept), padded to max_seq tokens with a mask.
    {"height": 192, "width": 256, "num_inference_steps": 3, "negative_prompt": "a blue square"},
    {"guidance_scale": 1.0, "num_inference_steps": 2},
], ids=["defaults", "non-square-negative-prompt", "no-cfg"])
def test_in_process_text_to_image_equals_diffusers(local_hidream, hidream_pipeline, call):
    defaults = local_hidream.manifest.defaults.to_json()
    images, _ = local_hidream.generate(PROMPT, seed=5, cache_policy="none", **call)
    expected = diffusers_image(hidream_pipeline, defaults, 5, **call)
    assert images.shape == (1, *expected.shape)
    assert np.abs(images[0].astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF


def test_a_flow_matching_scheduler_is_set_as_the_pipeline_sets_it(local_hidream):
    """The full model's FlowMatchEuler (the tiny one's UniPC takes the other branch): the runtime's schedule
    equals retrieve_timesteps with calculate_shift of max_seq, as HiDreamImagePipeline calls them."""
    import diffusers
    from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift, retrieve_timesteps

    from types import SimpleNamespace

    runtime = local_hidream.sampler.runtime
    config = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}
    flow = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    runtime._scheduler_class, runtime.scheduler_config = type(flow), flow.config
    try:
        ours = runtime.scheduler(SimpleNamespace(num_inference_steps=7))  # the only field it reads
    finally:
        runtime._scheduler_class = getattr(diffusers, runtime.settings["scheduler_class"])
        runtime.scheduler_config = runtime.load_scheduler_config()
    theirs = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    retrieve_timesteps(theirs, 7, "cpu", mu=calculate_shift(runtime.settings["max_image_tokens"]))
    assert ours.timesteps.tolist() == theirs.timesteps.tolist() and ours.sigmas.tolist() == theirs.sigmas.tolist()


def test_first_block_cache_skips_steps(local_hidream):
    uncached, plain = local_hidream.generate(PROMPT, seed=7, num_inference_steps=10, cache_policy="none")
    cached, stats = local_hidream.generate(PROMPT, seed=7, num_inference_steps=10, cache_policy="fbcache",
                                           cache_threshold=0.3)
    assert stats.denoiser_tail_passes < plain.denoiser_tail_passes
    psnr = 10 * np.log10(255.0 ** 2 / max(np.mean((cached.astype(float) - uncached.astype(float)) ** 2), 1e-12))
    assert psnr > 25, f"cached image {psnr:.1f} dB from the uncached one"


@pytest.mark.integration
def test_served_text_to_image_equals_diffusers(hidream_repository, hidream_pipeline):
    from machgen.contract.manifest import pipeline_dir
    from machgen.client import MachgenClient

    defaults = json.loads((pipeline_dir(hidream_repository, NAME) / "pipeline.json").read_text())["defaults"]
    with serving(hidream_repository) as server, \
            MachgenClient(server.grpc_url) as client:
        images, stats = client.generate_with_stats(NAME, PROMPT, seed=3, num_inference_steps=3)
    expected = diffusers_image(hidream_pipeline, defaults, 3, num_inference_steps=3)
    assert np.abs(images[0].astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF
    assert stats["steps"] == 3
