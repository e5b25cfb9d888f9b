"""Reference-to-video on the tiny Wan VACE: the served pipeline against
diffusers' WanVACEPipeline with reference images (and without: VACE's
text-to-video) on the same model, seed and settings, over every frame."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import build_tiny_repository, levels, load_diffusers, serving, write_tiny

MAX_PIXEL_DIFF = 2  # of 255, over all frames
NAME = "vace"
PROMPT = "a red circle at the top"


@pytest.fixture(scope="module")
def tiny_vace_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "wan-vace")


@pytest.fixture(scope="module")
def vace_pipeline(tiny_vace_dir):
    return load_diffusers(tiny_vace_dir)


@pytest.fixture(scope="module")
def vace_repository(tiny_vace_dir, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_vace_dir, NAME)


@pytest.fixture(scope="module")
def local_vace(vace_repository):
    from machgen.runtime.local import LocalPipeline

    return LocalPipeline(vace_repository, NAME)


def references(count: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(count).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def diffusers_video(pipe, defaults, seed: int, reference_images: np.ndarray | None, **call) -> np.ndarray:
    """WanVACEPipeline's frames as uint8 levels (int16), [frames, H, W, 3]."""
    import PIL.Image
    import torch

    settings = {key: defaults[key] for key in ("height", "width", "num_frames", "num_inference_steps",
                                               "guidance_scale", "max_sequence_length")}
    if reference_images is not None:
        settings["reference_images"] = [PIL.Image.fromarray(picture) for picture in reference_images]
    return levels(pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), output_type="np",
                       **{**settings, **call}).frames[0])


@pytest.mark.parametrize("count, call", [
    (1, {}),  # the served defaults: 9 frames, 4 steps, CFG 5
    (2, {"num_frames": 5, "guidance_scale": 1.0, "negative_prompt": "a blue square"}),
    (0, {"num_inference_steps": 3}),  # no reference: VACE's text-to-video
], ids=["one-reference", "two-references-no-cfg", "no-reference"])
def test_in_process_reference_to_video_equals_diffusers(local_vace, vace_pipeline, count, call):
    defaults = local_vace.manifest.defaults.to_json()
    pictures = references(count, defaults["height"], defaults["width"]) if count else None
    frames, stats = local_vace.generate(PROMPT, seed=4, cache_policy="none", reference_images=pictures, **call)
    expected = diffusers_video(vace_pipeline, defaults, 4, pictures, **call)
    assert frames.shape == expected.shape
    assert np.abs(frames.astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF
    assert stats.frames == len(expected)


def test_control_latents_equal_the_pipelines(local_vace, vace_pipeline):
    """The control branch's input for two references (their order, normalisation and mask) against
    WanVACEPipeline's preprocess_conditions, prepare_video_latents and prepare_masks."""
    import PIL.Image
    import torch

    defaults = local_vace.manifest.defaults.to_json()
    height, width = defaults["height"], defaults["width"]
    pictures = references(2, height, width)
    inputs = {"prompt": np.array([PROMPT.encode()], dtype=object), "reference_images": pictures,
              "num_frames": np.array([5], dtype=np.int32)}
    from point_mass import state

    runtime = local_vace.sampler.runtime
    request_state = state(runtime, local_vace.sampler.parse_request(inputs.get, local_vace.manifest.defaults))
    runtime.initial_latents(request_state)  # counts the reference frames in front of the video
    ours = runtime.request_conditioning(request_state)["control_hidden_states"]
    pipe = vace_pipeline
    with torch.no_grad():
        video, mask, pictures_in = pipe.preprocess_conditions(
            None, None, [PIL.Image.fromarray(picture) for picture in pictures], 1, height, width, 5,
            torch.float32, "cpu")
        expected = torch.cat([pipe.prepare_video_latents(video, mask, pictures_in, None, "cpu"),
                              pipe.prepare_masks(mask, pictures_in)], dim=1)
    assert ours.shape == expected.shape == (1, 96, 2 + 2, height // 8, width // 8)
    assert (ours - expected).abs().max() <= 1e-4


def test_head_and_tail_equal_the_vace_transformer(vace_pipeline):
    """The served split (control block j's hint after the j-th VACE layer, computed where it is
    needed) against WanVACETransformer3DModel.forward, which runs every control block first."""
    import torch

    from machgen.families.registry import get_family

    head_class, tail_class, _ = get_family("wan-vace").exporter().denoiser_classes
    transformer = vace_pipeline.transformer
    head, tail = head_class(transformer).eval(), tail_class(transformer).eval()
    gen = torch.Generator().manual_seed(0)
    latents, text = torch.randn(2, 16, 3, 6, 4, generator=gen), torch.randn(2, 7, 32, generator=gen)
    control, timestep = torch.randn(2, 96, 3, 6, 4, generator=gen), torch.tensor([[700.0], [300.0]])
    with torch.no_grad():
        image, text_hidden, timestep_proj, temb, _, control_hidden = head(latents, timestep, text, control)
        ours, _ = tail(image, text_hidden, timestep_proj, temb, latents, control_hidden)
        expected, without_control = (
            transformer(hidden_states=latents, timestep=timestep.reshape(-1), encoder_hidden_states=text,
                        control_hidden_states=value, return_dict=False)[0] for value in (control, control * 0))
    assert (ours - expected).abs().max() <= 1e-5
    assert (expected - without_control).abs().max() > 0.1  # the hints count


@pytest.mark.integration
def test_served_reference_to_video_equals_diffusers(vace_repository, vace_pipeline):
    from machgen.contract.manifest import pipeline_dir
    from machgen.client import MachgenClient

    defaults = json.loads((pipeline_dir(vace_repository, NAME) / "pipeline.json").read_text())["defaults"]
    pictures = references(2, defaults["height"], defaults["width"])
    with serving(vace_repository) as server, \
            MachgenClient(server.grpc_url) as client:
        frames, stats = client.generate_with_stats(NAME, PROMPT, reference_images=pictures, seed=2, num_frames=5)
    expected = diffusers_video(vace_pipeline, defaults, 2, pictures, num_frames=5)
    assert np.abs(frames.astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF
    assert stats["frames"] == 5
