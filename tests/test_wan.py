"""Text-to-video on the tiny Wan 2.2 (two experts): the served pipeline
against diffusers' WanPipeline on the same model, seed and settings, over
every frame; cache reuse and batching across requests for a video model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import build_tiny_repository, levels, load_diffusers, picture, serving, write_tiny

MAX_PIXEL_DIFF = 2  # of 255, over all frames
NAME = "wan"
# Image-to-video: another pipeline of the module's one repository, served by the module's one server.
I2V_NAME = "wan_i2v"
PROMPT = "a red circle at the top"


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "wan")


@pytest.fixture(scope="module")
def wan_pipeline(tiny_wan_dir):
    return load_diffusers(tiny_wan_dir)


@pytest.fixture(scope="module")
def wan_repository(tiny_wan_dir, tmp_path_factory):
    # Per-step calls wait up to 50 ms for other requests' (those released by one forward arrive within a few
    # ms): concurrent requests of one size share forwards by construction, not by chance.
    return build_tiny_repository(tmp_path_factory, tiny_wan_dir, NAME, in_flight=4, step_queue_delay_us=50_000)


@pytest.fixture(scope="module")
def local_wan(wan_repository):
    from machgen.runtime.local import LocalPipeline

    return LocalPipeline(wan_repository, NAME)


@pytest.fixture(scope="module")
def wan_server(wan_repository, wan_i2v_repository):
    """One server of the module's repository: text-to-video and image-to-video side by side."""
    assert wan_i2v_repository == wan_repository
    with serving(wan_repository) as server:
        yield server


def diffusers_video(pipe, defaults, prompt: str, seed: int, **call) -> np.ndarray:
    """WanPipeline's frames as uint8 levels (int16 for differences), [frames, H, W, 3]."""
    import torch

    settings = {key: defaults[key] for key in ("height", "width", "num_frames", "num_inference_steps",
                                               "guidance_scale", "max_sequence_length")}
    return levels(pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np",
                       **{**settings, **call}).frames[0])


def max_diff(ours: np.ndarray, theirs: np.ndarray) -> int:
    assert ours.shape == theirs.shape
    return int(np.abs(ours.astype(np.int16) - theirs).max())


def test_repository_has_both_experts_and_the_chunked_decoder(wan_repository):
    from machgen.contract.manifest import pipeline_dir

    pipeline = json.loads((pipeline_dir(wan_repository, NAME) / "pipeline.json").read_text())
    assert pipeline["tasks"] == ["text-to-video"] and pipeline["version"] == 3
    assert {"denoiser_head", "denoiser_tail", "denoiser_2_head", "denoiser_2_tail", "vae_decoder_first",
            "vae_decoder_next"} <= set(pipeline["components"])
    assert pipeline["family_settings"]["boundary_timestep"] == 875.0
    assert pipeline["defaults"]["fps"] == 16


@pytest.mark.parametrize("call", [
    {},  # the served defaults: 9 frames, 4 steps, two on each expert
    {"num_frames": 17, "height": 64, "width": 48, "num_inference_steps": 6, "guidance_scale": 4.0,
     "guidance_scale_2": 2.0, "negative_prompt": "a blue square"},
    {"num_frames": 1, "guidance_scale": 1.0},  # one frame, no CFG pass
], ids=["defaults", "17-frames-two-scales", "one-frame-no-cfg"])
def test_in_process_text_to_video_equals_diffusers(local_wan, wan_pipeline, call):
    defaults = local_wan.manifest.defaults.to_json()
    frames, stats = local_wan.generate(PROMPT, seed=3, cache_policy="none", **call)
    expected = diffusers_video(wan_pipeline, defaults, PROMPT, 3, **call)
    assert max_diff(frames, expected) <= MAX_PIXEL_DIFF
    steps = call.get("num_inference_steps", defaults["num_inference_steps"])
    cfg_rows = 1 if call.get("guidance_scale", defaults["guidance_scale"]) <= 1 else 2
    assert (stats.frames, stats.fps, stats.denoiser_tail_passes) == (len(frames), 16, cfg_rows * steps)


def test_cache_reuse_on_video_keeps_the_expert_switch_computed(local_wan):
    """MagCache on the two-expert model: steps are skipped on both experts,
    but the first step of the low-noise expert always runs its blocks (a
    residual kept by the other expert's blocks is never reused)."""
    from machgen.runtime.cache import CacheControls, CacheSettings

    steps = 20  # 7 steps on the high-noise expert, the switch outside warm-up
    uncached, plain = local_wan.generate(PROMPT, seed=4, num_inference_steps=steps, cache_policy="none")
    calls: list[str] = []
    run_component = local_wan.sampler.run_component
    sampler = local_wan.sampler
    saved = sampler.cache_settings
    sampler.cache_settings = CacheSettings(
        thresholds={"magcache": 0.5, "fbcache": 0.2}, magnitude_ratios=(1.0,) * steps,
        controls={"magcache": CacheControls(warmup_steps=2, final_steps=1, max_consecutive_skips=3)})
    sampler.run_component = lambda name, inputs: calls.append(name) or run_component(name, inputs)
    try:
        cached, stats = local_wan.generate(PROMPT, seed=4, num_inference_steps=steps, cache_policy="magcache")
    finally:
        sampler.cache_settings, sampler.run_component = saved, run_component
    denoiser_calls = [name for name in calls if name.startswith("denoiser")]
    first_low_noise = next(i for i, name in enumerate(denoiser_calls) if name.startswith("denoiser_2"))
    assert denoiser_calls[first_low_noise:first_low_noise + 2] == ["denoiser_2_head", "denoiser_2_tail"]
    assert "denoiser_reuse" in denoiser_calls[:first_low_noise] and "denoiser_2_reuse" in denoiser_calls
    assert stats.denoiser_tail_passes < plain.denoiser_tail_passes == 2 * steps
    psnr = 10 * np.log10(255.0 ** 2 / np.mean((cached.astype(float) - uncached.astype(float)) ** 2))
    assert psnr > 30, f"cached video {psnr:.1f} dB from the uncached one"


def test_the_low_noise_expert_takes_guidance_scale_2_or_guidance_scale(tiny_wan_dir):
    """WanPipeline's guidance_scale_2 defaults to guidance_scale (no export: the runtime alone)."""
    from machgen.runtime.family import RequestState

    from conftest import runtime_for
    from point_mass import request

    runtime = runtime_for(tiny_wan_dir, run_component=None)
    for inputs, low_noise in (({}, 4.0), ({"guidance_scale_2": 3.0}, 3.0)):
        req = request(guidance_scale=4.0, true_cfg_scale=4.0, negative_prompt="", inputs={"guidance_scale_2": None,
                                                                                         **inputs})
        guidance = runtime.guidance(req)
        state = RequestState(req, None, (), 0, guidance)
        assert guidance.scale_at(state) == 4.0
        state.denoiser = "denoiser_2"
        assert guidance.scale_at(state) == low_noise


@pytest.mark.parametrize("prompt", [
    "  a red circle\n\tmoving   left  ", "a cat &amp;amp; a dog &lt;3", "caf\u00e9 at night",
    "The Mona Lisa doesn\u00c3\u00a2\u00e2\u201a\u00ac\u00e2\u201e\u00a2t have eyebrows.", "", "\u3000\u00a0wide\u2003space\u00a0"])
def test_the_prompt_is_cleaned_as_the_wan_pipeline_cleans_it(prompt):
    """The runtime's own copy (importing the pipeline module costs a sampler 2.5 s): diffusers' ftfy repair,
    double unescape and whitespace folding, character for character."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as pipeline_clean

    from machgen.families.wan.runtime import prompt_clean

    assert prompt_clean(prompt) == pipeline_clean(prompt)


def test_magcache_calibration_records_both_experts(local_wan):
    """A magnitude ratio for every step of the schedule, the low-noise expert's included."""
    from machgen.builder.calibrate import record_magnitude_ratios

    _, stats, ratios = record_magnitude_ratios(local_wan, [(PROMPT, 1)])
    assert len(ratios) == stats[0].steps == local_wan.manifest.defaults.to_json()["num_inference_steps"]
    assert all(ratio > 0 for ratio in ratios)


def test_video_requests_are_validated_against_the_model(local_wan):
    from machgen.contract.validation import InvalidArgument

    for options, field in [({"num_frames": 8}, "num_frames"), ({"num_frames": 21}, "num_frames"),
                           ({"true_cfg_scale": 3.0}, "true_cfg_scale"), ({"height": 40}, "height"),
                           ({"guidance_scale_2": -1.0}, "guidance_scale_2")]:
        with pytest.raises(InvalidArgument) as error:
            local_wan.generate(PROMPT, **options)
        assert error.value.field == field


@pytest.mark.integration
def test_served_video_equals_diffusers_and_concurrent_requests_share_forwards(wan_server, local_wan, wan_pipeline):
    from machgen.client import MachgenClient

    defaults = local_wan.manifest.defaults.to_json()
    requests = [dict(seed=10 + i, num_frames=(9, 9, 5, 9)[i], num_inference_steps=(4, 6, 4, 5)[i],
                     **({"guidance_scale": 3.0} if i % 2 else {})) for i in range(4)]

    def generate(settings, url):
        with MachgenClient(url) as client:
            return client.generate_with_stats(NAME, PROMPT, cache_policy="none", **settings)

    server = wan_server
    solo = [generate(settings, server.grpc_url) for settings in requests]
    with MachgenClient(server.grpc_url) as client:
        # A step that runs the whole denoiser calls the joined head and tail of each expert (NAME_denoiser, _2).
        before = {model: client.rows_and_forwards(f"{NAME}_{model}")
                  for model in ("denoiser", "denoiser_2", "vae_decoder_next")}
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda settings: generate(settings, server.grpc_url), requests))
        after = {model: client.rows_and_forwards(f"{NAME}_{model}") for model in before}
    for settings, (frames, stats) in zip(requests, solo):
        expected = diffusers_video(wan_pipeline, defaults, PROMPT, settings["seed"],
                                   **{k: v for k, v in settings.items() if k != "seed"})
        assert max_diff(frames, expected) <= MAX_PIXEL_DIFF, settings
        assert stats["frames"] == settings["num_frames"] == len(frames)
    for (alone, _), (batched, _) in zip(solo, together):
        assert max_diff(batched, alone.astype(np.int16)) <= MAX_PIXEL_DIFF
    rows = sum(after[m][0] - before[m][0] for m in ("denoiser", "denoiser_2"))
    forwards = sum(after[m][1] - before[m][1] for m in ("denoiser", "denoiser_2"))
    # The first request's steps before the others arrived ran in the sampler (it was alone).
    in_sampler = sum(stats["passes_in_sampler"] for _, stats in together)
    assert rows + in_sampler == 2 * sum(settings["num_inference_steps"] for settings in requests)
    assert rows / forwards > 1.3, f"{rows} denoiser rows in {forwards} forwards"
    decoder_rows = after["vae_decoder_next"][0] - before["vae_decoder_next"][0]
    assert decoder_rows == sum((settings["num_frames"] - 1) // 4 for settings in requests)


# --------------------------------------------------------------- image-to-video
@pytest.fixture(scope="module")
def tiny_wan_i2v_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "wan-i2v")


@pytest.fixture(scope="module")
def wan_i2v_repository(tiny_wan_i2v_dir, wan_repository, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_wan_i2v_dir, I2V_NAME, into=wan_repository)


def diffusers_image_to_video(tiny_dir, defaults, image: np.ndarray, seed: int, **call) -> np.ndarray:
    from PIL import Image

    pipe = load_diffusers(tiny_dir)
    call = {"height": image.shape[0], "width": image.shape[1], **call}
    return diffusers_video(pipe, defaults, PROMPT, seed, image=Image.fromarray(image), **call)


@pytest.mark.parametrize("size, call", [
    ((48, 32), {}),
    ((32, 64), {"num_frames": 13, "num_inference_steps": 5, "guidance_scale": 3.0, "guidance_scale_2": 1.5}),
], ids=["defaults", "13-frames-two-scales"])
def test_in_process_image_to_video_equals_diffusers(wan_i2v_repository, tiny_wan_i2v_dir, size, call):
    from machgen.runtime.local import LocalPipeline

    local = LocalPipeline(wan_i2v_repository, I2V_NAME)
    image = picture(*size, seed=7)
    frames, stats = local.generate(PROMPT, image=image, seed=8, cache_policy="none", **call)
    expected = diffusers_image_to_video(tiny_wan_i2v_dir, local.manifest.defaults.to_json(), image, 8, **call)
    assert max_diff(frames, expected) <= MAX_PIXEL_DIFF
    assert stats.steps == call.get("num_inference_steps", local.manifest.defaults.to_json()["num_inference_steps"])


def test_image_to_video_needs_its_picture(wan_i2v_repository):
    from machgen.contract.validation import InvalidArgument
    from machgen.runtime.local import LocalPipeline

    local = LocalPipeline(wan_i2v_repository, I2V_NAME)
    for options, field in [({}, "image"), ({"image": picture(48, 32, 0), "strength": 0.5}, "strength"),
                           ({"image": picture(40, 32, 0)}, "image")]:
        with pytest.raises(InvalidArgument) as error:
            local.generate(PROMPT, **options)
        assert error.value.field == field


@pytest.mark.integration
def test_served_image_to_video_equals_diffusers(wan_server, wan_i2v_repository, tiny_wan_i2v_dir):
    from machgen.contract.manifest import pipeline_dir
    from machgen.client import MachgenClient

    image = picture(48, 32, seed=9)
    with MachgenClient(wan_server.grpc_url) as client:
        frames, stats = client.generate_with_stats(I2V_NAME, PROMPT, image=image, seed=2, num_frames=9)
    defaults = json.loads((pipeline_dir(wan_i2v_repository, I2V_NAME) / "pipeline.json").read_text())["defaults"]
    expected = diffusers_image_to_video(tiny_wan_i2v_dir, defaults, image, 2, num_frames=9)
    assert max_diff(frames, expected) <= MAX_PIXEL_DIFF
    assert stats["frames"] == 9
