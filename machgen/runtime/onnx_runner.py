"""ONNX Runtime on the CPU: one session per component, requests run as one batch.

Used by the Triton component models, by the builder's parity check and by the
in-process runner, so all three execute an ONNX file the same way.
"""

from __future__ import annotations

import os
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
        self._session = ort.InferenceSession(os.fspath(path), sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs by name; inputs may be numpy arrays or CPU torch tensors (viewed, not copied)."""
        feed = {name: as_numpy(inputs[name]) for name in self.input_names}
        return dict(zip(self.output_names, self._session.run(self.output_names, feed)))

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
