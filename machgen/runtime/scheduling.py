"""Whose denoising step runs next, when more requests are runnable than
the denoiser runs at once: the sampler's step gate.

Every denoiser call of a request passes the gate, which lets ``slots`` of
them run at once. When a slot frees and several wait, the decision
(``next_turn``, a pure function of the waiting calls and the state):

- between priorities, interactive before batch, strictly, except that
  batch work keeps a minimum share of denoiser time while both wait
  (``batch_min_share`` of the time served lately), so a burst of batch
  requests never starves and a person's request never waits behind one;
- within a priority, the owner that has received the least denoiser time
  goes first: a virtual counter per owner grows by the seconds its calls
  take (VTC, Sheng et al., "Fairness in Serving Large Language Models",
  OSDI 2024); an owner that comes back after having nothing to run starts
  at the smallest counter of those running or waiting, so time spent idle
  earns no credit. Among one owner's requests, the one that came first
  goes first (its requests run to completion in order, ``slots`` at a time,
  as a queue would run them); calls of no stated request, first come.

``SchedulingPolicy`` is the configuration, ``SchedulerState`` what the
decisions depend on (``reset()`` forgets it), ``StepGate`` the threads'
side.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from machgen.contract.api import PRIORITIES

INTERACTIVE, BATCH = PRIORITIES


@dataclass(frozen=True)
class SchedulingPolicy:
    # Denoiser calls running at once (the rest wait at the gate).
    slots: int = 8
    # Batch work's share of denoiser time while interactive work waits too: its guaranteed minimum. While
    # interactive requests run or wait, batch requests hold at most this share of the slots (at least one): the
    # interactive ones then run nearly as fast as alone (on the CPU a forward's time grows with its rows).
    batch_min_share: float = 0.1
    # The shares are of denoiser time served over about this long (an exponentially decaying sum).
    share_window_s: float = 10.0


@dataclass(frozen=True)
class Waiter:
    """One denoiser call waiting at the gate."""

    owner: str
    priority: str
    arrival: int  # order of arrival: of its request, where the call states one


@dataclass
class SchedulerState:
    """Virtual counters per (priority, owner) and the recent denoiser time of each priority."""

    counters: dict[tuple[str, str], float] = field(default_factory=dict)
    recent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PRIORITIES, 0.0))
    updated: float = 0.0

    def reset(self) -> None:
        self.counters.clear()
        self.recent = dict.fromkeys(PRIORITIES, 0.0)
        self.updated = 0.0

    def decay(self, now: float, window_s: float) -> None:
        if now > self.updated:
            factor = math.exp(-(now - self.updated) / window_s) if self.updated else 1.0
            self.recent = {priority: seconds * factor for priority, seconds in self.recent.items()}
            self.updated = now

    def charge(self, owner: str, priority: str, seconds: float, now: float, window_s: float) -> None:
        self.decay(now, window_s)
        self.counters[(priority, owner)] = self.counters.get((priority, owner), 0.0) + seconds
        self.recent[priority] += seconds

    def share(self, priority: str) -> float:
        total = sum(self.recent.values())
        return self.recent[priority] / total if total > 0 else 0.0

    def arrive(self, owner: str, priority: str, active: Sequence[tuple[str, str]]) -> None:
        """An owner with nothing running or waiting in this priority joins: lifted to the smallest counter of
        the owners active in it (``active``: (priority, owner) of every request running or waiting)."""
        others = [self.counters.get(key, 0.0) for key in set(active) if key[0] == priority and key[1] != owner]
        if others:
            key = (priority, owner)
            self.counters[key] = max(self.counters.get(key, 0.0), min(others))


def next_turn(waiting: Sequence[Waiter], state: SchedulerState, policy: SchedulingPolicy,
              batch_allowed: bool = True) -> Waiter | None:
    """The waiting call that takes the next free slot (``batch_allowed`` False: an interactive one, or none)."""
    if not batch_allowed:
        waiting = [waiter for waiter in waiting if waiter.priority == INTERACTIVE]
    if not waiting:
        return None
    present = {waiter.priority for waiter in waiting}
    if present == {INTERACTIVE, BATCH}:
        priority = BATCH if state.share(BATCH) < policy.batch_min_share else INTERACTIVE
    else:
        (priority,) = present
    return min((waiter for waiter in waiting if waiter.priority == priority),
               key=lambda waiter: (state.counters.get((priority, waiter.owner), 0.0), waiter.arrival))


class GateClosed(Exception):
    """A call given up while it waited at the gate (its request was cancelled)."""


class StepGate:
    """The step gate of one sampler: every denoiser call passes ``turn``.

    A request that has a slot keeps it from one of its calls to the next
    (its steps go on as a queue would run them), until it ``leave``s or, at
    a call, a waiting request is the decision's (``next_turn`` over the
    waiting ones and it): it then gives its slot up and waits like them.
    Calls that state no request are requests of one call."""

    def __init__(self, policy: SchedulingPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock = policy, clock
        self.state = SchedulerState()
        self._lock = threading.Lock()
        self._waiting: list[Waiter] = []
        # Each waiting call's wake-up: set once the call has its slot. Only that call wakes; a burst of requests
        # waiting at the gate costs one decision per freed slot, not one per waiting thread.
        self._granted: dict[int, threading.Event] = {}
        self._holding: dict[int, Waiter] = {}  # the requests that have a slot, by their order
        self._arrivals = itertools.count()

    def request_order(self) -> int:
        """A request's place in the order of arrival, for its calls' ``order``."""
        return next(self._arrivals)

    def _active(self) -> list[tuple[str, str]]:
        return [(w.priority, w.owner) for w in [*self._waiting, *self._holding.values()]]

    @contextlib.contextmanager
    def turn(self, owner: str, priority: str, is_cancelled: Callable[[], bool] = lambda: False,
             waited: list | None = None, order: int | None = None) -> Iterator[None]:
        """Wait for this call's turn, run the body, charge its time to ``owner``. ``order``: its request's
        (request_order; the request holds its slot until ``leave``); ``waited`` gets the seconds spent waiting
        and the seconds the body ran. Raises GateClosed when ``is_cancelled()`` while waiting."""
        arrived = self.clock()
        alone = order is None
        me = Waiter(owner, priority, self.request_order() if alone else order)
        with self._lock:
            if me.arrival in self._holding:
                # Its step boundary: it competes again, first among its owner's requests; it keeps its slot
                # unless another is the decision's (or batch work is over its share of the slots).
                del self._holding[me.arrival]
            elif (priority, owner) not in self._active():
                self.state.arrive(owner, priority, self._active())
            granted = self._granted[me.arrival] = threading.Event()
            self._waiting.append(me)
            self._dispatch()
        self._wait_for_slot(me, granted, is_cancelled)

        def release() -> None:
            if alone:
                self._holding.pop(me.arrival, None)
            self._dispatch()

        with self._charged(owner, priority, arrived, waited, release):
            yield

    def unslotted(self, owner: str, priority: str, waited: list | None = None):
        """A call that runs outside the slots, now (the interactive request computing its steps in the
        sampler): its time charged to ``owner`` as ``turn`` charges it."""
        return self._charged(owner, priority, self.clock(), waited)

    @contextlib.contextmanager
    def _charged(self, owner: str, priority: str, arrived: float, waited: list | None,
                 release: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Run the body, charge its time to ``owner``, then ``release`` (the lock held)."""
        started = self.clock()
        try:
            yield
        finally:
            ended = self.clock()
            with self._lock:
                self.state.charge(owner, priority, ended - started, ended, self.policy.share_window_s)
                release()
            if waited is not None:
                waited.append((started - arrived, ended - started))

    def _batch_room(self) -> bool:
        """Whether one more batch request may hold a slot: always, but while interactive requests run or wait
        only up to batch_min_share of the slots (one at least)."""
        if not any(w.priority == INTERACTIVE for w in [*self._waiting, *self._holding.values()]):
            return True
        held = sum(1 for w in self._holding.values() if w.priority == BATCH)
        return held < max(1, math.ceil(self.policy.slots * self.policy.batch_min_share))

    def _dispatch(self) -> None:
        """Give the free slots to the waiting calls the decision names, one after another (the lock held)."""
        while self._waiting and len(self._holding) < self.policy.slots:
            chosen = next_turn(self._waiting, self.state, self.policy, self._batch_room())
            if chosen is None:
                return
            self._waiting.remove(chosen)
            self._holding[chosen.arrival] = chosen
            self._granted.pop(chosen.arrival).set()

    def _wait_for_slot(self, me: Waiter, granted: threading.Event, is_cancelled: Callable[[], bool]) -> None:
        while not granted.wait(timeout=0.25):
            if is_cancelled():
                with self._lock:
                    if granted.is_set():  # its slot came as it gave up: the slot goes on to the next
                        self._holding.pop(me.arrival, None)
                    else:
                        self._waiting.remove(me)
                        del self._granted[me.arrival]
                    self._dispatch()
                raise GateClosed("cancelled while waiting for its turn")

    def leave(self, order: int) -> None:
        """The request of ``order`` is done with the denoiser: its slot goes to whoever is next."""
        with self._lock:
            if self._holding.pop(order, None) is not None:
                self._dispatch()

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)
