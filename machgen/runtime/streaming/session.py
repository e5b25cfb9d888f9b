"""One realtime session: the chunk it is generating, where in the chunk it is
(re-caching after a prompt switch, denoising, writing its cache), and what
it does with a denoiser call's answer for its row. Plain torch, no Triton."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from machgen.contract.streaming import StreamingSettings
from machgen.runtime.streaming.kv_cache import CacheEntry, SessionCache


class Phase(enum.Enum):
    RECACHE = "recache"  # a kept chunk's clean latents run again under the new prompt
    DENOISE = "denoise"
    COMMIT = "commit"  # the finished chunk's clean latents write its keys and values


def chunk_noise(seed: int, chunk: int, step: int, shape: tuple[int, ...]):
    """The noise of a chunk's step: a function of the session's seed and the chunk and step only, so that a
    session batched with others, run alone, forked or replayed draws the same."""
    import torch

    state = np.random.SeedSequence([seed, chunk, step]).generate_state(2, np.uint32)
    generator = torch.Generator("cpu").manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


@dataclass
class Row:
    """What a session puts into one denoiser call."""

    latents: Any  # [1, C, chunk frames, h, w]
    timestep: float
    first_frame: int
    cache: SessionCache


@dataclass
class StreamSession:
    session_id: str
    settings: StreamingSettings
    seed: int
    prompt: str
    embeddings: Any  # [1, text tokens, text dim]
    latent_shape: tuple[int, int, int]  # channels, latent height, latent width
    cache: SessionCache
    # What the model's action templates fill "{prompt}" with: the last prompt the session was given.
    subject: str | None = None
    chunk: int = 0  # the chunk being generated
    phase: Phase = Phase.DENOISE
    step: int = 0
    latents: Any = None
    clean: Any = None
    # Entries still to re-cache under a new prompt (oldest first) and those already re-cached.
    recache: list[CacheEntry] = field(default_factory=list)
    recached: list[CacheEntry] = field(default_factory=list)
    decoder_cache: Any = None
    # Changes asked for while a chunk runs, applied at the next chunk boundary (prompt, embeddings, seed).
    pending: dict[str, Any] = field(default_factory=dict)
    opened_at: float = field(default_factory=time.monotonic)
    # When the session's first frame was ready: its video plays from there, a frame every 1 / fps (None before).
    playing_since: float | None = None
    last_used: float = field(default_factory=time.monotonic)
    frames_sent: int = 0
    deadline_misses: int = 0
    # The chunk being made: seconds of the denoiser calls it rode in, and the most sessions one of them carried.
    chunk_denoise_s: float = 0.0
    chunk_rows: int = 0
    # Finished chunks its reader has not taken yet, and chunks asked for and not made yet.
    outbox: list = field(default_factory=list)
    wants: int = 0
    # Forks waiting for this session's next chunk boundary: it starts no chunk while one waits.
    fork_waits: int = 0
    closed: bool = False

    def __post_init__(self):
        if self.latents is None:
            self.latents = self.chunk_noise(0)

    @property
    def first_frame(self) -> int:
        return self.chunk * self.settings.chunk_frames

    @property
    def shape_key(self) -> tuple[int, ...]:
        """Sessions whose rows can share a call: the same latent size."""
        return self.latent_shape

    def chunk_noise(self, step: int):
        channels, height, width = self.latent_shape
        return chunk_noise(self.seed, self.chunk, step,
                           (1, channels, self.settings.chunk_frames, height, width))

    def row(self) -> Row:
        """This session's row of the next call."""
        if self.phase is Phase.RECACHE:
            entry = self.recache[0]
            context = SessionCache(self.settings, [e for e in self.recached
                                                   if self.settings.kept(e.first_frame, entry.first_frame)])
            return Row(entry.clean_latents, self.settings.context_timestep, entry.first_frame, context)
        if self.phase is Phase.COMMIT:
            return Row(self.clean, self.settings.context_timestep, self.first_frame, self.cache)
        return Row(self.latents, self.settings.sigmas()[self.step] * 1000, self.first_frame, self.cache)

    def advance(self, noise_pred, keys, values):
        """Takes this session's answer (its row of each output); returns the chunk's clean latents when the
        chunk is done (its cache written), else None."""
        if self.phase is Phase.RECACHE:
            entry = self.recache.pop(0)
            self.recached.append(CacheEntry(entry.first_frame, keys, values, entry.clean_latents))
            if not self.recache:
                self.cache.replace(self.recached)
                self.recached = []
                self.phase = Phase.DENOISE
            return None
        if self.phase is Phase.COMMIT:
            self.cache.append(CacheEntry(self.first_frame, keys, values, self.clean))
            done = self.clean
            self.clean = None
            self.chunk += 1
            self.step, self.phase = 0, Phase.DENOISE
            self._apply_pending()
            return done
        sigmas = self.settings.sigmas()
        clean = self.latents - sigmas[self.step] * noise_pred
        if self.step + 1 < len(sigmas):
            self.step += 1
            self.latents = (1 - sigmas[self.step]) * clean + sigmas[self.step] * self.chunk_noise(self.step)
        else:
            self.clean = clean
            self.phase = Phase.COMMIT
        return None

    @property
    def at_boundary(self) -> bool:
        """Between chunks: no call of the chunk to come has run yet (a prompt switch's re-cache included)."""
        return self.step == 0 and not self.recached and self.phase in (Phase.DENOISE, Phase.RECACHE)

    def change(self, **changes) -> int:
        """A new prompt (with its ``embeddings``) or seed: now if between chunks, else from the next chunk; the
        chunk it applies from."""
        self.pending.update(changes)
        if self.at_boundary:
            self._apply_pending()
            return self.chunk
        return self.chunk + 1

    def _apply_pending(self) -> None:
        """The changes asked for take effect at a chunk's start: a new prompt re-caches the kept entries, a new
        seed draws the chunk's noise again."""
        pending, self.pending = self.pending, {}
        self.seed = pending.get("seed", self.seed)
        self.subject = pending.get("subject", self.subject)
        if "prompt" in pending and pending["prompt"] != self.prompt:
            self.prompt, self.embeddings = pending["prompt"], pending["embeddings"]
            if self.cache.entries:
                self.recache, self.recached = list(self.cache.entries), []
                self.phase = Phase.RECACHE
        self.latents = self.chunk_noise(0)

    def fork(self, child_id: str, **changes) -> "StreamSession":
        """A child at this chunk boundary sharing this session's cache entries and decoder state, its own
        ``changes`` (prompt with embeddings, seed) taking effect from the chunk to come."""
        if not self.at_boundary:
            raise RuntimeError("a session forks only between chunks")
        child = StreamSession(child_id, self.settings, self.seed, self.prompt, self.embeddings, self.latent_shape,
                              self.cache.fork(), subject=self.subject, chunk=self.chunk, phase=self.phase,
                              latents=self.latents,
                              recache=list(self.recache), decoder_cache=self.decoder_cache,
                              frames_sent=self.frames_sent)
        child.change(**changes)
        return child
