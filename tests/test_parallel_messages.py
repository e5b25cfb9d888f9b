"""The ranks' side of a parallel program without rank processes: the typed messages each handled by one method
of RankPrograms (on a one-rank mesh, in this process), and the per-call parallel state of parallel/state.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from machgen.parallel import messages, state
from machgen.parallel.layout import ParallelLayout, ShardPlan
from machgen.parallel.messages import ChangeLayout, CountStaleHeld, DropStale, Load, Run, Unload


@pytest.fixture(autouse=True)
def no_mesh_left():
    yield
    state.set_mesh(None)


class Doubling:
    """A loaded program that doubles its input, and what it was loaded with."""

    input_names, output_names = ["x"], ["y"]

    def __init__(self, folder, device, rewrite):
        self.folder, self.device, self.rewrite = folder, device, rewrite
        self.rewritten = 3  # attentions whose values leave first, as values_first would count them
        self.calls = []

    def run(self, inputs):
        self.calls.append(state.split_mesh())
        return {"y": inputs["x"] * 2}


def one_rank(device=None):
    from machgen.parallel.mesh import RankMesh
    from machgen.parallel.rank_programs import RankPrograms

    return RankPrograms(RankMesh(ParallelLayout(), 0), device)


PLAN = ShardPlan(ParallelLayout(), ("x", "y"), {}).to_json()


def test_every_message_has_one_handler_and_another_kind_is_refused():
    ranks = one_rank()
    kinds = [value for value in vars(messages).values()
             if dataclasses.is_dataclass(value) and value.__module__ == messages.__name__]
    assert sorted(kind.__name__ for kind in kinds) == sorted(kind.__name__ for kind in ranks._handlers)
    assert all(dataclasses.fields(kind) and kind.__dataclass_params__.frozen for kind in kinds)
    with pytest.raises(KeyError):
        ranks(("run", "folder", {}, []))  # the old string-tagged tuple is no message


def test_a_program_is_loaded_by_the_runtimes_loader_run_counted_and_unloaded():
    from machgen.parallel.values_first import values_first

    ranks = one_rank(device="cpu")
    assert ranks(Load("/models/a", PLAN, Doubling)) == 3
    program, plan = ranks.programs["/models/a"]
    assert (program.folder, program.device, program.rewrite) == ("/models/a", "cpu", values_first)
    assert plan == ShardPlan.from_json(PLAN)
    outputs, split, stale = ranks(Run("/models/a", {"x": np.arange(4.0).reshape(2, 2)}, []))
    assert np.array_equal(outputs["y"], np.arange(4.0).reshape(2, 2) * 2) and (split, stale) == (False, False)
    assert program.calls == [None]  # one rank: nothing split
    assert ranks(CountStaleHeld("/models/a")) == 0 and ranks(DropStale("/models/a")) is None
    assert ranks(Unload("/models/a")) is None and "/models/a" not in ranks.programs
    with pytest.raises(KeyError):
        ranks(Run("/models/a", {"x": np.zeros((1, 2))}, []))


def test_a_cuda_rank_loads_on_its_own_gpu():
    from machgen.parallel.mesh import RankMesh
    from machgen.parallel.rank_programs import RankPrograms

    ranks = RankPrograms(RankMesh(ParallelLayout(), 0), "cuda")
    ranks(Load("/models/a", PLAN, Doubling))
    assert ranks.programs["/models/a"][0].device == "cuda:0"


def test_another_layout_keeps_the_programs_under_it():
    ranks = one_rank()
    ranks(Load("/models/a", PLAN, Doubling))
    program = ranks.programs["/models/a"][0]
    ranks(ChangeLayout(ParallelLayout().to_json()))
    assert ranks.programs["/models/a"][0] is program
    assert state.current_mesh() is ranks.mesh and ranks.programs["/models/a"][1].layout == ranks.mesh.layout


def test_a_call_is_split_only_inside_split_sequence_and_on_a_mesh_of_several_ranks():
    sequence = SimpleNamespace(layout=ParallelLayout(ring=2), rank=0)
    assert state.split_mesh() is None
    state.set_mesh(sequence)
    assert state.split_mesh() is None  # no call split
    with state.split_sequence(True):
        assert state.split_mesh() is sequence and state.split_mesh(all_ranks=True) is sequence
        with state.split_sequence(False):
            assert state.split_mesh() is None
        assert state.split_mesh() is sequence
    state.set_mesh(SimpleNamespace(layout=ParallelLayout(cfg=2), rank=0))
    with state.split_sequence(True):
        assert state.split_mesh() is None and state.split_mesh(all_ranks=True) is not None


def test_stale_blocks_are_the_calls_own_and_restored_after_it():
    outer, inner = object(), object()
    assert state.stale_blocks() is None
    with state.attending(outer):
        with state.attending(inner):
            assert state.stale_blocks() is inner
        assert state.stale_blocks() is outer
    assert state.stale_blocks() is None


def test_values_in_flight_are_taken_by_ticket_and_dropped_when_the_call_ends():
    with state.one_call():
        first, second = state.hold_values(["v1"]), state.hold_values(["v2"])
        assert first != second and state.values_in_flight() == 2
        assert state.take_values(first) == ["v1"] and state.values_in_flight() == 1
    assert state.values_in_flight() == 0
