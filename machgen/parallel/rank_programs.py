"""The rank side of a ``ParallelProgram`` (parallel/program.py): each rank
process holds the component programs loaded on it and handles each message
the parent sends about them (parallel/messages.py), one method per message.

Per call each rank takes its cfg group's rows and its chunk of every token
sequence (the component's ``ShardPlan``), runs the program (whose
``machgen::sequence_attention`` nodes exchange across the sequence ranks),
and the leader (rank 0) answers with the whole outputs gathered. A call
whose sequences the sequence degree does not divide runs them whole on every
rank of a sequence group (the same result, without the speed-up). A
component whose plan splits over every rank (a video decoder's rows of
pixels, parallel/rows.py) gives each rank its band instead, the batch whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from machgen.parallel.kept import RankStore
from machgen.parallel.layout import ParallelLayout, ShardPlan
from machgen.parallel.messages import ChangeLayout, CountStaleHeld, DropStale, Load, Run, Unload
from machgen.parallel.state import attending, one_call, set_mesh, split_sequence


def run_sharded(program: Any, inputs: Mapping[str, Any], plan: ShardPlan, mesh: Any,
                stale: Any = None) -> tuple | None:
    """One call of ``program`` on this rank's share of ``inputs``; on the leader (None on the others) the
    whole outputs, whether the sequence was split and whether its ring attended over stale blocks
    (``stale``: the program's StaleBatches, under a stale layout)."""
    import torch

    from machgen.contract.adapters import ROW_SCALES_INPUT, ROWS_INPUT
    from machgen.parallel.cfg import gather_rows, split_adapter_rows, split_rows
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


class RankPrograms:
    """A rank's handler (a RankPool target): the programs loaded on this rank, by folder, and one method for
    each message (parallel/messages.py)."""

    def __init__(self, mesh: Any, device: str | None):
        set_mesh(mesh)
        self.mesh = mesh
        self.device = f"cuda:{mesh.rank}" if device == "cuda" else device
        self.programs: dict[str, tuple[Any, ShardPlan]] = {}
        self.kept = RankStore()
        self.stale: dict[str, Any] = {}  # a stale layout's StaleBatches of each program's previous calls
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Load: self.load, Run: self.run, Unload: self.unload, DropStale: self.drop_stale,
            CountStaleHeld: self.count_stale_held, ChangeLayout: self.change_layout}

    def __call__(self, message: Any) -> Any:
        return self._handlers[type(message)](message)

    def load(self, message: Load) -> int:
        from machgen.parallel.values_first import values_first

        program = message.load(message.folder, device=self.device, rewrite=values_first)
        self.programs[message.folder] = (program, ShardPlan.from_json(message.plan))
        return program.rewritten

    def run(self, message: Run) -> tuple | None:
        program, plan = self.programs[message.folder]
        inputs = self.kept.unpack(message.inputs, message.forget)
        with one_call():
            if plan.ranks == "all":
                return run_split_by_rows(program, inputs, plan, self.mesh)
            return run_sharded(program, inputs, plan, self.mesh, self._stale_batches(message.folder))

    def _stale_batches(self, folder: str) -> Any:
        """The program's StaleBatches under a stale layout, else None."""
        if not self.mesh.layout.stale:
            return None
        if folder not in self.stale:
            from machgen.parallel.stale import StaleBatches

            self.stale[folder] = StaleBatches(self.mesh.layout.stale)
        return self.stale[folder]

    def unload(self, message: Unload) -> None:
        self.programs.pop(message.folder, None)
        self.drop_stale(DropStale(message.folder))

    def drop_stale(self, message: DropStale) -> None:
        if message.folder in self.stale:
            self.stale.pop(message.folder).drop()

    def count_stale_held(self, message: CountStaleHeld) -> int:
        return self.stale[message.folder].held if message.folder in self.stale else 0

    def change_layout(self, message: ChangeLayout) -> None:
        for blocks in self.stale.values():
            blocks.drop()
        self.stale.clear()
        self.mesh = _remesh(self.mesh, ParallelLayout.from_json(message.layout))
        self.programs = {folder: (program, dataclasses.replace(plan, layout=self.mesh.layout))
                         for folder, (program, plan) in self.programs.items()}


def _remesh(mesh: Any, layout: ParallelLayout) -> Any:
    """This rank's mesh of ``layout`` (every rank makes its groups in one order), set for the operators;
    the old mesh's groups destroyed."""
    import torch.distributed as dist

    from machgen.parallel.mesh import RankMesh

    for group in {id(group): group for group in mesh.groups.values() if group is not None}.values():
        dist.destroy_process_group(group)
    mesh = RankMesh(layout, mesh.rank)
    set_mesh(mesh)
    return mesh
