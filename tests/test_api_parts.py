"""The HTTP API's parts that need no server: keys, the job store, webhook signatures, request fields."""

import json
import time

import pytest

from machgen.api.keys import KeyRing, add_key, read_keys
from machgen.api.schemas import ApiError, TextValue, parse_size, typed
from machgen.api.store import Job, JobStore
from machgen.api.webhooks import new_secret, signed_headers


def test_a_keys_file_keeps_hashes_only_and_finds_each_key(tmp_path):
    path = tmp_path / "keys.txt"
    alice, bob = add_key(path, "alice"), add_key(path, "bob", max_jobs=2)
    text = path.read_text()
    assert alice not in text and bob not in text and "sha256:" in text
    ring = KeyRing(read_keys(path))
    assert ring.find(alice).name == "alice" and ring.find(bob).max_jobs == 2
    assert ring.find("mg-nope") is None and ring.find(None) is None
    with pytest.raises(ValueError, match="already has a key named 'alice'"):
        add_key(path, "alice")
    (tmp_path / "bad.txt").write_text("alice 1234\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        read_keys(tmp_path / "bad.txt")
    assert not KeyRing(None).required and KeyRing(None).find(alice) is None


def test_the_store_keeps_jobs_newest_first_and_fails_those_left_running(tmp_path):
    store = JobStore(tmp_path)
    jobs = [store.insert(Job(f"img_{i}", "image", "flux", "alice", {"prompt": str(i)})) for i in range(3)]
    jobs[0].status, jobs[0].outputs, jobs[0].expires_at = "completed", ["image-0.png"], int(time.time()) - 1
    store.result_dir("img_0").mkdir()
    (store.result_dir("img_0") / "image-0.png").write_bytes(b"png")
    store.update(jobs[0])
    jobs[1].status = "in_progress"
    store.update(jobs[1])
    assert [job.id for job in store.list()] == ["img_2", "img_1", "img_0"]
    assert [job.id for job in store.list(after="img_2", limit=1)] == ["img_1"]
    store.close()

    reopened = JobStore(tmp_path)  # as after a restart
    assert sorted(reopened.fail_interrupted()) == ["img_1", "img_2"]
    interrupted = reopened.get("img_1")
    assert interrupted.status == "failed" and interrupted.error["code"] == "interrupted"
    assert reopened.get("img_0").status == "completed"
    assert reopened.expire() == ["img_0"] and not reopened.result_dir("img_0").exists()
    assert reopened.get("img_0").outputs == [] and reopened.counts() == {"completed": 1, "failed": 2}


def test_an_idempotency_key_gives_back_its_owners_job(tmp_path):
    store = JobStore(tmp_path)
    first = store.insert(Job("img_a", "image", "flux", "alice", {}, idempotency_key="k"))
    assert store.insert(Job("img_b", "image", "flux", "alice", {}, idempotency_key="k")).id == first.id
    assert store.insert(Job("img_c", "image", "flux", "bob", {}, idempotency_key="k")).id == "img_c"


def test_webhook_headers_verify_with_the_standardwebhooks_package():
    from standardwebhooks import Webhook

    secret = new_secret()
    body = json.dumps({"type": "video.completed", "data": {"id": "video_1"}}).encode()
    headers = signed_headers(secret, "msg_1", int(time.time()), body)
    assert Webhook(secret).verify(body, headers)["data"]["id"] == "video_1"
    with pytest.raises(Exception):
        Webhook(new_secret()).verify(body, headers)


def test_request_fields_are_typed_and_sizes_read_as_width_by_height():
    assert parse_size("96x32", {}) == (96, 32) and parse_size(None, {"width": 8, "height": 4}) == (8, 4)
    # A form's text (TextValue) is read as its field's type; JSON's text is not a number (OpenAI's schemas).
    assert typed("seed", TextValue("12"), int) == 12 and typed("strength", 0.5, float) == 0.5
    assert typed("stream", TextValue("true"), bool) is True
    for name, value, kind in [("seed", 1.5, int), ("seed", True, int), ("steps", "x", int), ("n", "2", int),
                              ("strength", "0.5", float), ("stream", "true", bool),
                              ("guidance_scale", float("nan"), float), ("prompt", 3, str)]:
        with pytest.raises(ApiError) as error:
            typed(name, value, kind)
        assert error.value.status == 400 and error.value.param == name
    for size in ("1024", "0x64", "ax64", "64x64x3"):
        with pytest.raises(ApiError) as error:
            parse_size(size, {})
        assert error.value.param == "size"


def test_a_stream_read_gives_way_to_a_cancel_even_while_responses_keep_coming():
    """A job's task cancelled while its stream's responses are always ready stops (asyncio.wait_for on
    Python 3.11 swallowed such a cancel: a deleted job ran to its end); silence is a TimeoutError."""
    import asyncio

    from machgen.api.triton import _next_within

    class Endless:
        def __init__(self):
            self.read = 0

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(0)
            self.read += 1
            if self.read > 20_000:  # about a second: a read that ignored the cancel ends here
                raise StopAsyncIteration
            return self.read

    class Silent:
        async def __anext__(self):
            await asyncio.sleep(60)

    async def consume(stream):
        while True:
            try:
                await _next_within(stream, 5.0)
            except StopAsyncIteration:
                return

    async def scenario():
        stream = Endless()
        task = asyncio.ensure_future(consume(stream))
        for _ in range(20):  # a cancel at many points of the read
            await asyncio.sleep(0.001)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert task in done and task.cancelled(), f"still reading after {stream.read} responses"
        with pytest.raises(asyncio.TimeoutError):
            await _next_within(Silent(), 0.05)

    asyncio.run(scenario())


def test_a_signed_url_opens_its_path_until_it_expires_and_no_other(tmp_path):
    from machgen.api.keys import SIGNING_KEY_FILE, UrlSigner

    signer = UrlSigner.in_folder(tmp_path)
    url = signer.sign("/v1/jobs/img_a/content", {"index": "1"}, expires=1000)
    path, query = url.split("?")
    signed = dict(part.split("=") for part in query.split("&"))
    assert signed["index"] == "1" and signed["expires"] == "1000"
    assert signer.check(path, signed, now=999) is None
    assert "expired" in signer.check(path, signed, now=1000)
    assert "not valid" in signer.check("/v1/jobs/img_b/content", signed, now=999)
    assert "not valid" in signer.check(path, {**signed, "index": "0"}, now=999)
    assert "not valid" in signer.check(path, {**signed, "expires": "5000"}, now=999)
    # The key is kept (owner-only): URLs handed out before a restart still open after it.
    assert (tmp_path / SIGNING_KEY_FILE).stat().st_mode & 0o077 == 0
    assert UrlSigner.in_folder(tmp_path).check(path, signed, now=999) is None
    assert "not valid" in UrlSigner(b"another key").check(path, signed, now=999)


def test_openais_enumerated_fields_are_honoured_or_refused_by_name():
    from machgen.api.schemas import openai_choice

    assert openai_choice("output_format", "webp", "png") == "webp" and openai_choice("quality", None, "x") == "x"
    for name, value, code in [("output_format", "gif", "invalid_value"), ("quality", "high", "unsupported_value"),
                              ("background", "transparent", "unsupported_value"), ("style", 1, "invalid_value")]:
        with pytest.raises(ApiError) as refused:
            openai_choice(name, value, None)
        assert (refused.value.status, refused.value.param, refused.value.code) == (400, name, code)


def test_a_cancelled_video_is_one_of_openais_statuses_failed_with_its_reason():
    from machgen.api.schemas import video_object

    from openai_schema import validate

    job = Job("video_a", "video", "ti2v", "alice", {"prompt": "x", "width": 64, "height": 64, "num_frames": 17,
                                                   "fps": 16, "seeds": [3]}, status="cancelled")
    video = video_object(job)
    validate(video, "VideoResource")
    assert video["status"] == "failed" and video["error"]["code"] == "cancelled" and video["seconds"] == "1.0625"


def test_the_store_deletes_a_job_and_pages_either_way(tmp_path):
    store = JobStore(tmp_path)
    for index in range(4):
        store.insert(Job(f"video_{index}", "video", "ti2v", "alice", {}))
    store.result_dir("video_1").mkdir()
    store.delete("video_1")
    assert store.get("video_1") is None and not store.result_dir("video_1").exists()
    assert [job.id for job in store.list(ascending=True)] == ["video_0", "video_2", "video_3"]
    assert [job.id for job in store.list(after="video_0", ascending=True, limit=1)] == ["video_2"]
    assert [job.id for job in store.list(after="video_3")] == ["video_2", "video_0"]


def test_framework_validation_errors_are_openais_error_object(tmp_path):
    """A route's typed parameter that FastAPI itself refuses answers 400 in OpenAI's shape, not 422."""
    from fastapi.testclient import TestClient

    from machgen.api.app import create_app
    from machgen.api.settings import ApiSettings

    app = create_app(ApiSettings(data_dir=tmp_path))

    @app.get("/typed")
    async def typed_route(count: int):
        return {"count": count}

    client = TestClient(app)  # no lifespan: no Triton needed
    response = client.get("/typed?count=many")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "count" and response.json()["error"]["type"]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    missing = client.delete("/typed")
    assert missing.status_code == 405 and set(missing.json()) == {"error"}


def test_a_listener_slower_than_the_job_gets_every_preview_and_a_late_one_the_latest():
    """A stream's listener (OpenAI's partial images) that is busy while the job sends its next previews still
    gets each of them, in order; one that starts listening late gets the latest preview of each variant."""
    import asyncio

    from machgen.api.jobs import JobEvents

    async def run():
        events = JobEvents()
        received: list[tuple[str, int]] = []

        async def slow_listener():
            async for event, data in events.follow():
                received.append((event, data["step"]))
                await asyncio.sleep(0.05)  # encoding a partial image, say

        listening = asyncio.create_task(slow_listener())
        await asyncio.sleep(0)
        for step in (1, 2, 3):
            await events.emit("preview", {"index": 0, "step": step})
        await events.emit("completed", {"index": 0, "step": 4})
        await asyncio.wait_for(listening, timeout=5)
        late = [(event, data["step"]) async for event, data in events.follow()]
        return received, late

    received, late = asyncio.run(run())
    assert received == [("preview", 1), ("preview", 2), ("preview", 3), ("completed", 4)]
    assert late == [("preview", 3), ("completed", 4)]


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:8080/hook", "loopback"), ("http://[::1]/hook", "loopback"),
    ("http://[::ffff:127.0.0.1]/hook", "loopback"), ("http://10.1.2.3/hook", "private"),
    ("http://192.168.0.10/hook", "private"), ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://0.0.0.0/hook", "unspecified"), ("http://100.64.0.1/hook", "not public"),
    ("http://224.0.0.1/hook", "multicast"), ("https://localhost/hook", "loopback")])
def test_callbacks_to_addresses_that_are_not_public_are_refused_unless_allowed(url, why):
    from machgen.api.destinations import DestinationPolicy, RefusedDestination

    with pytest.raises(RefusedDestination, match=f"a {why} address"):
        DestinationPolicy().check(url)
    assert DestinationPolicy(allow_private=True).check(url).url == url


def test_a_public_callback_is_sent_to_the_address_checked():
    from machgen.api.destinations import DestinationPolicy, RefusedDestination

    checked = DestinationPolicy().check("https://user@93.184.216.34:8443/hooks/a?x=1")
    assert (checked.address, checked.host_header) == ("93.184.216.34", "93.184.216.34:8443")
    assert checked.connect_url == "https://93.184.216.34:8443/hooks/a?x=1"
    for bad in ("ftp://93.184.216.34/", "http:///nohost", "http://93.184.216.34:99999/"):
        with pytest.raises(RefusedDestination):
            DestinationPolicy().check(bad)


class _Receiver:
    """A local HTTP receiver that records each POST's Host header and body."""

    def __enter__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                received.append((self.headers["host"], self.rfile.read(int(self.headers["content-length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()


def _deliver_once(store, allow_private: bool) -> None:
    import asyncio

    from machgen.api.destinations import DestinationPolicy
    from machgen.api.webhooks import WebhookPolicy, WebhookSender

    sender = WebhookSender(WebhookPolicy(new_secret(), attempts=3), store, DestinationPolicy(allow_private))
    asyncio.run(sender._attempt(store.claim_webhook(lease_s=30)))


def test_a_webhook_goes_to_the_address_its_name_resolved_to_when_checked(tmp_path, monkeypatch):
    """The delivery connects to the address it checked, the name kept in the Host header; a name that resolves
    to a private address at delivery time (DNS rebinding) gets nothing, and the delivery is given up."""
    import socket

    from machgen.api import destinations

    answers = {}
    monkeypatch.setattr(destinations.socket, "getaddrinfo", lambda host, port, **kw: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port))])
    store = JobStore(tmp_path)
    with _Receiver() as receiver:
        answers["hooks.example"] = "127.0.0.1"
        store.queue_webhook(f"http://hooks.example:{receiver.port}/in", "image.completed", {"id": "img_1"})
        _deliver_once(store, allow_private=True)
        assert [(host, json.loads(body)["data"]) for host, body in receiver.received] == [
            (f"hooks.example:{receiver.port}", {"id": "img_1"})]
        store.queue_webhook(f"http://hooks.example:{receiver.port}/in", "image.completed", {"id": "img_2"})
        _deliver_once(store, allow_private=False)  # now resolves to loopback, which is refused
        assert len(receiver.received) == 1 and store.claim_webhook(lease_s=30) is None
    assert store.db.execute("SELECT gave_up, problem FROM webhooks WHERE body LIKE '%img_2%'")[0][0] == 1


def test_the_built_in_scorer_reads_what_the_prompt_names_in_a_picture_and_in_a_clip():
    """explore's "shapes" scorer: the share of the prompt's colour, shape and place (a picture) or direction (a
    clip, by the moving-shapes detector) read back."""
    import dataclasses

    import numpy as np

    from machgen.api.explore import shapes_score
    from machgen.datasets import moving_shapes, shapes

    sample = next(s for s in shapes.batch(20, seed=99) if shapes.detect(s.image) == s.label)
    assert shapes_score(sample.image, shapes.caption(sample.label)) == 1.0
    assert shapes_score(np.full((64, 64, 3), 20, np.uint8), shapes.caption(sample.label)) == 0.0
    clip = next(c for c in moving_shapes.batch(20, seed=7) if moving_shapes.detect(c.frames) == c.motion)
    assert shapes_score(clip.frames, clip.caption) == 1.0
    other = next(d for d in moving_shapes.DIRECTION_PHRASES if d != clip.motion.direction)
    assert shapes_score(clip.frames, moving_shapes.caption(dataclasses.replace(clip.motion, direction=other))) == \
        pytest.approx(2 / 3)
    assert shapes_score(clip.frames, f"a {clip.motion.colour} shape") == 1.0  # only what the prompt names
    assert shapes_score(np.repeat(clip.frames[:1], len(clip.frames), axis=0), clip.caption) == 0.0  # no motion
