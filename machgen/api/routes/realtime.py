"""WebSocket /v1/realtime/video: realtime sessions of a model built with a streaming mode, after vLLM-Omni's
realtime video messages (docs/http-api.md, "Realtime video", documents each message field by field).

A connection opens sessions (``session.start``, ``session.fork``) on the model's streaming twin over Triton's
gRPC, one stream per playing session, and sends each chunk as ``video.chunk_metadata`` followed by its binary
messages: one fragment of fragmented MP4 (``m4s``) or one JPEG per frame (``jpeg``). A session is the
connection's own: its Triton id carries a random token of the connection, other connections cannot name it,
and it is stopped when the connection ends. Who may connect: the API's keys (the ``Authorization`` header, or
``?key=`` for browsers), a cap of sessions per key, and the browser origins the operator allows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse

from machgen.api.incoming import ANONYMOUS, bearer
from machgen.api.realtime import (FORMATS, Fields, Realtime, RealtimeError, RealtimeParts, Session, encoder_for,
                                  invalid, session_info)
from machgen.api.realtime_handoff import Handoffs, HandoffMessages
from machgen.api.schemas import ApiError
from machgen.api.triton import ServedModel, TritonFailure, TritonModels, _next_within
from machgen.contract.api import STREAM_SILENCE_S, stream_error_status
from machgen.contract.manifest import STREAM, model_name
from machgen.contract.sessions import (ACTION_INPUT, CHUNK_INFO_OUTPUT, CHUNKS_INPUT, MAX_CHUNKS,
                                       PARENT_SESSION_INPUT, SESSION_INFO_OUTPUT, SESSION_INPUT, SESSION_OP_INPUT,
                                       VIDEO_CHUNK_OUTPUT)

log = logging.getLogger("machgen.api.realtime")
PATH = "/v1/realtime/video"
MAX_MESSAGE_BYTES = 256 * 1024
OP_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 10.0  # a stop at the connection's end, which waits for it
# Triton's input names as this protocol's fields name them.
FIELDS = {SESSION_OP_INPUT: "type", PARENT_SESSION_INPUT: "parent"}
STEERING = ("prompt", ACTION_INPUT, "seed")


@contextlib.asynccontextmanager
async def _lifespan(app):
    """The API process's realtime parts, made with the app's (its registry for the metrics); at its end the
    sessions handed off and never claimed are stopped on the server."""
    app.state.realtime = RealtimeParts(app.state.registry)
    app.state.realtime_handoffs = Handoffs(app.state.realtime)
    try:
        yield
    finally:
        await app.state.realtime_handoffs.close()


router = APIRouter(lifespan=_lifespan)


# Who may connect.

def _origin_refusal(websocket: WebSocket, allowed: tuple[str, ...]) -> str | None:
    """Why a browser's Origin may not open sessions here; None: it may (or the client sent none: not a
    browser's page, which always sends one)."""
    origin = websocket.headers.get("origin")
    if origin is None or "*" in allowed:
        return None
    origin = origin.strip().rstrip("/").lower()
    host = websocket.headers.get("host", "").lower()
    own = {f"http://{host}", f"https://{host}"} if host else set()
    if origin in own or origin in {entry.rstrip("/").lower() for entry in allowed}:
        return None
    return (f"the origin {origin} may not open realtime sessions here; the API allows its own"
            + (f" and {', '.join(allowed)}" if allowed else "") + " (machgen api --allowed-origin)")


def _key_of(websocket: WebSocket) -> str | None:
    """The key from ``Authorization: Bearer`` or, for a browser (whose WebSocket cannot send headers), from
    ``?key=``; the query's key is removed from the scope, so that the access log never shows it."""
    key = bearer(websocket)
    query = parse_qsl(websocket.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    found = [value for name, value in query if name == "key"]
    if found:
        websocket.scope["query_string"] = urlencode([(name, value if name != "key" else "REDACTED")
                                                     for name, value in query]).encode("latin-1")
    return key or (found[0] if found and found[0] else None)


async def _refuse(websocket: WebSocket, error: ApiError) -> None:
    """The handshake refused with an HTTP answer in OpenAI's error shape (a close before accepting where the
    server cannot send one: a bare 403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(error.body(), status_code=error.status,
                                                          headers=error.headers))
    else:
        await websocket.close(code=1008, reason=str(error)[:120])


@router.websocket(PATH)
async def realtime_video(websocket: WebSocket):
    state = websocket.app.state.machgen
    parts: RealtimeParts = websocket.app.state.realtime
    key = _key_of(websocket)  # first: a refusal's log line shows the query too
    refusal = _origin_refusal(websocket, state.settings.allowed_origins)
    if refusal is not None:
        parts.metrics.refused.labels("origin").inc()
        return await _refuse(websocket, ApiError(403, refusal, param="origin", code="origin_not_allowed"))
    owner = ANONYMOUS
    if state.keys.required:
        found = state.keys.find(key)
        if found is None:
            parts.metrics.refused.labels("key").inc()
            problem = "no API key given" if key is None else "the API key is not valid"
            return await _refuse(websocket, ApiError(
                401, f"{problem}: send 'Authorization: Bearer KEY' (or, from a browser, ?key=KEY)",
                param="key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        owner = found.name
    await websocket.accept()
    connection = Connection(websocket, state, parts, websocket.app.state.realtime_handoffs, owner)
    try:
        await connection.serve()
    finally:
        await connection.close()


class Connection(HandoffMessages):
    """One client's connection: its messages in order, its sessions' streams beside them."""

    def __init__(self, websocket: WebSocket, state, parts: RealtimeParts, handoffs: Handoffs, owner: str):
        import tritonclient.grpc.aio as grpcaio

        self.websocket, self.state, self.parts, self.owner = websocket, state, parts, owner
        self.handoffs = handoffs
        self.metrics = parts.metrics
        self.token = secrets.token_hex(8)
        self.sessions: dict[str, Session] = {}
        self.send_lock = asyncio.Lock()
        self.open = True
        self.client = grpcaio.InferenceServerClient(state.triton.url)
        self.handlers = {"session.start": self.start, "session.interaction": self.interact,
                         "session.fork": self.fork, "session.play": self.play, "session.stop": self.stop,
                         "session.ping": self.ping, "session.handoff": self.handoff, "session.claim": self.claim}

    async def serve(self) -> None:
        while self.open:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            try:
                await self.handle(message)
            except RealtimeError as error:
                await self.send(error.body())
            except Exception as error:  # noqa: BLE001 - Triton unreachable, a fault here: said, and serving on
                log.exception("realtime message failed")
                await self.send(RealtimeError("server_error", f"{type(error).__name__}: {error}").body())

    async def handle(self, message: dict) -> None:
        text = message.get("text")
        if text is None:
            raise invalid("type", "send JSON text messages; binary messages mean nothing here",
                          code="invalid_message")
        if len(text) > MAX_MESSAGE_BYTES:
            raise invalid("type", f"a message of {len(text)} characters; at most {MAX_MESSAGE_BYTES}",
                          code="invalid_message")
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise invalid("type", f"the message is not valid JSON: {err}", code="invalid_json") from None
        if not isinstance(values, dict):
            raise invalid("type", "a message is a JSON object with a 'type'", code="invalid_message")
        kind = values.get("type")
        if kind not in self.handlers:
            raise invalid("type", f"unknown message type {kind!r:.60}; the types: {', '.join(self.handlers)}",
                          code="invalid_message")
        await self.handlers[kind](Fields(values, kind))

    # Sending: each message whole, a chunk's metadata and binary messages together.

    async def send(self, body: dict, parts: list[bytes] = ()) -> bool:
        async with self.send_lock:
            if not self.open:
                return False
            try:
                await self.websocket.send_text(json.dumps(body))
                for part in parts:
                    await self.websocket.send_bytes(part)
                return True
            except Exception:  # noqa: BLE001 - the client went away mid-send (the receive loop sees it too)
                self.open = False
                return False

    # Messages

    async def ping(self, fields: Fields) -> None:
        fields.finish()
        await self.send({"type": "session.pong"})

    async def start(self, fields: Fields) -> None:
        model, realtime = await self._model(fields.text("model", limit=200))
        prompt, action = fields.text("prompt"), fields.text(ACTION_INPUT, limit=200)
        if prompt is None and action is None:
            raise invalid("prompt", "'prompt' is missing: a session starts from a prompt (or one of the model's "
                                    f"actions: {', '.join(realtime.actions) or 'none'})")
        seed = fields.integer("seed", 0, 2**63 - 1)
        seed = secrets.randbelow(2**63) if seed is None else seed
        sizes = {}
        for name, limit in (("width", "max_width"), ("height", "max_height")):
            value = fields.integer(name, 1, 1 << 16) or int(realtime.defaults[name])
            if value % realtime.size_multiple or value > int(realtime.defaults.get(limit) or value):
                raise invalid(name, f"'{name}' {value} must be a multiple of {realtime.size_multiple} and at most "
                                    f"{realtime.defaults.get(limit)}")
            sizes[name] = value
        output_format, lossless = self._format(fields)
        self._check_fps(fields, realtime)
        chunks = self._chunks(fields, realtime, from_start=True)
        name = self._new_name(fields)
        fields.finish()
        session = self._open(name, model, realtime, sizes["width"], sizes["height"], output_format, lossless)
        await self._announce(session, seed=seed)
        self._play(session, "start", chunks, {"prompt": prompt, ACTION_INPUT: action, "seed": seed,
                                              "width": session.width, "height": session.height})

    async def interact(self, fields: Fields) -> None:
        session = self._session(fields.name("session"))
        interaction = fields.nested("interaction", "{\"event\": {\"prompt\" | \"action\" | \"seed\"}}")
        event_id = interaction.text("event_id", limit=200) or secrets.token_hex(6)
        if interaction.take("transition_chunks") is not None:
            raise invalid("interaction.transition_chunks", "a prompt switch here is immediate (the kept chunks "
                                                           "are re-cached): transition_chunks is not supported",
                          code="unsupported_value")
        event = interaction.nested("event", "a prompt, an action or a seed")
        steering = {"prompt": event.text("prompt"), ACTION_INPUT: event.text(ACTION_INPUT, limit=200),
                    "seed": event.integer("seed", 0, 2**63 - 1)}
        for part in (event, interaction, fields):
            part.finish()
        if all(value is None for value in steering.values()):
            raise invalid("interaction.event.prompt", "an interaction brings a prompt, an action or a seed")
        await self._opened(session)
        try:
            info = await self._op(session, "interact", "interaction.event.", **steering)
        except RealtimeError as error:
            if error.field == "session":  # the server no longer has it (closed while paused, idle): so said
                await self.send(error.body())
                return await self._end(session, "closed")
            raise
        await self.send({"type": "session.interaction.queued", "request_id": session.name, "session": session.name,
                         "event_id": event_id, "chunk": info.get("chunk"),
                         "applies_from": info.get("applies_from")})

    async def fork(self, fields: Fields) -> None:
        parent = self._session(fields.name("parent"), field="parent")
        steering = {"prompt": fields.text("prompt"), ACTION_INPUT: fields.text(ACTION_INPUT, limit=200),
                    "seed": fields.integer("seed", 0, 2**63 - 1)}
        chunks = self._chunks(fields, parent.realtime, from_start=False)
        name = self._new_name(fields)
        fields.finish()
        await self._opened(parent)
        child = self._open(name, parent.model, parent.realtime, parent.width, parent.height, parent.output_format,
                           parent.lossless)
        child.opened.set()  # by the fork itself
        try:
            await self._op(child, "fork", "", **{PARENT_SESSION_INPUT: parent.triton_id, **steering})
        except RealtimeError:
            self._forget(child)
            raise
        await self._announce(child, parent=parent.name)
        self._play(child, "play", chunks)

    async def play(self, fields: Fields) -> None:
        session = self._session(fields.name("session"))
        chunks = self._chunks(fields, session.realtime, from_start=False)
        fields.finish()
        if session.stream is not None and not session.stream.done():
            raise RealtimeError("invalid_value", f"session {session.name!r} is playing; session.play resumes a "
                                                 "paused one", "session", session.name)
        self._play(session, "play", chunks)

    async def stop(self, fields: Fields) -> None:
        name = fields.name("session")
        fields.finish()
        for session in [self._session(name)] if name is not None else list(self.sessions.values()):
            await self._opened(session)
            session.stopping = True
            try:
                await self._op(session, "stop", "")
            except RealtimeError as error:
                if error.field != "session":  # a session the server had closed already is stopped all the same
                    raise
            if session.stream is None or session.stream.done():
                await self._end(session, "stopped")
            # else its stream ends with the session closed, and says so

    # Sessions

    async def _model(self, name: str | None) -> tuple[ServedModel, Realtime]:
        try:
            models = await self.state.triton.models()
        except Exception as err:  # noqa: BLE001 - Triton down or stopping
            raise RealtimeError("triton_unavailable", f"the server's models cannot be listed: {err}") from None
        realtime = {model_name: Realtime.of(model) for model_name, model in models.items()}
        if name is None:
            playable = [model_name for model_name, found in realtime.items() if found is not None]
            if len(playable) != 1:
                raise invalid("model", f"'model' is missing: the realtime models here: {', '.join(playable) or 'none'}")
            name = playable[0]
        if name not in models:
            raise invalid("model", f"the model '{name}' does not exist", code="model_not_found")
        if realtime[name] is None:
            raise invalid("model", f"the model '{name}' was built without a streaming mode: it serves no realtime "
                                   "sessions (docs/realtime.md)")
        return models[name], realtime[name]

    @staticmethod
    def _format(fields: Fields) -> tuple[str, bool]:
        output_format = fields.text("format", limit=10) or "m4s"
        if output_format not in FORMATS:
            raise invalid("format", f"'format' must be one of {', '.join(FORMATS)}, not {output_format!r}")
        lossless = fields.flag("lossless")
        if lossless and output_format != "m4s":
            raise invalid("lossless", "'lossless' is an m4s encoding (H.264 4:4:4 in RGB); JPEG is always lossy")
        return output_format, lossless

    @staticmethod
    def _check_fps(fields: Fields, realtime: Realtime) -> None:
        fps = fields.integer("fps", 1, 1000)
        if fps is not None and fps != realtime.fps:
            raise invalid("fps", f"this model's sessions play at {realtime.fps} fps (their frames' deadlines), "
                                 f"not {fps}")

    @staticmethod
    def _chunks(fields: Fields, realtime: Realtime, from_start: bool) -> int | None:
        chunks, frames = fields.integer("chunks", 1, MAX_CHUNKS), fields.integer("num_frames", 1, 1 << 30)
        if chunks is not None and frames is not None:
            raise invalid("num_frames", "give 'chunks' or 'num_frames', not both")
        return realtime.chunks_for(frames, from_start) if frames is not None else chunks

    def _new_name(self, fields: Fields) -> str:
        name = fields.name("session") or f"s-{secrets.token_hex(4)}"
        if name in self.sessions:
            raise invalid("session", f"this connection already has a session {name!r}")
        return name

    async def _opened(self, session: Session) -> None:
        """Waits until the server has opened a session just started (its stream's first word), so that an op
        sent at once does not overtake the start."""
        try:
            await asyncio.wait_for(session.opened.wait(), OP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RealtimeError("triton_unavailable", f"the server has not opened session {session.name!r} in "
                                f"{OP_TIMEOUT_S:.0f} s", "session", session.name) from None

    def _session(self, name: str | None, field: str = "session") -> Session:
        if name is None:
            if len(self.sessions) != 1:
                raise invalid(field, f"'{field}' is missing: this connection has {len(self.sessions)} sessions "
                                     f"({', '.join(self.sessions) or 'none'}): name one")
            return next(iter(self.sessions.values()))
        if name not in self.sessions:
            raise RealtimeError("session_not_found", f"this connection has no open session {name!r}", field, name)
        return self.sessions[name]

    def _open(self, name: str, model: ServedModel, realtime: Realtime, width: int, height: int, output_format: str,
              lossless: bool) -> Session:
        """A session of this connection, its seat under the key's cap taken."""
        cap = self.state.settings.max_sessions_per_key
        if self.parts.open_by_owner[self.owner] >= cap:
            self.metrics.refused.labels("cap").inc()
            raise RealtimeError("too_many_sessions", f"this key has {self.parts.open_by_owner[self.owner]} realtime "
                                f"sessions open, its cap (--max-sessions-per-key {cap}): stop one first", "session",
                                name, cap=cap)
        self.parts.open_by_owner[self.owner] += 1
        self.metrics.sessions.labels(model.name).inc()
        self.metrics.deadline_misses.labels(model.name)  # its series shows 0 before the first miss
        session = Session(name, f"{self.token}.{name}", model, realtime, width, height, output_format, lossless,
                          encoder_for(output_format, width, height, realtime.fps, lossless), time.monotonic())
        self.sessions[name] = session
        return session

    def _forget(self, session: Session) -> bool:
        if self.sessions.get(session.name) is not session:
            return False
        del self.sessions[session.name]
        self.parts.release(self.owner, session.model.name)
        return True

    async def _end(self, session: Session, reason: str) -> None:
        if self._forget(session):
            await self.send({"type": "session.done", "request_id": session.name, "session": session.name,
                             "chunks": session.chunks_sent, "stopped": reason == "stopped", "reason": reason})

    async def _announce(self, session: Session, **extra) -> None:
        realtime = session.realtime
        await self.send({"type": "video.start", "request_id": session.name, "session": session.name,
                         "model": session.model.name, "format": session.output_format, **extra,
                         "config": {"width": session.width, "height": session.height, "fps": realtime.fps,
                                    "chunk_frames": realtime.chunk_frames(False),
                                    "first_chunk_frames": realtime.chunk_frames(True), "lossless": session.lossless,
                                    "actions": list(realtime.actions)}})

    # Triton

    def _failure(self, failure: TritonFailure, session: Session, prefix: str) -> RealtimeError:
        """Triton's refusal in this protocol's words: its field as the message names it here, the connection's
        token left out of session ids."""
        message = str(failure).replace(session.triton_id, session.name).replace(f"{self.token}.", "")
        if failure.status == "INVALID_ARG":
            field = failure.field or "session"
            ours = FIELDS.get(field) or (prefix + field if field in STEERING else field)
            return RealtimeError("invalid_value", message.replace(f"'{field}'", f"'{ours}'"), ours, session.name)
        code = "triton_unavailable" if failure.status == "UNAVAILABLE" else "server_error"
        return RealtimeError(code, message, None, session.name)

    async def _op(self, session: Session, op: str, prefix: str, timeout_s: float = OP_TIMEOUT_S,
                  **values) -> dict[str, Any]:
        """A session op that answers at once (interact, fork, stop), on the public model: its session_info."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        inputs = {SESSION_INPUT: session.triton_id, SESSION_OP_INPUT: op, **values}
        tensors = [TritonModels.tensor(session.model, name, value) for name, value in inputs.items()
                   if value is not None]
        try:
            result = await self.client.infer(session.model.name, tensors, client_timeout=timeout_s,
                                             outputs=[grpcclient.InferRequestedOutput(SESSION_INFO_OUTPUT)])
        except InferenceServerException as err:
            status = str(err.status() or "").removeprefix("StatusCode.")
            raise self._failure(TritonFailure({"INVALID_ARGUMENT": "INVALID_ARG"}.get(status, status),
                                              err.message() or str(err)), session, prefix) from None
        return self._observed(session, session_info(result.as_numpy(SESSION_INFO_OUTPUT)))

    def _observed(self, session: Session, info: dict[str, Any]) -> dict[str, Any]:
        if "cache_bytes" in info:
            self.metrics.cache_bytes.labels(session.model.name).set(info["cache_bytes"])
        return info

    def _play(self, session: Session, op: str, chunks: int | None, inputs: dict[str, Any] | None = None) -> None:
        session.stream = asyncio.create_task(self._stream(session, op, chunks, inputs or {}))

    async def _stream(self, session: Session, op: str, chunks: int | None, values: dict[str, Any]) -> None:
        """The session played on the model's streaming twin: each chunk sent on as it comes; then paused (its
        chunks sent, the session still open) or done (stopped, closed by the server, failed)."""
        inputs = {SESSION_INPUT: session.triton_id, SESSION_OP_INPUT: op, CHUNKS_INPUT: chunks, **values}
        tensors = [TritonModels.tensor(session.model, name, value) for name, value in inputs.items()
                   if value is not None]
        finished = asyncio.Event()

        async def one_request():
            yield {"model_name": model_name(session.model.name, STREAM), "inputs": tensors,
                   "request_id": session.triton_id}
            await finished.wait()  # the stream stays open until the session's last word is in

        responses = self.client.stream_infer(one_request())
        received = responses.__aiter__()
        asked, sent = time.monotonic(), 0
        try:
            while True:
                try:
                    result, error = await _next_within(received, STREAM_SILENCE_S)
                except StopAsyncIteration:
                    raise TritonFailure("UNAVAILABLE", "the server ended the session's stream without a word") from None
                except asyncio.TimeoutError:
                    raise TritonFailure("UNAVAILABLE", f"the server sent nothing for {STREAM_SILENCE_S:.0f} s: the "
                                                       "session's stream is lost") from None
                session.opened.set()
                if error is not None:
                    status, message = stream_error_status(error.message())
                    raise TritonFailure(status or "UNKNOWN", message)
                names = {output.name for output in result.get_response().outputs}
                if SESSION_INFO_OUTPUT in names:
                    info = self._observed(session, session_info(result.as_numpy(SESSION_INFO_OUTPUT)))
                    break
                if VIDEO_CHUNK_OUTPUT in names:  # else a heartbeat: the stream lives
                    await self._send_chunk(session, session_info(result.as_numpy(CHUNK_INFO_OUTPUT)),
                                           result.as_numpy(VIDEO_CHUNK_OUTPUT), asked)
                    asked, sent = time.monotonic(), sent + 1
        except Exception as failure:  # noqa: BLE001 - whatever ends the stream ends the session, said
            responses.cancel()
            if isinstance(failure, TritonFailure):
                error = self._failure(failure, session, "")
            elif isinstance(failure, RealtimeError):
                error = failure
            else:
                log.exception("session %s: its stream failed", session.name)
                error = RealtimeError("server_error", f"{type(failure).__name__}: {failure}")
            error.session = session.name
            await self.send(error.body())
            if not session.stopping:  # the server may still hold it: given back (best effort)
                with contextlib.suppress(Exception):
                    await self._op(session, "stop", "", timeout_s=CLOSE_TIMEOUT_S)
            return await self._end(session, "error")
        except asyncio.CancelledError:
            responses.cancel()
            raise
        finally:
            finished.set()
            session.opened.set()  # nobody waits on a start that failed
        if info.get("state") == "open" and not session.stopping:
            session.next_chunk = info.get("chunk", session.next_chunk)
            await self.send({"type": "session.paused", "request_id": session.name, "session": session.name,
                             "chunks": sent, "chunk": info.get("chunk")})
        else:
            await self._end(session, "stopped" if session.stopping else "closed")

    async def _send_chunk(self, session: Session, info: dict[str, Any], frames, asked: float) -> None:
        encoding = time.monotonic()
        parts, extra = await session.encoder.encode(frames, int(info["first_frame"]))
        stats = {**info.get("stats", {}), "encode_ms": (time.monotonic() - encoding) * 1000,
                 "send_ms": session.last_send_ms}
        sending = time.monotonic()
        sent = await self.send({
            "type": "video.chunk_metadata", "request_id": session.name, "session": session.name, "kind": "media",
            "chunk": info["chunk"], "first_frame": info["first_frame"], "frames": info["frames"],
            "fps": info.get("fps", session.realtime.fps), "generation_chunk_index": info["chunk"],
            "transport_chunk_index": session.chunks_sent, "num_frames": info["frames"], "parts": len(parts),
            "byte_length": sum(len(part) for part in parts), **extra, "stats": stats}, parts)
        session.next_chunk = info["chunk"] + 1
        if not sent:
            return
        done = time.monotonic()
        session.last_send_ms = (done - sending) * 1000
        model = session.model.name
        if session.chunks_sent == 0:
            self.metrics.first_chunk_seconds.labels(model).observe(done - session.opened_at)
        session.chunks_sent += 1
        self.metrics.chunks.labels(model).inc()
        self.metrics.chunk_seconds.labels(model).observe(done - asked)
        if info.get("stats", {}).get("deadline_missed"):
            self.metrics.deadline_misses.labels(model).inc()

    async def close(self) -> None:
        """The connection's end: its streams cancelled, its sessions closed on the server, their seats back."""
        self.open = False
        sessions = list(self.sessions.values())
        for session in sessions:
            if session.stream is not None:
                session.stream.cancel()
        for session in sessions:
            if session.stream is not None:
                await asyncio.gather(session.stream, return_exceptions=True)
            session.stopping = True
            try:
                await self._op(session, "stop", "", timeout_s=CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - closed already, or Triton gone: nothing to give back
                log.debug("session %s: not stopped on the server", session.name, exc_info=True)
            self._forget(session)
        await self.client.close()
