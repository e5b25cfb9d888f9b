"""``machgen api --database-url postgresql://...``: several API processes on one PostgreSQL database (a real
server, started in a temporary folder) share the jobs; one killed loses none of them."""

import io
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from machgen.client import MachgenClient

from conftest import PIPELINE_NAME, ApiProcess, events_of, free_port, wait_until

pytestmark = [pytest.mark.integration]

JOBS = 40
STEPS = 30


class _Receiver(BaseHTTPRequestHandler):
    deliveries: list = []

    def do_POST(self):
        length = int(self.headers["content-length"])
        body = self.rfile.read(length)
        if len(body) < length:
            return  # the sender died mid-request (the killed process): no delivery, and nobody to answer
        type(self).deliveries.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def _api(triton_server, database_url: str, secret: str, folder, name: str, *extra: str) -> ApiProcess:
    return ApiProcess(triton_server.grpc_url, folder / name, None, "", secret, folder / f"{name}.log",
                      "--database-url", database_url, "--job-lease-seconds", "3", *extra)


def _job(api, index: int, callback: str) -> dict:
    response = httpx.post(f"{api.url}/v1/images/generations", timeout=30, json={
        "model": PIPELINE_NAME, "prompt": "a red cat", "size": "64x32", "seed": 100 + index,
        "num_inference_steps": STEPS, "async": True, "callback_url": callback})
    assert response.status_code == 200, response.text
    return response.json()


def test_two_api_processes_share_forty_jobs_and_one_killed_loses_none(triton_server, postgres_server, tmp_path):
    from standardwebhooks import Webhook

    from machgen.api.webhooks import new_secret

    url, secret = postgres_server.database(), new_secret()
    receiver = ThreadingHTTPServer(("127.0.0.1", free_port()), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    _Receiver.deliveries = []
    callback = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    doomed, survivor = (_api(triton_server, url, secret, tmp_path, name, "--max-jobs-per-key", str(JOBS))
                        for name in ("doomed", "survivor"))
    try:
        doomed.wait_ready(), survivor.wait_ready()
        # The survivor's half first, then the doomed process's, killed as soon as its last job is accepted: its
        # twenty jobs of 30 steps cannot all be done by then (sent interleaved, they could, on a fast machine).
        survivor_jobs = [_job(survivor, index, callback) for index in range(1, JOBS, 2)]
        doomed_jobs = [_job(doomed, index, callback) for index in range(0, JOBS, 2)]
        doomed.kill()  # SIGKILL mid-run: its leases are never given back
        by_id = {job["id"]: index for index, job in zip([*range(1, JOBS, 2), *range(0, JOBS, 2)],
                                                        survivor_jobs + doomed_jobs)}
        doomed_ids = [job["id"] for job in doomed_jobs]

        # The survivor sees the other's jobs, through the database.
        followed = httpx.get(f"{survivor.url}/v1/jobs/{doomed_ids[0]}", timeout=30).json()
        assert followed["id"] == doomed_ids[0] and followed["status"] in ("queued", "in_progress", "completed")

        import psycopg

        with psycopg.connect(url) as connection:
            left = connection.execute("SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'in_progress') AND "
                                      "runner LIKE %s", (f"%-{doomed.process.pid}-%",)).fetchone()[0]
        assert left >= 1, "the first process had finished its jobs before it was killed: nothing to take over"

        def all_finished() -> bool:
            listed = httpx.get(f"{survivor.url}/v1/jobs", params={"limit": 100}, timeout=30).json()["data"]
            return len(listed) == JOBS and all(job["status"] in ("completed", "failed", "cancelled") for job in listed)

        wait_until(all_finished, timeout=300, what=f"all {JOBS} jobs finishing on the surviving process")
        wait_until(lambda: len({json.loads(body)["data"]["id"] for _, body in _Receiver.deliveries}) >= JOBS,
                   timeout=60, what="a webhook for every job")
        time.sleep(1.0)  # a second delivery of any of them would come now
        listed = httpx.get(f"{survivor.url}/v1/jobs", params={"limit": 100}, timeout=30).json()["data"]
        assert sorted(job["status"] for job in listed) == ["completed"] * JOBS
        assert (tmp_path / "survivor.log").read_text().count("stopped renewing it; running it here") == left

        # One message per job. A process killed between a delivery and recording it leaves that delivery to be
        # sent again once its lease runs out: the same message (webhook-id and body), which a receiver that keeps
        # the ids it has seen processes once (Standard Webhooks). Only the killed process's deliveries in flight
        # (at most its sender's 8 at once) can come twice.
        messages: dict[str, bytes] = {}
        for headers, body in _Receiver.deliveries:
            headers = {k.lower(): v for k, v in headers.items()}
            Webhook(secret).verify(body, headers)
            assert messages.setdefault(headers["webhook-id"], body) == body, "a repeated webhook-id, another event"
        received = [json.loads(body) for body in messages.values()]
        assert sorted(payload["data"]["id"] for payload in received) == sorted(by_id), "one webhook per job"
        assert len(_Receiver.deliveries) - len(messages) <= 8
        assert {payload["type"] for payload in received} == {"image.completed"}

        # A job the killed process held is served by the survivor, as the model makes it for its seed.
        job_id = doomed_ids[-1]
        content = httpx.get(f"{survivor.url}/v1/jobs/{job_id}/content", timeout=30)
        assert content.status_code == 200 and content.headers["content-type"] == "image/png"
        with MachgenClient(triton_server.grpc_url) as client:
            expected = client.generate(PIPELINE_NAME, "a red cat", seed=100 + by_id[job_id],
                                       num_inference_steps=STEPS, width=64, height=32)[0]
        served = np.asarray(Image.open(io.BytesIO(content.content)).convert("RGB"))
        assert np.abs(served.astype(int) - expected.astype(int)).max() <= 2
    finally:
        receiver.shutdown()
        doomed.kill()
        survivor.stop()


def test_a_jobs_events_reach_a_listener_on_another_process(triton_server, postgres_server, tmp_path):
    from machgen.api.webhooks import new_secret

    url, secret = postgres_server.database(), new_secret()
    runner, listener = (_api(triton_server, url, secret, tmp_path, name, "--preview-interval", "2")
                        for name in ("runner", "listener"))
    try:
        runner.wait_ready(), listener.wait_ready()
        job = httpx.post(f"{runner.url}/v1/images/generations", timeout=30, json={
            "model": PIPELINE_NAME, "prompt": "a cat", "size": "64x32", "seed": 3, "num_inference_steps": 6,
            "async": True}).json()
        events = events_of(listener, job["id"])
        names = [name for name, _ in events]
        assert names[-1] == "completed" and events[-1][1]["id"] == job["id"]
        assert "preview" in names and names.count("progress") >= 1
        steps = [data["step"] for name, data in events if name == "progress"]
        assert steps == sorted(steps) and steps[-1] == 6
        image = httpx.get(f"{listener.url}/v1/jobs/{job['id']}/content", timeout=30)
        assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    finally:
        runner.stop()
        listener.stop()


def test_keys_added_to_the_database_are_needed_by_every_process(triton_server, postgres_server, tmp_path):
    from machgen.api.webhooks import new_secret

    url = postgres_server.database()
    api = _api(triton_server, url, new_secret(), tmp_path, "keyed")
    try:
        api.wait_ready()
        assert httpx.get(f"{api.url}/v1/models", timeout=30).status_code == 200  # no key in the database yet
        made = subprocess.run([sys.executable, "-m", "machgen.cli", "api-key", url, "agent", "--max-jobs", "1"],
                              capture_output=True, text=True, check=True)
        key = made.stdout.strip()
        import psycopg

        with psycopg.connect(url) as connection:
            kept = connection.execute("SELECT name, digest, max_jobs FROM api_keys").fetchall()
        assert key.startswith("mg-") and kept == [("agent", kept[0][1], 1)] and key not in kept[0][1]
        wait_until(lambda: httpx.get(f"{api.url}/v1/models", timeout=30).status_code == 401, timeout=30,
                   what="the new key being needed")
        models = httpx.get(f"{api.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert models.status_code == 200
        again = subprocess.run([sys.executable, "-m", "machgen.cli", "api-key", url, "agent"],
                               capture_output=True, text=True)
        assert again.returncode != 0 and "already has a key named 'agent'" in again.stderr
        # The signed result URLs of one process open on another: the signing key is the database's.
        image = httpx.post(f"{api.url}/v1/images/generations", headers={"Authorization": f"Bearer {key}"},
                           timeout=60, json={"model": PIPELINE_NAME, "prompt": "a cat", "size": "64x32", "seed": 1,
                                             "num_inference_steps": 2, "response_format": "url"}).json()
        other = _api(triton_server, url, new_secret(), tmp_path, "other")
        try:
            other.wait_ready()
            signed = image["data"][0]["url"].replace(f":{api.port}/", f":{other.port}/")
            downloaded = httpx.get(signed, timeout=30)
            assert downloaded.status_code == 200 and downloaded.content.startswith(b"\x89PNG")
        finally:
            other.stop()
    finally:
        api.stop()


def test_a_database_url_that_is_not_postgresql_is_refused_by_name(tmp_path):
    refused = subprocess.run([sys.executable, "-m", "machgen.cli", "api", "--database-url", "mysql://x/y",
                              "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--database-url" in refused.stderr
