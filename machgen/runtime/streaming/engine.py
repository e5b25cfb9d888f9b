"""The streaming engine: every open session of one model, their chunks
batched into one call of the streaming denoiser (each session's row at its
own step, with its own cache length), the sessions nearest their next frame
deadline first; a finished chunk decoded at once with its session's decoder
cache. The engine runs where the denoiser runs, so the caches never leave
that process; the Triton sampler and the in-process runner drive it alike."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from machgen.contract.streaming import StreamingSettings
from machgen.contract.validation import InvalidArgument
from machgen.runtime.streaming.kv_cache import SessionCache, bytes_of, padded_rows
from machgen.runtime.streaming.session import StreamSession

STREAMING_DENOISER = "streaming_denoiser"
# How long a fork waits for its parent's chunk to be done (a chunk takes a second on a loaded CPU, at most).
FORK_WAIT_S = 10.0


class SessionRefused(InvalidArgument):
    """A session the engine cannot take or find, naming the field at fault."""


@dataclass(frozen=True)
class CacheShape:
    """The streaming denoiser's cache dimensions (from the manifest)."""

    layers: int
    heads: int
    head_dim: int


@dataclass
class ChunkResult:
    session_id: str
    chunk: int
    first_frame: int  # the chunk's first video frame in the session
    first_latent: int  # and its first latent frame
    frames: Any  # uint8 [frames, H, W, 3]
    latents: Any  # the chunk's clean latents [1, C, chunk frames, h, w]
    stats: dict[str, float] = field(default_factory=dict)


class StreamingEngine:
    """``runtime``: the family's runtime (``encode_prompts``, ``decode_chunks``, ``latent_size``, its settings);
    ``run_component(name, inputs)`` runs the streaming denoiser in this process; ``release_memory()`` gives
    back the memory its sessions' runs grew, called by ``release_if_idle`` once the last session has closed."""

    def __init__(self, settings: StreamingSettings, runtime, run_component: Callable[[str, Mapping], Mapping],
                 cache_shape: CacheShape, *, max_rows: int = 8, max_sessions: int = 8,
                 memory_budget_bytes: int | None = None, idle_timeout_s: float = 60.0, fps: int = 16,
                 max_ahead_s: float | None = None, startup_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, release_memory: Callable[[], None] | None = None,
                 release_after_s: float = 0.0):
        self.settings = settings
        self.runtime = runtime
        self.run_component = run_component
        self.cache_shape = cache_shape
        self.max_rows = max_rows
        self.max_sessions = max_sessions
        self.memory_budget_bytes = memory_budget_bytes
        self.idle_timeout_s = idle_timeout_s
        self.fps = settings.fps or fps
        # Real-time pacing: a session this far ahead of its next frame's deadline gives its rows to the others
        # (None: every session as fast as the calls go, for benchmarks and tests).
        self.max_ahead_s = max_ahead_s
        # The time a session's first chunk is due after it opens. It is made at once, whatever the pacing; the
        # video plays from when it is ready, each later frame due 1 / fps after the one before.
        self.startup_s = startup_s
        # The share of recent wall time spent in calls (an exponential average): the load admission reads.
        self.busy_share = 0.0
        # Seconds a chunk recently took to make (its calls and its decode; an exponential average): pacing lets a
        # session start that much earlier, or sessions whose chunks ride in one call would all miss together.
        self.chunk_make_s = 0.0
        # Seconds of video a chunk plays: the most that earlier start may be (a model slower than real time
        # misses either way, and further ahead a key would wait longer for the chunks already begun).
        self.chunk_play_s = 0.0
        self._last_step_end: float | None = None
        self.clock = clock
        self.sessions: dict[str, StreamSession] = {}
        self.lock = threading.RLock()
        self.release_memory, self.release_after_s = release_memory, release_after_s
        self._release_due = False  # the sessions have all closed since the last release
        self._last_closed = 0.0

    # Sessions

    def open(self, session_id: str, prompt: str, seed: int, height: int, width: int,
             subject: str | None = None) -> StreamSession:
        """A new session from ``prompt``; ``subject``: what its actions' templates fill ``{prompt}`` with (the
        prompt itself unless it started from an action)."""
        with self.lock:
            if session_id in self.sessions:
                raise SessionRefused("session", f"session {session_id!r} is already open")
            self._check_room()
            latent_height, latent_width = self.runtime.latent_size(height, width)
            session = StreamSession(session_id, self.settings, seed, prompt, self._embed(prompt),
                                    (self.runtime.settings["latent_channels"], latent_height, latent_width),
                                    SessionCache(self.settings), subject=subject if subject is not None else prompt)
            session.opened_at = session.last_used = self.clock()
            self.sessions[session_id] = session
            return session

    def change(self, session_id: str, prompt: str | None = None, action: str | None = None,
               seed: int | None = None) -> int:
        """A prompt switch (a prompt, or an action's prompt) or a new seed for a session's chunks to come; the
        chunk it applies from."""
        with self.lock:
            session = self.session(session_id)
            session.last_used = self.clock()
            return session.change(**self._changes(prompt, action, seed, session.subject))

    def fork(self, session_id: str, child_id: str, prompt: str | None = None, action: str | None = None,
             seed: int | None = None, wait_s: float = FORK_WAIT_S) -> StreamSession:
        """A child of a session at its next chunk boundary. A session playing is between two of its calls, not
        between chunks, most of the time: it finishes the chunk it is making (its reader's calls make it) and
        starts no other until forked; one whose chunk is not done within ``wait_s`` (nobody reads it) is
        refused."""
        with self.lock:
            parent = self._fork_parent(session_id, child_id)
            parent.fork_waits += 1
        deadline = time.monotonic() + wait_s
        try:
            while True:
                with self.lock:
                    if self._fork_parent(session_id, child_id) is not parent:  # closed, and one of its name opened
                        raise SessionRefused("session", f"session {session_id!r} was closed while its fork waited")
                    if parent.at_boundary:
                        child = parent.fork(child_id, **self._changes(prompt, action, seed, parent.subject))
                        child.opened_at, child.last_used = parent.opened_at, self.clock()
                        child.playing_since = parent.playing_since
                        self.sessions[child_id] = child
                        return child
                if time.monotonic() > deadline:
                    raise SessionRefused("session", f"session {session_id!r} did not finish its chunk within "
                                                    f"{wait_s:g} s (is it being read?): fork it between chunks")
                time.sleep(0.005)
        finally:
            with self.lock:
                parent.fork_waits -= 1

    def _fork_parent(self, session_id: str, child_id: str) -> StreamSession:
        if child_id in self.sessions:
            raise SessionRefused("session", f"session {child_id!r} is already open")
        parent = self.session(session_id)
        self._check_room()
        return parent

    def close(self, session_id: str) -> None:
        with self.lock:
            self.session(session_id).closed = True
            del self.sessions[session_id]
            self._release_due, self._last_closed = not self.sessions, self.clock()

    def session(self, session_id: str) -> StreamSession:
        found = self.sessions.get(session_id)
        if found is None:
            raise SessionRefused("session", f"no open session {session_id!r} (closed, evicted or never opened)")
        return found

    def cache_bytes(self) -> int:
        with self.lock:
            return bytes_of([s.cache for s in self.sessions.values()])

    def evict_idle(self) -> list[str]:
        """Closes the sessions whose reader has neither taken a chunk nor steered for ``idle_timeout_s``
        (the engine's own stepping does not count); their ids."""
        with self.lock:
            now = self.clock()
            idle = [sid for sid, s in self.sessions.items() if now - s.last_used > self.idle_timeout_s]
            for sid in idle:
                self.close(sid)
            return idle

    def release_if_idle(self) -> bool:
        """Gives back the memory the calls grew (``release_memory``) if every session has closed since the last
        time, ``release_after_s`` ago at least; whether it did. Its host calls it off the requests' threads (a
        release reopens the sessions, a while for a large model); a session that opens meanwhile runs on
        (onnx_runner.OnnxSession)."""
        with self.lock:
            if (not self._release_due or self.sessions or self.release_memory is None
                    or self.clock() - self._last_closed < self.release_after_s):
                return False
            self._release_due = False
        self.release_memory()
        return True

    def action_prompt(self, action: str, subject: str | None) -> str:
        """The prompt an action switches to: its template in the model card, ``{prompt}`` in it standing for
        the session's own prompt (``subject``: the one it started from or was last given)."""
        if action not in self.settings.actions:
            known = ", ".join(sorted(self.settings.actions)) or "none"
            raise SessionRefused("action", f"unknown action {action!r}; this model's actions: {known}")
        template = self.settings.actions[action]
        if "{prompt}" in template and subject is None:
            raise SessionRefused("prompt", f"action {action!r} is made from the session's prompt: start the "
                                           "session with a prompt")
        return template.replace("{prompt}", subject or "")

    def _changes(self, prompt: str | None, action: str | None, seed: int | None,
                 subject: str | None) -> dict[str, Any]:
        if prompt is not None and action is not None:
            raise SessionRefused("action", "give a prompt or an action, not both")
        changes: dict[str, Any] = {}
        if prompt is not None:
            changes["subject"] = prompt
        if action is not None:
            prompt = self.action_prompt(action, subject)
        if prompt is not None:
            changes.update(prompt=prompt, embeddings=self._embed(prompt))
        if seed is not None:
            changes["seed"] = int(seed)
        return changes

    def _embed(self, prompt: str):
        return self.runtime.encode_prompts([prompt])["encoder_hidden_states"]

    def _check_room(self) -> None:
        if len(self.sessions) >= self.max_sessions:
            raise SessionRefused("session", f"this model holds at most {self.max_sessions} sessions at real time "
                                            f"and {len(self.sessions)} are open: try again later")
        if self.memory_budget_bytes is not None and self.cache_bytes() >= self.memory_budget_bytes:
            raise SessionRefused("session", f"the sessions' caches fill this model's memory budget "
                                            f"({self.memory_budget_bytes} bytes): try again later")

    # Chunks

    def at_end(self, session: StreamSession) -> bool:
        """Whether the session's next chunk would pass the positions the build tabled (``max_frames``): it makes
        no more, and never rides in another session's call (its row would fail the whole call)."""
        return session.first_frame + self.settings.chunk_frames > self.settings.max_frames

    def deadline(self, session: StreamSession) -> float:
        """When the session's next frame is due: its first ``startup_s`` after it opened; each later one 1 / fps
        after the one before, counted from when the video starts playing: when the first chunk that brings more
        than a lone frame is ready (with one-latent-frame chunks the first is the causal VAE's single first
        frame, 1 / fps of video: a clock started there would want the next chunk at once)."""
        if session.playing_since is None:
            return session.opened_at + self.startup_s
        return session.playing_since + session.frames_sent / self.fps

    def _paced_out(self, session: StreamSession, now: float) -> bool:
        """Whether real-time pacing holds the session back: its next frame's deadline is further than
        ``max_ahead_s`` plus the time a chunk takes to make. A first chunk never waits (a reader waits for it)."""
        return (self.max_ahead_s is not None and session.playing_since is not None
                and self.deadline(session) - now > self.max_ahead_s + min(self.chunk_make_s, self.chunk_play_s))

    def next_rows(self, wanted: set[str] | None = None) -> list[StreamSession]:
        """The sessions of the next call: the one nearest its deadline and those of its size, in deadline
        order, at most ``max_rows`` (only ``wanted`` ones where given). A session takes part while a chunk of
        it is wanted (``want``), so it never runs ahead of its reader, and steering lands where asked."""
        now = self.clock()
        ready = sorted((s for s in self.sessions.values() if (wanted is None or s.session_id in wanted)
                        and s.wants > 0 and not self.at_end(s) and not self._paced_out(s, now)
                        and not (s.fork_waits and s.at_boundary)),
                       key=self.deadline)
        if not ready:
            return []
        shape = ready[0].shape_key
        return [s for s in ready if s.shape_key == shape][:self.max_rows]

    def step(self, wanted: set[str] | None = None) -> list[ChunkResult]:
        """One call of the streaming denoiser over the next rows; the chunks it finished, decoded (also put in
        their sessions' outboxes)."""
        with self.lock:
            sessions = self.next_rows(wanted)
            if not sessions:
                return []
            import torch

            rows = [s.row() for s in sessions]
            started = self.clock()
            past_keys, past_values, past_valid = padded_rows(
                [row.cache for row in rows], self.cache_shape.layers, self.cache_shape.heads,
                self.cache_shape.head_dim, rows[0].latents)
            outputs = self.run_component(STREAMING_DENOISER, {
                "hidden_states": torch.cat([row.latents for row in rows]),
                "timestep": torch.tensor([[row.timestep] for row in rows], dtype=torch.float32),
                "frame_offset": torch.tensor([row.first_frame for row in rows], dtype=torch.int64),
                "encoder_hidden_states": torch.cat([s.embeddings for s in sessions]),
                "past_keys": past_keys, "past_values": past_values, "past_valid": past_valid,
            })
            denoised = self.clock()
            self._account(started, denoised)
            noise_pred, keys, values = (torch.as_tensor(outputs[name])
                                        for name in ("noise_pred", "chunk_keys", "chunk_values"))
            finished = []  # (session, its chunk's index, first latent frame, clean latents)
            for index, session in enumerate(sessions):
                chunk, first_frame = session.chunk, session.first_frame
                session.chunk_denoise_s += denoised - started
                session.chunk_rows = max(session.chunk_rows, len(sessions))
                clean = session.advance(noise_pred[index:index + 1], keys[index].clone(), values[index].clone())
                if clean is not None:
                    finished.append((session, chunk, first_frame, clean))
            return self._decode(finished) if finished else []

    def _decode(self, finished: list) -> list[ChunkResult]:
        """The chunks one call finished, decoded together, each put in its session's outbox."""
        decode_started = self.clock()
        decoded = self.runtime.decode_chunks([clean for *_, clean in finished],
                                             [session.decoder_cache for session, *_ in finished])
        done = self.clock()
        results = []
        for (session, chunk, first_frame, clean), (frames, cache) in zip(finished, decoded):
            due = self.deadline(session)
            session.decoder_cache = cache
            session.deadline_misses += done > due
            result = ChunkResult(session.session_id, chunk, session.frames_sent, first_frame, frames, clean, {
                "denoise_ms": session.chunk_denoise_s * 1000, "decode_ms": (done - decode_started) * 1000,
                "decoded_together": len(finished), "rows": session.chunk_rows, "deadline_missed": done > due,
                "late_ms": max(0.0, done - due) * 1000, "cache_bytes": session.cache.bytes()})
            self.chunk_make_s += 0.2 * (session.chunk_denoise_s + done - decode_started - self.chunk_make_s)
            self.chunk_play_s = max(self.chunk_play_s, len(frames) / self.fps)
            session.chunk_denoise_s, session.chunk_rows = 0.0, 0
            if session.playing_since is None:
                if session.frames_sent + len(frames) > 1:
                    session.playing_since = done
            elif done > due:
                # The reader's player waited for this chunk (a rebuffer) and plays its later frames on from now:
                # left on the clock it missed, every later chunk would count late and keep the nearest deadline,
                # crowding out sessions still on time.
                session.playing_since += done - due
            session.frames_sent += len(frames)
            session.wants -= 1
            session.outbox.append(result)
            results.append(result)
        return results

    def load(self) -> float:
        """The share of recent wall time spent in calls: ``busy_share``, fading over 2 s without a call."""
        if self._last_step_end is None:
            return 0.0
        return self.busy_share * max(0.0, 1.0 - (self.clock() - self._last_step_end) / 2.0)

    def _account(self, started: float, ended: float) -> None:
        """``busy_share`` after a call from ``started`` to ``ended``: over about the last 20 calls' span."""
        span = ended - (self._last_step_end if self._last_step_end is not None else started)
        self._last_step_end = ended
        if span > 0:
            self.busy_share += 0.05 * (min(1.0, (ended - started) / span) - self.busy_share)

    def want(self, session_id: str, chunks: int = 1) -> None:
        """Asks for ``chunks`` more chunks of a session: it takes part in the calls until they are made."""
        with self.lock:
            self.session(session_id).wants += chunks

    def put_back(self, session_id: str, chunk: ChunkResult) -> None:
        """A chunk taken by a reader that is gone before it sent it: the next reader's first."""
        with self.lock:
            self.session(session_id).outbox.insert(0, chunk)

    def next_chunk(self, session_id: str, poll_s: float = 0.005,
                   still_wanted: Callable[[], bool] | None = None) -> ChunkResult | None:
        """The session's next chunk: from its outbox, else wanted and made by stepping (other sessions' rows
        riding along), waiting while pacing holds it back. None as soon as ``still_wanted`` says no (its reader
        is gone or another took its place): the chunk stays for the next reader."""
        while True:
            if still_wanted is not None and not still_wanted():
                return None
            with self.lock:
                session = self.session(session_id)
                if not session.outbox and not session.wants:  # asked again each time: another reader may
                    session.wants = 1                           # have taken the chunk this one waited for
                if session.outbox:
                    session.last_used = self.clock()
                    return session.outbox.pop(0)
                if self.at_end(session):  # it can make nothing more: its memory goes at once
                    self.close(session_id)
                    frames = self.settings.max_frames
                    raise InvalidArgument("session", f"session {session_id!r} has played the {frames} latent "
                                                     f"frames ({frames // self.settings.chunk_frames} chunks) this "
                                                     "model's positions reach (its streaming max_frames): it is "
                                                     "closed; open a new session")
                if self.next_rows():
                    self.step()
                    continue
            time.sleep(poll_s)  # paced: every session is far enough ahead


def streaming_engine(runtime, run_component, **options) -> StreamingEngine:
    """The engine of a built model's streaming mode (its family runtime's settings carry it), or a refusal."""
    settings = runtime.settings.get("streaming")
    if settings is None:
        raise SessionRefused("model", "this model was built without a streaming mode (realtime sessions): see "
                                      "docs/realtime.md")
    shape = CacheShape(**settings["cache_shape"])
    streaming = StreamingSettings.from_json({k: v for k, v in settings.items() if k != "cache_shape"})
    return StreamingEngine(streaming, runtime, run_component, shape, **options)
