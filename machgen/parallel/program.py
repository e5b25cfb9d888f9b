"""A torch-target program run on the ranks of a layout, called like a
``TorchProgram`` (``run``, ``run_batches``), so that the sampler, the
in-process pipeline and the Triton component model need not know.

Per call each rank takes its cfg group's rows and its chunk of every token
sequence (the component's ``ShardPlan``), runs the program (whose
``machgen::sequence_attention`` nodes exchange across the sequence ranks),
and the leader (rank 0) answers with the whole outputs gathered. Inputs
that repeat from call to call (a request's text conditioning) are sent once
and kept by the ranks (parallel/kept.py). A call
whose sequences the sequence degree does not divide runs them whole on every
rank of a sequence group (the same result, without the speed-up). A
component whose plan splits over every rank (a video decoder's rows of
pixels, parallel/rows.py) gives each rank its band instead, the batch whole.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from machgen.parallel.kept import KeptInputs, RankStore
from machgen.parallel.layout import ParallelLayout, ShardPlan
from machgen.parallel.ranks import RankError, RankPool
from machgen.runtime.onnx_runner import run_grouped
from machgen.runtime.tensors import as_numpy

# Under a stale layout the ranks hold, for each batch a program ran last, every ring layer's keys and values for
# its next call; a program that has not been called for this long lets them go (an idle model holds no blocks).
STALE_IDLE_S = 30.0


def run_sharded(program: Any, inputs: Mapping[str, Any], plan: ShardPlan, mesh: Any,
                stale: Any = None) -> tuple | None:
    """One call of ``program`` on this rank's share of ``inputs``; on the leader (None on the others) the
    whole outputs, whether the sequence was split and whether its ring attended over stale blocks
    (``stale``: the program's StaleBatches, under a stale layout)."""
    import torch

    from machgen.contract.adapters import ROW_SCALES_INPUT, ROWS_INPUT
    from machgen.parallel.cfg import gather_rows, split_adapter_rows, split_rows
    from machgen.parallel.op import split_sequence
    from machgen.parallel.stale import attending
    from machgen.parallel.usp import gather_sequence, shard_sequence

    tensors = {name: torch.as_tensor(value) for name, value in inputs.items()}
    whole = tensors
    rows = next((tensors[name].shape[0] for name in plan.batched if name in tensors), 1)
    tensors = {name: split_rows(t, mesh.cfg_group) if name in plan.batched else t for name, t in tensors.items()}
    if ROWS_INPUT in tensors:  # per-request adapters: the rows that have them, numbered as this group's rows
        tensors[ROWS_INPUT], tensors[ROW_SCALES_INPUT] = split_adapter_rows(
            tensors[ROWS_INPUT], tensors[ROW_SCALES_INPUT], rows, mesh.cfg_group)
    degree = plan.layout.sequence_degree
    split = degree > 1 and all(t.shape[plan.sequence[name]] % degree == 0
                               for name, t in tensors.items() if name in plan.sequence)
    if plan.marker is not None:  # the program splits its tokens itself, into the marker's length
        tensors[plan.marker] = sequence_marker(degree if split else 1)
    elif split:
        tensors = {name: shard_sequence(t, plan.sequence[name], mesh) if name in plan.sequence else t
                   for name, t in tensors.items()}
    blocks = None
    if stale is not None and not split:
        stale.drop()
    elif stale is not None:
        blocks = stale.begin(tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(whole.items())), whole)
    with split_sequence(split), attending(blocks):
        outputs = program.run(tensors)
    if split and plan.marker is None:
        outputs = {name: gather_sequence(t, plan.sequence[name], mesh) if name in plan.sequence else t
                   for name, t in outputs.items()}
    outputs = {name: gather_rows(t, rows, mesh.cfg_group) if name in plan.batched else t
               for name, t in outputs.items()}
    return (outputs, split, blocks is not None and blocks.reusing) if mesh.rank == 0 else None


def run_split_by_rows(program: Any, inputs: Mapping[str, Any], plan: ShardPlan, mesh: Any) -> tuple | None:
    """run_sharded for a plan over every rank (``ranks="all"``): each rank its band of every split tensor's
    axis (the batch whole), the leader gathering the outputs' bands. A call whose axes the world size does not
    divide, or whose bands would be narrower than the plan's ``min_rows``, runs whole on every rank."""
    import torch
    import torch.distributed as dist

    from machgen.parallel.op import split_sequence

    ranks = plan.layout.world_size
    tensors = {name: torch.as_tensor(value) for name, value in inputs.items()}
    split = ranks > 1 and all(t.shape[plan.sequence[name]] % ranks == 0
                              and t.shape[plan.sequence[name]] // ranks >= plan.min_rows
                              for name, t in tensors.items() if name in plan.sequence)
    if split:
        tensors = {name: t.chunk(ranks, dim=plan.sequence[name])[mesh.rank].contiguous()
                   if name in plan.sequence else t for name, t in tensors.items()}
    with split_sequence(split):
        outputs = program.run(tensors)
    if split:
        for name in [name for name in outputs if name in plan.sequence]:
            band = outputs[name].contiguous()
            bands = [torch.empty_like(band) for _ in range(ranks)] if mesh.rank == 0 else None
            dist.gather(band, bands, dst=0)
            outputs[name] = torch.cat(bands, dim=plan.sequence[name]) if mesh.rank == 0 else None
    return (outputs, split, False) if mesh.rank == 0 else None


def sequence_marker(degree: int):
    """The marker input of a program that splits its tokens itself: its length is the sequence degree."""
    import torch

    return torch.zeros(degree, dtype=torch.int64)


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


def serve_programs(mesh: Any, device: str | None) -> Any:
    """A rank's handler: ("load", folder, plan) loads a component's program (its values first:
    parallel/values_first.py; answers how many attentions send them so), ("run", folder, inputs,
    forget) calls it (inputs as KeptInputs packed them), ("unload", folder) lets it go, ("layout", layout)
    makes the process groups of another layout of as many ranks (the programs stay loaded), ("drop stale",
    folder) lets go of the program's stale blocks and ("stale held", folder) counts the batches it holds."""
    from machgen.parallel.op import set_mesh
    from machgen.parallel.stale import StaleBatches
    from machgen.parallel.values_first import one_call, values_first
    from machgen.runtime.torch_runner import TorchProgram

    set_mesh(mesh)
    if device == "cuda":
        device = f"cuda:{mesh.rank}"
    programs: dict[str, tuple[Any, ShardPlan]] = {}
    kept = RankStore()
    stale: dict[str, StaleBatches] = {}  # a stale layout's blocks of each program's previous calls

    def handle(message: tuple) -> Any:
        nonlocal mesh
        kind, *rest = message
        if kind == "load":
            folder, plan = rest
            program = TorchProgram.load(folder, device=device, rewrite=values_first)
            programs[folder] = (program, ShardPlan.from_json(plan))
            return program.rewritten
        elif kind == "unload":
            programs.pop(rest[0], None)
            if rest[0] in stale:
                stale.pop(rest[0]).drop()
        elif kind == "drop stale":
            if rest[0] in stale:
                stale.pop(rest[0]).drop()
        elif kind == "stale held":
            return stale[rest[0]].held if rest[0] in stale else 0
        elif kind == "layout":
            for blocks in stale.values():
                blocks.drop()
            stale.clear()
            mesh = _remesh(mesh, ParallelLayout.from_json(rest[0]))
            programs.update({folder: (program, dataclasses.replace(plan, layout=mesh.layout))
                             for folder, (program, plan) in programs.items()})
        else:
            folder, payload, forget = rest
            program, plan = programs[folder]
            inputs = kept.unpack(payload, forget)
            with one_call():
                if plan.ranks == "all":
                    return run_split_by_rows(program, inputs, plan, mesh)
                batches = stale.setdefault(folder, StaleBatches(mesh.layout.stale)) if mesh.layout.stale else None
                return run_sharded(program, inputs, plan, mesh, batches)
        return None

    return handle


def _remesh(mesh: Any, layout: ParallelLayout) -> Any:
    """This rank's mesh of ``layout`` (every rank makes its groups in one order), set for the operators;
    the old mesh's groups destroyed."""
    import torch.distributed as dist

    from machgen.parallel.mesh import RankMesh
    from machgen.parallel.op import set_mesh

    for group in {id(group): group for group in mesh.groups.values() if group is not None}.values():
        dist.destroy_process_group(group)
    mesh = RankMesh(layout, mesh.rank)
    set_mesh(mesh)
    return mesh


# (layout, device, threads) -> [pool, users, the inputs its ranks keep]
_POOLS: dict[tuple[ParallelLayout, str | None, int], list] = {}
_POOLS_LOCK = threading.Lock()


class ParallelProgram:
    """A component's program on ``layout``'s ranks. The components of one
    process that run one layout share its ranks (the denoiser's head and
    tail: one rank process per GPU, not two); the last to ``close`` stops them."""

    def __init__(self, folder: str | Path, inputs: Sequence[str], outputs: Sequence[str], plan: ShardPlan,
                 layout: ParallelLayout | None = None, device: str | None = None, threads: int = 1):
        """``layout``: another layout than the plan's (one the build allows); ``device``: "cuda" puts rank r
        on cuda:r (NCCL), else the CPU (gloo)."""
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
        with _POOLS_LOCK:
            if self._key not in _POOLS:
                backend = "nccl" if device == "cuda" else "gloo"
                _POOLS[self._key] = [RankPool(self.layout, "machgen.parallel.program:serve_programs", device,
                                              backend=backend, threads=threads), 0, KeptInputs()]
            _POOLS[self._key][1] += 1
            self.pool, _, self.kept = _POOLS[self._key]
        try:
            # Sequence attentions whose values leave first (every rank rewrites its program alike).
            self.values_first = max(self.pool.call(("load", self.folder, self.plan.to_json())))
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
                outputs, split, stale = self.pool.call(("run", self.folder, payload, forget))[0]
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
                        self.pool.call(("drop stale", self.folder))
                    except RankError:
                        pass  # the ranks are gone, and their blocks with them
                self._watching_idle = False
                return

    def stale_batches_held(self) -> int:
        """How many batches' stale blocks the ranks hold for this program's next calls (0 off a stale layout)."""
        return max(self.pool.call(("stale held", self.folder)))

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
        with _POOLS_LOCK:
            entry = _POOLS.get(self._key)
            if entry is None or entry[0] is not self.pool:
                return
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del _POOLS[self._key]
        if last:
            self.pool.stop()
        elif self.pool.alive():
            self.pool.call(("unload", self.folder))


def move_to_layout(programs: Sequence[Any], layout: ParallelLayout) -> bool:
    """Run ``programs`` (ParallelPrograms, or runners that wrap them) under ``layout`` from now on, in place:
    their rank processes and loaded programs stay, only the process groups are made again (a run comparing
    layouts of one world size loads each program once). False, and nothing changed, where that cannot be:
    another world size, ranks that other programs use too, ranks gone; the caller then opens them anew."""
    programs = [_unwrapped(program) for program in programs]
    if not all(isinstance(program, ParallelProgram) for program in programs):
        return False
    with _POOLS_LOCK:
        pools: dict[int, list[ParallelProgram]] = {}
        for program in programs:
            pools.setdefault(id(program.pool), []).append(program)
        for group in pools.values():
            entry = _POOLS.get(group[0]._key)
            if (entry is None or entry[0] is not group[0].pool or entry[1] != len(group) or not entry[0].alive()
                    or layout.world_size != entry[0].layout.world_size
                    or (layout, *group[0]._key[1:]) in _POOLS and layout != entry[0].layout):
                return False
        for group in pools.values():
            pool, old_key = group[0].pool, group[0]._key
            new_key = (layout, *old_key[1:])
            if pool.layout != layout:
                try:
                    pool.call(("layout", layout.to_json()))
                except RankError:
                    return False  # the pool stopped: closing its programs finds it gone
                pool.layout = layout
                _POOLS[new_key] = _POOLS.pop(old_key)
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
