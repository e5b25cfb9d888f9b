"""ONNX Runtime on the CPU: one session per component, requests run as one batch.

Used by the Triton component models, by the builder's parity check and by the
in-process runner, so all three execute an ONNX file the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from machgen.runtime.tensors import as_numpy, concat


class OnnxSession:
    """An ONNX Runtime CPU session with serving-friendly threading.

    ``intra_op_threads`` 0 means one thread per core this process may use.
    (Left at 0, ONNX Runtime's own choice ran the tiny VAE 2x slower here.)
    Spinning is off: a server runs several sessions in several processes,
    and idle spinning threads would steal the cores the busy one needs.
    """

    def __init__(self, path: str | os.PathLike, intra_op_threads: int = 0):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = cpu_threads(intra_op_threads)
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.path = Path(path)
        self._options = options
        self._session = self._open()
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    def _open(self):
        import onnxruntime as ort

        started = time.monotonic()
        session = ort.InferenceSession(os.fspath(self.path), sess_options=self._options,
                                       providers=["CPUExecutionProvider"])
        self.open_seconds = time.monotonic() - started  # what a release costs the next call, at most
        return session

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name; inputs may be numpy arrays or CPU torch tensors (viewed, not copied)."""
        feed = {name: as_numpy(inputs[name]) for name in self.input_names}
        session = self._session  # read once: a release swaps it, and this run keeps the one it began on
        if session is None:  # an idle release whose reopening failed: again, now that a call needs it
            session = self._session = self._open()
        return dict(zip(self.output_names, session.run(self.output_names, feed)))

    def release_memory(self, idle: bool = False) -> None:
        """Gives back the memory the runs grew: ONNX Runtime's CPU arena keeps every block it ever
        allocated for as long as its session lives (without it, runs are a third slower), so the session is
        replaced by a fresh one of the same file and options (the same outputs, bit for bit). A run in
        progress finishes on the old one, which goes when that run returns. ``idle``: no run is in progress
        nor can start until this returns (IdleRelease), so the old session goes first: the weights are never
        held twice. The module's ``release_memory`` then hands the freed pages back to the system."""
        if idle:
            self._session = None
        self._session = self._open()

    def run_batches(self, batches: Sequence[Mapping[str, np.ndarray]],
                    max_rows: int | None = None) -> list[dict[str, np.ndarray]]:
        return run_grouped(self.run, self.input_names, batches, max_rows)


class CheckedWideRunner:
    """A once-per-request stage's wider session, used for a lone call only where it has been seen to give
    the narrow session's outputs bit for bit.

    Both open the same file, but ONNX Runtime may split an operator's work
    (a reduction, a convolution) differently over more threads and round it
    differently: measured, the trained video default's VAE encoder by 5e-7.
    A request's output must not depend on whether it ran alone, so the first
    lone call of each set of input shapes runs on both sessions and answers
    the narrow one's; the wide session takes that shape's later lone calls
    only if every output was equal. How a session splits its work follows
    from the shapes, not the values, so one equal call speaks for the shape.
    ``narrow`` and ``wide``: runners (``run_batches``, ``input_names``)."""

    def __init__(self, narrow: Any, wide: Any, log: Callable[[str], None] = lambda message: None):
        self.narrow, self.wide, self.log = narrow, wide, log
        self.input_names = narrow.input_names
        self.verdicts: dict[tuple, bool] = {}  # input shapes -> whether the wide session gave the same bits

    def run_batches(self, batches: Sequence[Mapping[str, np.ndarray]],
                    max_rows: int | None = None) -> list[dict[str, np.ndarray]]:
        shapes = tuple((name, tuple(np.shape(value)), str(np.asarray(value).dtype))
                       for batch in batches for name, value in sorted(batch.items()))
        verdict = self.verdicts.get(shapes)
        if verdict:
            return self.wide.run_batches(batches, max_rows)
        outputs = self.narrow.run_batches(batches, max_rows)
        if verdict is None:
            wide = self.wide.run_batches(batches, max_rows)
            same = all(np.array_equal(as_numpy(result[name]), as_numpy(other[name]))
                       for result, other in zip(outputs, wide) for name in result)
            self.verdicts[shapes] = same
            if not same:
                self.log(f"{getattr(self.narrow, 'path', 'a stage')}: its wider session rounds differently on "
                         f"inputs {[(name, shape) for name, shape, _ in shapes]}: their lone calls stay on "
                         "one thread")
        return outputs

    def release_memory(self, idle: bool = False) -> None:
        for runner in (self.narrow, self.wide):
            release_memory(runner, idle=idle)


# A release waits for an idle spell at least this many times as long as reopening the sessions takes: the next
# call after it waits for the reopening at most, so a large model (seconds to open) is released only after long
# idleness, a small one after the configured seconds.
RELEASE_COST_SHARE = 50


def release_delay(idle_s: float, *runners: Any) -> float:
    """Seconds of idleness before ``runners`` are released: ``idle_s`` (0: never) or, for sessions slower to
    reopen, RELEASE_COST_SHARE times their opening."""
    if idle_s <= 0:
        return 0.0
    return max(idle_s, RELEASE_COST_SHARE * sum(session_open_seconds(runner) for runner in runners))


def session_open_seconds(runner: Any) -> float:
    """Seconds opening ``runner``'s ONNX Runtime sessions took (0 for a runner without any)."""
    inner = [getattr(runner, name) for name in ("narrow", "wide", "runner") if hasattr(runner, name)]
    if inner:
        return sum(session_open_seconds(session) for session in inner)
    return getattr(runner, "open_seconds", 0.0)


def release_memory(*runners: Any, idle: bool = False) -> None:
    """The arenas of ``runners``' ONNX Runtime sessions given back (those that have any: a torch program
    has none), then the freed heap. ``idle``: none of them runs meanwhile (OnnxSession.release_memory)."""
    for runner in runners:
        release = getattr(runner, "release_memory", None)
        if release is not None:
            release(idle=idle)
    trim_heap()


def trim_heap() -> None:
    """Hands the process's freed heap back to the system, where the C library can (glibc's malloc_trim):
    glibc keeps freed memory for the next allocations otherwise."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", False)
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


class IdleRelease:
    """Calls ``release`` once ``idle_s`` seconds have passed with no call running (each call wrapped in
    ``running()``), once per idle spell, and never while a call runs: a call that comes meanwhile waits for
    the release. A daemon thread (``start``) checks every second or so; ``idle_s`` 0: never."""

    def __init__(self, release: Callable[[], None], idle_s: float, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda message: None):
        self.release, self.idle_s, self.clock, self.log = release, idle_s, clock, log
        self.releases = 0
        self._lock = threading.Lock()
        self._running = 0
        self._last_call = clock()
        self._released = True  # nothing has grown before the first call
        self._stopped = threading.Event()

    @contextlib.contextmanager
    def running(self):
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._last_call, self._released = self.clock(), False

    def check(self) -> bool:
        """Releases if it is due; whether it did."""
        with self._lock:
            if (self.idle_s <= 0 or self._released or self._running
                    or self.clock() - self._last_call < self.idle_s):
                return False
            self._released = True  # a release that fails is not tried again before the next call
            self.release()
            self.releases += 1
            return True

    def start(self) -> "IdleRelease":
        if self.idle_s > 0:
            threading.Thread(target=self._watch, name="idle-release", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.idle_s / 2)):
            try:
                self.check()
            except Exception as err:  # noqa: BLE001 - the calls go on in the sessions they have
                self.log(f"releasing idle memory failed: {err!r}")


def cpu_threads(setting: int) -> int:
    """Threads a setting of 0 (one per core this process may use) or N means."""
    return setting or len(os.sched_getaffinity(0))


def run_grouped(run: Callable[[Mapping[str, Any]], dict[str, Any]], input_names: Sequence[str],
                batches: Sequence[Mapping[str, Any]], max_rows: int | None = None) -> list[dict[str, Any]]:
    """Run several requests' inputs through ``run``, those of equal per-item
    shapes as one forward (at most ``max_rows`` rows each); outputs in
    request order. Values are numpy arrays or torch tensors."""
    keys = [_shape_key(b, input_names) for b in batches]
    sizes = [len(b[input_names[0]]) for b in batches]
    results: list[dict[str, Any] | None] = [None] * len(batches)
    for group in group_requests(keys, sizes, max_rows):
        if len(group) == 1:
            results[group[0]] = run(batches[group[0]])
            continue
        outputs = run({n: concat([batches[i][n] for i in group]) for n in input_names})
        offsets = np.cumsum([0] + [sizes[i] for i in group])
        for position, index in enumerate(group):
            results[index] = {n: v[offsets[position]:offsets[position + 1]] for n, v in outputs.items()}
    return results


def _shape_key(inputs: Mapping[str, Any], names: Sequence[str]) -> tuple:
    return tuple((str(inputs[n].dtype), tuple(inputs[n].shape[1:])) for n in names)


def group_requests(keys: Sequence[Hashable], sizes: Sequence[int], max_rows: int | None = None) -> list[list[int]]:
    """Which requests run together: indices grouped by equal ``keys`` (shape
    buckets never mix), groups in order of their first request's arrival,
    each in arrival order, cut so no forward exceeds ``max_rows`` rows (a
    request larger than that runs alone). Every index appears exactly once.
    """
    buckets: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        buckets.setdefault(key, []).append(index)
    groups: list[list[int]] = []
    for members in buckets.values():
        current: list[int] = []
        rows = 0
        for index in members:
            if current and max_rows is not None and rows + sizes[index] > max_rows:
                groups.append(current)
                current, rows = [], 0
            current.append(index)
            rows += sizes[index]
        groups.append(current)
    return groups
