import numpy as np
import pytest

from machgen.ensembles.api import API_INPUTS, InvalidArgument, parse_request

DEFAULTS = {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 3.5, "true_cfg_scale": 1.0,
            "negative_prompt": None, "max_sequence_length": 32, "max_height": 256, "max_width": 256,
            "max_inference_steps": 1000}
TYPES = {t.name: t.triton_dtype for t in API_INPUTS}


def parse(**inputs):
    arrays = {}
    for name, value in inputs.items():
        if TYPES[name] == "BYTES":
            arrays[name] = np.array([value if isinstance(value, bytes) else value.encode()], dtype=object)
        else:
            arrays[name] = np.array([value], dtype={"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}[TYPES[name]])
    return parse_request(arrays.get, DEFAULTS, size_multiple=16, cache_policies=("none", "fbcache"))


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


def test_more_than_one_element_is_refused():
    arrays = {"prompt": np.array([b"a", b"b"], dtype=object)}
    with pytest.raises(InvalidArgument, match="'prompt'.*one element"):
        parse_request(arrays.get, DEFAULTS, size_multiple=16)
