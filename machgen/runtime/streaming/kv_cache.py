"""A session's cache of keys and values: one entry per finished chunk, kept
while the chunks after it attend to it (the sink and the window), shared by
forks until they differ, padded into rows for a batched denoiser call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from machgen.contract.streaming import StreamingSettings


@dataclass(frozen=True)
class CacheEntry:
    """One chunk's keys and values [layers, tokens, heads, head_dim] (torch tensors, never changed once made),
    the clean latents that wrote them (kept for a prompt switch's re-cache) and its first latent frame."""

    first_frame: int
    keys: object
    values: object
    clean_latents: object

    @property
    def tokens(self) -> int:
        return int(self.keys.shape[1])

    def tensors(self) -> tuple:
        return self.keys, self.values, self.clean_latents


class SessionCache:
    """The entries a session's next chunk attends to, oldest first.

    A fork copies the list, not the tensors: parent and children hold the same
    entries until each appends its own (copy on write, as entries never
    change), and ``bytes_of`` counts a shared tensor once.
    """

    def __init__(self, settings: StreamingSettings, entries: Sequence[CacheEntry] = ()):
        self.settings = settings
        self.entries: list[CacheEntry] = list(entries)

    def append(self, entry: CacheEntry) -> None:
        """Adds a finished chunk's entry and evicts what the chunk after it no longer attends to."""
        self.entries.append(entry)
        next_frame = entry.first_frame + self.settings.chunk_frames
        self.entries = [e for e in self.entries if self.settings.kept(e.first_frame, next_frame)]

    def replace(self, entries: Sequence[CacheEntry]) -> None:
        self.entries = list(entries)

    def fork(self) -> "SessionCache":
        return SessionCache(self.settings, self.entries)

    @property
    def tokens(self) -> int:
        return sum(entry.tokens for entry in self.entries)

    def bytes(self) -> int:
        return bytes_of([self])


def bytes_of(caches: Sequence[SessionCache]) -> int:
    """The memory the caches hold, each tensor counted once however many caches share it."""
    seen: dict[int, int] = {}
    for cache in caches:
        for entry in cache.entries:
            for tensor in entry.tensors():
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def padded_rows(caches: Sequence[SessionCache], layers: int, heads: int, head_dim: int, like):
    """(past_keys, past_values [rows, layers, entries, heads, head_dim], past_valid [rows, entries]) of one
    denoiser call: each row's entries in order, zeros after them up to the longest row's (at least one entry,
    so that no input is empty); ``past_valid`` is 1 on real entries."""
    import torch

    longest = max([1] + [cache.tokens for cache in caches])
    keys = like.new_zeros(len(caches), layers, longest, heads, head_dim)
    values = like.new_zeros(len(caches), layers, longest, heads, head_dim)
    valid = like.new_zeros(len(caches), longest)
    for row, cache in enumerate(caches):
        if cache.entries:
            length = cache.tokens
            keys[row, :, :length] = torch.cat([e.keys for e in cache.entries], dim=1)
            values[row, :, :length] = torch.cat([e.values for e in cache.entries], dim=1)
            valid[row, :length] = 1
    return keys, values, valid
