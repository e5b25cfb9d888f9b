"""ONNX Runtime on the CPU: one session per component, requests run as one batch.

Used by the Triton component models, by the builder's parity check and by the
in-process runner, so all three execute an ONNX file the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Hashable, Mapping, Sequence

import numpy as np


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
        options.intra_op_num_threads = intra_op_threads or len(os.sched_getaffinity(0))
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.path = Path(path)
        self._session = ort.InferenceSession(os.fspath(path), sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {name: inputs[name] for name in self.input_names}
        return dict(zip(self.output_names, self._session.run(self.output_names, feed)))

    def run_batches(self, batches: Sequence[Mapping[str, np.ndarray]],
                    max_rows: int | None = None) -> list[dict[str, np.ndarray]]:
        """Run several requests' inputs, those of equal per-item shapes as one
        forward (at most ``max_rows`` rows each); outputs in request order."""
        keys = [_shape_key(b, self.input_names) for b in batches]
        sizes = [len(b[self.input_names[0]]) for b in batches]
        results: list[dict[str, np.ndarray] | None] = [None] * len(batches)
        for group in group_requests(keys, sizes, max_rows):
            if len(group) == 1:
                results[group[0]] = self.run(batches[group[0]])
                continue
            merged = {n: np.concatenate([batches[i][n] for i in group], axis=0) for n in self.input_names}
            outputs = self.run(merged)
            offsets = np.cumsum([0] + [sizes[i] for i in group])
            for position, index in enumerate(group):
                results[index] = {n: v[offsets[position]:offsets[position + 1]] for n, v in outputs.items()}
        return results


def _shape_key(inputs: Mapping[str, np.ndarray], names: Sequence[str]) -> tuple:
    return tuple((inputs[n].dtype.str, inputs[n].shape[1:]) for n in names)


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


class InSamplerComponents:
    """The components a pipeline runs in the sampler's own process (their
    ``pipeline.json`` entry names an ``onnx`` file under the sampler's folder
    instead of a Triton model). One single-threaded session each: they are
    tiny, and the sampler shares the cores with the served components."""

    def __init__(self, components: Mapping[str, Mapping], sampler_dir: str | os.PathLike):
        self._sessions = {name: OnnxSession(Path(sampler_dir) / entry["onnx"], intra_op_threads=1)
                          for name, entry in components.items() if "onnx" in entry}

    def __contains__(self, component: str) -> bool:
        return component in self._sessions

    def run(self, component: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._sessions[component].run(inputs)
