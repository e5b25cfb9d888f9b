"""The HTTP API (machgen api) on a served model, called as application developers call it: the official
``openai`` package, curl-like HTTP, Server-Sent Events, webhooks verified with ``standardwebhooks``."""

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from machgen.client import MachgenClient

from conftest import PIPELINE_NAME, ApiProcess, events_of, picture, wait_until

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

MAX_PIXEL_DIFF = 2  # of 255


def openai_client(api, key=None):
    import openai

    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=key or api.key, max_retries=0)


def png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert np.abs(actual.astype(int) - expected.astype(int)).max() <= MAX_PIXEL_DIFF


def auth(api, key=None) -> dict:
    return {"Authorization": f"Bearer {key or api.key}"}


def test_images_generate_with_the_openai_package_equals_the_plain_triton_model(api_server, triton_server):
    client = openai_client(api_server)
    result = client.images.generate(model=PIPELINE_NAME, prompt="a red cat", n=2, size="64x32",
                                    extra_body={"seed": 5, "num_inference_steps": 3})
    by_url = client.images.generate(model=PIPELINE_NAME, prompt="a red cat", size="64x32", response_format="url",
                                    extra_body={"seed": 6, "num_inference_steps": 3})
    with MachgenClient(triton_server.grpc_url) as triton:
        expected = [triton.generate(PIPELINE_NAME, "a red cat", seed=seed, num_inference_steps=3, width=64,
                                    height=32)[0] for seed in (5, 6)]
    assert len(result.data) == 2
    assert_close(png_pixels(base64.b64decode(result.data[0].b64_json)), expected[0])
    assert_close(png_pixels(base64.b64decode(result.data[1].b64_json)), expected[1])  # n: seed, seed + 1
    downloaded = httpx.get(by_url.data[0].url, headers=auth(api_server), timeout=30)
    assert downloaded.headers["content-type"] == "image/png"
    assert_close(png_pixels(downloaded.content), expected[1])


def test_images_edit_is_image_to_image_with_strength(api_server, triton_server):
    start = picture(32, 64, seed=4)
    buffer = io.BytesIO()
    Image.fromarray(start).save(buffer, format="PNG")
    result = openai_client(api_server).images.edit(
        model=PIPELINE_NAME, image=("start.png", buffer.getvalue(), "image/png"), prompt="a blue square",
        extra_body={"seed": 2, "strength": 0.5, "num_inference_steps": 4})
    with MachgenClient(triton_server.grpc_url) as triton:
        expected = triton.generate(PIPELINE_NAME, "a blue square", image=start, strength=0.5, seed=2,
                                   num_inference_steps=4)[0]
    assert_close(png_pixels(base64.b64decode(result.data[0].b64_json)), expected)


def test_a_jobs_events_are_its_steps_in_order_previews_at_the_interval_then_the_job(api_server):
    job = httpx.post(f"{api_server.url}/v1/images/generations", headers=auth(api_server), timeout=30, json={
        "model": PIPELINE_NAME, "prompt": "a green circle", "n": 2, "seed": 1, "num_inference_steps": 5,
        "preview_interval": 2, "async": True}).json()
    assert job["object"] == "job" and job["status"] in ("queued", "in_progress")
    events = events_of(api_server, job["id"])
    for index in (0, 1):
        steps = [data["step"] for name, data in events if name == "progress" and data["index"] == index]
        assert steps == [1, 2, 3, 4, 5]
    percents = [data["progress"] for name, data in events if name == "progress"]
    assert percents == sorted(percents) and percents[-1] < 100
    # Late listeners get each variant's latest preview: step 4 (2 was replaced while nobody listened, or not).
    previews = [(data["index"], data["step"]) for name, data in events if name == "preview"]
    assert {step for _, step in previews} <= {2, 4} and {index for index, _ in previews} == {0, 1}
    image = events[[name for name, _ in events].index("preview")][1]["image"]
    assert png_pixels(base64.b64decode(image.split(",", 1)[1])).ndim == 3
    name, final = events[-1]
    assert name == "completed" and final["status"] == "completed" and final["progress"] == 100
    assert len(final["outputs"]) == 2
    image = httpx.get(api_server.url + final["outputs"][1], headers=auth(api_server), timeout=30)
    assert image.status_code == 200 and png_pixels(image.content).shape == (64, 64, 3)


def test_a_streamed_image_request_sends_its_partial_images_then_the_image(api_server):
    """OpenAI's events alone (test_openai_contract.py checks them field by field); the job's own progress
    events are at /v1/jobs/{id}/events, its id in the X-Machgen-Job-Id header."""
    with httpx.stream("POST", f"{api_server.url}/v1/images/generations", headers=auth(api_server), timeout=60,
                      json={"model": PIPELINE_NAME, "prompt": "a cat", "seed": 3, "num_inference_steps": 4,
                            "partial_images": 3, "stream": True}) as response:
        job_id = response.headers["x-machgen-job-id"]
        body = "".join(response.iter_text())
    names = [line[len("event: "):] for line in body.splitlines() if line.startswith("event: ")]
    assert names == ["image_generation.partial_image"] * 3 + ["image_generation.completed"]
    steps = [data["step"] for name, data in events_of(api_server, job_id) if name == "progress"]
    assert steps == [1, 2, 3, 4]


def test_a_served_models_own_inputs_are_in_v1_models_as_its_card_publishes_them(api_server, triton_server):
    """GET /v1/models and /v1/models/{name} list the model's own inputs as ``machgen inputs`` reads them (the
    tiny Flux has none of its own; test_api_routes.py checks a model that has)."""
    with MachgenClient(triton_server.grpc_url) as triton:
        card = triton.model_card(PIPELINE_NAME)
        published = triton.published_inputs(PIPELINE_NAME)
    one = httpx.get(f"{api_server.url}/v1/models/{PIPELINE_NAME}", headers=auth(api_server), timeout=30).json()
    listed = httpx.get(f"{api_server.url}/v1/models", headers=auth(api_server), timeout=30).json()["data"]
    assert one in listed and one["id"] == PIPELINE_NAME and one["kind"] == "image"
    assert one["inputs"] == card["inputs"]
    assert [entry["name"] for entry in one["inputs"]] == list(published)


def test_bad_requests_get_openais_error_body_with_the_field(api_server):
    import openai

    client = openai_client(api_server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=PIPELINE_NAME, prompt="a cat", size="66x64")
    assert refused.value.param == "width" and "multiple of 4" in refused.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        client.images.generate(model="dall-e-3", prompt="a cat")
    assert unknown.value.code == "model_not_found"
    url = f"{api_server.url}/v1/images/generations"
    cases = [
        ({"model": PIPELINE_NAME, "prompt": "a cat", "size": "63x64"}, 400, "width"),
        ({"model": PIPELINE_NAME, "prompt": "a cat", "size": "big"}, 400, "size"),
        ({"model": PIPELINE_NAME, "prompt": "a cat", "num_inference_steps": 0}, 400, "num_inference_steps"),
        ({"model": PIPELINE_NAME, "prompt": "a cat", "n": 11}, 400, "n"),
        ({"model": PIPELINE_NAME, "prompt": "a cat", "num_frames": 9}, 400, "num_frames"),
        ({"model": PIPELINE_NAME, "prompt": "a cat", "seed": "x"}, 400, "seed"),
        ({"model": PIPELINE_NAME, "prompt": "a cat", "wings": 2}, 400, "wings"),
        ({"model": PIPELINE_NAME}, 400, "prompt"),
        ({"model": "dall-e-3", "prompt": "a cat"}, 404, "model"),
    ]
    for body, status, param in cases:
        response = httpx.post(url, json=body, headers=auth(api_server), timeout=30)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["message"] and error["type"], body
    malformed = httpx.post(url, content=b"{not json", headers={**auth(api_server), "content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"
    wrong_type = httpx.post(url, content=b"prompt=cat", headers={**auth(api_server), "content-type": "text/plain"})
    assert wrong_type.status_code == 415 and wrong_type.json()["error"]["code"] == "unsupported_media_type"
    huge = httpx.post(f"{api_server.url}/v1/images/edits", headers=auth(api_server), timeout=30,
                      files={"image": ("big.png", b"0" * (26 * 1024 * 1024), "image/png")}, data={"prompt": "x"})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    broken = httpx.post(f"{api_server.url}/v1/images/edits", headers=auth(api_server), timeout=30,
                        files={"image": ("bad.png", b"not a picture", "image/png")}, data={"prompt": "x"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "image"
    assert httpx.get(f"{api_server.url}/v1/jobs/nope", headers=auth(api_server)).status_code == 404
    assert httpx.get(f"{api_server.url}/v1/nowhere", headers=auth(api_server)).json()["error"]["code"] == "not_found"


def test_without_a_valid_key_401_and_over_a_keys_limit_429(api_server, api_keys):
    import openai

    for key in ("mg-wrong", None):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        response = httpx.get(f"{api_server.url}/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai_client(api_server, key="mg-wrong").images.generate(model=PIPELINE_NAME, prompt="a cat")
    _, _, limited_key = api_keys
    long_job = {"model": PIPELINE_NAME, "prompt": "a cat", "num_inference_steps": 1000, "async": True}
    first = httpx.post(f"{api_server.url}/v1/images/generations", json=long_job, headers=auth(api_server, limited_key))
    assert first.status_code == 200
    try:
        second = httpx.post(f"{api_server.url}/v1/images/generations", json=long_job,
                            headers=auth(api_server, limited_key))
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
        assert second.json()["error"]["code"] == "too_many_jobs"
        with pytest.raises(openai.RateLimitError):
            openai_client(api_server, key=limited_key).images.generate(model=PIPELINE_NAME, prompt="a cat")
        # Another key's jobs are not counted against this one; nor is the job visible to it.
        assert httpx.get(f"{api_server.url}/v1/jobs/{first.json()['id']}", headers=auth(api_server)).status_code == 404
    finally:
        cancelled = httpx.delete(f"{api_server.url}/v1/jobs/{first.json()['id']}",
                                 headers=auth(api_server, limited_key), timeout=30).json()
    assert cancelled["status"] == "cancelled"


def test_a_keys_jobs_past_its_running_cap_wait_queued_start_in_order_and_leave_others_be(triton_server, api_keys,
                                                                                          tmp_path):
    """--max-running-per-key 1: three jobs of one key run one after the other, in the order they came, the
    others queued meanwhile; another key's job runs beside them."""
    from machgen.api.webhooks import new_secret

    keys_file, key, other_key = api_keys
    api = ApiProcess(triton_server.grpc_url, tmp_path / "data", keys_file, key, new_secret(), tmp_path / "api.log",
                     "--max-running-per-key", "1").wait_ready()
    try:
        def submit(chosen: str, steps: int) -> str:
            response = httpx.post(f"{api.url}/v1/images/generations", headers=auth(api, chosen), timeout=30,
                                  json={"model": PIPELINE_NAME, "prompt": "a cat", "num_inference_steps": steps,
                                        "async": True})
            assert response.status_code == 200, response.text
            return response.json()["id"]

        def status_of(job_id: str, chosen: str = key) -> str:
            return httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=auth(api, chosen), timeout=30).json()["status"]

        # The first job, and the other key's, long enough to be seen running while the others are submitted and
        # looked at on a loaded machine (a look after short jobs had ended showed nothing waiting, or running).
        mine = [submit(key, 300)]
        wait_until(lambda: status_of(mine[0]) == "in_progress", what="the first job to start")
        mine += [submit(key, 20), submit(key, 20)]
        other = submit(other_key, 300)
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            # The latest first: a job in progress means every earlier one had ended before it was read, so one
            # look cannot show two in progress that never were (the other order can: an earlier job read just
            # before it ends, a later one just after it starts).
            seen.append({other: status_of(other, other_key), **{job_id: status_of(job_id) for job_id in reversed(mine)}})
            if all(status == "completed" for status in seen[-1].values()):
                break
            time.sleep(0.05)
        assert all(status == "completed" for status in seen[-1].values()), seen[-1]
        assert all(sum(statuses[job_id] == "in_progress" for job_id in mine) <= 1 for statuses in seen)
        started = [next(index for index, statuses in enumerate(seen) if statuses[job_id] != "queued")
                   for job_id in mine]
        assert started == sorted(started) and started[0] < started[-1], started
        assert any(statuses[other] == "in_progress" and "queued" in [statuses[job_id] for job_id in mine]
                   for statuses in seen)
    finally:
        api.stop()


class _Receiver(BaseHTTPRequestHandler):
    """Answers 500 to its first delivery, 200 after."""

    deliveries: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        self.deliveries.append((dict(self.headers), body))
        self.send_response(500 if len(self.deliveries) == 1 else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_webhook_is_signed_per_standard_webhooks_and_retried_after_a_failure(api_server):
    from standardwebhooks import Webhook

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    _Receiver.deliveries = []
    try:
        job = httpx.post(f"{api_server.url}/v1/images/generations", headers=auth(api_server), timeout=30, json={
            "model": PIPELINE_NAME, "prompt": "a cat", "seed": 1, "num_inference_steps": 2, "async": True,
            "callback_url": f"http://127.0.0.1:{receiver.server_address[1]}/hook"}).json()
        deadline = time.monotonic() + 30
        while len(_Receiver.deliveries) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        receiver.shutdown()
    assert len(_Receiver.deliveries) == 2, "no retry after the receiver failed"
    (first_headers, first_body), (headers, body) = _Receiver.deliveries
    payload = Webhook(api_server.webhook_secret).verify(body, {k.lower(): v for k, v in headers.items()})
    assert payload["type"] == "image.completed" and payload["data"]["id"] == job["id"]
    assert payload["data"]["status"] == "completed"
    assert first_headers["webhook-id"] == headers["webhook-id"]  # one message, delivered twice
    with pytest.raises(Exception):
        Webhook(api_server.webhook_secret).verify(body.replace(b"completed", b"failed"),
                                                  {k.lower(): v for k, v in headers.items()})


def test_a_callback_to_an_address_that_is_not_public_is_refused_naming_the_field(triton_server, api_keys,
                                                                                  tmp_path_factory):
    """Request forgery through webhooks and explore scorers: loopback, private and link-local (cloud metadata)
    receivers are refused unless the operator allows them (--allow-private-callbacks, which the other tests'
    API has)."""
    from conftest import api_on

    with api_on(triton_server.grpc_url, api_keys, tmp_path_factory, "api-public-callbacks",
                allow_private_callbacks=False) as api:
        for url in ("http://127.0.0.1:9/hook", "http://169.254.169.254/latest/meta-data/", "http://localhost/x",
                    "http://10.0.0.8/hook", "http://[::1]:8080/"):
            refused = httpx.post(f"{api.url}/v1/images/generations", headers=auth(api), timeout=30, json={
                "model": PIPELINE_NAME, "prompt": "a cat", "seed": 1, "num_inference_steps": 2, "async": True,
                "callback_url": url})
            error = refused.json()["error"]
            assert refused.status_code == 400 and (error["param"], error["code"]) == ("callback_url",
                                                                                      "callback_refused"), url
            assert "--allow-private-callbacks" in error["message"]
            # An explore's scorer likewise (it gets the early images, signed as webhooks are).
            refused = httpx.post(f"{api.url}/v1/images/generations", headers=auth(api), timeout=30, json={
                "model": PIPELINE_NAME, "prompt": "a cat", "n": 2, "num_inference_steps": 2,
                "explore": {"keep": 1, "scorer": url}})
            error = refused.json()["error"]
            assert refused.status_code == 400 and (error["param"], error["code"]) == ("explore.scorer",
                                                                                      "callback_refused"), url
        assert httpx.get(f"{api.url}/v1/jobs", headers=auth(api), timeout=30).json()["data"] == []  # no job made
        served = httpx.post(f"{api.url}/v1/images/generations", headers=auth(api), timeout=60, json={
            "model": PIPELINE_NAME, "prompt": "a cat", "seed": 1, "num_inference_steps": 2})
        assert served.status_code == 200 and served.json()["data"][0]["b64_json"]


def test_jobs_outlive_the_api_process_and_those_it_was_running_are_failed(triton_server, api_keys, tmp_path):
    """Finished jobs are listed and downloadable after a restart; the one running when the process died is
    failed with code interrupted, and its webhook says so."""
    from standardwebhooks import Webhook

    from machgen.api.webhooks import new_secret

    keys_file, key, _ = api_keys
    data = tmp_path / "data"
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    _Receiver.deliveries = [(None, b"")]  # every delivery answered 200
    first = ApiProcess(triton_server.grpc_url, data, keys_file, key, new_secret(), tmp_path / "api.log").wait_ready()
    long_job = {"model": PIPELINE_NAME, "prompt": "a dog", "num_inference_steps": 1000, "async": True,
                "callback_url": f"http://127.0.0.1:{receiver.server_address[1]}/hook"}
    try:
        done = httpx.post(f"{first.url}/v1/images/generations", headers=auth(first), timeout=60, json={
            "model": PIPELINE_NAME, "prompt": "a cat", "seed": 4, "num_inference_steps": 2}).json()
        running = httpx.post(f"{first.url}/v1/images/generations", headers={**auth(first), "Idempotency-Key": "k1"},
                             json=long_job).json()
        again = httpx.post(f"{first.url}/v1/images/generations", headers={**auth(first), "Idempotency-Key": "k1"},
                           json=long_job).json()
        assert again["id"] == running["id"]
    finally:
        first.kill()  # no clean stop: as a crash or the OOM killer leaves it
    second = ApiProcess(triton_server.grpc_url, data, keys_file, key, new_secret(), tmp_path / "api.log").wait_ready()
    try:
        deadline = time.monotonic() + 30
        while len(_Receiver.deliveries) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        receiver.shutdown()
        headers, body = _Receiver.deliveries[1]
        payload = Webhook(second.webhook_secret).verify(body, {k.lower(): v for k, v in headers.items()})
        assert payload["type"] == "image.failed" and payload["data"]["id"] == running["id"]
        jobs = {job["id"]: job for job in httpx.get(f"{second.url}/v1/jobs", headers=auth(second)).json()["data"]}
        completed = jobs[done["machgen"]["job_id"]]
        assert completed["status"] == "completed"
        image = httpx.get(second.url + completed["outputs"][0], headers=auth(second))
        assert image.status_code == 200
        assert np.array_equal(png_pixels(image.content), png_pixels(base64.b64decode(done["data"][0]["b64_json"])))
        interrupted = jobs[running["id"]]
        assert interrupted["status"] == "failed" and interrupted["error"]["code"] == "interrupted"
    finally:
        second.stop()


def test_metrics_count_jobs_steps_and_previews(api_server):
    httpx.post(f"{api_server.url}/v1/images/generations", headers=auth(api_server), timeout=60, json={
        "model": PIPELINE_NAME, "prompt": "a cat", "num_inference_steps": 2})
    text = httpx.get(f"{api_server.url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['machgen_api_jobs{state="completed"}'] >= 1
    assert values["machgen_api_denoising_steps_total"] >= 2
    assert "machgen_api_previews_sent_total" in values and "machgen_api_job_queue_seconds_count" in values


def test_a_jobs_priority_and_owner_reach_the_model_and_its_metrics(api_server):
    """The API sends a job's priority and its key's name as the request's owner (the step gate's order is
    tests/test_scheduling.py's); its stats say the priority and the seconds its steps waited and ran."""
    def submit(priority):
        response = httpx.post(f"{api_server.url}/v1/images/generations", headers=auth(api_server), timeout=60,
                              json={"model": PIPELINE_NAME, "prompt": "a cat", "seed": 3, "num_inference_steps": 3,
                                    **({"priority": priority} if priority else {})})
        assert response.status_code == 200, response.text
        return response.json()["machgen"]

    batch, default = submit("batch"), submit(None)
    jobs = {answer["job_id"]: httpx.get(f"{api_server.url}/v1/jobs/{answer['job_id']}", headers=auth(api_server),
                                        timeout=30).json() for answer in (batch, default)}
    assert [job["priority"] for job in jobs.values()] == ["batch", "interactive"]
    assert [answer["stats"][0]["priority"] for answer in (batch, default)] == ["batch", "interactive"]
    assert all(answer["stats"][0]["denoiser_seconds"] > 0 and answer["stats"][0]["waited_seconds"] >= 0
               for answer in (batch, default))
    text = httpx.get(f"{api_server.url}/metrics").text
    for priority in ("batch", "interactive"):
        assert f'machgen_api_owner_denoiser_seconds_total{{owner="tester",priority="{priority}"}}' in text
        assert f'machgen_api_owner_queue_seconds_count{{owner="tester",priority="{priority}"}}' in text
    refused = httpx.post(f"{api_server.url}/v1/images/generations", headers=auth(api_server), timeout=30, json={
        "model": PIPELINE_NAME, "prompt": "a cat", "priority": "urgent"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "interactive, batch" in refused.json()["error"]["message"]


def test_the_models_list_says_what_each_model_makes(api_server):
    models = openai_client(api_server).models.list()
    (model,) = [m for m in models.data if m.id == PIPELINE_NAME]
    assert model.kind == "image" and model.defaults["width"] == 64
