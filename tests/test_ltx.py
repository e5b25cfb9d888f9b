"""Text-to-video on the tiny LTX-Video: the served pipeline against
diffusers' LTXPipeline on the same model, seed and settings, over every
frame, the frame rate included (it scales the rotary positions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import build_tiny_repository, levels, load_diffusers, picture, serving, write_tiny

MAX_PIXEL_DIFF = 2  # of 255, over all frames
NAME = "ltx"
# Image-to-video: another pipeline of the module's one repository.
I2V_NAME = "ltx_i2v"
PROMPT = "a red circle at the top"


@pytest.fixture(scope="module")
def tiny_ltx_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "ltx")


@pytest.fixture(scope="module")
def ltx_pipeline(tiny_ltx_dir):
    return load_diffusers(tiny_ltx_dir)


@pytest.fixture(scope="module")
def ltx_repository(tiny_ltx_dir, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_ltx_dir, NAME)


@pytest.fixture(scope="module")
def local_ltx(ltx_repository):
    from machgen.runtime.local import LocalPipeline

    return LocalPipeline(ltx_repository, NAME)


def diffusers_video(pipe, defaults, seed: int, **call) -> np.ndarray:
    """LTXPipeline's frames as uint8 levels (int16), [frames, H, W, 3]; ``fps`` is its frame_rate."""
    import torch

    settings = {key: defaults[key] for key in ("height", "width", "num_frames", "num_inference_steps",
                                               "guidance_scale", "max_sequence_length")}
    settings["frame_rate"] = call.pop("fps", defaults["fps"])
    return levels(pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), output_type="np",
                       **{**settings, **call}).frames[0])


@pytest.mark.parametrize("call", [
    {},  # the served defaults: 9 frames at 25 fps, 4 steps, CFG 3
    {"num_frames": 17, "height": 64, "width": 32, "num_inference_steps": 6, "guidance_scale": 4.0, "fps": 12,
     "negative_prompt": "a blue square"},
    {"num_frames": 1, "guidance_scale": 1.0, "num_inference_steps": 3},
], ids=["defaults", "17-frames-12-fps", "one-frame-no-cfg"])
def test_in_process_text_to_video_equals_diffusers(local_ltx, ltx_pipeline, call):
    defaults = local_ltx.manifest.defaults.to_json()
    frames, stats = local_ltx.generate(PROMPT, seed=5, cache_policy="none", **call)
    expected = diffusers_video(ltx_pipeline, defaults, 5, **call)
    assert frames.shape == expected.shape
    assert np.abs(frames.astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF
    assert (stats.frames, stats.fps) == (len(frames), call.get("fps", 25))


def test_the_frame_rate_changes_the_video(local_ltx):
    at_25, _ = local_ltx.generate(PROMPT, seed=6, fps=25, cache_policy="none")
    at_8, _ = local_ltx.generate(PROMPT, seed=6, fps=8, cache_policy="none")
    assert np.abs(at_25.astype(np.int16) - at_8).max() > 2


def test_first_block_cache_skips_steps_of_a_video(local_ltx):
    uncached, plain = local_ltx.generate(PROMPT, seed=7, num_inference_steps=12, cache_policy="none")
    cached, stats = local_ltx.generate(PROMPT, seed=7, num_inference_steps=12, cache_policy="fbcache",
                                       cache_threshold=0.5)
    assert stats.denoiser_tail_passes < plain.denoiser_tail_passes
    psnr = 10 * np.log10(255.0 ** 2 / max(np.mean((cached.astype(float) - uncached.astype(float)) ** 2), 1e-12))
    assert psnr > 25, f"cached video {psnr:.1f} dB from the uncached one"


@pytest.mark.integration
def test_one_server_serves_both_tasks_as_diffusers_and_in_process(ltx_repository, ltx_pipeline, local_ltx_i2v):
    """The module's repository holds text-to-video and image-to-video: one server of it serves both."""
    from machgen.contract.manifest import pipeline_dir
    from machgen.client import MachgenClient

    defaults = json.loads((pipeline_dir(ltx_repository, NAME) / "pipeline.json").read_text())["defaults"]
    image = picture(32, 64, seed=6)
    with serving(ltx_repository) as server, \
            MachgenClient(server.grpc_url) as client:
        frames, stats = client.generate_with_stats(NAME, PROMPT, seed=3, num_frames=13, fps=16)
        i2v_frames = client.generate(I2V_NAME, PROMPT, image=image, seed=4, num_frames=9)
    expected = diffusers_video(ltx_pipeline, defaults, 3, num_frames=13, fps=16)
    assert np.abs(frames.astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF
    assert (stats["frames"], stats["fps"]) == (13, 16)
    # In process the same pipeline equals LTXImageToVideoPipeline (test_in_process_image_to_video_equals_diffusers).
    in_process, _ = local_ltx_i2v.generate(PROMPT, image=image, seed=4, num_frames=9)
    assert np.abs(i2v_frames.astype(np.int16) - in_process).max() <= 1


# --------------------------------------------------------------- image-to-video
@pytest.fixture(scope="module")
def tiny_ltx_i2v_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "ltx-i2v")


@pytest.fixture(scope="module")
def local_ltx_i2v(tiny_ltx_i2v_dir, ltx_repository, tmp_path_factory):
    from machgen.runtime.local import LocalPipeline

    build_tiny_repository(tmp_path_factory, tiny_ltx_i2v_dir, I2V_NAME, in_flight=1, into=ltx_repository)
    return LocalPipeline(ltx_repository, I2V_NAME)


@pytest.mark.parametrize("size, call", [
    ((32, 64), {}),
    ((64, 32), {"num_frames": 13, "num_inference_steps": 5, "guidance_scale": 1.0, "fps": 16}),
], ids=["defaults", "13-frames-no-cfg"])
def test_in_process_image_to_video_equals_diffusers(local_ltx_i2v, tiny_ltx_i2v_dir, size, call):
    from PIL import Image

    image = picture(*size, seed=4)
    frames, stats = local_ltx_i2v.generate(PROMPT, image=image, seed=9, cache_policy="none", **call)
    pipe = load_diffusers(tiny_ltx_i2v_dir)
    expected = diffusers_video(pipe, local_ltx_i2v.manifest.defaults.to_json(), 9, image=Image.fromarray(image),
                               height=size[0], width=size[1], **call)
    assert frames.shape == expected.shape
    assert np.abs(frames.astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF


@pytest.mark.export
def test_torch_target_serves_the_video_in_process(tiny_ltx_dir, ltx_pipeline, tmp_path):
    """The torch target (torch.export programs, CPU here) on a video family: 5-D latents in, every frame out."""
    from machgen.builder.build import TargetOptions, build_repository
    from machgen.runtime.local import LocalPipeline

    build_repository(tiny_ltx_dir, NAME, tmp_path, target="torch", target_options=TargetOptions(device="cpu"),
                     log=lambda line: None, preview=False)
    local = LocalPipeline(tmp_path, NAME)
    frames, _ = local.generate(PROMPT, seed=8, num_frames=5, fps=20, cache_policy="none")
    expected = diffusers_video(ltx_pipeline, local.manifest.defaults.to_json(), 8, num_frames=5, fps=20)
    assert np.abs(frames.astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF
