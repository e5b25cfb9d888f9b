"""Wan 2.2 (both experts) under every parallel layout it allows, on CPU
ranks (gloo, float32): its tails split their tokens themselves (the rotary
positions come from the whole latents' shape), and every frame equals the
single-rank video, in process and through Triton. test_parallel_wan_ti2v.py
runs the in-process tests on Wan 2.2 TI2V (its per-token modulation split
as its tokens are; text- and image-to-video). Wan 2.2 image-to-video and
VACE (its control stream split as the video) take the same tails: their
sharded tails on the ranks equal the whole ones."""

from __future__ import annotations


import numpy as np
import pytest

from machgen.parallel.layout import ParallelLayout

from conftest import build_tiny_repository, serving, single_rank_pipeline, under_layout, write_tiny

BUILT_LAYOUT = "cfg=2,ulysses=2"
# 9 frames: 3 latent frames of 4x2 patches (Wan 2.2, 64x32) or 2x2 (TI2V's VAE compresses 16x, 64x64), 24 or
# 12 tokens, which every sequence degree here divides; CFG with the default negative prompt: two guidance rows a
# call.
SIZES = {"wan": dict(height=64, width=32), "wan-ti2v": dict(height=64, width=64)}
# 5 frames of these: 2 latent frames of 16 tokens in all, as many as the text's.
AS_MANY_AS_THE_TEXT = {"wan": dict(height=64, width=32, num_frames=5), "wan-ti2v": dict(height=128, width=64,
                                                                                       num_frames=5)}
EXPERTS = {"wan": ("denoiser", "denoiser_2"), "wan-ti2v": ("denoiser",)}
SAME_PIXELS = 1  # of 255, on every frame
CACHED = dict(num_inference_steps=8, cache_policy="fbcache", cache_threshold=0.5)

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def family():
    """The family these tests run on (test_parallel_wan_ti2v.py runs them on Wan 2.2 TI2V: its own module, so
    that the two builds and servers run on different test workers)."""
    return "wan"


@pytest.fixture(scope="module")
def video(family):
    return dict(prompt="a red cat", seed=7, num_frames=9, **SIZES[family])


@pytest.fixture(scope="module")
def wan_parallel_repository(tmp_path_factory, family):
    return build_tiny_repository(tmp_path_factory, write_tiny(tmp_path_factory, family), "wan", in_flight=1,
                                 target="torch", parallel=ParallelLayout.parse(BUILT_LAYOUT))


@pytest.fixture(scope="module")
def picture(family, video):
    """TI2V's image-to-video: a picture as the first frame (its latents kept in every step's input)."""
    from conftest import picture as make_picture

    return make_picture(video["height"], video["width"], seed=3) if family == "wan-ti2v" else None


@pytest.fixture(scope="module")
def local_wan(wan_parallel_repository):
    with single_rank_pipeline(wan_parallel_repository, "wan") as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def single_rank(local_wan, video, picture):
    return {"uncached": local_wan.generate(**video, cache_policy="none"),
            "cached": local_wan.generate(**video, **CACHED),
            "picture": local_wan.generate(**video, image=picture) if picture is not None else None}


def test_the_tails_split_their_tokens_themselves_and_the_decoder_its_rows_on_the_ranks(wan_parallel_repository,
                                                                                     family):
    import json

    def parallel(component):
        return json.loads((wan_parallel_repository / f"wan_{component}" / "1" / "component.json").read_text()
                          )["parallel"]

    for expert in EXPERTS[family]:
        tail = parallel(f"{expert}_tail")
        assert tail["marker"] == "sequence_marker" and tail["ranks"] == "sequence"
        assert parallel(f"{expert}_head") is None
    # Parallel VAE decode: the latents' and frames' rows, and each rank's share of the causal cache.
    assert parallel("vae_decoder_first")["sequence"] == {"latents": 3, "frames": 3, "decoder_cache": 1}
    assert parallel("vae_decoder_next")["sequence"] == {"latents": 3, "decoder_cache": 1, "frames": 3,
                                                        "updated_cache": 1}
    assert parallel("vae_decoder_next")["ranks"] == "all" and parallel("vae_decoder_next")["batched"] == []
    assert parallel("text_encoder") is None
    config = (wan_parallel_repository / "wan_denoiser_tail" / "config.pbtxt").read_text()
    assert "sequence_marker" not in config  # the served interface is the spec's


@pytest.mark.parametrize("layout", ["cfg=2", "ulysses=2", "ring=2", "ulysses=2,ring=2", "cfg=2,ulysses=2"])
def test_every_layout_gives_the_single_rank_video_with_cache_reuse_on_and_off(layout, local_wan, single_rank, family,
                                                                              video, picture):
    layout = ParallelLayout.parse(layout)
    with under_layout(local_wan, layout) as pipeline:
        uncached, _ = pipeline.generate(**video, cache_policy="none")
        cached, stats = pipeline.generate(**video, **CACHED)
        from_picture = pipeline.generate(**video, image=picture)[0] if picture is not None else None
        tails = [pipeline.runner(f"{expert}_tail") for expert in EXPERTS[family]]
        assert all(tail.calls for tail in tails)  # both experts ran
        assert all(tail.split_calls == (tail.calls if layout.sequence_degree > 1 else 0) for tail in tails)
        decoders = [pipeline.runner(f"vae_decoder_{chunk}") for chunk in ("first", "next")]
        assert all(decoder.calls and decoder.split_calls == decoder.calls for decoder in decoders)  # by rows
    assert uncached.shape == single_rank["uncached"][0].shape
    assert np.abs(uncached.astype(int) - single_rank["uncached"][0].astype(int)).max() <= SAME_PIXELS
    assert np.abs(cached.astype(int) - single_rank["cached"][0].astype(int)).max() <= SAME_PIXELS
    assert stats.denoiser_tail_passes == single_rank["cached"][1].denoiser_tail_passes < 2 * CACHED[
        "num_inference_steps"]
    if picture is not None:
        assert np.abs(from_picture.astype(int) - single_rank["picture"][0].astype(int)).max() <= SAME_PIXELS


@pytest.mark.integration
def test_served_by_triton_every_frame_equals_the_single_rank_video(wan_parallel_repository, single_rank, video,
                                                                  local_wan):
    from machgen.client import MachgenClient

    local_wan.close()  # the ranks the layout tests put aside (a server started beside them started slowly)
    with serving(wan_parallel_repository) as server, MachgenClient(server.grpc_url) as client:
        frames = client.generate("wan", video["prompt"], seed=video["seed"], height=video["height"],
                                 width=video["width"], num_frames=video["num_frames"], cache_policy="none")
    assert np.abs(frames.astype(int) - single_rank["uncached"][0].astype(int)).max() <= SAME_PIXELS


def test_a_video_with_as_many_tokens_as_the_text_runs_on_one_rank_and_split(local_wan, video, family):
    """The swap tells self- from cross-attention without a guard on the lengths: a trace that compared the
    video's tokens with the text's would refuse every call where they are equal (16 here, on one rank)."""
    short = {**video, **AS_MANY_AS_THE_TEXT[family], "num_inference_steps": 2}
    one_rank, _ = local_wan.generate(**short)
    with under_layout(local_wan, ParallelLayout(ulysses=2)) as pipeline:
        split, _ = pipeline.generate(**short)
    assert np.abs(split.astype(int) - one_rank.astype(int)).max() <= SAME_PIXELS


@pytest.mark.parametrize("variant, layout", [("wan-i2v", "ulysses=2"), ("wan-vace", "ring=2")])
def test_image_to_video_and_vace_tails_split_over_the_ranks_give_the_whole_tails_outputs(variant, layout,
                                                                                         tmp_path_factory):
    from parallel_ranks import assert_sharded_parts_equal_whole

    parts = assert_sharded_parts_equal_whole(write_tiny(tmp_path_factory, variant), ParallelLayout.parse(layout))
    assert parts and all(part.endswith("_tail") for part in parts)
