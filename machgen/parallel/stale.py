"""Stale keys: DistriFusion's displaced patch parallelism on a ring, run
only where a layout asks for it (``ring=2,stale``). Not exact.

A ring rank attends from its query chunk over its own keys and values of
this step and the other ring ranks' of the request's previous step. This
step's blocks leave in one all-gather (the bytes a ring moves) that is only
waited for at the next step's same attention, so the exchange hides under
a whole step's compute rather than under one block's. It rests on the
activations of neighbouring denoising steps being close (Li et al.,
DistriFusion, CVPR 2024); what it costs in quality is measured
(perf/bench_parallel.py --parts quality).

A call attends over stale blocks only where they stand in for its own: the
calls before it had the same input shapes, none of its inputs (latents,
timesteps, text) moved by more than ``STALE_MAX_CHANGE`` from one to the
next, and there were as many of them as the layout's warm-up
(``stale=N``: N). Any other call is exact, its blocks gathered before it
attends: a request's first N steps (its first one's timestep and noise are
far from whatever denoised before), a batch that gained or lost a request,
late steps whose timesteps halve. Calls of several batches may alternate
(requests whose steps are not batched together): each call continues the
batch whose last call it is close to, up to ``MAX_BATCHES`` of them. Every
rank decides alike: from the whole inputs, which every rank of a pool
receives.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from machgen.runtime.cache import relative_l1

# The largest mean relative change of any input of a call since the previous call for its stale blocks to stand
# in (neighbouring steps of a 20-50-step schedule change their latents and timesteps by a few per cent; a fresh
# request starts at the schedule's first timestep, several times the last one's, from noise that differs from
# another latent by 100 % or more).
STALE_MAX_CHANGE = 0.5
# Batches whose blocks a program keeps at once (each holds every ring layer's keys and values).
MAX_BATCHES = 4


def relative_change(now: torch.Tensor, before: torch.Tensor) -> float:
    if torch.equal(now, before):  # conditioning, positions, an empty tensor
        return 0.0
    return relative_l1(now.float(), before.float())


class StaleKeys:
    """One program's key/value blocks of its previous call on a rank, one slot per ring attention it made (every
    layer's, every head group's), in call order."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup  # exact calls in a row before one attends over stale blocks
        self._close = 0  # calls in a row that each moved little from the one before
        self._fingerprint: Any = None
        self._moving: dict[str, torch.Tensor] = {}
        # Per slot: the all-gather still in flight (None: done), and every ring rank's block [2, B, T, H, D].
        self._slots: list[tuple[Any, list[torch.Tensor]]] = []
        self._next = 0
        self.reusing = False

    def continues(self, fingerprint: Any, moving: Mapping[str, torch.Tensor]) -> bool:
        """Whether a call of inputs ``fingerprint`` (their shapes) and values ``moving`` is close to the last."""
        return (fingerprint == self._fingerprint and moving.keys() == self._moving.keys()
                and all(relative_change(value, self._moving[name]) <= STALE_MAX_CHANGE
                        for name, value in moving.items()))

    def begin(self, fingerprint: Any, moving: Mapping[str, torch.Tensor], continued: bool) -> None:
        """Start a call of inputs ``fingerprint`` and values ``moving``, ``continued`` if close to the last
        (``continues``); ``reusing`` then says whether it attends over the previous call's blocks."""
        self._close = self._close + 1 if continued else 0
        self.reusing = self._close >= self.warmup and bool(self._slots)
        if not self.reusing:
            self.drop()
        self._fingerprint, self._moving, self._next = fingerprint, dict(moving), 0

    @property
    def holds(self) -> bool:
        return bool(self._slots)

    def drop(self) -> None:
        """Forget the blocks held (waiting for the exchanges in flight: every rank has them under way)."""
        for work, _ in self._slots:
            if work is not None:
                work.wait()
        self._slots, self._fingerprint, self._moving = [], None, {}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float | None) -> torch.Tensor:
        """Attention of this rank's query chunk over every ring rank's keys and values ([B, T/k, H, D] each):
        its own of this call, the others' of the previous one where the call reuses (else of this one)."""
        block = torch.stack([k, v]).contiguous()
        me, slot = dist.get_rank(group), self._next
        self._next += 1
        if self.reusing:
            work, held = self._slots[slot]
            if work is not None:
                work.wait()
            blocks = [block if rank == me else other for rank, other in enumerate(held)]
        else:
            blocks = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
            dist.all_gather(blocks, block, group=group)
        whole = torch.cat(blocks, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), whole[0].transpose(1, 2), whole[1].transpose(1, 2),
                                             scale=scale).transpose(1, 2)
        if self.reusing:  # this call's blocks, for the next call's same attention
            incoming = [torch.empty_like(block) for _ in blocks]
            self._slots[slot] = (dist.all_gather(incoming, block, group=group, async_op=True), incoming)
        else:
            self._slots.append((None, blocks))
        return out


class StaleBatches:
    """A program's StaleKeys, one per batch of requests whose calls it runs (most recently used last)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._batches: list[StaleKeys] = []

    def begin(self, fingerprint: Any, moving: Mapping[str, torch.Tensor]) -> StaleKeys:
        """The batch a call of inputs ``fingerprint`` and values ``moving`` continues (a new one where it
        continues none, the least recently used dropped beyond MAX_BATCHES), its call begun."""
        batch = next((batch for batch in reversed(self._batches) if batch.continues(fingerprint, moving)), None)
        continued = batch is not None
        if batch is None:
            batch = StaleKeys(self.warmup)
            if len(self._batches) >= MAX_BATCHES:
                self._batches.pop(0).drop()
        else:
            self._batches.remove(batch)
        self._batches.append(batch)
        batch.begin(fingerprint, moving, continued)
        return batch

    @property
    def held(self) -> int:
        """Batches whose blocks are held for their next call."""
        return sum(1 for batch in self._batches if batch.holds)

    def drop(self) -> None:
        for batch in self._batches:
            batch.drop()
        self._batches = []
