"""A lone request's rows cut over a component's idle instances (runtime/spread.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from machgen.runtime.spread import RowSpread, row_slices, spread_parts


@pytest.mark.parametrize("rows, instances, busy, parts", [
    (2, 2, 0, 2),   # a guided request alone: one row per instance
    (2, 2, 1, 1),   # another call holds an instance: whole
    (2, 2, 2, 1),   # all busy (or more calls than instances): whole, the batcher queues it
    (2, 2, 5, 1),
    (1, 2, 0, 1),   # one row cannot be cut
    (5, 4, 0, 4),
    (3, 8, 2, 3),   # no more parts than rows
    (4, 1, 0, 1),   # one instance: nothing to spread over
])
def test_a_call_is_cut_into_one_part_per_idle_instance(rows, instances, busy, parts):
    assert spread_parts(rows, instances, busy) == parts


@pytest.mark.parametrize("rows, parts", [(2, 2), (5, 2), (7, 3), (4, 4), (3, 1)])
def test_row_slices_cover_every_row_once_in_order_sizes_within_one(rows, parts):
    slices = row_slices(rows, parts)
    covered = [row for part in slices for row in range(rows)[part]]
    assert covered == list(range(rows))
    sizes = [part.stop - part.start for part in slices]
    assert len(sizes) == parts and max(sizes) - min(sizes) <= 1


class Instances:
    """A component of ``count`` instances: each call holds one for ``seconds`` and answers per row."""

    def __init__(self, seconds: float = 0.05, together: int = 1):
        self.seconds = seconds
        # With together > 1, each call waits (5 s at most) until that many run at once: it fails unless they do.
        self.together = threading.Barrier(together, timeout=5) if together > 1 else None
        self.lock = threading.Lock()
        self.running = 0
        self.most_running = 0
        self.calls: list[int] = []

    def run(self, inputs):
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.calls.append(len(inputs["x"]))
        if self.together is not None:
            self.together.wait()
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        if (inputs["x"] < 0).any():
            raise RuntimeError("negative row")
        return {"y": inputs["x"] * 2 + inputs["bias"], "total": inputs["x"].sum(axis=1, keepdims=True)}


def rows_of(count: int, start: float = 0.0) -> dict:
    x = np.arange(count * 3, dtype=np.float32).reshape(count, 3) + start
    return {"x": x, "bias": np.full((count, 1), 0.5, dtype=np.float32)}


def test_a_lone_call_runs_its_parts_at_once_and_answers_the_whole_calls_outputs():
    component, spread = Instances(together=2), RowSpread(2)
    inputs = rows_of(2)
    outputs = spread.call(component.run, inputs)
    assert component.calls == [1, 1] and component.most_running == 2
    component.together = None
    whole = component.run(inputs)
    for name in whole:
        np.testing.assert_array_equal(outputs[name], whole[name])
    spread.close()


def test_calls_that_find_the_instances_busy_go_whole():
    component, spread = Instances(seconds=0.2), RowSpread(2)
    first = threading.Thread(target=spread.call, args=(component.run, rows_of(2)))
    first.start()
    deadline = time.monotonic() + 5
    while component.running < 2 and time.monotonic() < deadline:  # the first call's two parts hold both instances
        time.sleep(0.005)
    outputs = spread.call(component.run, rows_of(4, start=10))
    first.join()
    assert sorted(component.calls) == [1, 1, 4]
    np.testing.assert_array_equal(outputs["y"], rows_of(4, start=10)["x"] * 2 + 0.5)
    # Both gone: a new lone call is cut again.
    component.calls.clear()
    spread.call(component.run, rows_of(3))
    assert sorted(component.calls) == [1, 2]
    spread.close()


def test_a_part_that_fails_fails_the_call_and_frees_its_instances():
    component, spread = Instances(), RowSpread(2)
    inputs = rows_of(2)
    inputs["x"][1] = -1  # the second part's row
    with pytest.raises(RuntimeError, match="negative row"):
        spread.call(component.run, inputs)
    assert component.running == 0
    component.calls.clear()
    spread.call(component.run, rows_of(2))
    assert component.calls == [1, 1]  # nothing left counted busy
    spread.close()


def test_inputs_whose_rows_disagree_go_whole():
    component, spread = Instances(), RowSpread(2)
    inputs = {"x": rows_of(2)["x"], "bias": np.zeros((1, 1), dtype=np.float32)}
    spread.call(component.run, inputs)
    assert component.calls == [2]
    spread.close()


def test_the_build_spreads_over_cpu_instances_only_where_calls_go_straight_to_them():
    from machgen.builder.repository import ServingOptions, TargetServing, spread_instances

    assert spread_instances(ServingOptions(), TargetServing()) == 2
    assert spread_instances(ServingOptions(component_instances=3), TargetServing()) == 3
    assert spread_instances(ServingOptions(component_instances=3), TargetServing(target="torch")) == 1  # all cores each
    assert spread_instances(ServingOptions(spread_rows=False), TargetServing()) == 1
    # A queue delay gathers the parts back into one forward.
    assert spread_instances(ServingOptions(step_queue_delay_us=500), TargetServing()) == 1
    assert spread_instances(ServingOptions(), TargetServing(target="torch", torch_device="cuda")) == 1
    assert spread_instances(ServingOptions(), TargetServing(target="torch", parallel={"ulysses": 2},
                                                            parallel_components=("denoiser_tail",))) == 1
