"""What a ``ParallelProgram`` says to its ranks (parallel/program.py), one
frozen dataclass per message, each handled by one method of the ranks'
``RankPrograms`` (parallel/rank_programs.py). Every rank gets every message,
in one order. Plain data: they travel pickled through the ranks' pipes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Load:
    """Load the program of a component folder and keep it under its folder; answers in how many attentions its
    values leave first (parallel/values_first.py)."""

    folder: str
    plan: Mapping[str, Any]  # its ShardPlan, as JSON
    # The runtime's loader of a torch-target program, ``load(folder, device=, rewrite=)`` (TorchProgram.load):
    # given by the runtime, which opens components, so that parallel imports none of its runners.
    load: Callable[..., Any]


@dataclass(frozen=True)
class Run:
    """Call a loaded program; the leader answers (outputs, whether the call was split, whether its ring
    attended over stale blocks), the others None."""

    folder: str
    inputs: Mapping[str, Any]  # as KeptInputs packed them (parallel/kept.py)
    forget: list[bytes] | None  # the keys the ranks let go of first (None: every one)


@dataclass(frozen=True)
class Unload:
    """Let a program go, and its stale blocks."""

    folder: str


@dataclass(frozen=True)
class DropStale:
    """Let go of a program's stale blocks (a stale layout's, once the program is idle)."""

    folder: str


@dataclass(frozen=True)
class CountStaleHeld:
    """How many batches' stale blocks the rank holds for a program's next calls."""

    folder: str


@dataclass(frozen=True)
class ChangeLayout:
    """Make the process groups of another layout of as many ranks; the programs stay loaded."""

    layout: Mapping[str, Any]  # a ParallelLayout, as JSON
