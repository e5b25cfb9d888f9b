"""The realtime WebSocket of the HTTP API (machgen api, /v1/realtime/video) on a tiny random Wan built with a
streaming mode, called as a client calls it (the ``websockets`` package): chunks equal to the gRPC client's
for the same seed and steering, forks named by their child, stops; who may connect (keys, the cap of sessions
per key, browser origins); bad messages answered with errors naming the field while the connection and the
server serve on; the metrics. One repository, one Triton server and one API process for the module."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import ApiProcess, build_tiny_repository, serving, wait_until, write_tiny_streaming

from machgen.client import MachgenClient

pytestmark = [pytest.mark.export, pytest.mark.integration]

MODEL = "tiny-stream"
HEIGHT, WIDTH = 48, 32
PROMPT = "a red circle"
CAP = 2  # --max-sessions-per-key
ALLOWED_ORIGIN = "http://player.example"
# Sessions batched with others equal each run alone within one level of 255 (tests/test_streaming.py): which
# sessions share a call differs between the WebSocket's run and the gRPC client's.
BATCHED = 1
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def realtime_server(tmp_path_factory):
    repository = build_tiny_repository(tmp_path_factory, write_tiny_streaming(tmp_path_factory), MODEL)
    with serving(repository) as server:
        yield server


@pytest.fixture(scope="module")
def realtime_api(realtime_server, api_keys, tmp_path_factory):
    from machgen.api.webhooks import new_secret

    keys_file, key, _ = api_keys
    folder = tmp_path_factory.mktemp("realtime-api")
    api = ApiProcess(realtime_server.grpc_url, folder / "data", keys_file, key, new_secret(), folder / "api.log",
                     "--max-sessions-per-key", str(CAP), "--allowed-origin", ALLOWED_ORIGIN).wait_ready()
    yield api
    api.stop()


@pytest.fixture
def grpc(realtime_server):
    with MachgenClient(realtime_server.grpc_url) as client:
        yield client


class Socket:
    """A client's connection: ``send`` a message, ``next`` one (JSON as a dict, binary as bytes), and the
    chunks it received by session (each chunk's metadata and its binary messages)."""

    def __init__(self, api: ApiProcess, key: str | None = "", origin: str | None = None, query: str = ""):
        from websockets.sync.client import connect

        key = api.key if key == "" else key
        headers = {"Authorization": f"Bearer {key}"} if key and not query else {}
        self.connection = connect(f"ws://127.0.0.1:{api.port}/v1/realtime/video{query}", origin=origin,
                                  additional_headers=headers, max_size=None, open_timeout=30).__enter__()
        self.chunks: dict[str, list[tuple[dict, list[bytes]]]] = {}

    def send(self, **message) -> None:
        self.connection.send(json.dumps(message))

    def next(self, timeout: float = 120) -> dict | bytes:
        message = self.connection.recv(timeout=timeout)
        return json.loads(message) if isinstance(message, str) else message

    def until(self, wanted) -> list[dict]:
        """The JSON messages up to the one ``wanted(message)`` is true of (chunks kept by session)."""
        seen = []
        while True:
            message = self.next()
            assert isinstance(message, dict), "a binary message not announced by a chunk's metadata"
            if message["type"] == "video.chunk_metadata":
                parts = [self.next() for _ in range(message["parts"])]
                assert all(isinstance(part, bytes) for part in parts)
                assert sum(len(part) for part in parts) == message["byte_length"]
                self.chunks.setdefault(message["session"], []).append((message, parts))
            seen.append(message)
            if wanted(message):
                return seen

    def paused(self, *sessions: str) -> list[dict]:
        waiting = set(sessions)

        def done(message):
            if message["type"] in ("session.paused", "session.done"):
                waiting.discard(message["session"])
            assert message["type"] != "error", message
            return not waiting

        return self.until(done)

    def ended(self, *sessions: str) -> list[dict]:
        """The session.done messages of ``sessions``, once each has come."""
        waiting = set(sessions)

        def done(message):
            if message["type"] == "session.done":
                waiting.discard(message["session"])
            return not waiting

        return [message for message in self.until(done) if message["type"] == "session.done"]

    def error(self) -> dict:
        return self.until(lambda message: message["type"] == "error")[-1]

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> "Socket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def decoded(fragments: list[bytes]) -> np.ndarray:
    """A session's fMP4 fragments, in order, decoded (PyAV) to uint8 frames [F, H, W, 3]."""
    import av

    with av.open(io.BytesIO(b"".join(fragments)), format="mp4") as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def fragments_of(socket: Socket, session: str) -> list[bytes]:
    return [part for _, parts in socket.chunks[session] for part in parts]


def frames_of(chunks) -> np.ndarray:
    return np.concatenate([chunk.frames for chunk in chunks])


def largest_difference(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def sessions_open(api: ApiProcess) -> float:
    text = httpx.get(f"{api.url}/metrics", timeout=30).text
    return sum(float(value) for value in re.findall(r"^machgen_api_realtime_sessions\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture
def no_sessions_left(realtime_api):
    """Each test starts and ends with the key's seats free (a closed connection gives them back at once, its
    sessions stopped on the server in the background)."""
    wait_until(lambda: sessions_open(realtime_api) == 0, timeout=60, what="the last test's sessions closed")
    yield
    wait_until(lambda: sessions_open(realtime_api) == 0, timeout=60, what="this test's sessions closed")


def test_a_session_streams_the_grpc_clients_frames_is_steered_forked_and_stopped(realtime_api, grpc,
                                                                                  no_sessions_left):
    """Lossless m4s, so that the frames are compared as they were made: two chunks, an action, a fork with its
    own seed playing beside two more chunks of its parent (its chunks named by the child), then a stop; equal
    to the same through MachgenClient.open_session over gRPC."""
    with Socket(realtime_api) as socket:
        socket.send(type="session.start", model=MODEL, prompt=PROMPT, seed=31, width=WIDTH, height=HEIGHT,
                    format="m4s", lossless=True, fps=16, chunks=2, session="main")
        start = socket.next()
        assert start == {"type": "video.start", "request_id": "main", "session": "main", "model": MODEL,
                         "format": "m4s", "seed": 31,
                         "config": {"width": WIDTH, "height": HEIGHT, "fps": 16, "chunk_frames": 8,
                                    "first_chunk_frames": 5, "lossless": True, "actions": ["left", "right"]}}
        socket.paused("main")
        socket.send(type="session.interaction", interaction={"event_id": "turn", "event": {"action": "right"}})
        queued = socket.next()
        assert queued == {"type": "session.interaction.queued", "request_id": "main", "session": "main",
                          "event_id": "turn", "chunk": 2, "applies_from": 2}
        socket.send(type="session.fork", parent="main", session="child", seed=5, chunks=1)
        forked = socket.until(lambda message: message["type"] == "video.start")[-1]
        assert forked["session"] == "child" and forked["parent"] == "main" and forked["format"] == "m4s"
        socket.send(type="session.play", session="main", chunks=2)
        socket.paused("main", "child")
        socket.send(type="session.stop")
        done = socket.ended("main", "child")
        assert {(m["session"], m["stopped"], m["reason"]) for m in done} == {("main", True, "stopped"),
                                                                             ("child", True, "stopped")}
        socket.send(type="session.ping")
        assert socket.next() == {"type": "session.pong"}
    main, child = socket.chunks["main"], socket.chunks["child"]
    assert [(m["chunk"], m["first_frame"], m["frames"], m["transport_chunk_index"]) for m, _ in main] == [
        (0, 0, 5, 0), (1, 5, 8, 1), (2, 13, 8, 2), (3, 21, 8, 3)]
    assert [(m["session"], m["chunk"], m["first_frame"]) for m, _ in child] == [("child", 2, 13)]
    first = main[0][0]
    assert first["init"] and first["mime_type"].startswith('video/mp4; codecs="avc1.') and first["parts"] == 1
    assert not main[1][0]["init"] and child[0][0]["init"]  # each session's stream has its own init segment
    for name in ("denoise_ms", "decode_ms", "rows", "deadline_missed", "encode_ms", "send_ms"):
        assert name in first["stats"], name
    assert first["stats"]["send_ms"] is None and main[1][0]["stats"]["send_ms"] >= 0

    session = grpc.open_session(MODEL, prompt=PROMPT, seed=31, height=HEIGHT, width=WIDTH, chunks=2)
    played = list(session)
    session.interact(action="right")
    grpc_child = session.fork(seed=5, chunks=1)
    played += list(session.play(chunks=2))
    grpc_child_chunks = list(grpc_child)
    session.stop()
    grpc_child.stop()
    streamed = decoded(fragments_of(socket, "main"))
    assert streamed.shape == (29, HEIGHT, WIDTH, 3)
    assert largest_difference(streamed, frames_of(played)) <= BATCHED
    assert largest_difference(decoded(fragments_of(socket, "child")), frames_of(grpc_child_chunks)) <= BATCHED
    unsteered = grpc.open_session(MODEL, prompt=PROMPT, seed=31, height=HEIGHT, width=WIDTH, chunks=4)
    unsteered_frames = frames_of(list(unsteered))
    unsteered.stop()
    assert largest_difference(streamed[:13], unsteered_frames[:13]) <= BATCHED
    assert largest_difference(streamed[13:], unsteered_frames[13:]) > 10  # the action steered it


def test_jpeg_pictures_and_the_default_m4s_are_the_frames_within_their_codecs_loss(realtime_api, grpc,
                                                                                     no_sessions_left):
    """format "jpeg" sends one JPEG per frame; the default m4s is H.264 in 4:2:0 (what browsers play). Both
    lossy on the tiny model's noise-like frames (their levels' spread: about 55), so compared by mean difference
    at twice what each lost when measured (JPEG at quality 90 and H.264 at CRF 18: both 4.1 levels of 255 on
    average, 43 and 52 at most)."""
    from PIL import Image

    with Socket(realtime_api) as socket:
        socket.send(type="session.start", model=MODEL, prompt=PROMPT, seed=8, width=WIDTH, height=HEIGHT,
                    format="jpeg", num_frames=5, session="pictures")
        assert socket.next()["format"] == "jpeg"
        socket.send(type="session.start", model=MODEL, prompt=PROMPT, seed=8, width=WIDTH, height=HEIGHT,
                    chunks=1, session="video")
        socket.paused("pictures", "video")
        socket.send(type="session.stop")
        socket.ended("pictures", "video")
    (metadata, pictures), = socket.chunks["pictures"]
    assert metadata["parts"] == metadata["frames"] == 5 and "init" not in metadata
    frames = np.stack([np.asarray(Image.open(io.BytesIO(picture)).convert("RGB")) for picture in pictures])
    video = decoded(fragments_of(socket, "video"))
    session = grpc.open_session(MODEL, prompt=PROMPT, seed=8, height=HEIGHT, width=WIDTH, chunks=1)
    expected = frames_of(list(session))
    session.stop()
    assert frames.shape == video.shape == expected.shape == (5, HEIGHT, WIDTH, 3)
    assert np.abs(frames.astype(int) - expected.astype(int)).mean() < 8
    assert np.abs(video.astype(int) - expected.astype(int)).mean() < 8


def test_who_may_play_keys_the_cap_per_key_and_browser_origins(realtime_api, api_keys, no_sessions_left):
    from websockets.exceptions import InvalidStatus

    _, key, other_key = api_keys
    for given, words in ((None, "no API key given"), ("mg-wrong", "the API key is not valid")):
        with pytest.raises(InvalidStatus) as refused:
            Socket(realtime_api, key=given)
        assert refused.value.response.status_code == 401
        error = json.loads(refused.value.response.body)["error"]
        assert error["code"] == "invalid_api_key" and error["param"] == "key" and words in error["message"]
    with Socket(realtime_api, query=f"?key={key}") as by_query:  # a browser's way: its WebSocket sends no headers
        by_query.send(type="session.ping")
        assert by_query.next() == {"type": "session.pong"}
    assert key not in realtime_api.log_file.read_text()  # the access log shows ?key=REDACTED

    with pytest.raises(InvalidStatus) as refused:
        Socket(realtime_api, origin="http://elsewhere.example")
    assert refused.value.response.status_code == 403
    error = json.loads(refused.value.response.body)["error"]
    assert error["code"] == "origin_not_allowed" and error["param"] == "origin"
    assert "http://elsewhere.example" in error["message"] and ALLOWED_ORIGIN in error["message"]
    for origin in (ALLOWED_ORIGIN, f"http://127.0.0.1:{realtime_api.port}", None):  # listed, its own, no browser
        with Socket(realtime_api, origin=origin) as allowed:
            allowed.send(type="session.ping")
            assert allowed.next() == {"type": "session.pong"}

    def start(socket: Socket, name: str) -> None:
        socket.send(type="session.start", model=MODEL, prompt=PROMPT, seed=1, width=WIDTH, height=HEIGHT,
                    chunks=1, session=name)

    with Socket(realtime_api) as first, Socket(realtime_api) as second, Socket(realtime_api, other_key) as other:
        start(first, "a")
        start(first, "b")
        first.paused("a", "b")
        start(second, "c")
        refused = second.error()
        assert refused["code"] == "too_many_sessions" and refused["field"] == "session" and refused["cap"] == CAP
        assert f"--max-sessions-per-key {CAP}" in refused["message"]
        second.send(type="session.fork", parent="a", session="d")  # not its session: another connection's
        assert second.error()["code"] == "session_not_found"
        start(other, "a")  # another key has its own seats (and a session may have any connection's name)
        other.paused("a")
        first.send(type="session.stop", session="a")
        first.until(lambda message: message["type"] == "session.done")
        start(second, "c")
        assert second.next()["type"] == "video.start"
        second.paused("c")


def test_bad_messages_get_errors_naming_the_field_and_the_connection_serves_on(realtime_api, grpc,
                                                                             no_sessions_left):
    start = {"type": "session.start", "model": MODEL, "prompt": PROMPT, "seed": 2, "width": WIDTH,
             "height": HEIGHT, "chunks": 1}
    with Socket(realtime_api) as socket:
        for message, code, field, words in (
                ("{not json", "invalid_json", "type", "not valid JSON"),
                ("[1, 2]", "invalid_message", "type", "JSON object"),
                ({"type": "session.dance"}, "invalid_message", "type", "unknown message type"),
                ({**start, "prompt": None}, "invalid_value", "prompt", "'prompt' is missing"),
                ({**start, "prompt": 7}, "invalid_value", "prompt", "non-empty string"),
                ({**start, "format": "gif"}, "invalid_value", "format", "m4s, jpeg"),
                ({**start, "width": 40}, "invalid_value", "width", "multiple of 16"),
                ({**start, "seed": -1}, "invalid_value", "seed", "integer from 0"),
                ({**start, "chunks": True}, "invalid_value", "chunks", "integer"),
                ({**start, "fps": 30}, "invalid_value", "fps", "play at 16 fps"),
                ({**start, "negative_prompt": "x"}, "unknown_parameter", "negative_prompt", "takes no field"),
                ({**start, "model": "nope"}, "model_not_found", "model", "'nope' does not exist"),
                ({**start, "format": "jpeg", "lossless": True}, "invalid_value", "lossless", "JPEG"),
                ({**start, "session": "bad id!"}, "invalid_value", "session", "letters, digits"),
                ({"type": "session.interaction", "interaction": {"event": {"prompt": "x"}}}, "invalid_value",
                 "session", "this connection has 0 sessions"),
                ({"type": "session.stop", "session": "nope"}, "session_not_found", "session", "no open session"),
        ):
            socket.connection.send(message if isinstance(message, str) else json.dumps(message))
            error = socket.next()
            assert (error["type"], error["code"], error["field"]) == ("error", code, field), (message, error)
            assert words in error["message"], (words, error)
        socket.connection.send(b"\x00binary")
        assert socket.error()["field"] == "type"
        # Refused by the server (Triton): the field in this protocol's words, the session ended.
        socket.send(**{**start, "prompt": None, "action": "jump", "session": "jumper"})
        assert socket.next()["type"] == "video.start"
        refused = socket.error()
        assert (refused["field"], refused["session"]) == ("action", "jumper"), refused
        assert "unknown action 'jump'" in refused["message"] and "left, right" in refused["message"]
        assert socket.next() == {"type": "session.done", "request_id": "jumper", "session": "jumper", "chunks": 0,
                                 "stopped": False, "reason": "error"}
        socket.send(**{**start, "session": "good"})
        socket.paused("good")
        socket.send(type="session.interaction", session="good", interaction={"event": {"action": "jump"}})
        assert socket.error()["field"] == "interaction.event.action"
        socket.send(type="session.interaction", session="good", interaction={"event": {}})
        assert socket.error()["field"] == "interaction.event.prompt"
        socket.send(type="session.interaction", session="good",
                    interaction={"event": {"prompt": "x"}, "transition_chunks": 2})
        assert socket.error()["field"] == "interaction.transition_chunks"
        socket.send(type="session.play", session="good", chunks=1)
        socket.paused("good")
        assert [m["chunk"] for m, _ in socket.chunks["good"]] == [0, 1]
        socket.send(type="session.ping")
        assert socket.next() == {"type": "session.pong"}
    assert grpc.generate(MODEL, PROMPT, seed=1, num_frames=5, num_inference_steps=2).shape == (5, HEIGHT, WIDTH, 3)


def test_metrics_count_sessions_chunks_latency_deadline_misses_and_cache_bytes(realtime_api, no_sessions_left):
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus):
        Socket(realtime_api, key=None)
    with Socket(realtime_api) as socket:
        socket.send(type="session.start", model=MODEL, prompt=PROMPT, seed=3, width=WIDTH, height=HEIGHT, chunks=2)
        socket.until(lambda message: message["type"] == "video.chunk_metadata")
        text = httpx.get(f"{realtime_api.url}/metrics", timeout=30).text
        assert f'machgen_api_realtime_sessions{{model="{MODEL}"}} 1.0' in text
        socket.until(lambda message: message["type"] == "session.paused")
        text = httpx.get(f"{realtime_api.url}/metrics", timeout=30).text  # the session open, its cache held

    def value(name: str) -> float:
        found = re.search(rf'^{name}{{model="{MODEL}"}} (\S+)$', text, re.M)
        assert found, name
        return float(found[1])

    assert value("machgen_api_realtime_chunks_total") >= 2
    assert value("machgen_api_realtime_chunk_seconds_count") == value("machgen_api_realtime_chunks_total")
    assert value("machgen_api_realtime_first_chunk_seconds_count") >= 1
    assert value("machgen_api_realtime_deadline_misses_total") >= 0
    assert value("machgen_api_realtime_cache_bytes") > 0  # the session's cache, as its stream's end said
    assert 'machgen_api_realtime_refused_total{reason="key"}' in text


def test_the_documented_client_plays_a_session_to_an_mp4(realtime_api, tmp_path, no_sessions_left):
    """docs/http-api.md's example client, as a reader saves and runs it."""
    page = (ROOT / "docs" / "http-api.md").read_text()
    script = page.split("cat > realtime_client.py <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    (tmp_path / "realtime_client.py").write_text(script)
    run = subprocess.run([sys.executable, "realtime_client.py", f"ws://127.0.0.1:{realtime_api.port}", MODEL,
                          PROMPT], cwd=tmp_path, env={"KEY": realtime_api.key, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "chunk 0: 5 frames" in run.stdout and "session.interaction.queued" in run.stdout, run.stdout
    video = decoded([(tmp_path / "session.mp4").read_bytes()])
    assert video.shape[1:] == (HEIGHT, WIDTH, 3) and len(video) == 5 + 8 * 2


def triton_sessions(server) -> float:
    """machgen_realtime_sessions of the model on Triton's /metrics: the sessions open on the server."""
    text = httpx.get(f"http://{server.host}:{server.ports.metrics}/metrics", timeout=30).text
    found = re.search(rf'^machgen_realtime_sessions{{[^}}]*model="{MODEL}"[^}}]*}} (\S+)$', text, re.M)
    assert found, "machgen_realtime_sessions of the model is not on Triton's /metrics"
    return float(found[1])


def test_a_handed_off_session_plays_on_where_it_was_on_the_connection_that_claims_it(realtime_api, grpc,
                                                                                        no_sessions_left):
    """Handed off between chunks, its first connection closed before the claim: the claimer's chunks go on from
    the session's next one, steering on the new connection lands, and the frames are those of the same session
    played on one gRPC stream (lossless m4s)."""
    with Socket(realtime_api) as first:
        first.send(type="session.start", model=MODEL, prompt=PROMPT, seed=31, width=WIDTH, height=HEIGHT,
                   lossless=True, chunks=1, session="live")
        first.paused("live")
        first.send(type="session.handoff", session="live")
        handed = first.next()
        assert (handed["type"], handed["session"], handed["chunk"], handed["expires_in"]) == (
            "session.handed_off", "live", 1, 60)
        assert re.fullmatch(r"mgh_[A-Za-z0-9_-]{32}", handed["token"])
        first.send(type="session.interaction", session="live", interaction={"event": {"action": "right"}})
        assert first.error()["code"] == "session_not_found"  # no longer this connection's
    assert sessions_open(realtime_api) == 1  # its first connection gone, the session is not
    with Socket(realtime_api) as second:
        second.send(type="session.claim", token=handed["token"], session="mine", chunks=1)
        start = second.next()
        assert start == {"type": "video.start", "request_id": "mine", "session": "mine", "model": MODEL,
                         "format": "m4s", "claimed": True,
                         "config": {"width": WIDTH, "height": HEIGHT, "fps": 16, "chunk_frames": 8,
                                    "first_chunk_frames": 5, "lossless": True, "actions": ["left", "right"]}}
        second.paused("mine")
        second.send(type="session.interaction", session="mine", interaction={"event": {"action": "right"}})
        assert second.next()["applies_from"] == 2
        second.send(type="session.play", session="mine", chunks=1)
        second.paused("mine")
        second.send(type="session.stop")
        second.ended("mine")
    assert [(m["chunk"], m["first_frame"], m["transport_chunk_index"]) for m, _ in second.chunks["mine"]] == [
        (1, 5, 0), (2, 13, 1)]
    assert second.chunks["mine"][0][0]["init"]  # the claimer's stream begins with its own init segment
    session = grpc.open_session(MODEL, prompt=PROMPT, seed=31, height=HEIGHT, width=WIDTH, chunks=2)
    played = list(session)
    session.interact(action="right")  # at chunk 2, as test 1 shows it steers seed 31
    played += list(session.play(chunks=1))
    session.stop()
    streamed = np.concatenate([decoded(fragments_of(first, "live")), decoded(fragments_of(second, "mine"))])
    assert largest_difference(streamed, frames_of(played)) <= BATCHED


def test_a_handoff_of_a_playing_session_its_refusals_the_cap_and_an_unclaimed_session_stopped_at_expiry(
        realtime_server, realtime_api, api_keys, no_sessions_left):
    _, _, other_key = api_keys
    with Socket(realtime_api) as first, Socket(realtime_api) as second, Socket(realtime_api, other_key) as other:
        first.send(type="session.start", model=MODEL, prompt=PROMPT, seed=4, width=WIDTH, height=HEIGHT,
                   format="jpeg", session="live")  # plays until stopped
        first.until(lambda message: message["type"] == "video.chunk_metadata")
        first.send(type="session.handoff", session="live")
        token = first.until(lambda message: message["type"] == "session.handed_off")[-1]["token"]
        for message, words in ((dict(token=token), "another API key's"),
                               (dict(token="mgh_" + "A" * 32), "issued no such handoff token")):
            other.send(type="session.claim", **message)
            refused = other.error()
            assert (refused["code"], refused["field"]) == ("invalid_handoff", "token") and words in refused["message"]
        second.send(type="session.claim", token=token, chunks=2)  # the refusal above did not spend it
        assert second.next()["session"] == "live"
        second.paused("live")
        claimed = [m["chunk"] for m, _ in second.chunks["live"]]
        assert len(claimed) == 2 and claimed[0] >= first.chunks["live"][-1][0]["chunk"] + 1
        first.send(type="session.ping")  # the first connection was sent nothing of it since
        assert first.next() == {"type": "session.pong"}
        second.send(type="session.claim", token=token)
        refused = second.error()
        assert (refused["code"], refused["field"]) == ("invalid_handoff", "token") and "claimed already" in \
            refused["message"]
        second.send(type="session.stop", session="live")
        second.ended("live")

        # Unclaimed: it holds its seat under the key's cap until its token expires, then it is stopped.
        first.send(type="session.start", model=MODEL, prompt=PROMPT, seed=5, width=WIDTH, height=HEIGHT,
                   chunks=1, session="orphan")
        first.paused("orphan")
        before = triton_sessions(realtime_server)
        first.send(type="session.handoff", session="orphan", expires_in=2)
        handed = first.until(lambda message: message["type"] == "session.handed_off")[-1]
        assert handed["expires_in"] == 2
        first.send(type="session.start", model=MODEL, prompt=PROMPT, seed=5, width=WIDTH, height=HEIGHT,
                   chunks=1, session="second")
        first.paused("second")
        first.send(type="session.start", model=MODEL, prompt=PROMPT, seed=5, width=WIDTH, height=HEIGHT,
                   chunks=1, session="third")
        assert first.error()["code"] == "too_many_sessions"  # "orphan" and "second" hold the key's 2 seats
        wait_until(lambda: triton_sessions(realtime_server) == before, timeout=30,
                   what="the unclaimed session stopped on the server")  # "second" opened, "orphan" stopped
        wait_until(lambda: sessions_open(realtime_api) == 1, timeout=30, what="the unclaimed session's seat back")
        second.send(type="session.claim", token=handed["token"])
        refused = second.error()
        assert refused["field"] == "token" and "expired" in refused["message"]
        first.send(type="session.stop")
        first.ended("second")
