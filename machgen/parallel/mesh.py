"""Which rank does what under a layout, and the process groups of each axis.

Ranks are numbered cfg-major, then ring, then Ulysses (layout.py says why).
A rank's ``sequence_rank`` (``ring_rank * ulysses + ulysses_rank``) is the
chunk of the token sequence it holds. Every rank creates every group, in one
order: torch.distributed requires it of ``new_group``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from machgen.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Coordinates:
    """One rank's place in a layout."""

    cfg: int
    ring: int
    ulysses: int

    def sequence_rank(self, layout: ParallelLayout) -> int:
        return self.ring * layout.ulysses + self.ulysses


def coordinates(rank: int, layout: ParallelLayout) -> Coordinates:
    cfg, sequence = divmod(rank, layout.sequence_degree)
    ring, ulysses = divmod(sequence, layout.ulysses)
    return Coordinates(cfg, ring, ulysses)


def global_rank(place: Coordinates, layout: ParallelLayout) -> int:
    return place.cfg * layout.sequence_degree + place.sequence_rank(layout)


def axis_groups(layout: ParallelLayout, axis: str) -> list[list[int]]:
    """The global ranks of every group along ``axis`` (cfg, ring, ulysses or sequence)."""
    shape = {"cfg": range(layout.cfg), "ring": range(layout.ring), "ulysses": range(layout.ulysses)}
    varying = ("ring", "ulysses") if axis == "sequence" else (axis,)
    fixed = [name for name in shape if name not in varying]
    groups = []
    for kept in itertools.product(*(shape[name] for name in fixed)):
        members = []
        for moving in itertools.product(*(shape[name] for name in varying)):
            place = dict(zip(fixed, kept)) | dict(zip(varying, moving))
            members.append(global_rank(Coordinates(**place), layout))
        groups.append(sorted(members))
    return groups


class RankMesh:
    """This rank's coordinates and its groups (None where an axis has degree 1).

    Built after ``torch.distributed.init_process_group`` by every rank; with
    one rank, no process group is needed (every group is None).
    """

    def __init__(self, layout: ParallelLayout, rank: int = 0):
        self.layout = layout
        self.rank = rank
        self.place = coordinates(rank, layout)
        self.sequence_rank = self.place.sequence_rank(layout)
        self.groups: dict[str, Any] = {"cfg": None, "ring": None, "ulysses": None, "sequence": None}
        if layout.is_single:
            return
        import torch.distributed as dist

        for axis in self.groups:
            if axis != "sequence" and getattr(layout, axis) == 1:
                continue
            if axis == "sequence" and layout.sequence_degree == 1:
                continue
            for members in axis_groups(layout, axis):
                group = dist.new_group(members)
                if rank in members:
                    self.groups[axis] = group

    @property
    def cfg_group(self):
        return self.groups["cfg"]

    @property
    def ring_group(self):
        return self.groups["ring"]

    @property
    def ulysses_group(self):
        return self.groups["ulysses"]

    @property
    def sequence_group(self):
        return self.groups["sequence"]
