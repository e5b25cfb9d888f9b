"""ONNX export of one component, and its parity check against torch.

The dynamo exporter is the one that works for these models (the legacy one
fails on ``aten::rms_norm`` and bakes batch sizes in); it must be traced with
batch >= 2, or the batch axis is specialised to 1.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from machgen.builder.registry import ComponentSpec, ExportableComponent

if TYPE_CHECKING:  # pragma: no cover
    from machgen.plugins.schema import SparseAttentionConfig

# Files above this size keep their weights in an external data file (the
# protobuf limit is 2 GiB).
_EXTERNAL_DATA_BYTES = 1 << 30


class ParityError(RuntimeError):
    """The exported ONNX file does not reproduce the torch module."""


@dataclass(frozen=True)
class ParityReport:
    component: str
    max_abs_diff: float  # the worst over all checked input sets
    tolerance: float
    checks: int
    seconds: float


def _dynamic_shapes(spec: ComponentSpec) -> dict:
    from torch.export import Dim

    dims: dict[str, object] = {}
    shapes = {}
    for tensor in spec.inputs:
        axes = {}
        for axis, size in enumerate(tensor.shape):
            if isinstance(size, str):
                if size not in dims:
                    dims[size] = Dim(size, min=1) if size == "batch" else Dim(size)
                axes[axis] = dims[size]
        shapes[tensor.name] = axes
    return shapes


def export_onnx(component: ExportableComponent, path: Path,
                attention: "SparseAttentionConfig | None" = None) -> int:
    """Export ``component`` to ``path`` (ONNX, opset chosen by the exporter).

    With ``attention``, the module is expected to call the SparseAttention
    op (plugins/ops.attention_swapped): each call becomes a
    ``machgen::SparseAttention`` node and the file gets that op's function
    body for ONNX Runtime. Returns the number of such nodes.
    """
    import onnx
    import torch

    from machgen.plugins import ops

    spec = component.spec
    missing = [t.name for t in spec.inputs if t.name not in component.sample_inputs]
    if missing:
        raise ValueError(f"{spec.name}: sample inputs lack {missing}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            component.module,
            args=(),
            kwargs={t.name: component.sample_inputs[t.name] for t in spec.inputs},
            input_names=[t.name for t in spec.inputs],
            output_names=[t.name for t in spec.outputs],
            dynamic_shapes=_dynamic_shapes(spec),
            dynamo=True,
            verbose=False,
            custom_translation_table=ops.onnx_translation() if attention is not None else None,
        )
    size = sum(t.numel() * t.element_size() for t in component.module.state_dict().values())
    if attention is None:
        program.save(os.fspath(path), external_data=size > _EXTERNAL_DATA_BYTES)
        return 0
    model = program.model_proto
    nodes = ops.attach_onnx_function(model, attention)
    onnx.save_model(model, os.fspath(path), save_as_external_data=size > _EXTERNAL_DATA_BYTES,
                    location=path.name + ".data")
    return nodes


def _as_tuple(outputs):
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def check_parity(component: ExportableComponent, path: Path) -> ParityReport:
    """Run the ONNX file under ONNX Runtime and torch on the sample inputs, and
    on their first row alone (a batch size the trace did not see)."""
    import numpy as np
    import torch

    from machgen.ensembles.onnx_runner import OnnxSession

    spec = component.spec
    start = time.perf_counter()
    session = OnnxSession(path)
    full = {t.name: component.sample_inputs[t.name] for t in spec.inputs}
    first_row = {t.name: (full[t.name][:1] if t.batched else full[t.name]) for t in spec.inputs}
    worst = 0.0
    for inputs in (full, first_row):
        with torch.no_grad():
            expected = _as_tuple(component.module(**inputs))
        got = session.run({k: v.numpy() for k, v in inputs.items()})
        for tensor, want in zip(spec.outputs, expected):
            have = got[tensor.name]
            want = want.numpy()
            if have.shape != want.shape:
                raise ParityError(f"{spec.name}.{tensor.name}: ONNX shape {have.shape} != torch {want.shape}")
            diff = float(np.max(np.abs(have.astype(np.float64) - want.astype(np.float64)))) if want.size else 0.0
            worst = max(worst, diff)
    report = ParityReport(spec.name, worst, spec.tolerance, 2, time.perf_counter() - start)
    if not worst <= spec.tolerance:
        raise ParityError(
            f"{spec.name}: ONNX Runtime differs from torch by {worst:.3g} (max abs), above the tolerance "
            f"{spec.tolerance:g}")
    return report
