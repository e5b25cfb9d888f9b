import re
from dataclasses import replace

import numpy as np
import pytest

from machgen.contract.api import API_INPUTS, input_array
from machgen.contract.request import parse_request
from machgen.contract.specs import Capabilities, ServedDefaults
from machgen.contract.validation import InvalidArgument

DEFAULTS = ServedDefaults(height=64, width=64, num_inference_steps=4, guidance_scale=3.5, true_cfg_scale=1.0,
                          negative_prompt=None, max_sequence_length=32, max_height=256, max_width=256,
                          max_inference_steps=1000)
IMAGE_MODEL = Capabilities(tasks=("text-to-image",))
TYPES = {t.name: t.triton_dtype for t in API_INPUTS}
API = {t.name: t for t in API_INPUTS}


def parse(**inputs):
    arrays = {}
    for name, value in inputs.items():
        if TYPES[name] == "BYTES":
            arrays[name] = np.array([value if isinstance(value, bytes) else value.encode()], dtype=object)
        else:
            arrays[name] = np.array([value], dtype={"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}[TYPES[name]])
    return parse_request(arrays.get, DEFAULTS, size_multiple=16, capabilities=IMAGE_MODEL,
                         cache_policies=("none", "fbcache"))


def test_defaults_fill_absent_inputs():
    req = parse(prompt="a cat", seed=3)
    assert (req.prompt, req.seed, req.height, req.width, req.num_inference_steps) == ("a cat", 3, 64, 64, 4)
    assert req.negative_prompt is None and not req.uses_true_cfg


def test_absent_seed_is_drawn_at_random_and_zero_is_kept():
    assert parse(prompt="x", seed=0).seed == 0
    assert len({parse(prompt="x").seed for _ in range(5)}) > 1


def test_cache_inputs_are_optional_and_passed_through():
    assert (parse(prompt="x").cache_policy, parse(prompt="x").cache_threshold) == (None, None)
    req = parse(prompt="x", cache_policy="fbcache", cache_threshold=0.25)
    assert (req.cache_policy, req.cache_threshold) == ("fbcache", 0.25)


def test_true_cfg_needs_a_scale_above_one_and_a_negative_prompt():
    assert parse(prompt="x", negative_prompt="y", true_cfg_scale=4.0).uses_true_cfg
    assert not parse(prompt="x", true_cfg_scale=4.0).uses_true_cfg


@pytest.mark.parametrize("inputs, field, words", [
    ({}, "prompt", "missing"),
    ({"prompt": b"\xff\xfe"}, "prompt", "UTF-8"),
    ({"prompt": "x", "height": 72}, "height", "multiple of 16"),
    ({"prompt": "x", "width": 8}, "width", "outside"),
    ({"prompt": "x", "height": 4096}, "height", "outside"),
    ({"prompt": "x", "width": 272}, "width", "outside"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "outside"),
    ({"prompt": "x", "num_inference_steps": 1001}, "num_inference_steps", "outside"),
    ({"prompt": "x", "seed": -1}, "seed", "outside"),
    ({"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale", "outside"),
    ({"prompt": "x", "true_cfg_scale": -1.0}, "true_cfg_scale", "outside"),
    ({"prompt": "x", "cache_policy": "teacache"}, "cache_policy", "not one of none, fbcache"),
    ({"prompt": "x", "cache_threshold": -0.1}, "cache_threshold", "outside"),
    ({"prompt": "x", "cache_threshold": float("inf")}, "cache_threshold", "outside"),
])
def test_bad_inputs_are_named(inputs, field, words):
    with pytest.raises(InvalidArgument) as err:
        parse(**inputs)
    assert err.value.field == field
    assert f"'{field}'" in str(err.value) and words in str(err.value)


@pytest.mark.parametrize("field", ["stg_scale", "audio_guidance_rescale"])  # LTX-2's guidance, refused elsewhere
def test_another_familys_input_is_refused_by_name(field):
    from machgen.contract.request import check_option_names
    from machgen.families.registry import family_inputs

    with pytest.raises(InvalidArgument) as err:
        check_option_names([field], TYPES, family_inputs())
    assert err.value.field == field
    assert f"'{field}'" in str(err.value) and "does not take it" in str(err.value)
    with pytest.raises(TypeError, match="nope"):
        check_option_names(["nope"], TYPES, family_inputs())


def test_more_than_one_element_is_refused():
    arrays = {"prompt": np.array([b"a", b"b"], dtype=object)}
    with pytest.raises(InvalidArgument, match="'prompt'.*one element"):
        parse_request(arrays.get, DEFAULTS, size_multiple=16, capabilities=IMAGE_MODEL)


IMAGE_TASKS = ("text-to-image", "image-to-image")


def parse_with_image(image, tasks=IMAGE_TASKS, **inputs):
    arrays = {"image": image} if image is not None else {}
    for name, value in {"prompt": "x", **inputs}.items():
        arrays[name] = input_array(API[name], value)
    return parse_request(arrays.get, DEFAULTS, size_multiple=16, capabilities=Capabilities(tasks=tasks))


def test_image_sets_the_size_and_strength_defaults_as_diffusers():
    req = parse_with_image(np.zeros((96, 32, 3), np.uint8))
    assert (req.height, req.width, req.strength, req.denoising_steps) == (96, 32, 0.6, 3)
    assert parse_with_image(None).image is None and parse_with_image(None).denoising_steps == 4
    req = parse_with_image(np.zeros((64, 64, 3), np.uint8), strength=1.0, height=64, width=64)
    assert req.denoising_steps == 4


@pytest.mark.parametrize("image, tasks, inputs, field, words", [
    (np.zeros((64, 64, 3), np.float32), IMAGE_TASKS, {}, "image", "UINT8"),
    (np.zeros((64, 64), np.uint8), IMAGE_TASKS, {}, "image", "[height, width, 3]"),
    (np.zeros((64, 64, 4), np.uint8), IMAGE_TASKS, {}, "image", "[height, width, 3]"),
    (np.zeros((0, 64, 3), np.uint8), IMAGE_TASKS, {}, "image", "[height, width, 3]"),
    (np.zeros((64, 64, 3), np.uint8), IMAGE_TASKS, {"height": 128}, "image", "height asks for 128"),
    (np.zeros((64, 40, 3), np.uint8), IMAGE_TASKS, {}, "image", "multiple of 16"),
    (np.zeros((512, 64, 3), np.uint8), IMAGE_TASKS, {}, "image", "multiple of 16 in [16, 256]"),
    (np.zeros((64, 64, 3), np.uint8), ("text-to-image",), {}, "image", "does not start from an image"),
    (np.zeros((64, 64, 3), np.uint8), IMAGE_TASKS, {"strength": 1.5}, "strength", "outside"),
    (np.zeros((64, 64, 3), np.uint8), IMAGE_TASKS, {"strength": 0.0}, "strength", "no denoising step of 4"),
    (None, IMAGE_TASKS, {"strength": 0.5}, "strength", "only to image-to-image"),
    (None, ("image-to-video",), {}, "image", "missing; this model starts from an image"),
    (np.zeros((64, 64, 3), np.uint8), ("image-to-video",), {"strength": 0.5}, "strength", "only to image-to-image"),
])
def test_bad_image_inputs_are_named(image, tasks, inputs, field, words):
    with pytest.raises(InvalidArgument) as err:
        parse_with_image(image, tasks, **inputs)
    assert err.value.field == field
    assert f"'{field}'" in str(err.value) and words in str(err.value)


VIDEO = replace(DEFAULTS, num_frames=17, max_frames=81, fps=16)
VIDEO_TASKS = ("text-to-video", "image-to-video", "reference-to-video")


def parse_video(tasks=VIDEO_TASKS, **arrays):
    inputs = {"prompt": np.array([b"a cat"], dtype=object), **arrays}
    return parse_request(inputs.get, VIDEO, size_multiple=16, capabilities=Capabilities(tasks=tasks), frame_multiple=4)


def test_video_fields_take_the_model_defaults_and_follow_its_frame_rule():
    request = parse_video()
    assert (request.num_frames, request.fps, request.reference_images) == (17, 16, None)
    request = parse_video(num_frames=np.array([81], np.int32), fps=np.array([24], np.int32),
                          reference_images=np.zeros((2, 64, 64, 3), np.uint8))
    assert (request.num_frames, request.fps, request.reference_images.shape) == (81, 24, (2, 64, 64, 3))


@pytest.mark.parametrize("tasks, arrays, field, words", [
    (("text-to-image",), {"num_frames": np.array([5], np.int32)}, "num_frames", "makes images, not video"),
    (("text-to-image",), {"fps": np.array([24], np.int32)}, "fps", "makes images, not video"),
    (("text-to-image",), {"reference_images": np.zeros((1, 64, 64, 3), np.uint8)}, "reference_images",
     "makes images, not video"),
    (VIDEO_TASKS, {"num_frames": np.array([18], np.int32)}, "num_frames", "not 4k + 1"),
    (VIDEO_TASKS, {"num_frames": np.array([85], np.int32)}, "num_frames", "outside [1, 81]"),
    (VIDEO_TASKS, {"num_frames": np.array([0], np.int32)}, "num_frames", "outside"),
    (VIDEO_TASKS, {"fps": np.array([0], np.int32)}, "fps", "outside"),
    (("text-to-video",), {"reference_images": np.zeros((1, 64, 64, 3), np.uint8)}, "reference_images",
     "does not do reference-to-video"),
    (VIDEO_TASKS, {"reference_images": np.zeros((64, 64, 3), np.uint8)}, "reference_images", "expected shape"),
    (VIDEO_TASKS, {"reference_images": np.zeros((9, 64, 64, 3), np.uint8)}, "reference_images", "1 to 8 images"),
    (VIDEO_TASKS, {"reference_images": np.zeros((1, 64, 64, 3), np.float32)}, "reference_images", "UINT8"),
    (VIDEO_TASKS, {"reference_images": np.zeros((1, 32, 64, 3), np.uint8)}, "reference_images",
     "not the video's 64x64"),
])
def test_bad_video_inputs_are_named(tasks, arrays, field, words):
    with pytest.raises(InvalidArgument, match=re.escape(words)) as raised:
        parse_video(tasks=tasks, **arrays)
    assert raised.value.field == field


def parse_guidance(guidance_is_cfg: bool, experts: int, **values):
    """A Wan-like video model's request: one denoiser, or two experts (Wan's guidance_scale_2 input)."""
    from machgen.families.wan.spec import GUIDANCE_SCALE_2

    inputs = {"prompt": np.array([b"a cat"], dtype=object),
              **{name: np.array([value], np.float32) for name, value in values.items()}}
    return parse_request(inputs.get, replace(VIDEO, negative_prompt=""), size_multiple=16,
                         capabilities=Capabilities(tasks=("text-to-video",), guidance_is_cfg=guidance_is_cfg),
                         frame_multiple=4, family_inputs=(GUIDANCE_SCALE_2,), settings={"experts": experts})


def test_guidance_scale_is_the_cfg_scale_of_a_model_without_embedded_guidance():
    request = parse_guidance(True, 1, guidance_scale=5.0)
    assert (request.true_cfg_scale, request.inputs["guidance_scale_2"], request.uses_true_cfg) == (5.0, None, True)
    assert not parse_guidance(True, 1, guidance_scale=1.0).uses_true_cfg  # WanPipeline: CFG only above 1
    request = parse_guidance(True, 2, guidance_scale=4.0)
    assert request.inputs["guidance_scale_2"] is None  # the low-noise expert's scale defaults to guidance_scale
    assert parse_guidance(True, 2, guidance_scale=4.0, guidance_scale_2=3.0).inputs["guidance_scale_2"] == 3.0
    request = parse_guidance(False, 1, guidance_scale=3.5, true_cfg_scale=4.0)  # Flux: embedded guidance
    assert (request.guidance_scale, request.true_cfg_scale) == (3.5, 4.0)


@pytest.mark.parametrize("guidance_is_cfg, experts, values, field, words", [
    (True, 2, {"true_cfg_scale": 4.0}, "true_cfg_scale", "guidance scale is guidance_scale"),
    (False, 1, {"guidance_scale_2": 3.0}, "guidance_scale_2", "one denoiser, not two experts"),
    (True, 2, {"guidance_scale_2": -1.0}, "guidance_scale_2", "outside [0, 100]"),
])
def test_bad_guidance_inputs_are_named(guidance_is_cfg, experts, values, field, words):
    with pytest.raises(InvalidArgument, match=re.escape(words)) as raised:
        parse_guidance(guidance_is_cfg, experts, **values)
    assert raised.value.field == field


def test_family_input_parsers_name_the_field():
    from machgen.contract.validation import fraction_input, guidance_scale_input, indices_input

    assert indices_input("stg_blocks", np.array([3, 0], dtype=np.int32), 4) == (3, 0)
    assert indices_input("stg_blocks", np.array([], dtype=np.int32), 4) == ()
    for call, words in [(lambda: indices_input("stg_blocks", np.array([4], dtype=np.int32), 4), "outside"),
                        (lambda: indices_input("stg_blocks", np.array([1, 1], dtype=np.int32), 4), "repeats"),
                        (lambda: indices_input("stg_blocks", np.array([0.5], dtype=np.float32), 4), "integer"),
                        (lambda: fraction_input("guidance_rescale", np.array([1.5], dtype=np.float32)), "outside"),
                        (lambda: guidance_scale_input("stg_scale", np.array([-1.0], dtype=np.float32)), "outside")]:
        with pytest.raises(InvalidArgument, match=words):
            call()


def test_only_models_with_sound_declare_the_audio_output():
    from machgen.contract.api import public_outputs

    assert [t.name for t in public_outputs(audio=False)] == ["images", "stats", "trajectory"]
    assert [t.name for t in public_outputs(audio=True)] == ["images", "stats", "trajectory", "audio"]
