"""Realtime sessions of a served model over Triton's gRPC (contract/sessions.py):
``MachgenClient.open_session`` starts one and plays it; its chunks arrive as
the server decodes them; ``interact``, ``fork`` and ``stop`` steer it."""

from __future__ import annotations

import json
import queue
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from machgen.client.errors import GenerationError
from machgen.contract.api import PROGRESS_OUTPUT, stream_error_status
from machgen.contract.manifest import STREAM, model_name
from machgen.contract.sessions import (ACTION_INPUT, CHUNK_INFO_OUTPUT, CHUNKS_INPUT, PARENT_SESSION_INPUT,
                                       SESSION_INFO_OUTPUT, SESSION_INPUT, SESSION_OP_INPUT, VIDEO_CHUNK_OUTPUT)



@dataclass(frozen=True)
class VideoChunk:
    """One chunk of a session: its frames (uint8 [frames, H, W, 3]), where they start in the session's video,
    the frame rate it plays at, and how it was made (queue, denoise and decode times, the rows of its calls)."""

    session: str
    chunk: int
    first_frame: int
    frames: np.ndarray
    fps: int
    stats: dict[str, Any] = field(default_factory=dict)


def _json(array: np.ndarray) -> dict[str, Any]:
    return json.loads(bytes(array.reshape(-1)[0]).decode("utf-8"))


class RealtimeSession:
    """A session being played (``client``: the MachgenClient that opened it): iterate it (or ``chunks()``) for
    its chunks as they come; ``info`` is the server's last word on it once the stream ends (``chunks``
    reached, stopped, evicted)."""

    def __init__(self, client, model: str, session_id: str, inputs: dict[str, Any]):
        self.client = client
        self.model = model
        self.session_id = session_id
        self.info: dict[str, Any] | None = None
        self._responses: queue.Queue = queue.Queue()
        # A start opens the session on the server when the stream's request gets there: an op sent before (on
        # another connection) could overtake it, so ops wait for the stream's first answer. A play's session
        # is open already.
        self._opened = threading.Event()
        if inputs.get(SESSION_OP_INPUT) != "start":
            self._opened.set()
        # One stream per session: tritonclient's gRPC client carries one at a time.
        self._stream_client = client.new_grpc_client()
        self._stream_client.start_stream(callback=self._answered)
        self._closed = threading.Event()
        self._send(model_name(model, STREAM), self._inputs(inputs))

    def _send(self, stream_model: str, inputs: list) -> None:
        # A stream that failed before its request went out (the server down or starting again) says why only
        # through its callback; tritonclient's own exception names no status.
        from tritonclient.utils import InferenceServerException

        try:
            self._stream_client.async_stream_infer(stream_model, inputs)
        except InferenceServerException as err:
            try:
                _, error = self._responses.get(timeout=1.0)
            except queue.Empty:
                error = None
            self._end_stream()
            why = error.message() if error is not None else err.message()
            raise GenerationError("StatusCode.UNAVAILABLE", f"the session's stream failed before its request was "
                                                            f"sent: {why}") from err

    def _inputs(self, values: dict[str, Any]) -> list:
        return [self.client.make_input(name, value, model=self.model)
                for name, value in {SESSION_INPUT: self.session_id, **values}.items() if value is not None]

    def __iter__(self) -> Iterator[VideoChunk]:
        return self.chunks()

    def chunks(self) -> Iterator[VideoChunk]:
        try:
            while True:
                try:
                    result, error = self._responses.get(timeout=self.client.stream_silence_s)
                except queue.Empty:
                    raise GenerationError("StatusCode.UNAVAILABLE", f"the server sent nothing for "
                                      f"{self.client.stream_silence_s:g} s: the session's stream is lost") from None
                if error is not None:
                    raise _stream_failure(error)
                names = {output.name for output in result.get_response().outputs}
                if SESSION_INFO_OUTPUT in names:
                    self.info = _json(result.as_numpy(SESSION_INFO_OUTPUT))
                    return
                if VIDEO_CHUNK_OUTPUT not in names:  # a heartbeat (PROGRESS_OUTPUT): the stream lives
                    assert PROGRESS_OUTPUT in names, names
                    continue
                info = _json(result.as_numpy(CHUNK_INFO_OUTPUT))
                yield VideoChunk(info["session"], info["chunk"], info["first_frame"],
                                 result.as_numpy(VIDEO_CHUNK_OUTPUT), info["fps"], info["stats"])
        finally:
            self._end_stream()

    def _end_stream(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._stream_client.stop_stream(cancel_requests=True)
            self._stream_client.close()

    def _answered(self, result, error) -> None:
        self._opened.set()
        self._responses.put((result, error))

    def _op(self, op: str, **values: Any) -> dict[str, Any]:
        if not self._opened.wait(self.client.stream_silence_s):
            raise GenerationError("StatusCode.UNAVAILABLE", f"session {self.session_id!r} was not started: its "
                                  f"stream got no answer in {self.client.stream_silence_s:g} s")
        return _json(self._infer(op, self._inputs({SESSION_OP_INPUT: op, **values}))[SESSION_INFO_OUTPUT])

    def _infer(self, op: str, inputs: list) -> dict[str, np.ndarray]:
        """An op's request. One that fails once the session's stream has ended with an error says what the
        stream was told: a sampler that died fails the stream at once, while the op, sent again until a
        sampler answers, would only hear that no such session is open."""
        try:
            return self.client.infer(self.model, inputs, outputs=(SESSION_INFO_OUTPUT,))
        except GenerationError as err:
            with self._responses.mutex:
                ended = next((error for _, error in self._responses.queue if error is not None), None)
            if ended is None or self._closed.is_set():  # a stream this client ended holds its own cancellation
                raise
            told = _stream_failure(ended)
            raise GenerationError(told.status, f"{told} (then {op}: {err})") from err

    def interact(self, prompt: str | None = None, action: str | None = None, seed: int | None = None):
        """A new prompt, one of the model's actions, or a new seed: from the chunk after the one being made
        (at once if the session is between chunks)."""
        return self._op("interact", prompt=prompt, **{ACTION_INPUT: action}, seed=seed)

    def fork(self, child_id: str | None = None, prompt: str | None = None, action: str | None = None,
             seed: int | None = None, chunks: int | None = None) -> "RealtimeSession":
        """A child of this session at its next chunk boundary, sharing what it has cached, then going on with
        its own prompt, action or seed; played at once (its own stream)."""
        child_id = child_id or f"{self.session_id}.{secrets.token_hex(4)}"
        inputs = self._inputs({SESSION_OP_INPUT: "fork", PARENT_SESSION_INPUT: self.session_id, "prompt": prompt,
                               ACTION_INPUT: action, "seed": seed})
        inputs = [tensor for tensor in inputs if tensor.name() != SESSION_INPUT]
        inputs.append(self.client.make_input(SESSION_INPUT, child_id))
        self._infer("fork", inputs)
        return RealtimeSession(self.client, self.model, child_id, {SESSION_OP_INPUT: "play", CHUNKS_INPUT: chunks})

    def play(self, chunks: int | None = None) -> "RealtimeSession":
        """This session played again on a new stream (after ``chunks`` ended the last one)."""
        self._end_stream()
        return RealtimeSession(self.client, self.model, self.session_id,
                               {SESSION_OP_INPUT: "play", CHUNKS_INPUT: chunks})

    def stop(self) -> dict[str, Any]:
        """Closes the session on the server (its memory freed); its stream ends."""
        info = self._op("stop")
        return info

    def close(self) -> None:
        """Ends this client's stream (the session stays open on the server until stopped or idle)."""
        self._end_stream()

    def __enter__(self) -> "RealtimeSession":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        except GenerationError:
            pass
        self._end_stream()


def _stream_failure(error) -> GenerationError:
    """A session stream's error (tritonclient's) as the client raises it."""
    if error.status() is not None:  # not the server's answer: the stream broke (gRPC's status)
        return GenerationError(str(error.status()), f"the session's stream broke, its server or the connection to "
                                                    f"it gone (a session dies with its server): {error.message()}")
    status, message = stream_error_status(error.message())
    return GenerationError(f"StatusCode.{_grpc_code(status)}", message)


def _grpc_code(status: str | None) -> str:
    return {"INVALID_ARG": "INVALID_ARGUMENT", "UNSUPPORTED": "UNIMPLEMENTED", None: "UNKNOWN"}.get(status, status)
