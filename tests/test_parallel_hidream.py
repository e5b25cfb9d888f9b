"""HiDream-I1 under every parallel layout it allows, in process on CPU ranks
(gloo, float32): each rank's joint sequence is its chunk of the image, T5
and Llama tokens (HiDream's SDPA calls reached by the swap), and the image
equals the single-rank one, which equals diffusers'."""

from __future__ import annotations


import numpy as np
import pytest

from machgen.parallel.layout import ParallelLayout

from conftest import (build_tiny_repository, levels, load_diffusers, single_rank_pipeline, under_layout,
                      write_tiny)

BUILT_LAYOUT = "cfg=2,ulysses=2"
# 64x64: 256 image tokens; 16 T5 and 16 Llama tokens: every sequence degree here divides them. CFG with an
# empty negative prompt: two guidance rows a call.
IMAGE = dict(prompt="a red cat at the top", seed=5, height=64, width=64)
CACHED = dict(num_inference_steps=8, cache_policy="fbcache", cache_threshold=0.5)
SAME_PIXELS = 1  # of 255
MAX_PIXEL_DIFF = 2  # of 255, against diffusers (as test_hidream.py)

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def tiny_hidream_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "hidream")


@pytest.fixture(scope="module")
def hidream_parallel_repository(tiny_hidream_dir, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_hidream_dir, "hidream", in_flight=1, target="torch",
                                 parallel=ParallelLayout.parse(BUILT_LAYOUT))


@pytest.fixture(scope="module")
def local_hidream(hidream_parallel_repository):
    with single_rank_pipeline(hidream_parallel_repository, "hidream") as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def single_rank(local_hidream):
    return {"uncached": local_hidream.generate(**IMAGE, cache_policy="none"),
            "cached": local_hidream.generate(**IMAGE, **CACHED)}


def test_head_and_tail_run_on_the_ranks_and_the_single_rank_image_equals_diffusers(hidream_parallel_repository,
                                                                                   single_rank, tiny_hidream_dir):
    import json

    import torch

    from machgen.contract.manifest import PipelineManifest, find_pipeline_dir

    plans = {part: json.loads((hidream_parallel_repository / f"hidream_denoiser_{part}" / "1" / "component.json")
                              .read_text())["parallel"] for part in ("head", "tail")}
    # Split outside the programs, along every token axis: image, T5, Llama (the axis after the layers), text.
    assert plans["head"]["sequence"] == {"hidden_states": 1, "image_mask": 1, "img_ids": 1, "t5_embeds": 1,
                                         "llama_embeds": 2, "image_hidden": 1, "text_hidden": 1,
                                         "first_block_residual": 1}
    assert plans["tail"]["sequence"]["llama_embeds"] == 2 and plans["tail"]["marker"] is None
    defaults = PipelineManifest.read(find_pipeline_dir(hidream_parallel_repository, "hidream")).defaults
    pipe = load_diffusers(tiny_hidream_dir)
    expected = levels(pipe(prompt=IMAGE["prompt"], height=IMAGE["height"], width=IMAGE["width"],
                           num_inference_steps=defaults.num_inference_steps, guidance_scale=defaults.guidance_scale,
                           max_sequence_length=defaults.max_sequence_length, output_type="np",
                           generator=torch.Generator().manual_seed(IMAGE["seed"])).images[0])
    assert np.abs(single_rank["uncached"][0][0].astype(int) - expected).max() <= MAX_PIXEL_DIFF


@pytest.mark.parametrize("layout", ["cfg=2", "ulysses=2", "ring=2", "ulysses=2,ring=2", "cfg=2,ulysses=2"])
def test_every_layout_gives_the_single_rank_image_with_cache_reuse_on_and_off(layout, local_hidream, single_rank):
    layout = ParallelLayout.parse(layout)
    with under_layout(local_hidream, layout) as pipeline:
        uncached, _ = pipeline.generate(**IMAGE, cache_policy="none")
        cached, stats = pipeline.generate(**IMAGE, **CACHED)
        for part in ("denoiser_head", "denoiser_tail"):
            runner = pipeline.runner(part)
            assert runner.calls and runner.split_calls == (runner.calls if layout.sequence_degree > 1 else 0)
    assert np.abs(uncached.astype(int) - single_rank["uncached"][0].astype(int)).max() <= SAME_PIXELS
    assert np.abs(cached.astype(int) - single_rank["cached"][0].astype(int)).max() <= SAME_PIXELS
    assert stats.denoiser_tail_passes == single_rank["cached"][1].denoiser_tail_passes < 2 * CACHED[
        "num_inference_steps"]
