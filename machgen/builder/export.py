"""Export of one component (ONNX, or a torch.export program for the
``torch`` target), and its parity check against the torch module.

The dynamo exporter is the one that works for every component: torch.export
proves each named axis symbolic (traced with batch >= 2, or the batch axis is
specialised to 1). The torch target uses the same trace, saved as a program
instead of converted. The TorchScript-based exporter is tens of times faster
(perf/RESULTS.md, "ONNX export"), but a trace can bake in a value it read
from a tensor; ``MACHGEN_ONNX_EXPORTER=torchscript`` (the test suite's
setting) takes it where it traced without doing so and reproduces torch,
and the dynamo exporter everywhere else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from machgen.builder.family_export import ExportableComponent
from machgen.contract.adapters import RANK_AXIS, ROWS_AXIS
from machgen.contract.specs import ComponentSpec

if TYPE_CHECKING:  # pragma: no cover
    from machgen.plugins.schema import SparseAttentionConfig

# Files above this size keep their weights in an external data file (the
# protobuf limit is 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30
ONNX_EXPORTER_ENV = "MACHGEN_ONNX_EXPORTER"
ONNX_EXPORTERS = ("dynamo", "torchscript")
# Axes that are empty in some calls (a denoiser call without adapters: no rows, a bank of rank 0), which no
# sample shows: the TorchScript exporter's file is also checked with them empty (its reshapes of an empty tensor
# can fail where torch's do not: seen, Flux's adapted denoiser).
_EMPTY_AXES = (ROWS_AXIS, RANK_AXIS)


def onnx_exporter(setting: str | None = None) -> str:
    """The ONNX exporter a build uses: ``setting``, else $MACHGEN_ONNX_EXPORTER, else dynamo."""
    chosen = setting or os.environ.get(ONNX_EXPORTER_ENV) or "dynamo"
    if chosen not in ONNX_EXPORTERS:
        raise ValueError(f"ONNX exporter {chosen!r} is not one of {', '.join(ONNX_EXPORTERS)}")
    return chosen


class ParityError(RuntimeError):
    """The exported ONNX file does not reproduce the torch module."""


@dataclass(frozen=True)
class ParityReport:
    component: str
    max_abs_diff: float  # the worst over all checked input sets
    tolerance: float
    checks: int
    seconds: float


def _dynamic_shapes(spec: ComponentSpec, inferred: bool = False) -> dict:
    """Every named axis dynamic: one ``Dim`` per name, or with ``inferred``
    ``Dim.DYNAMIC`` everywhere, letting torch.export find the ranges and
    equalities itself (it refuses declared ranges that a model's guards
    narrow, such as a VAE's batch limit)."""
    from torch.export import Dim

    dims: dict[str, object] = {}
    shapes = {}
    for tensor in spec.inputs:
        axes = {}
        for axis, size in enumerate(tensor.shape):
            if isinstance(size, str):
                if size not in dims:
                    dims[size] = Dim.DYNAMIC if inferred else Dim(size, min=1) if size == "batch" else Dim(size)
                axes[axis] = dims[size]
        shapes[tensor.name] = axes
    return shapes


def trace(component: ExportableComponent, dtype: str = "float32", device: str = "cpu"):
    """``component`` (its module already in ``dtype`` on ``device``) traced
    with torch.export on its sample inputs, every named axis dynamic: what
    the ``torch`` target saves and what the ONNX export converts.

    Every axis is Dim.DYNAMIC: named ranges fail where a model's guards
    narrow them (the VAE's batch <= 63). The inputs are made contiguous, as
    the torch target's inputs always are (TorchProgram.prepare): a sample
    that is a view (one part's output sliced) would leave a guard on its
    strides that a gathered or copied input fails."""
    import torch

    spec = component.spec
    missing = [t.name for t in spec.inputs if t.name not in component.sample_inputs]
    if missing:
        raise ValueError(f"{spec.name}: sample inputs lack {missing}")
    inputs = {t.name: _to_program(component.sample_inputs[t.name], dtype, device).contiguous() for t in spec.inputs}
    with _tracing():
        return torch.export.export(component.module, args=(), kwargs=inputs,
                                   dynamic_shapes=_dynamic_shapes(spec, inferred=True))


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    """Quiet, without autograd, and without the fake-tensor cache: with every axis symbolic, a cache hit
    rebuilds its output's symbolic sizes and strides, which cost more than the meta kernel it saves (a tiny
    Wan's chunked VAE decoder exported in 17.6 s against 19.8, its denoiser tail 5.6 against 6.9)."""
    import torch
    import torch._dynamo.config

    with warnings.catch_warnings(), torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        warnings.simplefilter("ignore")
        yield


@dataclass(frozen=True)
class OnnxExport:
    """What ``export_onnx`` wrote: the exporter whose file it is ("torchscript" or "dynamo") and the number of
    ``machgen::SparseAttention`` nodes in it."""

    exporter: str
    sparse_attention_nodes: int = 0


def export_onnx(component: ExportableComponent, path: Path,
                attention: "SparseAttentionConfig | None" = None, exporter: str | None = None) -> OnnxExport:
    """Export ``component`` to ``path`` (ONNX, opset chosen by the exporter):
    its ``trace`` in float32 on the CPU, converted; with ``exporter``
    torchscript (``onnx_exporter``), the TorchScript exporter's file where it
    applies (``export_torchscript``).

    With ``attention``, the module is expected to call the SparseAttention
    op (plugins/ops.attention_swapped): each call becomes a
    ``machgen::SparseAttention`` node and the file gets that op's function
    body for ONNX Runtime.
    """
    import onnx
    import torch

    from machgen.plugins import ops

    # The TorchScript exporter has no translation of the SparseAttention op: a module calling it falls through.
    if onnx_exporter(exporter) == "torchscript" and export_torchscript(component, path):
        return OnnxExport("torchscript")
    spec = component.spec
    # torch.export first, then the conversion of its program: the exporter's own trace leaves some shapes
    # unproved that torch.export proves (LTX's attention mask view: (b*h*t)//(b*h*t)).
    exported = trace(component)
    path.parent.mkdir(parents=True, exist_ok=True)
    kwargs = {t.name: component.sample_inputs[t.name] for t in spec.inputs}
    with _tracing(), _without_slices_split(), _torchlib_registry_once():
        program = torch.onnx.export(
            exported,
            args=(),
            kwargs=kwargs,
            input_names=[t.name for t in spec.inputs],
            output_names=[t.name for t in spec.outputs],
            dynamo=True,
            verbose=False,
            custom_translation_table={**_squeeze_translations(), **_slice_scatter_translations(),
                                      **(ops.onnx_translation() if attention is not None else {})},
        )
    size = sum(t.numel() * t.element_size() for t in component.module.state_dict().values())
    model = program.model_proto
    _name_axes(model, spec)
    nodes = ops.attach_onnx_function(model, attention) if attention is not None else 0
    onnx.save_model(model, os.fspath(path), save_as_external_data=size > EXTERNAL_DATA_BYTES,
                    location=path.name + ".data")
    return OnnxExport("dynamo", nodes)


def export_torchscript(component: ExportableComponent, path: Path) -> bool:
    """Export ``component`` to ``path`` with the TorchScript-based exporter,
    every named axis dynamic; False (the file then meaningless) where it does
    not apply: the exporter fails (an op it cannot translate: the
    SparseAttention op, say), the trace read a value out of a tensor (a
    TracerWarning other than a condition's: that value is then a constant of
    the file), or the file differs from torch on the parity check's inputs
    (``check_parity``, which the build runs again), on them at other sizes
    (``_at_other_sizes``) or with the axes that can be empty empty
    (``_with_empty_axes``). A trace can fix a size silently, without a
    warning (before builder/torchscript_translations.py, Wan's and Flux's
    denoisers fixed the batch, which the first row alone showed). Unlike
    torch.export's, nothing proves the other sizes right: hence dynamo by
    default.

    ``component.torchscript_context`` is entered around the trace (not the
    checks, which run the module as it is)."""
    import onnx
    import torch
    from torch.onnx import _constants
    from torch.onnx._internal.exporter import _constants as dynamo_constants

    from machgen.builder import torchscript_translations

    spec = component.spec
    if sum(t.numel() * t.element_size() for t in component.module.state_dict().values()) > EXTERNAL_DATA_BYTES:
        return False  # kept for the dynamo path, which writes the weights to an external data file
    torchscript_translations.register()
    names = [t.name for t in spec.inputs]
    # Positional, in the spec's order: the exporter orders keyword inputs by the forward's signature.
    module = _positional(component.module, names)
    inputs = tuple(component.sample_inputs[name] for name in names)
    dynamic_axes = {t.name: {axis: size for axis, size in enumerate(t.shape) if isinstance(size, str)}
                    for t in spec.inputs + spec.outputs}
    path.parent.mkdir(parents=True, exist_ok=True)
    traced_under = component.torchscript_context or contextlib.nullcontext
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), traced_under():
        warnings.simplefilter("always")
        try:
            torch.onnx.export(module, inputs, os.fspath(path), dynamo=False, input_names=names,
                              output_names=[t.name for t in spec.outputs], dynamic_axes=dynamic_axes,
                              opset_version=_constants.ONNX_DEFAULT_OPSET)
        except Exception:  # noqa: BLE001 (whatever it cannot export, the dynamo exporter does)
            return False
    if any(issubclass(warning.category, torch.jit.TracerWarning) and not _branch_taken(warning)
           for warning in caught):
        return False
    # The opset and IR version of the dynamo exporter's files: a denoiser's head and tail, one file of each
    # exporter, can then be joined (builder/chain.py).
    model = onnx.load(os.fspath(path))
    model.ir_version = dynamo_constants.ONNX_IR_VERSION
    onnx.save_model(model, os.fspath(path))
    checked = [component, _at_other_sizes(component)]
    if any(size in _EMPTY_AXES for t in spec.inputs for size in t.shape):
        checked.append(_with_empty_axes(component))
    try:
        for sample in checked:
            check_parity(sample, path)
    except Exception:  # noqa: BLE001 (ParityError, ONNX Runtime refusing the file, torch refusing the sizes)
        return False
    return True


def _at_other_sizes(component: ExportableComponent) -> ExportableComponent:
    """``component`` with its sample inputs twice as long along every named axis but the batch (the first row
    checks that one), or as many times as its ``axis_growth`` says, each tiled: the values stay in their
    domains (token ids, positions)."""
    import torch

    inputs = {}
    for tensor in component.spec.inputs:
        value = component.sample_inputs[tensor.name]
        for axis, size in enumerate(tensor.shape):
            if isinstance(size, str) and size != "batch":
                value = torch.cat([value] * component.axis_growth.get(size, 2), dim=axis)
        inputs[tensor.name] = value
    return replace(component, sample_inputs=inputs)


def _with_empty_axes(component: ExportableComponent) -> ExportableComponent:
    """``component`` with its sample inputs cut to nothing along the axes that can be empty (``_EMPTY_AXES``: the
    adapter bank of a call without adapters)."""
    inputs = {}
    for tensor in component.spec.inputs:
        value = component.sample_inputs[tensor.name]
        for axis, size in enumerate(tensor.shape):
            if size in _EMPTY_AXES:
                value = value.narrow(axis, 0, 0)
        inputs[tensor.name] = value
    return replace(component, sample_inputs=inputs, first_row=None)


def _branch_taken(warning) -> bool:
    """Whether a TracerWarning is of a condition (a size compared in an ``if`` or ``assert``): the branch taken
    is in the file, and the parity check runs it; a value read out of a tensor (a size as a Python number, a
    tensor made of one) would be a constant of the file that the check could not tell from a size's."""
    return str(warning.message).startswith("Converting a tensor to a Python boolean")


def _positional(module, names: list[str]):
    """``module`` taking its inputs positionally, in ``names``' order, in its mode: the exporter puts the
    module it is given back in that one's mode afterwards, every submodule with it (a new module is in
    training mode: the component's dropouts were on after an export)."""
    import torch

    class Positional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = module

        def forward(self, *inputs):
            return self.module(**dict(zip(names, inputs)))

    return Positional().train(module.training)


def _register_torchscript_translations() -> None:
    """builder/torchscript_translations.register (perf/bench_export.py calls it by this name)."""
    from machgen.builder import torchscript_translations

    torchscript_translations.register()


_TORCHLIB_REGISTRIES: dict = {}


@contextlib.contextmanager
def _torchlib_registry_once() -> Iterator[None]:
    """The exporter's registry of torchlib's translations made once per process, not once per export: the
    exporter builds it anew each time (0.8 s of every export here, a tenth of a tiny denoiser's), and each
    export gets a copy of its lists, which it may add its custom translations to."""
    from torch.onnx._internal.exporter import _registration

    registry_class = _registration.ONNXRegistry
    build = registry_class.from_torchlib
    original = registry_class.__dict__["from_torchlib"]

    def from_torchlib(opset_version=_registration._constants.TORCHLIB_OPSET):
        built = _TORCHLIB_REGISTRIES.get(opset_version)
        if built is None:
            built = _TORCHLIB_REGISTRIES[opset_version] = build(opset_version=opset_version)
        registry = registry_class()
        registry._opset_version = built._opset_version
        registry.functions = {target: list(translations) for target, translations in built.functions.items()}
        return registry

    registry_class.from_torchlib = staticmethod(from_torchlib)
    try:
        yield
    finally:
        registry_class.from_torchlib = original


@contextlib.contextmanager
def _without_slices_split() -> Iterator[None]:
    """The exporter's optimizer without its SlicesSplit rewrite (two Slices
    of one tensor's last axis at its halves -> Split). Its two-node pattern
    is matched against every pair of Slices: measured, 3.8 s of a 17 s
    export of LTX-2's denoiser head, two thirds of all rewriting, and it
    rewrote nothing in any component of the six families (onnxscript 0.7.2).
    Where it would apply, the file keeps the two Slices."""
    from onnxscript import rewriter
    from onnxscript.rewriter.rules.common import _basic_rules

    rules = rewriter._DEFAULT_REWRITE_RULES
    rewriter._DEFAULT_REWRITE_RULES = tuple(rule for rule in rules if rule is not _basic_rules.slice_split_rule)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def _squeeze_translations() -> dict:
    """aten.squeeze.dim as torch means it: onnxscript 0.7.2 writes a Squeeze
    even where the axis is not 1 (torch then leaves the tensor as it is), and
    ONNX Runtime refuses such a file (LTX-2's transformer: ``gate.squeeze(2)``
    on [batch, tokens, dim])."""
    import torch
    from onnxscript import opset18 as op

    def squeeze_dim(self, dim: int):
        shape = self.shape
        if shape is not None and (len(shape) == 0 or (isinstance(shape[dim], int) and shape[dim] != 1)):
            return op.Identity(self)
        return op.Squeeze(self, op.Constant(value_ints=[dim]))

    return {torch.ops.aten.squeeze.dim: squeeze_dim}


def _slice_scatter_translations() -> dict:
    """aten.slice_scatter into every other element of the last axis (Wan's
    rotary embedding writes ``out[..., 0::2]`` and then ``out[..., 1::2]``)
    as the axis cut into pairs, one of each pair replaced, joined back: the
    same values. Where the odd write follows an even one, the pairs are the
    two writes' values (the even write's nodes are then unused and dropped).
    onnxscript 0.7.2 writes any slice_scatter as a ScatterND with the axis
    transposed to the front and back, three transposes of [batch, tokens,
    heads, head_dim] per write: a quarter of Wan's tail forward on the CPU.
    Other slice_scatters keep onnxscript's translation."""
    import torch
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.core import aten_slice_scatter

    evens_written: dict[int, tuple] = {}  # id of an even write's output -> (that output, the values written)

    def slice_scatter(self, src, dim: int = 0, start=None, end=None, step=1):
        rank = None if self.shape is None else len(self.shape)
        last = self.shape[rank - 1] if rank else None
        if (not rank or dim not in (-1, rank - 1) or step != 2 or start not in (0, 1) or not isinstance(last, int)
                or last % 2 or (end is not None and not (isinstance(end, int) and end >= last))):
            return aten_slice_scatter(self, src, dim, start, end, step)
        written = op.Unsqueeze(src, op.Constant(value_ints=[-1]))
        if start == 1 and id(self) in evens_written:
            pair = (op.Unsqueeze(evens_written[id(self)][1], op.Constant(value_ints=[-1])), written)
        else:
            pairs = op.Reshape(self, op.Constant(value_ints=[0] * (rank - 1) + [-1, 2]))
            kept = op.Split(pairs, axis=-1, num_outputs=2)[1 - start]
            pair = (written, kept) if start == 0 else (kept, written)
        result = op.Reshape(op.Concat(*pair, axis=-1), op.Constant(value_ints=[0] * (rank - 1) + [-1]))
        if start == 0:
            evens_written[id(result)] = (result, src)
        return result

    return {torch.ops.aten.slice_scatter.default: slice_scatter}


def _name_axes(model, spec: ComponentSpec) -> None:
    """The spec's axis names on the graph's inputs and outputs (a converted
    program names them after its symbols: s0, s1, ...); an axis the trace
    fixed to one size is refused."""
    tensors = {t.name: t for t in spec.inputs + spec.outputs}
    for value in list(model.graph.input) + list(model.graph.output):
        if value.name not in tensors:
            continue
        for dim, size in zip(value.type.tensor_type.shape.dim, tensors[value.name].shape):
            if not isinstance(size, str):
                continue
            if dim.HasField("dim_value"):
                raise ValueError(f"{spec.name}.{value.name}: the trace fixed axis '{size}' to {dim.dim_value}")
            dim.dim_param = size


def trace_torch(component: ExportableComponent, dtype: str, device: str, cuda_graphs: bool = True,
                compile: bool = False):
    """(program, TorchComponentInfo) of ``component``: its ``trace`` in
    ``dtype`` on ``device``."""
    from machgen.runtime.torch_runner import TorchComponentInfo

    spec = component.spec
    program = trace(component, dtype, device)
    weight_bytes = sum(t.numel() * t.element_size() for t in component.module.state_dict().values())
    info = TorchComponentInfo(inputs=tuple(t.name for t in spec.inputs), outputs=tuple(t.name for t in spec.outputs),
                              dtype=dtype, device=device, weight_bytes=weight_bytes, cuda_graphs=cuda_graphs,
                              compile=compile)
    return program, info


def export_torch(component: ExportableComponent, folder: Path, dtype: str, device: str, cuda_graphs: bool = True,
                 compile: bool = False) -> int:
    """The ``torch`` target: ``trace_torch``, saved to ``folder`` (model.pt2
    and component.json, which also says how it runs: ``cuda_graphs``,
    ``compile``). Returns the number of SparseAttention calls in the program."""
    import torch

    from machgen.runtime.torch_runner import INFO_FILE, PROGRAM_FILE

    program, info = trace_torch(component, dtype, device, cuda_graphs, compile)
    folder.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, os.fspath(folder / PROGRAM_FILE))
    (folder / INFO_FILE).write_text(info.to_json())
    # A parallel build's sparse calls are machgen::sequence_sparse_attention (the exchange, then the op).
    return sum(1 for node in program.graph.nodes if node.op == "call_function"
               and str(node.target).startswith(("machgen.sparse_attention.", "machgen.sequence_sparse_attention.")))


def _to_program(value, dtype: str, device: str):
    import torch

    value = value.to(device)
    return value.to(getattr(torch, dtype)) if value.is_floating_point() else value


def _as_tuple(outputs):
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def check_parity(component: ExportableComponent, path: Path, dtype: str = "float32",
                 device: str = "cpu", relative_tolerance: float = 0.0) -> ParityReport:
    """Run the exported file (ONNX under ONNX Runtime, or the torch target's
    program) and the torch module on the sample inputs, and on their first
    row alone (a batch size the trace did not see).

    The module runs in ``dtype`` on ``device``, as the program was traced; in
    a dtype other than float32 the tolerance is relative (1 % of the largest
    output): the program and the module round the same computation. A file
    in a lower precision than the module (int8 layers) is held to
    ``relative_tolerance`` of the largest output."""
    import numpy as np
    import torch

    from machgen.runtime.components import open_component
    from machgen.runtime.tensors import as_numpy

    spec = component.spec
    start = time.perf_counter()
    session = open_component(path, device=device)
    full = {t.name: component.sample_inputs[t.name] for t in spec.inputs}
    first_row = {t.name: (full[t.name][:1] if t.batched else full[t.name]) for t in spec.inputs}
    if component.first_row is not None:
        first_row = component.first_row(first_row)
    worst = 0.0
    tolerance = spec.tolerance
    for inputs in (full, first_row):
        with torch.no_grad():
            expected = _as_tuple(component.module(**{k: _to_program(v, dtype, device) for k, v in inputs.items()}))
        got = session.run(inputs)
        for tensor, want in zip(spec.outputs, expected):
            have = as_numpy(got[tensor.name])
            want = as_numpy(want.float() if want.is_floating_point() else want)
            if dtype != "float32" and want.size:
                tolerance = max(tolerance, 0.01 * float(np.abs(want).max()))
            if relative_tolerance and want.size:
                tolerance = max(tolerance, relative_tolerance * float(np.abs(want).max()))
            if have.shape != want.shape:
                raise ParityError(f"{spec.name}.{tensor.name}: {path.name} shape {have.shape} != torch {want.shape}")
            diff = float(np.max(np.abs(have.astype(np.float64) - want.astype(np.float64)))) if want.size else 0.0
            worst = max(worst, diff)
    report = ParityReport(spec.name, worst, tolerance, 2, time.perf_counter() - start)
    if not worst <= tolerance:
        raise ParityError(
            f"{spec.name}: {path.name} differs from torch by {worst:.3g} (max abs), above the tolerance "
            f"{tolerance:g}")
    return report
