"""INT8 linear layers for the onnxruntime target (``machgen-build build --precision int8``).

Each MatMul and Gemm of a denoiser component gets int8 weights, symmetric, one scale per output channel, and
its input quantized to uint8 per call from that call's own range (ONNX Runtime's dynamic quantization, run
as fused integer kernels on CPUs with VNNI). Measured on the shapes image default, one thread, 12 unseen
prompts, uncached (2026-12-07, these 2 cores): this way 1.49x faster than float32 at 52.2 dB mean, 50.5
worst against the float image; static QDQ (activations' ranges calibrated on the model's prompts, uint8, the
same weights) 1.05x at 39.2 dB, 32.9 worst, and symmetric int8 activations 0.75x at 37.6 dB: a fixed range
loses what a per-call one keeps, and the QDQ pairs cost time on these kernels. Static QDQ is the form
TensorRT's explicit quantization takes (a GPU's FP8 and INT8); it is not built yet.

Which layers stay float is the sensitivity sweep's choice (builder/precision_sweep.py); ``exclude`` names them.

Also what a component's weights weigh (``component_weight_bytes``): the build log says it per component, an int8
part's float bytes beside, and the manifest records it (``weight_bytes``).
"""

from __future__ import annotations

import ast
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

# The operators whose weights become int8.
QUANTIZED_OPS = ("MatMul", "Gemm")
# An int8 component's outputs may depart from the float module's by this share of their largest value.
INT8_RELATIVE_TOLERANCE = 0.05
# The dynamo exporter's record of the modules a node was traced in, outermost first, the node's own name last.
_NAME_SCOPES = "pkg.torch.onnx.name_scopes"
# ONNX Runtime's dynamic quantizer first rewrites each Gemm as a MatMul named so (its transposed weight named
# ``<weight>_Transposed``), then skips the excluded nodes by their new names.
_GEMM_AS_MATMUL = "_MatMul"
_TRANSPOSED = "_Transposed"


@dataclass(frozen=True)
class LinearLayer:
    """A MatMul or Gemm whose weight is an initializer: what the quantizer turns int8."""

    node: str
    weight: str  # the weight initializer's name
    module: str  # the module path it was exported from ("transformer.transformer_blocks.0.attn.to_q"), else node
    input: str  # the activation it multiplies
    parameters: int  # weight elements


def module_path(node, weight: str) -> str:
    """Where the exporter says ``node`` came from: the dynamo exporter's name scopes (the module is the scope
    before the node's own name), else a node named ``/<module path>/<op>`` (the TorchScript-based exporter's
    scopes), else a weight named ``<module>.weight``, else the node's own name."""
    for prop in node.metadata_props:
        if prop.key == _NAME_SCOPES:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                break
            if len(scopes) >= 2 and scopes[-2]:
                return str(scopes[-2])
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return ".".join(part for part in node.name.split("/")[1:-1] if part)
    weight = weight.removesuffix(_TRANSPOSED)  # a float Gemm the quantizer rewrote as MatMul
    if weight.endswith(".weight"):
        return weight[:-len(".weight")]
    return node.name


def linear_layers(model) -> list[LinearLayer]:
    """The quantizable linear layers of an onnx.ModelProto, in graph order."""
    import numpy as np

    weights = {tensor.name: tensor for tensor in model.graph.initializer}
    layers = []
    for node in model.graph.node:
        if node.op_type in QUANTIZED_OPS and len(node.input) > 1 and node.input[1] in weights:
            weight = node.input[1]
            layers.append(LinearLayer(node.name, weight, module_path(node, weight), node.input[0],
                                      int(np.prod(weights[weight].dims))))
    return layers


def excluded_nodes(layers: Iterable[LinearLayer], exclude: Iterable[str]) -> list[str]:
    """The nodes of ``layers`` that ``exclude`` names, by node, weight or module name."""
    names = set(exclude)
    return [layer.node for layer in layers if {layer.node, layer.weight, layer.module} & names]


def _quantizer_names(nodes: Iterable[str]) -> list[str]:
    """``nodes`` as the quantizer's exclusion must name them: a Gemm also by the name of the MatMul it becomes."""
    return [name for node in nodes for name in (node, node + _GEMM_AS_MATMUL)]


def quantize_int8(path: Path, exclude: Iterable[str] = (), out: Path | None = None,
                  record: bool = True) -> dict[str, Any]:
    """Rewrites the ONNX file at ``path`` (or writes ``out``) with int8 linear layers (see the module's doc),
    those that ``exclude`` names (by node, weight or module) left float. What each layer got: {"weights": ...,
    "activations": ..., "layers": {module: [smallest, largest scale]}, "float_layers": [module, ...],
    "weight_bytes": {"float": before, "int8": after}} (``record`` False: {}, for the sweep's many trials)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = Path(out or path)
    model = onnx.load(os.fspath(path), load_external_data=False)
    layers = linear_layers(model)
    external = any(tensor.data_location == onnx.TensorProto.EXTERNAL for tensor in model.graph.initializer)
    float_bytes = initializer_bytes(model.graph) if record else 0  # before ``out`` may overwrite ``path``
    kept_float = excluded_nodes(layers, exclude)
    if layers and len(kept_float) == len(layers):
        if out != Path(path):
            _copy_model(Path(path), out)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)  # (the quantizer writes into an existing folder only)
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # its advice to pre-process (shape inference) is for static quantization
        try:
            quantize_dynamic(os.fspath(path), os.fspath(out), op_types_to_quantize=list(QUANTIZED_OPS),
                             per_channel=True, weight_type=QuantType.QInt8,
                             nodes_to_exclude=_quantizer_names(kept_float), use_external_data_format=external)
        finally:
            root.setLevel(level)
    if not record:
        return {}
    floats = set(kept_float)
    return {"precision": "int8", "weights": "int8, symmetric, a scale per output channel",
            "activations": "uint8, quantized per call from its own range (dynamic)",
            "operators": list(QUANTIZED_OPS), "layers": _weight_scales(out, layers, floats),
            "float_layers": sorted({layer.module for layer in layers if layer.node in floats}),
            "weight_bytes": {"float": float_bytes, "int8": onnx_weight_bytes(out)}}


def _weight_scales(path: Path, layers: list[LinearLayer], floats: set[str]) -> dict[str, list[float]]:
    """Each int8 layer's smallest and largest weight scale, by module (the quantizer names a weight's scale
    ``<weight>_scale``, a Gemm's transposed weight ``<weight>_Transposed_scale``)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(os.fspath(path), load_external_data=False)
    scales = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer
              if tensor.name.endswith("_scale")}
    found = {}
    for layer in layers:
        if layer.node in floats:
            continue
        value = scales.get(f"{layer.weight}_scale", scales.get(f"{layer.weight}_Transposed_scale"))
        if value is not None:
            name = layer.module if layer.module not in found else f"{layer.module} ({layer.node})"
            found[name] = [float(np.min(value)), float(np.max(value))]
    return found


def _copy_model(source: Path, target: Path) -> None:
    """``source`` and the files beside it that share its name (external data) to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for item in source.parent.glob(source.name + "*"):
        if item.is_file():
            shutil.copy2(item, target.parent / (target.name + item.name[len(source.name):]))


# Weight bytes (issue 62, memory): what the build log prints and the manifest's ``weight_bytes`` records.

# Element types stored two to a byte (ONNX packs them).
_PACKED_FOUR_BITS = ("INT4", "UINT4", "FLOAT4E2M1")


def tensor_bytes(tensor) -> int:
    """The bytes of an onnx.TensorProto's values at its element type, wherever they are stored (inline or in an
    external data file: the dims and type say it without reading them)."""
    import math

    import onnx

    count = math.prod(tensor.dims)
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(value) for value in tensor.string_data)
    packed = {getattr(onnx.TensorProto, name) for name in _PACKED_FOUR_BITS if hasattr(onnx.TensorProto, name)}
    if tensor.data_type in packed:
        return (count + 1) // 2
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def initializer_bytes(graph) -> int:
    """The bytes of an onnx.GraphProto's weights: its initializers (sparse ones by their stored values and
    indices) and those of the subgraphs its nodes hold (If, Loop, Scan)."""
    import onnx

    total = sum(tensor_bytes(tensor) for tensor in graph.initializer)
    total += sum(tensor_bytes(sparse.values) + tensor_bytes(sparse.indices) for sparse in graph.sparse_initializer)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                total += initializer_bytes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                total += sum(initializer_bytes(subgraph) for subgraph in attribute.graphs)
    return total


def onnx_weight_bytes(path: Path) -> int:
    """The weight bytes of the ONNX file at ``path``, its external data included (not read: counted)."""
    import onnx

    return initializer_bytes(onnx.load(os.fspath(path), load_external_data=False).graph)


def component_weight_bytes(path: Path) -> int:
    """The weight bytes of an exported component's file: an ONNX file's initializers; a torch-target program
    (model.pt2) what its component.json counted when it was traced (runtime/torch_runner.py weight_bytes)."""
    import json

    from machgen.runtime.torch_runner import INFO_FILE

    path = Path(path)
    if path.suffix == ".onnx":
        return onnx_weight_bytes(path)
    info = path.parent / INFO_FILE
    if info.is_file():
        return int(json.loads(info.read_text())["weight_bytes"])
    raise ValueError(f"{path}: neither an ONNX file nor a torch-target program with its {INFO_FILE}")


def format_bytes(count: int) -> str:
    """``count`` bytes for a log line: bytes under a KiB, KiB under a MiB, MiB under a GiB, else GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count / 2**10:.1f} KiB" if count >= 2**10 else f"{count} B"


def weights_note(built: int, float_bytes: int | None = None, precision: str = "float") -> str:
    """A build log's words on a component's weights: ``built`` bytes and, where the component was built below
    float (``float_bytes`` its float export's), float against ``precision`` and their ratio."""
    if float_bytes is None or precision == "float":
        return f"weights {format_bytes(built)}"
    ratio = f"{built / float_bytes:.2f}x" if float_bytes else "-"
    return f"weights {format_bytes(built)} {precision} against {format_bytes(float_bytes)} float ({ratio})"
