"""A torch-target program run on the ranks of a layout, called like a
``TorchProgram`` (``run``, ``run_batches``), so that the sampler, the
in-process pipeline and the Triton component model need not know.

This is the parent's side: it sends the ranks typed messages
(parallel/messages.py) that each rank's ``RankPrograms`` handles
(parallel/rank_programs.py: how a call is split and gathered). Inputs that
repeat from call to call (a request's text conditioning) are sent once and
kept by the ranks (parallel/kept.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from machgen.parallel import state
from machgen.parallel.kept import KeptInputs
from machgen.parallel.layout import ParallelLayout, ShardPlan
from machgen.parallel.messages import ChangeLayout, CountStaleHeld, DropStale, Load, Run, Unload
from machgen.parallel.rank_programs import sequence_marker
from machgen.parallel.ranks import RankError, RankPool
from machgen.runtime.onnx_runner import run_grouped
from machgen.runtime.tensors import as_numpy

# Under a stale layout the ranks hold, for each batch a program ran last, every ring layer's keys and values for
# its next call; a program that has not been called for this long lets them go (an idle model holds no blocks).
STALE_IDLE_S = 30.0


class WholeSequence:
    """A program that splits its tokens itself, run on one device: its marker says one chunk."""

    def __init__(self, program: Any, marker: str):
        self.program, self.marker = program, marker
        self.input_names = [name for name in program.input_names if name != marker]
        self.output_names = program.output_names

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return self.program.run({**inputs, self.marker: sequence_marker(1)})

    def run_batches(self, batches: Sequence[Mapping[str, Any]], max_rows: int | None = None) -> list[dict[str, Any]]:
        return run_grouped(self.run, self.input_names, batches, max_rows)

    def __getattr__(self, name: str) -> Any:  # prepare, memory_report, ... of the program
        return getattr(self.program, name)


class ParallelProgram:
    """A component's program on ``layout``'s ranks. The components of one
    process that run one layout share its ranks (the denoiser's head and
    tail: one rank process per GPU, not two); the last to ``close`` stops them."""

    def __init__(self, folder: str | Path, inputs: Sequence[str], outputs: Sequence[str], plan: ShardPlan,
                 load: Callable[..., Any], layout: ParallelLayout | None = None, device: str | None = None,
                 threads: int = 1):
        """``load``: the runtime's loader of the folder's program on each rank (messages.Load.load);
        ``layout``: another layout than the plan's (one the build allows); ``device``: "cuda" puts rank r on
        cuda:r (NCCL), else the CPU (gloo)."""
        self.layout = layout or plan.layout
        self.plan = dataclasses.replace(plan, layout=self.layout)
        self.input_names = [name for name in inputs if name != plan.marker]  # the ranks add the marker
        self.output_names = list(outputs)
        self.folder = str(Path(folder).resolve())
        # Calls under this layout, those whose sequence was split (the others ran it whole on every
        # sequence rank), and those whose ring attended over the previous call's blocks (a stale layout).
        self.calls = self.split_calls = self.stale_calls = 0
        self._key = (self.layout, device, threads)
        self.stale_idle_s = STALE_IDLE_S
        self._last_call = 0.0  # time.monotonic() of the latest call
        self._watching_idle = False  # a thread waits to drop the stale blocks once idle (under pool.calling)
        self._closed = threading.Event()
        with state.pools_lock:
            if self._key not in state.pools:
                backend = "nccl" if device == "cuda" else "gloo"
                state.pools[self._key] = state.SharedPool(
                    RankPool(self.layout, "machgen.parallel.rank_programs:RankPrograms", device, backend=backend,
                             threads=threads), KeptInputs())
            shared = state.pools[self._key]
            shared.users += 1
            self.pool, self.kept = shared.pool, shared.kept
        try:
            # Sequence attentions whose values leave first (every rank rewrites its program alike).
            self.values_first = max(self.pool.call(Load(self.folder, self.plan.to_json(), load)))
        except BaseException:
            self.close()
            raise

    def prepare(self, value):
        """What travels to the ranks: numpy (adapters' banks are converted with this)."""
        return as_numpy(value)

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        with self.pool.calling:  # packing and sending in one order: what the ranks keep is what kept says
            payload, forget = self.kept.pack({name: as_numpy(inputs[name]) for name in self.input_names})
            try:
                outputs, split, stale = self.pool.call(Run(self.folder, payload, forget))[0]
            except (RankError, OSError):
                self.kept.lost()
                raise
            self._last_call = time.monotonic()
            if self.layout.stale and not self._watching_idle:
                self._watching_idle = True
                threading.Thread(target=self._drop_stale_when_idle, name="drop-stale-blocks", daemon=True).start()
        self.calls += 1
        self.split_calls += split
        self.stale_calls += stale
        return outputs

    def _drop_stale_when_idle(self) -> None:
        """Once no call came for ``stale_idle_s``, every rank lets go of this program's stale blocks (one
        message in call order: every rank drops them at the same point)."""
        while not self._closed.wait(min(max(self._last_call + self.stale_idle_s - time.monotonic(), 0.0), 1.0)):
            with self.pool.calling:
                if time.monotonic() - self._last_call < self.stale_idle_s:
                    continue  # called meanwhile
                if self.pool.alive() and self.layout.stale:
                    try:
                        self.pool.call(DropStale(self.folder))
                    except RankError:
                        pass  # the ranks are gone, and their blocks with them
                self._watching_idle = False
                return

    def stale_batches_held(self) -> int:
        """How many batches' stale blocks the ranks hold for this program's next calls (0 off a stale layout)."""
        return max(self.pool.call(CountStaleHeld(self.folder)))

    def run_batches(self, batches: Sequence[Mapping[str, Any]], max_rows: int | None = None) -> list[dict[str, Any]]:
        return run_grouped(self.run, self.input_names, batches, max_rows)

    def alive(self) -> bool:
        """Whether every rank runs (a rank that died stops them all)."""
        return self.pool.alive()

    def memory_report(self) -> str:
        return (f"{self.layout.world_size} ranks ({self.layout}), values first in {self.values_first} attentions, "
                f"pids {self.pool.pids}")

    def close(self) -> None:
        self._closed.set()
        with state.pools_lock:
            shared = state.pools.get(self._key)
            if shared is None or shared.pool is not self.pool:
                return
            shared.users -= 1
            last = shared.users == 0
            if last:
                del state.pools[self._key]
        if last:
            self.pool.stop()
        elif self.pool.alive():
            self.pool.call(Unload(self.folder))


def move_to_layout(programs: Sequence[Any], layout: ParallelLayout) -> bool:
    """Run ``programs`` (ParallelPrograms, or runners that wrap them) under ``layout`` from now on, in place:
    their rank processes and loaded programs stay, only the process groups are made again (a run comparing
    layouts of one world size loads each program once). False, and nothing changed, where that cannot be:
    another world size, ranks that other programs use too, ranks gone; the caller then opens them anew."""
    programs = [_unwrapped(program) for program in programs]
    if not all(isinstance(program, ParallelProgram) for program in programs):
        return False
    with state.pools_lock:
        pools: dict[int, list[ParallelProgram]] = {}
        for program in programs:
            pools.setdefault(id(program.pool), []).append(program)
        for group in pools.values():
            shared = state.pools.get(group[0]._key)
            if (shared is None or shared.pool is not group[0].pool or shared.users != len(group)
                    or not shared.pool.alive() or layout.world_size != shared.pool.layout.world_size
                    or (layout, *group[0]._key[1:]) in state.pools and layout != shared.pool.layout):
                return False
        for group in pools.values():
            pool, old_key = group[0].pool, group[0]._key
            new_key = (layout, *old_key[1:])
            if pool.layout != layout:
                try:
                    pool.call(ChangeLayout(layout.to_json()))
                except RankError:
                    return False  # the pool stopped: closing its programs finds it gone
                pool.layout = layout
                state.pools[new_key] = state.pools.pop(old_key)
            for program in group:
                program.layout, program._key = layout, new_key
                program.plan = dataclasses.replace(program.plan, layout=layout)
                program.calls = program.split_calls = program.stale_calls = 0  # counted per layout
    return True


def _unwrapped(runner: Any) -> Any:
    """The program inside a runner that wraps it (an AdaptedRunner's ``runner``)."""
    while not isinstance(runner, ParallelProgram) and "runner" in getattr(runner, "__dict__", {}):
        runner = runner.runner
    return runner
