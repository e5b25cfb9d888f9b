"""Inputs the ranks keep between calls, so that what does not change
between a request's steps (its text conditioning, its positions, a
picture's latents) travels to them once, not at every step.

The parent decides alone (``KeptInputs``) and the ranks obey (``RankStore``):
an input seen a second time with the same content (a 128-bit BLAKE2b of its
bytes, with its dtype and shape) is sent once more with the order to keep
it; from then on it travels as a ``Kept`` reference. What changes every step
(the latents) is seen once and never kept. The kept set is bounded in bytes,
least recently used first out; the order to forget rides with the next call.
Content, not request ids, makes the key: a batch of several requests'
rows is one tensor, kept as long as the batch stays the same, and the Triton
component model that calls the ranks needs to know nothing of requests.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

# What the ranks keep at most, each; beyond it the least recently used go.
KEPT_BYTES = 512 * 2**20
# Smaller inputs always travel (hashing and bookkeeping would cost what sending saves).
MIN_KEPT_BYTES = 1024
# Content seen once, remembered to spot its second sighting.
_SEEN = 256


@dataclass(frozen=True)
class Kept:
    """An input the ranks hold: its key."""

    key: bytes


@dataclass(frozen=True)
class Keep:
    """An input sent for the last time: the ranks keep it under ``key``."""

    key: bytes
    value: np.ndarray


def content_key(value: np.ndarray) -> bytes:
    digest = hashlib.blake2b(np.ascontiguousarray(value).data, digest_size=16)
    digest.update(f"{value.dtype.str}{value.shape}".encode())
    return digest.digest()


class KeptInputs:
    """The parent's side: what the ranks of one pool hold."""

    def __init__(self, budget: int = KEPT_BYTES, min_bytes: int = MIN_KEPT_BYTES):
        self.budget, self.min_bytes = budget, min_bytes
        self._held: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes, least recently used first
        self.held_bytes = 0
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._forget: list[bytes] = []
        self._reset = False
        # Bytes sent and bytes whose sending a Kept reference saved, over every call.
        self.sent_bytes = self.saved_bytes = 0

    def pack(self, inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], list[bytes] | None]:
        """(What to send for ``inputs``, keys the ranks must drop first: None drops everything)."""
        payload: dict[str, Any] = {}
        for name, value in inputs.items():
            if value.nbytes < self.min_bytes or value.nbytes > self.budget:
                payload[name] = value
                self.sent_bytes += value.nbytes
                continue
            key = content_key(value)
            if key in self._held:
                self._held.move_to_end(key)
                payload[name] = Kept(key)
                self.saved_bytes += value.nbytes
            elif key in self._seen:
                del self._seen[key]
                self._held[key] = value.nbytes
                self.held_bytes += value.nbytes
                payload[name] = Keep(key, value)
                self.sent_bytes += value.nbytes
            else:
                self._seen[key] = None
                if len(self._seen) > _SEEN:
                    self._seen.popitem(last=False)
                payload[name] = value
                self.sent_bytes += value.nbytes
        kept_now = {item.key for item in payload.values() if isinstance(item, (Kept, Keep))}
        for key in [key for key in self._held if key not in kept_now]:
            if self.held_bytes <= self.budget:
                break
            self.held_bytes -= self._held.pop(key)
            self._forget.append(key)
        forget, self._forget = (None if self._reset else self._forget), []
        self._reset = False
        return payload, forget

    def lost(self) -> None:
        """A call failed: what the ranks hold is no longer known; the next call makes them drop it all."""
        self._held.clear()
        self.held_bytes = 0
        self._forget = []
        self._reset = True


class RankStore:
    """A rank's side: the inputs it keeps, by key."""

    def __init__(self):
        self._values: dict[bytes, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._values)

    def unpack(self, payload: Mapping[str, Any], forget: list[bytes] | None) -> dict[str, np.ndarray]:
        if forget is None:
            self._values.clear()
        for key in forget or ():
            self._values.pop(key, None)
        inputs = {}
        for name, item in payload.items():
            if isinstance(item, Keep):
                self._values[item.key] = item.value
                inputs[name] = item.value
            elif isinstance(item, Kept):
                inputs[name] = self._values[item.key]
            else:
                inputs[name] = item
        return inputs
