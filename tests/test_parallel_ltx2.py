"""LTX-2 (video and sound) under every parallel layout, in process on CPU
ranks (gloo, float32): cfg=2 splits each step's guidance rows (CFG's, the
spatio-temporal guidance's perturbed ones and the modality guidance's
isolated ones) over two ranks; a sequence layout splits the video's tokens
(the sound, whole on every rank, attends all of them: every rank's part
merged). Every frame and the whole sound track equal the single-rank clip,
which equals diffusers'."""

from __future__ import annotations


import numpy as np
import pytest

from machgen.parallel.layout import ParallelLayout

from conftest import build_tiny_repository, load_diffusers, single_rank_pipeline, under_layout, write_tiny
from test_ltx2 import MAX_AUDIO_DIFF, PROMPT, assert_same_clip, diffusers_clip

SAME_PIXELS = 1  # of 255, on every frame: exact modes, float32 sums reordered
# The served defaults (4 rows a step: CFG, STG, modality isolation; uneven over two ranks: one padded) and
# a clip of other settings with 3 rows.
CALLS = {"defaults": {},
         "9-frames-3-rows": {"num_frames": 9, "height": 64, "width": 32, "guidance_scale": 4.0,
                             "negative_prompt": "a blue square", "stg_scale": 3.0, "modality_scale": 1.0,
                             "audio_modality_scale": 1.0}}
CACHED = dict(num_inference_steps=8, cache_policy="fbcache", cache_threshold=0.5)

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def tiny_ltx2_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "ltx2")


@pytest.fixture(scope="module")
def ltx2_parallel_repository(tiny_ltx2_dir, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_ltx2_dir, "ltx2", in_flight=1, target="torch",
                                 parallel=ParallelLayout.parse("cfg=2,ulysses=2"))


@pytest.fixture(scope="module")
def local_ltx2(ltx2_parallel_repository):
    with single_rank_pipeline(ltx2_parallel_repository, "ltx2") as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def single_rank(local_ltx2):
    clips = {name: local_ltx2.generate_with_audio(PROMPT, seed=5, cache_policy="none", **call)
             for name, call in CALLS.items()}
    clips["cached"] = local_ltx2.generate_with_audio(PROMPT, seed=5, **CACHED)
    return clips


def test_on_one_rank_the_parallel_build_equals_diffusers(local_ltx2, single_rank, tiny_ltx2_dir):
    pipe = load_diffusers(tiny_ltx2_dir)
    defaults = local_ltx2.manifest.defaults.to_json()
    for name, call in CALLS.items():
        frames, audio, _ = single_rank[name]
        assert_same_clip(frames, audio, diffusers_clip(pipe, defaults, 5, **call))


@pytest.mark.parametrize("layout", ["cfg=2", "ulysses=2", "ring=2", "ulysses=2,ring=2", "cfg=2,ulysses=2"])
def test_every_layout_gives_the_single_rank_clip_with_cache_reuse_on_and_off(layout, local_ltx2, single_rank):
    layout = ParallelLayout.parse(layout)
    # The 3-row clip where rows are split (an odd count padded); the served defaults under every layout.
    calls = {name: call for name, call in CALLS.items() if layout.cfg > 1 or name == "defaults"}
    with under_layout(local_ltx2, layout) as pipeline:
        clips = {name: pipeline.generate_with_audio(PROMPT, seed=5, cache_policy="none", **call)
                 for name, call in calls.items()}
        clips["cached"] = pipeline.generate_with_audio(PROMPT, seed=5, **CACHED)
        for part in ("denoiser_head", "denoiser_tail"):
            runner = pipeline.runner(part)
            # every call's video split where the layout splits it (2 x 4 x 4 and 3 x 8 x 4 latent tokens)
            assert runner.calls and runner.split_calls == (runner.calls if layout.sequence_degree > 1 else 0)
        # Parallel VAE decode over every rank, where each band gets the two latent rows its reflection needs
        # (the 64-pixel clip: 8 latent rows; the defaults' 32 pixels: 4, split over 2 ranks, not 4).
        spatial = local_ltx2.manifest.family_settings["vae_spatial_ratio"]
        latent_rows = [call.get("height", local_ltx2.manifest.defaults.height) // spatial
                       for call in [*calls.values(), CACHED]]
        decoder = pipeline.runner("vae_decoder")
        assert decoder.calls == len(latent_rows)
        assert decoder.split_calls == sum(rows >= 2 * layout.world_size for rows in latent_rows)
    for name, (frames, audio, stats) in clips.items():
        want_frames, want_audio, want_stats = single_rank[name]
        assert frames.shape == want_frames.shape and audio.shape == want_audio.shape
        assert np.abs(frames.astype(int) - want_frames.astype(int)).max() <= SAME_PIXELS, name
        assert np.abs(audio - want_audio).max() <= MAX_AUDIO_DIFF, name
        assert stats.denoiser_tail_passes == want_stats.denoiser_tail_passes, name
    # cache reuse skipped steps, and decided alike on both (4 rows a computed step)
    assert clips["cached"][2].denoiser_tail_passes < 4 * CACHED["num_inference_steps"]


def test_image_to_video_split_over_the_ranks_gives_the_whole_sequences_outputs(tmp_path_factory):
    """LTX-2 image-to-video's head and tail (a timestep per video token: the picture's at 0) split over
    ulysses=2 give every rank what one process gives on the whole video."""
    from parallel_ranks import assert_sharded_parts_equal_whole

    parts = assert_sharded_parts_equal_whole(write_tiny(tmp_path_factory, "ltx2-i2v"), ParallelLayout(ulysses=2))
    assert sorted(parts) == ["denoiser_head", "denoiser_tail"]
