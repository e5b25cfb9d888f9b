"""A real tritonserver on loopback, called over gRPC and HTTP, against diffusers."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from machgen.client import GenerationError, MachgenClient
from machgen.contract.manifest import PipelineManifest, pipeline_dir

from conftest import PIPELINE_NAME, free_port, wait_until

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


BAD_REQUESTS = [
    ("prompt", lambda c: [c.make_input("seed", 1)], "missing"),
    ("prompt", lambda c: [c.make_input("prompt", 5, dtype="INT64")], "data-type"),
    ("height", lambda c: [c.make_input("prompt", "x"), c.make_input("height", 64.0, dtype="FP32")], "data-type"),
    ("height", lambda c: [c.make_input("prompt", "x"), c.make_input("height", 66)], "multiple of 4"),
    ("width", lambda c: [c.make_input("prompt", "x"), c.make_input("width", 4096)], "outside"),
    ("num_inference_steps", lambda c: [c.make_input("prompt", "x"), c.make_input("num_inference_steps", 0)], "outside"),
    ("num_inference_steps", lambda c: [c.make_input("prompt", "x"), c.make_input("num_inference_steps", 1001)],
     "outside"),
    ("cache_policy", lambda c: [c.make_input("prompt", "x"), c.make_input("cache_policy", "magcache")],
     "not one of none, fbcache"),  # MagCache is offered only once calibrated
    ("cache_threshold", lambda c: [c.make_input("prompt", "x"), c.make_input("cache_threshold", -1.0)], "outside"),
    ("image", lambda c: [c.make_input("prompt", "x"), c.make_input("image", np.zeros((8, 8, 3)), dtype="FP32")],
     "data-type"),
    ("image", lambda c: [c.make_input("prompt", "x"), c.make_input("image", np.zeros((8, 8, 4)))], "shape"),
    ("image", lambda c: [c.make_input("prompt", "x"), c.make_input("image", np.zeros((8, 8, 3))),
                         c.make_input("width", 16)], "width asks for 16"),
    ("strength", lambda c: [c.make_input("prompt", "x"), c.make_input("image", np.zeros((8, 8, 3))),
                            c.make_input("strength", 2.0)], "outside"),
    ("num_frames", lambda c: [c.make_input("prompt", "x"), c.make_input("num_frames", 5)], "makes images, not video"),
    ("reference_images", lambda c: [c.make_input("prompt", "x"),
                                    c.make_input("reference_images", np.zeros((1, 64, 64, 3)))], "not video"),
]


@pytest.mark.parametrize("field, make_inputs, words", BAD_REQUESTS,
                         ids=[f"{f}-{w.split()[0]}" for f, _, w in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(field, make_inputs, words, triton_server):
    for client in clients(triton_server):
        with client:
            with pytest.raises(GenerationError) as err:
                client.infer(PIPELINE_NAME, make_inputs(client))
            assert err.value.status in ("400", "StatusCode.INVALID_ARGUMENT")
            assert f"'{field}'" in str(err.value) and words in str(err.value)
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


def test_calibrated_controls_served_equal_in_process(variant_repository, variant_server):
    """MagCache and a thinned-out negative row (controls a calibration writes) through Triton."""
    from machgen.runtime.local import LocalPipeline

    name = "flux_calibrated"  # conftest.VARIANTS
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


def test_serve_cli_reports_ready_and_stops_on_sigterm(built_repository, tmp_path):
    """machgen serve, with the HTTP API beside it (--api-port): both answer, and SIGTERM stops both."""
    import httpx

    repository, _ = built_repository
    http, api = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "machgen.cli", "serve", str(repository), "--http-port", str(http),
         "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--api-port", str(api),
         "--api-data-dir", str(tmp_path / "api")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            lines.append(line)
            if line.startswith("ready:") or not line:
                break
        assert lines[-1].startswith("ready:") and f"HTTP 127.0.0.1:{http}" in lines[-1], "".join(lines)
        with MachgenClient(f"127.0.0.1:{http}", "http") as client:
            assert client.is_ready(PIPELINE_NAME)

        def api_answers() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{api}/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(api_answers, what="the API beside the server")
        models = httpx.get(f"http://127.0.0.1:{api}/v1/models").json()["data"]
        assert [model["id"] for model in models] == [PIPELINE_NAME]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        with MachgenClient(f"127.0.0.1:{http}", "http") as client:
            assert not client.is_ready(PIPELINE_NAME)
        assert not api_answers()
    finally:
        if process.poll() is None:
            process.kill()
