"""A real tritonserver on loopback, called over gRPC and HTTP, against diffusers."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from machgen.client import GenerationError, MachgenClient
from machgen.contract.manifest import PipelineManifest, pipeline_dir

from conftest import CALIBRATED, PIPELINE_NAME, metric

pytestmark = pytest.mark.integration

MAX_PIXEL_DIFF = 2  # of 255
SETTINGS = [
    dict(prompt="a red cat", seed=3),
    dict(prompt="a green circle at the top left", seed=11, num_inference_steps=6, height=32, width=96,
         guidance_scale=1.5),
    dict(prompt="a red cat", negative_prompt="a blue dog", true_cfg_scale=4.0, seed=7),
]


def clients(server):
    return [MachgenClient(server.grpc_url, "grpc"), MachgenClient(server.http_url, "http")]


def diffusers_image(pipe, defaults, prompt, seed, **options):
    call = {"height": defaults["height"], "width": defaults["width"],
            "num_inference_steps": defaults["num_inference_steps"], "guidance_scale": defaults["guidance_scale"]}
    call.update(options)
    image = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed),
                 max_sequence_length=defaults["max_sequence_length"], **call).images[0]
    return np.asarray(image)


@pytest.fixture(scope="module")
def defaults(built_repository):
    repository, _ = built_repository
    return PipelineManifest.read(pipeline_dir(repository, PIPELINE_NAME)).defaults.to_json()


@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "size-steps-guidance", "true-cfg"])
def test_served_image_equals_diffusers(settings, triton_server, tiny_flux_pipeline, defaults):
    expected = diffusers_image(tiny_flux_pipeline, defaults, **settings)
    for client in clients(triton_server):
        with client:
            options = {k: v for k, v in settings.items() if k != "prompt"}
            images = client.generate(PIPELINE_NAME, settings["prompt"], **options)
        assert images.dtype == np.uint8 and images.shape == (1,) + expected.shape
        diff = np.abs(images[0].astype(int) - expected.astype(int)).max()
        assert diff <= MAX_PIXEL_DIFF, f"{client.protocol}: max pixel difference {diff}"
        assert expected.std() > 10  # a real image, not a constant one


def raw(client, name: str, value, triton_dtype: str):
    """An input exactly as given: any shape, any data type (the client's own typing bypassed)."""
    from tritonclient.utils import np_to_triton_dtype

    array = np.asarray(value, dtype=object if triton_dtype == "BYTES" else None)
    if triton_dtype != "BYTES":
        array = array.astype({"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64,
                              "UINT8": np.uint8, "UINT64": np.uint64, "INT8": np.int8}[triton_dtype])
        assert np_to_triton_dtype(array.dtype) == triton_dtype
    tensor = client._module.InferInput(name, list(array.shape), triton_dtype)
    tensor.set_data_from_numpy(array)
    return tensor


NAN, INF = float("nan"), float("inf")
NOT_UTF8 = b"\xff\xfe a \xc3\x28"
# (the field the answer must name, the inputs besides a valid prompt, words the answer holds or None). Every
# input of the tiny Flux: wrong data types and shapes, NaN and infinities for every float, integers out of
# range or overflowing, sizes zero, negative, off the factor or over the maximum, bad images, inputs of
# other families and tasks, names no model has, text that is not UTF-8.
BAD_REQUESTS = [
    ("prompt", lambda c: [c.make_input("seed", 1)], "missing"),
    ("prompt", lambda c: [raw(c, "prompt", [5], "INT64")], None),
    ("prompt", lambda c: [raw(c, "prompt", [b"a", b"b"], "BYTES")], None),
    ("prompt", lambda c: [raw(c, "prompt", [NOT_UTF8], "BYTES")], "UTF-8"),
    ("negative_prompt", lambda c: [raw(c, "negative_prompt", [NOT_UTF8], "BYTES")], "UTF-8"),
    ("negative_prompt", lambda c: [raw(c, "negative_prompt", [1.0], "FP32")], None),
    ("seed", lambda c: [raw(c, "seed", [-1], "INT64")], "outside"),
    ("seed", lambda c: [raw(c, "seed", [1.5], "FP32")], None),
    ("seed", lambda c: [raw(c, "seed", [2**64 - 1], "UINT64")], None),
    ("seed", lambda c: [raw(c, "seed", [1, 2], "INT64")], None),
    ("num_inference_steps", lambda c: [c.make_input("num_inference_steps", 0)], "outside"),
    ("num_inference_steps", lambda c: [c.make_input("num_inference_steps", -5)], "outside"),
    ("num_inference_steps", lambda c: [c.make_input("num_inference_steps", 1001)], "outside"),
    ("num_inference_steps", lambda c: [c.make_input("num_inference_steps", 2**31 - 1)], "outside"),
    ("num_inference_steps", lambda c: [raw(c, "num_inference_steps", [4], "INT64")], None),
    ("num_inference_steps", lambda c: [raw(c, "num_inference_steps", [[4]], "INT32")], None),
    *[(field, lambda c, field=field, bad=bad: [c.make_input(field, bad)], "outside")
      for field in ("guidance_scale", "true_cfg_scale", "cache_threshold")
      for bad in (NAN, INF, -INF, -1.0)],
    *[("strength", lambda c, bad=bad: [c.make_input("image", np.zeros((8, 8, 3))), c.make_input("strength", bad)],
       "outside") for bad in (NAN, INF, -INF, -1.0)],
    ("guidance_scale", lambda c: [raw(c, "guidance_scale", [3], "INT32")], None),
    ("guidance_scale", lambda c: [raw(c, "guidance_scale", [3.0], "FP64")], None),
    ("guidance_scale", lambda c: [c.make_input("guidance_scale", 1e9)], "outside"),
    ("true_cfg_scale", lambda c: [raw(c, "true_cfg_scale", [2.0, 3.0], "FP32")], None),
    *[(field, lambda c, field=field, bad=bad: [c.make_input(field, bad)], words)
      for field in ("height", "width")
      for bad, words in ((0, "outside"), (-64, "outside"), (66, "multiple of 4"), (4096, "outside"),
                         (2**31 - 1, "outside"))],
    ("height", lambda c: [raw(c, "height", [64.0], "FP32")], None),
    ("width", lambda c: [raw(c, "width", [64], "INT8")], None),
    ("cache_policy", lambda c: [c.make_input("cache_policy", "bogus")], "not one of"),
    ("cache_policy", lambda c: [c.make_input("cache_policy", "magcache")], "not one of none, fbcache"),
    ("cache_policy", lambda c: [raw(c, "cache_policy", [NOT_UTF8], "BYTES")], "UTF-8"),
    ("image", lambda c: [raw(c, "image", np.zeros((8, 8, 3)), "FP32")], None),
    ("image", lambda c: [raw(c, "image", np.zeros((8, 8, 4)), "UINT8")], None),
    ("image", lambda c: [raw(c, "image", np.zeros((8, 8, 1)), "UINT8")], None),
    ("image", lambda c: [raw(c, "image", np.zeros((8, 8)), "UINT8")], None),
    ("image", lambda c: [raw(c, "image", np.zeros((1, 8, 8, 3)), "UINT8")], None),
    ("image", lambda c: [raw(c, "image", np.zeros((0, 8, 3)), "UINT8")], None),
    ("image", lambda c: [raw(c, "image", np.zeros((4100, 8, 3)), "UINT8")], None),
    ("image", lambda c: [c.make_input("image", np.zeros((8, 8, 3))), c.make_input("width", 16)],
     "width asks for 16"),
    ("strength", lambda c: [c.make_input("strength", 0.5)], "image"),
    ("strength", lambda c: [c.make_input("image", np.zeros((8, 8, 3))), c.make_input("strength", 2.0)], "outside"),
    ("num_frames", lambda c: [c.make_input("num_frames", 5)], "makes images, not video"),
    ("fps", lambda c: [c.make_input("fps", 24)], None),
    ("reference_images", lambda c: [c.make_input("reference_images", np.zeros((1, 64, 64, 3)))], "not video"),
    ("stg_scale", lambda c: [raw(c, "stg_scale", [1.0], "FP32")], None),  # LTX-2's
    ("guidance_scale_2", lambda c: [raw(c, "guidance_scale_2", [3.0], "FP32")], None),  # Wan's
    ("bogus_input", lambda c: [raw(c, "bogus_input", [1], "INT32")], None),
]


def _valid_prompt(make_inputs):
    def inputs(client):
        made = make_inputs(client)
        if not any(tensor.name() == "prompt" for tensor in made) and make_inputs is not BAD_REQUESTS[0][1]:
            made = [client.make_input("prompt", "a red cat"), *made]
        return made
    return inputs


def test_bad_input_corpus_is_invalid_argument_naming_the_field(triton_server):
    """Every bad request of the corpus, over gRPC and HTTP, is answered INVALID_ARGUMENT (HTTP 400) naming
    its field; the server then makes the same image as before the corpus."""
    assert len(BAD_REQUESTS) >= 40
    valid = dict(seed=21, num_inference_steps=3)
    with MachgenClient(triton_server.grpc_url) as client:
        before = client.generate(PIPELINE_NAME, "a red cat", **valid)
    misanswered = []
    for field, make_inputs, words in BAD_REQUESTS:
        for client in clients(triton_server):
            with client:
                try:
                    client.infer(PIPELINE_NAME, _valid_prompt(make_inputs)(client))
                    misanswered.append(f"{client.protocol} {field}: served")
                    continue
                except GenerationError as err:
                    answer = err
            named = f"'{field}'" in str(answer) and (words is None or words in str(answer))
            if answer.status not in ("400", "StatusCode.INVALID_ARGUMENT") or not named:
                misanswered.append(f"{client.protocol} {field} ({words}): {answer.status} {answer}")
    assert not misanswered, "\n".join(misanswered)
    with MachgenClient(triton_server.grpc_url) as client:
        assert np.array_equal(client.generate(PIPELINE_NAME, "a red cat", **valid), before)


def test_a_prompt_of_a_megabyte_is_served_truncated_or_refused_by_name(triton_server):
    """diffusers truncates a long prompt to the text encoders' lengths; so does the server, or it refuses
    the prompt by name: never a crash."""
    huge = "a red cat " * 100_000
    for client in clients(triton_server):
        with client:
            try:
                images = client.generate(PIPELINE_NAME, huge, seed=5, num_inference_steps=2)
            except GenerationError as err:
                assert err.status in ("400", "StatusCode.INVALID_ARGUMENT") and "'prompt'" in str(err)
            else:
                assert images.shape == (1, 64, 64, 3)
            assert client.is_ready(PIPELINE_NAME)
    # the server keeps serving
    with MachgenClient(triton_server.grpc_url) as client:
        assert client.generate(PIPELINE_NAME, "a red cat", seed=1, num_inference_steps=1).shape == (1, 64, 64, 3)


CACHED = dict(seed=4, num_inference_steps=12, cache_policy="fbcache")


def test_cached_request_equals_the_same_policy_in_process(triton_server, built_repository):
    from machgen.runtime.local import LocalPipeline

    repository, _ = built_repository
    local = LocalPipeline(repository, PIPELINE_NAME)
    for threshold in (0.05, 0.5):
        expected, expected_stats = local.generate("a red cat", cache_threshold=threshold, **CACHED)
        with MachgenClient(triton_server.grpc_url) as client:
            images, stats = client.generate_with_stats(PIPELINE_NAME, "a red cat", cache_threshold=threshold,
                                                       **CACHED)
        assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1
        assert stats["denoiser_tail_calls"] == expected_stats.denoiser_tail_calls
        assert stats["denoiser_head_calls"] == 12 and stats["cache_policy"] == "fbcache"
    assert stats["denoiser_tail_calls"] < 12, stats  # the loose threshold really skipped


def test_a_step_that_runs_head_and_tail_is_one_call_to_their_ensemble(triton_server):
    """Served, a step that runs the whole denoiser calls NAME_denoiser (Triton's ensemble of head and tail:
    one round trip, the head's outputs passed on inside the server); a First-Block Cache step, which must see
    the head's outputs before it decides on the tail, calls the two apart."""
    chain, head = f"{PIPELINE_NAME}_denoiser", f"{PIPELINE_NAME}_denoiser_head"

    def calls() -> dict:
        return {model: metric(triton_server, "nv_inference_request_success", model) for model in (chain, head)}

    with MachgenClient(triton_server.grpc_url) as client:
        for policy, chained in (("none", 3), ("fbcache", 0)):
            before = calls()
            client.generate(PIPELINE_NAME, "a red cat", seed=2, num_inference_steps=3, cache_policy=policy)
            after = calls()
            assert (after[chain] - before[chain], after[head] - before[head]) == (chained, 3), policy


def test_calibrated_controls_served_equal_in_process(variant_repository, variant_server):
    """MagCache and a thinned-out negative row (controls a calibration writes) through Triton."""
    from machgen.runtime.local import LocalPipeline

    name = CALIBRATED  # conftest.VARIANTS
    local = LocalPipeline(variant_repository, name)
    options = dict(seed=6, num_inference_steps=10, negative_prompt="a blue dog", true_cfg_scale=3.0)
    requests = [dict(cache_policy="fbcache", cache_threshold=0.3), dict(cache_policy="magcache", cache_threshold=0.3)]
    expected = [local.generate("a red cat", **options, **request) for request in requests]
    with MachgenClient(variant_server.grpc_url) as client:
        served = [client.generate_with_stats(name, "a red cat", **options, **request) for request in requests]
    for (images, stats), (expected_images, expected_stats) in zip(served, expected):
        assert np.abs(images.astype(int) - expected_images.astype(int)).max() <= 1
        assert stats["negative_rows_derived"] == expected_stats.negative_rows_derived > 0
        assert stats["denoiser_tail_passes"] == expected_stats.denoiser_tail_passes < 20


def test_concurrent_requests_with_different_policies_equal_alone(triton_server):
    from concurrent.futures import ThreadPoolExecutor

    requests = [dict(cache_policy="none", seed=1), dict(cache_policy="fbcache", cache_threshold=0.5, seed=1),
                dict(cache_policy="fbcache", cache_threshold=0.1, seed=2), dict(cache_policy="none", seed=2)]

    def generate(options):
        with MachgenClient(triton_server.grpc_url) as client:
            return client.generate(PIPELINE_NAME, "a red cat", num_inference_steps=12, **options)

    alone = [generate(options) for options in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(generate, requests))
    for single, concurrent in zip(alone, together):
        np.testing.assert_array_equal(single, concurrent)
    assert not np.array_equal(alone[0], alone[1])  # the policies do differ


def test_generate_cli_writes_the_served_image(triton_server, tmp_path):
    out = tmp_path / "cat.png"
    done = subprocess.run(
        [sys.executable, "-m", "machgen.cli", "generate", "--url", triton_server.http_url, "--protocol", "http",
         "--model", PIPELINE_NAME, "--prompt", "a red cat", "--seed", "3", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with MachgenClient(triton_server.grpc_url) as client:
        expected = client.generate(PIPELINE_NAME, "a red cat", seed=3, num_inference_steps=2)[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), expected)

    bad = subprocess.run(
        [sys.executable, "-m", "machgen.cli", "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
         "--prompt", "x", "--height", "3", "--out", str(tmp_path / "no.png")], capture_output=True, text=True)
    assert bad.returncode == 2 and "'height'" in bad.stderr and not (tmp_path / "no.png").exists()

    # image-to-image: the picture just written, redrawn
    redrawn = tmp_path / "redrawn.png"
    done = subprocess.run(
        [sys.executable, "-m", "machgen.cli", "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
         "--prompt", "a blue cat", "--seed", "4", "--image", str(out), "--strength", "0.5", "--out", str(redrawn)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with MachgenClient(triton_server.grpc_url) as client:
        expected = client.generate(PIPELINE_NAME, "a blue cat", seed=4, image=np.asarray(Image.open(out)),
                                   strength=0.5)[0]
    np.testing.assert_array_equal(np.asarray(Image.open(redrawn)), expected)

    # MP4 output: an image model's single frame, at the default rate
    from machgen.client.video import read_mp4, write_mp4

    clip = tmp_path / "cat.mp4"
    done = subprocess.run(
        [sys.executable, "-m", "machgen.cli", "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
         "--prompt", "a red cat", "--seed", "3", "--steps", "2", "--out", str(clip)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    frames, fps = read_mp4(clip)
    assert frames.shape == (1, *np.asarray(Image.open(out)).shape) and fps == 16
    # H.264 is lossy (this noisy tiny-model image loses ~15 levels) but deterministic: the served frame, encoded
    write_mp4(np.asarray(Image.open(out))[None], tmp_path / "expected.mp4", fps=16)
    np.testing.assert_array_equal(frames, read_mp4(tmp_path / "expected.mp4")[0])
    mismatch = subprocess.run(
        [sys.executable, "-m", "machgen.cli", "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
         "--prompt", "x", "--task", "t2v", "--out", str(tmp_path / "no.png")], capture_output=True, text=True)
    assert mismatch.returncode == 2 and "t2v writes an .mp4 file" in mismatch.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "machgen.cli", "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
         "--prompt", "x", "--num-frames", "5", "--out", str(tmp_path / "no.mp4")], capture_output=True, text=True)
    assert refused.returncode == 2 and "'num_frames'" in refused.stderr and not (tmp_path / "no.mp4").exists()


def test_control_apis_answer_only_the_key_machgen_serve_holds(triton_server):
    """The model-repository (load, unload) and shared-memory APIs refuse a caller without the server's key,
    or with another, on both protocols; with it they answer."""
    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client
    from tritonclient.utils import InferenceServerException

    from machgen.server import CONTROL_KEY_HEADER

    for module, url, protocol in ((http_client, triton_server.http_url, "http"),
                                  (grpc_client, triton_server.grpc_url, "grpc")):
        client = module.InferenceServerClient(url)
        calls = {"repository index": lambda headers: client.get_model_repository_index(headers=headers),
                 "unload": lambda headers: client.unload_model(PIPELINE_NAME, headers=headers),
                 "load": lambda headers: client.load_model(PIPELINE_NAME, headers=headers),
                 "shared memory": lambda headers: client.get_system_shared_memory_status(headers=headers),
                 "shared memory registration": lambda headers: client.register_system_shared_memory(
                     "region", "/machgen_test", 64, headers=headers)}
        for what, call in calls.items():
            wrong_key = {name: "not-the-key" for name in triton_server.control_headers(protocol)}
            for headers in (None, wrong_key):
                with pytest.raises(InferenceServerException, match="restricted") as refused:
                    call(headers)
                assert CONTROL_KEY_HEADER in str(refused.value), f"{module.__name__} {what}"
        assert client.get_model_repository_index(headers=triton_server.control_headers(protocol))
        assert client.is_model_ready(PIPELINE_NAME)
        client.close()


def test_logging_and_trace_settings_answer_only_the_key_machgen_serve_holds(triton_server):
    """Switching verbose logging or tracing on (and reading their settings: Triton restricts a category
    whole) is refused without the server's key on both protocols, the settings left as they were: HTTP 403,
    gRPC UNAVAILABLE (Triton 2.51's code for a restricted protocol). With the key both change, and are put
    back (the session's server serves the other tests)."""
    import json
    import urllib.error
    import urllib.request

    import tritonclient.grpc as grpc_client
    import tritonclient.http as http_client
    from tritonclient.utils import InferenceServerException

    from machgen.server import CONTROL_KEY_HEADER, GRPC_CONTROL_KEY_HEADER

    def raw_http(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://{triton_server.http_url}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    refusal = {"error": f"This API is restricted, expecting header '{CONTROL_KEY_HEADER}'"}
    for path, body in (("/v2/logging", {"log_verbose_level": 1}), ("/v2/trace/setting", {"trace_rate": "7"})):
        assert raw_http("POST", path, body) == (403, refusal), path
        assert raw_http("GET", path) == (403, refusal), path

    http = http_client.InferenceServerClient(triton_server.http_url)
    grpc = grpc_client.InferenceServerClient(triton_server.grpc_url)
    key = {"http": triton_server.control_headers("http"), "grpc": triton_server.control_headers("grpc")}
    wrong_key = {GRPC_CONTROL_KEY_HEADER: "not-the-key"}
    refused_calls = {
        "log settings update": lambda headers: grpc.update_log_settings({"log_verbose_level": 1}, headers=headers),
        "log settings": lambda headers: grpc.get_log_settings(headers=headers),
        "trace settings update": lambda headers: grpc.update_trace_settings(settings={"trace_rate": "7"},
                                                                            headers=headers),
        "trace settings": lambda headers: grpc.get_trace_settings(headers=headers)}
    for what, call in refused_calls.items():
        for headers in (None, wrong_key):
            with pytest.raises(InferenceServerException) as refused:
                call(headers)
            assert (refused.value.status(), refused.value.message()) == (
                "StatusCode.UNAVAILABLE", f"This protocol is restricted, expecting header '{GRPC_CONTROL_KEY_HEADER}'"
            ), what
    logging, trace = http.get_log_settings(headers=key["http"]), http.get_trace_settings(headers=key["http"])
    assert logging["log_verbose_level"] == 0 and trace["trace_rate"] != "7"  # the refused updates changed nothing
    try:
        assert http.update_log_settings({"log_verbose_level": 1}, headers=key["http"])["log_verbose_level"] == 1
        assert http.update_trace_settings(settings={"trace_rate": "7"}, headers=key["http"])["trace_rate"] == "7"
        by_grpc = grpc.get_log_settings(headers=key["grpc"], as_json=True)["settings"]
        assert by_grpc["log_verbose_level"] == {"uint32_param": 1}
        assert grpc.update_log_settings({"log_verbose_level": 0}, headers=key["grpc"],
                                        as_json=True)["settings"]["log_verbose_level"] == {"uint32_param": 0}
        assert grpc.update_trace_settings(settings={"trace_rate": trace["trace_rate"]}, headers=key["grpc"],
                                          as_json=True)["settings"]["trace_rate"] == {"value": [trace["trace_rate"]]}
    finally:
        http.update_log_settings({"log_verbose_level": 0}, headers=key["http"])
        http.update_trace_settings(settings={"trace_rate": trace["trace_rate"]}, headers=key["http"])
        http.close()
        grpc.close()


HANGING_MODEL = '''
import time

import machgen.runtime.triton_models  # noqa: F401 - as every machgen model's stub does


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(120)  # a load that hangs, silent

    def execute(self, requests):
        return []
'''

def first_start_then(first: str, every: str = "pass") -> str:
    """A Python model whose initialize runs the statement ``first`` on its first start only (a marker file in its
    folder says it started), then ``every`` on each start."""
    return f'''
import os
import signal
import time


class TritonPythonModel:
    def initialize(self, args):
        marker = os.path.join(args["model_repository"], "started-once")
        if not os.path.exists(marker):
            open(marker, "w").close()
            {first}
        {every}

    def execute(self, requests):
        return []
'''


# A load that hangs, silent, the first time it is started; the next time it logs nothing for 12 s while it
# computes (a big model's weights being read and converted).
HANGS_ONCE_THEN_COMPUTES = first_start_then("time.sleep(120)", "end = time.monotonic() + 12\n"
                                            "        while time.monotonic() < end:\n"
                                            "            pass")
# A load that kills its server (the stub's parent) the first time it is started, as Triton's own abort at
# start-up does (boost::interprocess::lock_exception, SIGABRT); the next time it loads.
ABORTS_ONCE = first_start_then("os.kill(os.getppid(), signal.SIGABRT)")


def one_model_repository(root: Path, name: str, source: str) -> Path:
    repository = root / name
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "1" / "model.py").write_text(source)
    (repository / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [1] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n'
        'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
    return repository


def test_a_start_that_hangs_says_which_models_it_waits_for_and_one_that_computes_is_waited_for(tmp_path):
    """A start whose log stays silent and whose processes idle is given up after stall_timeout, naming the
    models whose load began and did not end and the state of each stub, and leaving their Python stacks in the
    log (seen in full runs: a start that hung for minutes, its log silent), and made again where asked; one
    whose log stays silent as long while a load computes is not."""
    from machgen.server import Ports, ServerError, StartStalled, TritonServer

    from conftest import free_port

    repository = one_model_repository(tmp_path, "hangs", HANGING_MODEL)
    server = TritonServer(repository, Ports(free_port(), free_port(), free_port()), log_file=tmp_path / "log")
    try:
        with pytest.raises(StartStalled) as stalled:
            server.start(timeout=90, stall_timeout=5)
    finally:
        server.stop()
    message = str(stalled.value)
    assert "made no progress for 5 s" in message and "models not loaded: hangs;" in message, message
    assert "stub processes: hangs_0_0 (pid" in message and "sleeping" in message, message
    # Where it hangs: the stub's threads' Python stacks, in the server log.
    assert "the Python stacks of 1 of them are in the server log" in message, message
    assert "in initialize" in (tmp_path / "log").read_text(errors="replace"), message
    assert not server.alive()

    # Given two attempts, a start that hangs is made again; that one's silent, computing load is waited for.
    repository = one_model_repository(tmp_path, "computes", HANGS_ONCE_THEN_COMPUTES)
    server = TritonServer(repository, Ports(free_port(), free_port(), free_port()), log_file=tmp_path / "log2")
    try:
        started = time.monotonic()
        server.start(timeout=90, stall_timeout=5, attempts=2)
        assert time.monotonic() - started > 5 + 12 and server.ready()
    except ServerError as error:
        pytest.fail(f"a load that computes was taken for one that hangs: {error}")
    finally:
        server.stop()
    assert (tmp_path / "log2").read_text(errors="replace").count('"loading: computes:1"') == 2  # started twice


def test_a_start_whose_server_is_killed_is_made_again_where_asked(tmp_path):
    """A start whose server a signal kills before it is ready (Triton's lock_exception abort, seen on a loaded
    machine) is StartAborted, naming the signal; given two attempts, the start is made again and serves."""
    from machgen.server import Ports, ServerError, StartAborted, TritonServer

    from conftest import free_port

    repository = one_model_repository(tmp_path, "aborts", ABORTS_ONCE)
    server = TritonServer(repository, Ports(free_port(), free_port(), free_port()), log_file=tmp_path / "log")
    try:
        with pytest.raises(StartAborted, match="tritonserver was killed by SIGABRT while it started"):
            server.start(timeout=90)
        assert not server.alive() and not server.stubs()
    finally:
        server.stop()
    (repository / "aborts" / "started-once").unlink()
    server = TritonServer(repository, Ports(free_port(), free_port(), free_port()), log_file=tmp_path / "log2")
    try:
        server.start(timeout=90, attempts=2)
        assert server.ready()
    except ServerError as error:
        pytest.fail(f"a start whose server was killed was not made again: {error}")
    finally:
        server.stop()
    assert (tmp_path / "log2").read_text(errors="replace").count('"loading: aborts:1"') == 2  # started twice
