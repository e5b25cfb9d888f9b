"""The parallel state of this process, in one place (as xDiT keeps its
process groups in ``parallel_state``): the modules that read or set it import
it from here, and it imports none of them (only, for its annotations, the
types it holds). No torch.

- the rank mesh: set by a rank process, set again for another layout
  (None: one process, as a build's parity check runs a program);
- the call running now, per thread: whether its sequence is split
  (``split_sequence``) and the stale blocks its ring attends over
  (``attending``), settings a rank gives the operators of the program it runs;
- the values exchanges ``machgen::send_values`` started and no attention has
  taken yet (parallel/values_first.py), dropped when the rank's call ends;
- in the parent, the rank pools that its parallel programs share.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from machgen.parallel.kept import KeptInputs
    from machgen.parallel.layout import ParallelLayout
    from machgen.parallel.mesh import RankMesh
    from machgen.parallel.ranks import RankPool
    from machgen.parallel.stale import StaleKeys

_mesh: RankMesh | None = None
_call = threading.local()


def set_mesh(mesh: RankMesh | None) -> None:
    """The rank mesh of this process."""
    global _mesh
    _mesh = mesh


def current_mesh() -> RankMesh | None:
    return _mesh


@contextlib.contextmanager
def _call_setting(name: str, value: object) -> Iterator[None]:
    previous = getattr(_call, name, None)
    setattr(_call, name, value)
    try:
        yield
    finally:
        setattr(_call, name, previous)


def split_sequence(split: bool):
    """Calls inside run on the rank's chunk of the sequence (``split``) or on
    the whole of it (a sequence the degree does not divide: every rank of the
    sequence group then computes the same, unsplit)."""
    return _call_setting("split", split)


def split_mesh(all_ranks: bool = False) -> RankMesh | None:
    """The rank mesh where the call running now is split over several ranks
    (its sequence over the sequence ranks; ``all_ranks``: its rows over every
    rank, parallel/rows.py), else None: it runs whole."""
    if _mesh is None or not getattr(_call, "split", None):
        return None
    degree = _mesh.layout.world_size if all_ranks else _mesh.layout.sequence_degree
    return _mesh if degree > 1 else None


def attending(stale: StaleKeys | None):
    """Ring attention inside runs over ``stale``'s blocks (None: the exact ring)."""
    return _call_setting("stale", stale)


def stale_blocks() -> StaleKeys | None:
    """The stale blocks the call running now attends over (``attending``), or None."""
    return getattr(_call, "stale", None)


_tickets = itertools.count()
# Ticket -> the values' exchange under way (ulysses.start_values), until its attention takes it.
_values_in_flight: dict[int, list] = {}


def hold_values(exchange: list) -> int:
    """Keep a values exchange under way for the attention that takes it: its ticket."""
    ticket = next(_tickets)
    _values_in_flight[ticket] = exchange
    return ticket


def take_values(ticket: int) -> list:
    return _values_in_flight.pop(ticket)


def values_in_flight() -> int:
    """Values exchanges started and not taken."""
    return len(_values_in_flight)


@contextlib.contextmanager
def one_call() -> Iterator[None]:
    """A program's call on a rank: the exchanges it started and no attention took (the call failed between a
    send and its attention) are dropped when it ends, not kept until the rank process does."""
    try:
        yield
    finally:
        _values_in_flight.clear()


@dataclass
class SharedPool:
    """Rank processes that the parallel programs of one layout, device and thread count share."""

    pool: RankPool
    kept: KeptInputs  # what its ranks keep between calls
    users: int = 0  # programs open on it: the last to close stops it


# (layout, device, threads) -> the pool its programs share
pools: dict[tuple[ParallelLayout, str | None, int], SharedPool] = {}
pools_lock = threading.Lock()
