"""NAME_stream, the public model's decoupled twin: progress per step, previews, then the plain model's result."""

import queue

import numpy as np
import pytest

from machgen.client import GenerationError, MachgenClient

from conftest import PIPELINE_NAME, steps_after_stop_asked

pytestmark = pytest.mark.integration

STREAM = f"{PIPELINE_NAME}_stream"


def test_the_stream_sends_each_step_in_order_previews_at_the_interval_and_the_plain_models_result(triton_server):
    request = dict(seed=5, num_inference_steps=7, negative_prompt="a blue dog", true_cfg_scale=3.0)
    progress = []
    with MachgenClient(triton_server.grpc_url) as client:
        assert client.has_stream(PIPELINE_NAME)
        plain, plain_stats = client.generate_with_stats(PIPELINE_NAME, "a red cat", **request)
        streamed, stats = client.generate_with_stats(PIPELINE_NAME, "a red cat", on_progress=progress.append,
                                                     preview_interval=3, **request)
    np.testing.assert_array_equal(streamed, plain)
    assert stats["text_cache_hits"] == 2  # the plain request's prompts
    measured = ("text_cache_hits", "text_cache_misses", "waited_seconds", "denoiser_seconds")  # differ per run
    work = {key: value for key, value in stats.items() if key not in measured}
    assert work == {key: value for key, value in plain_stats.items() if key not in measured}
    assert stats["denoiser_seconds"] > 0 and stats["waited_seconds"] >= 0
    assert [(p.step, p.total) for p in progress] == [(step, 7) for step in range(1, 8)]
    elapsed = [p.elapsed for p in progress]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    # Every third step, never the last (the result itself follows).
    assert [p.step for p in progress if p.preview is not None] == [3, 6]
    preview = next(p.preview for p in progress if p.preview is not None)
    # One picture at the latents' size: the image's divided by the VAE's scale.
    assert preview.dtype == np.uint8 and preview.ndim == 4 and preview.shape[::3] == (1, 3)
    scale = plain.shape[1] // preview.shape[1]
    assert scale > 1 and preview.shape[1:3] == (plain.shape[1] // scale, plain.shape[2] // scale)


def test_the_streams_default_interval_comes_from_the_model_and_zero_sends_none(triton_server, built_repository):
    from machgen.contract.manifest import PipelineManifest, pipeline_dir

    interval = PipelineManifest.read(pipeline_dir(built_repository[0], PIPELINE_NAME)).preview_interval
    steps = 2 * interval + 1
    with MachgenClient(triton_server.grpc_url) as client:
        defaulted, silent = [], []
        client.generate(PIPELINE_NAME, "a cat", seed=1, num_inference_steps=steps, on_progress=defaulted.append)
        client.generate(PIPELINE_NAME, "a cat", seed=1, num_inference_steps=steps, on_progress=silent.append,
                        preview_interval=0)
    assert [p.step for p in defaulted if p.preview is not None] == [interval, 2 * interval]
    assert len(silent) == steps and all(p.preview is None for p in silent)


def test_a_bad_stream_request_is_invalid_argument_naming_the_field(triton_server):
    with MachgenClient(triton_server.grpc_url) as client:
        for options, field in [(dict(height=33), "height"), (dict(preview_interval=-1), "preview_interval")]:
            with pytest.raises(GenerationError) as error:
                client.generate(PIPELINE_NAME, "a cat", on_progress=lambda p: None, **options)
            assert "INVALID_ARG" in error.value.status and f"'{field}'" in str(error.value)


def test_cancelling_a_stream_stops_the_request_at_the_next_step(triton_server):
    """The client cancels its stream after the third step: the sampler stops within two steps of the
    stream model seeing it, and the next stream request runs."""
    import tritonclient.grpc as grpcclient

    client = MachgenClient(triton_server.grpc_url)
    triton = grpcclient.InferenceServerClient(triton_server.grpc_url)
    responses: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = [client.make_input("prompt", "a long cat"), client.make_input("seed", 1),
              client.make_input("num_inference_steps", 1000)]  # the most: still running when cancelled on loaded cores
    triton.async_stream_infer(STREAM, inputs, request_id="stream-to-cancel")
    steps = []
    while len(steps) < 3:
        result, error = responses.get(timeout=60)
        assert error is None, error
        steps.append(int(result.as_numpy("progress")[0]))
    triton.stop_stream(cancel_requests=True)
    assert steps_after_stop_asked(triton_server, "stream-to-cancel") <= 1
    with client:
        assert client.generate(PIPELINE_NAME, "a cat", seed=1, num_inference_steps=2,
                               on_progress=lambda p: None).shape[0] == 1


def test_generate_cli_shows_progress_and_writes_the_previews(triton_server, tmp_path):
    import subprocess
    import sys

    from PIL import Image

    out, previews = tmp_path / "cat.png", tmp_path / "previews"
    done = subprocess.run(
        [sys.executable, "-m", "machgen.cli", "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
         "--prompt", "a red cat", "--seed", "3", "--steps", "4", "--preview-interval", "1", "--preview-dir",
         str(previews), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in previews.iterdir()) == ["step-0001.png", "step-0002.png", "step-0003.png"]
    assert "wrote 3 previews" in done.stderr
    with MachgenClient(triton_server.grpc_url) as client:
        expected = client.generate(PIPELINE_NAME, "a red cat", seed=3, num_inference_steps=4)[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), expected)
