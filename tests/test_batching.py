"""Batching across requests, cancellation and the bounded queue, on a real tritonserver."""

import json
import queue
import time

import numpy as np
import pytest

from machgen.builder.repository import ServingOptions
from machgen.client import NO_RETRY, GenerationError, MachgenClient

from conftest import PIPELINE_NAME, metric, solo_then_together, wait_until

pytestmark = pytest.mark.integration

MAX_PIXEL_DIFF = 2  # of 255


BATCHED = "flux_batched"  # conftest.VARIANTS: per-step calls wait for each other


def test_concurrent_requests_with_mixed_steps_equal_their_solo_runs(variant_server):
    # distinct seeds, mixed step counts, one or two rows per denoiser call (true CFG on every third)
    requests = [dict(prompt=("a red cat", "a green circle at the top left")[i % 2], seed=100 + i,
                     num_inference_steps=(2, 3, 5, 8)[i % 4],
                     **(dict(negative_prompt="a blue dog", true_cfg_scale=4.0) if i % 3 == 0 else {}))
                for i in range(32)]

    solo, together, rows, forwards = solo_then_together(variant_server, BATCHED, requests)
    for settings, alone, batched in zip(requests, solo, together):
        diff = np.abs(alone.astype(int) - batched.astype(int)).max()
        assert diff <= MAX_PIXEL_DIFF, f"{settings}: max pixel difference {diff} from its solo run"
    # the denoiser steps of different requests really shared forwards
    assert rows == sum(r["num_inference_steps"] * (2 if "true_cfg_scale" in r else 1) for r in requests)
    assert rows / forwards > 1.5


class _Calls:
    """gRPC async_infer calls whose outcomes land in one queue: (tag, error or None)."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.inputs = MachgenClient(url)
        self.outcomes: queue.Queue = queue.Queue()

    def start(self, tag: str, steps: int, model: str = PIPELINE_NAME, **kwargs):
        inputs = [self.inputs.make_input("prompt", "a red cat"), self.inputs.make_input("seed", 1),
                  self.inputs.make_input("num_inference_steps", steps)]
        return self.client.async_infer(model, inputs,
                                       callback=lambda result, error: self.outcomes.put((tag, error)), **kwargs)

    def wait(self, count: int, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        return dict(self.outcomes.get(timeout=max(0.1, deadline - time.monotonic())) for _ in range(count))

    def close(self) -> None:
        self.client.close()
        self.inputs.close()


def test_cancelled_and_timed_out_requests_free_their_slots_and_the_others_complete(triton_server):
    slots = ServingOptions().in_flight
    long_steps = 250  # seconds of work at this concurrency
    calls = _Calls(triton_server.grpc_url)
    tail = f"{PIPELINE_NAME}_denoiser_tail"
    with MachgenClient(triton_server.grpc_url) as client:
        rows_before, _ = client.rows_and_forwards(tail)
    try:
        cancelled = calls.start("cancelled", long_steps)
        calls.start("deadline", long_steps, client_timeout=1.0)
        for index in range(slots - 2):
            calls.start(f"long{index}", long_steps)
        # Every slot's request is stepping once the tail has run a few steps' rows of them all.
        with MachgenClient(triton_server.grpc_url) as client:
            wait_until(lambda: client.rows_and_forwards(tail)[0] - rows_before >= 3 * slots,
                       what="the long requests' first steps")
        cancelled.cancel()
        # Two short requests can only run if the cancelled and timed-out ones gave their slots back.
        for index in range(2):
            calls.start(f"short{index}", 2)
        first = calls.wait(4, timeout=30.0)
        assert sorted(first) == ["cancelled", "deadline", "short0", "short1"], "the long requests finished first"
        assert first["short0"] is None and first["short1"] is None, {tag: str(error) for tag, error in first.items()}
        assert "cancel" in str(first["cancelled"]).lower()
        assert "deadline" in str(first["deadline"]).lower()
        rest = calls.wait(slots - 2)
        assert rest == {f"long{index}": None for index in range(slots - 2)}, {
            tag: str(error) for tag, error in rest.items() if error is not None}
    finally:
        calls.close()
    log = triton_server.log_file.read_text(errors="replace")
    assert log.count("cancelled after") >= 2, "the server did not stop the withdrawn requests"


def test_a_full_queue_answers_unavailable_and_keeps_serving(variant_server):
    queue_model = "flux_queue"  # conftest.VARIANTS: one request in flight, one waiting
    calls = _Calls(variant_server.grpc_url)
    try:
        with MachgenClient(variant_server.grpc_url, retry=NO_RETRY) as client:
            calls.start("running", 300, queue_model)
            wait_until(lambda: client.rows_and_forwards(f"{queue_model}_denoiser_tail")[0] > 0,
                       what="the first request's steps")
            calls.start("queued", 2, queue_model)
            wait_until(lambda: metric(variant_server, "nv_inference_pending_request_count", queue_model) == 1,
                       what="the second request in the queue")
            with pytest.raises(GenerationError) as refused:
                client.generate(queue_model, "a red cat", num_inference_steps=2)
        assert refused.value.status == "StatusCode.UNAVAILABLE"
        assert "queue" in str(refused.value).lower()
        assert calls.wait(2) == {"running": None, "queued": None}
        with MachgenClient(variant_server.grpc_url) as client:
            assert client.generate(queue_model, "a red cat", num_inference_steps=2).shape[0] == 1
    finally:
        calls.close()


def test_the_sampler_refuses_a_key_already_running_stops_the_one_a_cancel_names_and_sends_progress_if_asked(
        triton_server):
    # What the public model sends its sampler, sent by hand over one stream.
    import tritonclient.grpc as grpcclient

    sampler = f"{PIPELINE_NAME}_sampler"
    responses: queue.Queue = queue.Queue()
    stream = grpcclient.InferenceServerClient(triton_server.grpc_url)
    stream.start_stream(callback=lambda result, error: responses.put((result, error)))
    outputs = [grpcclient.InferRequestedOutput(name) for name in ("images", "progress", "error", "accepted_by")]

    def next_response(request_id: str) -> dict:
        deadline = time.monotonic() + 60.0
        while True:
            result, error = responses.get(timeout=max(0.1, deadline - time.monotonic()))
            assert error is None, error
            if result.get_response().id == request_id:
                return {output.name: result.as_numpy(output.name) for output in result.get_response().outputs}

    def error_of(response: dict) -> dict:
        assert "error" in response, f"not an error: {sorted(response)}"
        return json.loads(response["error"][0])

    with MachgenClient(triton_server.grpc_url) as client:
        def generation(key: str, steps: int) -> list:
            return [client.make_input("prompt", "a red cat"), client.make_input("num_inference_steps", steps),
                    client.make_input("request_key", key, model=sampler)]

        try:
            stream.async_stream_infer(sampler, generation("one key", 250), request_id="first", outputs=outputs)
            # First who took it (the relay watches that process), then its steps.
            taken_by = int(next_response("first")["accepted_by"][0])
            assert taken_by in {stub.pid for stub in triton_server.stubs() if stub.model == sampler}
            assert "progress" in next_response("first")
            stream.async_stream_infer(sampler, generation("one key", 2), request_id="second", outputs=outputs)
            refused = error_of(next_response("second"))
            assert refused["status"] == "INVALID_ARG" and "request_key" in refused["message"]
            stream.async_stream_infer(sampler, [client.make_input("cancel", "one key", model=sampler)],
                                      request_id="stop")
            while "progress" in (last := next_response("first")):
                pass
            assert error_of(last)["status"] == "CANCELLED"
            # The key is free again once its request has ended.
            stream.async_stream_infer(sampler, generation("one key", 2), request_id="again", outputs=outputs)
            while {"progress", "accepted_by"} & set(last := next_response("again")):
                pass
            assert last["images"].shape[0] == 1
            # The plain public model asks for no progress (it polls its client's cancellation instead).
            quiet = [*generation("quiet", 3), client.make_input("progress", 0, model=sampler)]
            stream.async_stream_infer(sampler, quiet, request_id="quiet", outputs=outputs)
            assert "accepted_by" in next_response("quiet")
            assert next_response("quiet")["images"].shape[0] == 1, "a progress response it did not ask for"
        finally:
            stream.stop_stream()
            stream.close()


def test_through_the_api_a_full_queue_is_503_and_a_waiting_job_runs_once_there_is_room(variant_server, api_keys,
                                                                                        tmp_path):
    """The streaming twin keeps the public model's bounds (one in flight and one waiting for flux_queue): a
    synchronous image request past them answers 503 with Retry-After; an asynchronous job stays queued and
    runs once the running one is cancelled."""
    import httpx

    from machgen.api.webhooks import new_secret

    from conftest import ApiProcess

    queue_model = "flux_queue"
    keys_file, key, _ = api_keys
    api = ApiProcess(variant_server.grpc_url, tmp_path / "data", keys_file, key, new_secret(), tmp_path / "api.log",
                     "--preview-interval", "0").wait_ready()
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{api.url}/v1/images/generations"
    try:
        running = httpx.post(url, headers=headers, json={"model": queue_model, "prompt": "a cat",
                                                         "num_inference_steps": 1000, "async": True}).json()
        wait_until(lambda: httpx.get(f"{api.url}/v1/jobs/{running['id']}", headers=headers).json()["progress"] > 0,
                   what="the first job's steps")
        waiting = httpx.post(url, headers=headers, json={"model": queue_model, "prompt": "a dog", "seed": 2,
                                                         "num_inference_steps": 2, "async": True}).json()
        # A decoupled model's execute takes each request as it comes: two, one running and one waiting.
        wait_until(lambda: metric(variant_server, "nv_inference_exec_count", f"{queue_model}_stream") >= 2,
                   what="the second job at the streaming model")
        refused = httpx.post(url, headers=headers, timeout=60, json={"model": queue_model, "prompt": "x"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "server_busy"
        assert httpx.get(f"{api.url}/v1/jobs/{waiting['id']}", headers=headers).json()["status"] == "queued"
        httpx.delete(f"{api.url}/v1/jobs/{running['id']}", headers=headers, timeout=60)
        wait_until(lambda: httpx.get(f"{api.url}/v1/jobs/{waiting['id']}", headers=headers).json()["status"]
                   == "completed", what="the waiting job to run")
    finally:
        api.stop()
