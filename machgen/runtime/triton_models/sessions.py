"""The sampler's realtime sessions: the requests with a ``session_op``
(contract/sessions.py), served by one StreamingEngine in the sampler's own
process, which runs the streaming denoiser and so holds every session's
cache (nothing of a cache crosses a process). A playing request streams one
response per chunk; the others answer at once. Idle sessions are evicted
by a background thread."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Callable

import numpy as np

from machgen.contract.sessions import (CHUNK_INFO_OUTPUT, MAX_SESSIONS_PARAMETER, PLAYING_OPS, SESSION_IDLE_PARAMETER,
                                       SESSION_INFO_OUTPUT, SESSION_LEAD_PARAMETER, SESSION_MEMORY_PARAMETER,
                                       SESSION_ROWS_PARAMETER, VIDEO_CHUNK_OUTPUT, SessionRequest)
from machgen.contract.validation import InvalidArgument
from machgen.runtime.streaming.engine import SessionRefused, streaming_engine
from machgen.runtime.triton_models.backend import pb_utils, text_array
from machgen.runtime.triton_models.sessions_open import SessionsOpen

# Admission: a new session is refused while the calls already fill this share of the time (real time is
# then spoken for: one more session would make every session late).
FULL_BUSY_SHARE = 0.9


# The chunk latency histogram's buckets, seconds.
LATENCY_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class SessionMetrics:
    """The realtime sessions' Prometheus metrics on Triton's /metrics (the Python backend's custom metrics),
    labelled with the model: sessions open, keys and values cached, chunks made, chunks past their deadline,
    and each chunk's latency from its request to its frames."""

    def __init__(self, model: str):
        family = pb_utils.MetricFamily
        labels = {"model": model}
        self._families = [
            family("machgen_realtime_sessions", "Realtime sessions open", family.GAUGE),
            family("machgen_realtime_cache_bytes", "Bytes of keys and values the sessions cache", family.GAUGE),
            family("machgen_realtime_chunks_total", "Chunks sent to sessions", family.COUNTER),
            family("machgen_realtime_deadline_misses_total", "Chunks ready after their first frame was due",
                   family.COUNTER),
            family("machgen_realtime_chunk_latency_seconds", "Seconds from a chunk's request to its frames",
                   family.HISTOGRAM),
        ]
        self.sessions, self.cache_bytes, self.chunks, self.misses = (f.Metric(labels=labels)
                                                                      for f in self._families[:4])
        self.latency = self._families[4].Metric(labels=labels, buckets=LATENCY_BUCKETS)
        # The Python backend's metric calls are not safe from several threads at once (tritonserver itself
        # crashed, SIGSEGV, with four sessions starting together): the sessions' threads take turns.
        self.lock = threading.Lock()

    def chunk_sent(self, deadline_missed: bool, latency_s: float) -> None:
        with self.lock:
            self.chunks.increment(1)
            self.misses.increment(int(deadline_missed))
            self.latency.observe(latency_s)

    def gauges(self, read: Callable[[], tuple[int, int]]) -> None:
        """``read``: the sessions open and the bytes cached, read under the lock, or an older reading could
        be written last."""
        with self.lock:
            sessions, cache_bytes = read()
            self.sessions.set(sessions)
            self.cache_bytes.set(cache_bytes)

    def close(self) -> None:
        # Kept, not deleted: Triton 2.51 shares one metric between the versions of a model that make it with the
        # same labels, and frees it as soon as one of them deletes its own (triton-inference-server/server#8663).
        # After machgen serve loaded the sampler again (its shared memory given back), the old version's deletes
        # left the new one writing to freed memory: tritonserver took SIGABRT ("malloc(): unaligned fastbin chunk
        # detected") and hung. They go with the process.
        _RETIRED_METRICS.append((self._families, self.sessions, self.cache_bytes, self.chunks, self.misses,
                                 self.latency))


_RETIRED_METRICS: list = []


class SessionHost:
    def __init__(self, runtime, run_in_sampler: Callable, defaults, parameter: Callable[[str, str], str], logger,
                 model: str, release_memory: Callable[[], None] | None = None, release_after_s: float = 0.0):
        """``release_memory``: gives back what the in-sampler sessions' runs grew, ``release_after_s`` after
        the last session's close (within a second)."""
        self.engine = streaming_engine(
            runtime, run_in_sampler, fps=defaults.fps or 16, release_memory=release_memory,
            release_after_s=release_after_s,
            max_sessions=int(parameter(MAX_SESSIONS_PARAMETER, "8")),
            max_rows=int(parameter(SESSION_ROWS_PARAMETER, "8")),
            idle_timeout_s=float(parameter(SESSION_IDLE_PARAMETER, "60")),
            memory_budget_bytes=int(float(parameter(SESSION_MEMORY_PARAMETER, "1024")) * 2**20),
            # Paced to real time: a session makes a chunk at most this long (plus the making) before it is due.
            max_ahead_s=float(parameter(SESSION_LEAD_PARAMETER, "0.5")))
        self.defaults = defaults
        self.size_multiple = int(runtime.settings.get("size_multiple", 16))
        self.logger = logger
        self.metrics = SessionMetrics(model)
        self.sessions_open = SessionsOpen(model)
        # The play streaming each session's chunks now (the newest: an older one ends).
        self._players: dict[str, object] = {}
        self._players_lock = threading.Lock()
        self._closing = threading.Event()
        self._evictor = threading.Thread(target=self._evict_idle, name="session-evictor", daemon=True)
        self._evictor.start()

    def serve(self, request: SessionRequest, sender, is_cancelled: Callable[[], bool], streams: bool) -> list:
        """The final outputs of a session request (its chunks sent on ``sender`` before, when it plays);
        ``streams``: the caller reads a stream (NAME_stream), so it may play."""
        if request.op in PLAYING_OPS and not streams:
            raise InvalidArgument("session_op", f"{request.op} streams chunks: send it to the streaming twin "
                                                "(NAME_stream)")
        engine = self.engine
        if request.op == "start":
            if engine.sessions and engine.load() >= FULL_BUSY_SHARE:
                raise SessionRefused("session", f"the model is at its real-time capacity ({len(engine.sessions)} "
                                                "sessions keep it busy): try again later")
            height, width = self._size(request)
            if request.prompt is not None and request.action is not None:
                raise InvalidArgument("action", "give a prompt or an action, not both")
            prompt = request.prompt if request.action is None else engine.action_prompt(request.action, None)
            with self.sessions_open.opening(lambda: len(engine.sessions)):
                engine.open(request.session, prompt, self._seed(request), height, width,
                            subject=request.prompt)
        self._update_gauges()
        if request.op in PLAYING_OPS:
            return self._play(request, sender, is_cancelled)
        if request.op == "interact":
            applies_from = engine.change(request.session, prompt=request.prompt, action=request.action,
                                         seed=request.seed)
            self._update_gauges()
            return self._info(request.session, "open", applies_from=applies_from)
        if request.op == "fork":
            engine.fork(request.parent, request.session, prompt=request.prompt, action=request.action,
                        seed=request.seed)
        elif request.op == "stop":
            engine.close(request.session)
            self._update_gauges()
            return self._info(request.session, "closed")
        self._update_gauges()
        return self._info(request.session, "open")

    def _update_gauges(self) -> None:
        """The metrics' gauges and the sessions-open file (after every open and close, and each second)."""
        self.metrics.gauges(lambda: (len(self.engine.sessions), self.engine.cache_bytes()))
        self.sessions_open.update(lambda: len(self.engine.sessions))

    def _play(self, request: SessionRequest, sender, is_cancelled: Callable[[], bool]) -> list:
        """Streams the session's chunks. A newer play of the session (its client's stream closed and played
        again, or the session handed to another connection) takes over: this one ends, leaving it the chunks."""
        player = object()
        with self._players_lock:
            self._players[request.session] = player
        still_wanted = _Throttled(lambda: self._players.get(request.session) is player and not is_cancelled())
        sent = 0
        try:
            while request.chunks is None or sent < request.chunks:
                asked = time.monotonic()
                try:
                    chunk = self.engine.next_chunk(request.session, still_wanted=still_wanted)
                except SessionRefused:
                    return self._info(request.session, "closed", sent)
                if chunk is None:
                    break
                if not still_wanted.now():  # gone while the chunk was made: it is the next play's
                    self.engine.put_back(request.session, chunk)
                    break
                self._send_chunk(request, sender, chunk, asked)
                sent += 1
        finally:
            with self._players_lock:
                if self._players.get(request.session) is player:
                    del self._players[request.session]
            self._update_gauges()  # a session closed at its end, or by an error, is counted out
        return self._info(request.session, "open" if request.session in self.engine.sessions else "closed", sent)

    def _send_chunk(self, request: SessionRequest, sender, chunk, asked: float) -> None:
        info = {"session": request.session, "chunk": chunk.chunk, "first_frame": chunk.first_frame,
                "frames": int(len(chunk.frames)), "fps": self.engine.fps,
                "stats": {**chunk.stats, "wait_ms": (time.monotonic() - asked) * 1000}}
        sender.send(pb_utils.InferenceResponse([
            pb_utils.Tensor(VIDEO_CHUNK_OUTPUT, np.ascontiguousarray(chunk.frames)),
            pb_utils.Tensor(CHUNK_INFO_OUTPUT, text_array(json.dumps(info)))]))
        self.metrics.chunk_sent(chunk.stats["deadline_missed"], info["stats"]["wait_ms"] / 1000)
        self._update_gauges()

    def _info(self, session_id: str, state: str, chunks: int | None = None, **extra) -> list:
        info = {"session": session_id, "state": state, "cache_bytes": self.engine.cache_bytes(),
                "sessions": len(self.engine.sessions), **extra}
        session = self.engine.sessions.get(session_id)
        if session is not None:
            info.update(chunk=session.chunk, frames=session.frames_sent, deadline_misses=session.deadline_misses)
        if chunks is not None:
            info["chunks_sent"] = chunks
        return [pb_utils.Tensor(SESSION_INFO_OUTPUT, text_array(json.dumps(info)))]

    @staticmethod
    def _seed(request: SessionRequest) -> int:
        return request.seed if request.seed is not None else random.randrange(2**63)

    def _size(self, request: SessionRequest) -> tuple[int, int]:
        sizes = {"height": request.height or self.defaults.height, "width": request.width or self.defaults.width}
        limits = {"height": self.defaults.max_height, "width": self.defaults.max_width}
        for name, value in sizes.items():
            if value % self.size_multiple:
                raise InvalidArgument(name, f"{value} is not a multiple of {self.size_multiple}")
            if value > limits[name]:
                raise InvalidArgument(name, f"{value} is over this model's maximum, {limits[name]}")
        return sizes["height"], sizes["width"]

    def _evict_idle(self) -> None:
        while not self._closing.wait(1.0):
            for session_id in self.engine.evict_idle():
                self.logger.log_info(f"session {session_id}: closed after {self.engine.idle_timeout_s:g} s idle")
            self._update_gauges()
            try:
                self.engine.release_if_idle()
            except Exception as err:  # noqa: BLE001 - the sessions keep what they have
                self.logger.log_warn(f"releasing the sessions' memory failed: {err!r}")

    def close(self) -> None:
        self._closing.set()
        self._evictor.join(timeout=5)
        self.metrics.close()
        self.sessions_open.close()


class _Throttled:
    """A check asked often (each poll of a waiting chunk) and run at most every ``every_s`` seconds: asking
    Triton whether a request was cancelled is a message to the server."""

    def __init__(self, check: Callable[[], bool], every_s: float = 0.1):
        self.check, self.every_s = check, every_s
        self._last, self._answer = 0.0, True

    def __call__(self) -> bool:
        return self.now() if time.monotonic() - self._last >= self.every_s else self._answer

    def now(self) -> bool:
        self._last, self._answer = time.monotonic(), bool(self.check())
        return self._answer
