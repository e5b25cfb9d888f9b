"""A lone request's rows spread over a component's idle instances.

On the CPU every component model has several instances (ServingOptions.
component_instances), each an ONNX Runtime session on one thread: built so
that the calls of concurrent requests run side by side. A request alone,
though, sends each denoiser call to one instance while the others idle; a
video under classifier-free guidance sends two rows a step and left one of
the two cores idle for the whole loop. ``RowSpread`` cuts such a call's
rows into as many parts as there are idle instances and sends the parts at
once; the outputs are joined back in row order. Busy servers are
unaffected: when the denoiser calls in flight already occupy the
instances, a call goes whole, so the dynamic batcher keeps its batches.

A component's rows are independent of each other (the dynamic batcher
already joins different requests' rows into one forward), so the parts'
outputs are the whole call's up to the rounding of a smaller matmul.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping

from machgen.runtime.tensors import concat

Outputs = dict[str, Any]


def spread_parts(rows: int, instances: int, busy: int) -> int:
    """Parts a call of ``rows`` is cut into when ``busy`` calls (or parts)
    occupy ``instances``: one per idle instance, at most one per row, at least one."""
    return max(1, min(rows, instances - busy))


def row_slices(rows: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering ``rows``, sizes differing by at most one."""
    bounds = [rows * part // parts for part in range(parts + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


class RowSpread:
    """Runs calls, each whole or cut over the instances idle at its start (see the module docstring)."""

    def __init__(self, instances: int):
        self.instances = instances
        self._busy = 0
        self._lock = threading.Lock()
        self._parts = ThreadPoolExecutor(max_workers=max(1, instances - 1), thread_name_prefix="spread-part")

    def call(self, run: Callable[[Mapping[str, Any]], Outputs], inputs: Mapping[str, Any],
             whole_cores: bool = False) -> Outputs:
        """``run`` over ``inputs``, cut over the idle instances (``whole_cores``: over all of them, busy or not:
        a call that takes the cores first, the others' processes niced)."""
        if self.instances == 1:
            return run(inputs)
        row_counts = {len(value) for value in inputs.values()}
        rows = row_counts.pop() if len(row_counts) == 1 else 0
        with self._lock:
            parts = spread_parts(rows, self.instances, 0 if whole_cores else self._busy) if rows else 1
            self._busy += parts
        try:
            if parts == 1:
                return run(inputs)
            pieces = [{name: value[rows_of_part] for name, value in inputs.items()}
                      for rows_of_part in row_slices(rows, parts)]
            later = [self._parts.submit(run, piece) for piece in pieces[1:]]
            try:
                first = run(pieces[0])
            finally:
                wait(later)  # the instances stay counted busy until every part is back
            outputs = [first] + [future.result() for future in later]
            return {name: concat([part[name] for part in outputs]) for name in first}
        finally:
            with self._lock:
                self._busy -= parts

    def close(self) -> None:
        self._parts.shutdown(wait=False)
