"""FP8 linear layers for the tensorrt target (``machgen-build build --target tensorrt --precision fp8``).

The denoiser's ONNX files get explicit quantization, the form TensorRT builds FP8 kernels from (NVIDIA's
"explicit quantization": a QuantizeLinear/DequantizeLinear pair says where a tensor is FP8 and at what scale):
- **weights** of the linear layers inside the transformer blocks stored as float8 E4M3 (``FLOAT8E4M3FN``),
  one scale per output channel (its largest magnitude over 448, E4M3's largest finite value), read through a
  DequantizeLinear;
- **their inputs** quantized to E4M3 through a Q/DQ pair with one scale per tensor, static: the largest
  magnitude the layer's input took while the diffusers pipeline denoised calibration prompts at the card's
  settings (``linear_input_amax``: torch hooks on the very layers the components were exported from), over
  448.

The layers outside the blocks (the time, text and patch embedders, the final norm and projection) stay in the
checkpoint's dtype: a few per cent of a step's multiply-adds, and the transformer's first and last layers. So
does a layer that the calibration never reached. The graph is still one ONNX Runtime runs: on a CPU its Q/DQ
pairs round each tensor to E4M3 and the MatMuls run in float, which is how the build checks the file against
the float module (``FP8_RELATIVE_TOLERANCE``) on machines without TensorRT.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from machgen.builder.quantize import QUANTIZED_OPS, LinearLayer, initializer_bytes, linear_layers, onnx_weight_bytes

FP8_MAX = 448.0  # float8 E4M3 (FN: finite, no infinities): its largest magnitude
# An FP8 component's outputs may depart from the float module's by this share of their largest value, as int8's
# (E4M3 keeps 3 mantissa bits: a rounded value within 6.25 % of its own, a layer's sums average them; the tiny
# Flux's head and tail depart 0.6 %).
FP8_RELATIVE_TOLERANCE = 0.05
# The smallest scale a channel or tensor gets: an all-zero channel would otherwise divide by zero.
_SMALLEST_SCALE = 1e-12


def in_a_block(module: str) -> bool:
    """Whether a module path is inside one of the transformer's repeated blocks (a numeric part after the
    first: ``transformer_blocks.3.attn.to_q``)."""
    parts = module.split(".")
    return any(part.isdigit() for part in parts[1:])


def linear_input_amax(pipe: Any, run: Callable[[], None]) -> dict[Any, float]:
    """The largest |input| of every nn.Linear of the pipeline's torch components (by the layer object) over
    what ``run`` computes with them (calibration_run)."""
    import torch

    amax: dict[Any, float] = {}
    handles = []

    def record(layer, args):
        amax[layer] = max(amax.get(layer, 0.0), float(args[0].detach().abs().max()))

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for layer in component.modules():
                if isinstance(layer, torch.nn.Linear):
                    handles.append(layer.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return amax


def calibrate_fp8(pipe: Any, defaults: Any, pairs: int, log: Callable[[str], None] = print) -> dict[Any, float]:
    """linear_input_amax over ``pairs`` prompt/seed pairs of calibrate's fit set (moving-shapes captions for a
    video model), run on the GPU where there is one (float32 kept: the export goes on from the same weights)."""
    import time

    import torch

    from machgen.builder.calibrate import FIT_PROMPTS_SEED
    from machgen.datasets import moving_shapes, shapes

    dataset = moving_shapes if defaults.max_frames > 1 else shapes
    chosen = [(prompt, seed) for prompt, seed, _ in dataset.evaluation_prompts(pairs, seed=FIT_PROMPTS_SEED)]
    run = calibration_run(pipe, defaults, chosen)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    pipe.to(device)
    try:
        amax = linear_input_amax(pipe, run)
    finally:
        pipe.to("cpu")
    log(f"fp8: the inputs of {len(amax)} linear layers calibrated on {len(chosen)} prompt/seed pairs of "
        f"calibrate's fit set at the served defaults ({device}, {time.perf_counter() - start:.0f} s)")
    return amax


def amax_by_name(module: Any, amax: Mapping[Any, float]) -> dict[str, float]:
    """``amax`` (linear_input_amax) by the layers' names in ``module``, an exported component whose layers
    are the pipeline's own (a layer it holds that the calibration never ran is absent)."""
    return {name: amax[layer] for name, layer in module.named_modules() if layer in amax}


def calibration_run(pipe: Any, defaults: Any, pairs: Sequence[tuple]) -> Callable[[], None]:
    """The diffusers pipeline denoising ``pairs`` ((prompt, seed, ...)) at the served defaults (those of the
    card that its ``__call__`` takes), one at a time, to the latents (no decode)."""
    import inspect

    import torch

    taken = inspect.signature(pipe.__call__).parameters
    settings = {name: value for name, value in defaults.to_json().items() if name in taken and value is not None}
    required = [name for name, parameter in taken.items() if parameter.default is parameter.empty
                and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and name != "prompt"]
    if required:
        raise ValueError(f"{type(pipe).__name__} needs {', '.join(required)} besides a prompt: the FP8 calibration "
                         "denoises text prompts only")

    def run() -> None:
        for prompt, seed, *_ in pairs:
            pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
                 **settings)

    return run


def _amax_of(layer: LinearLayer, amax: Mapping[str, float]) -> float | None:
    """The calibrated amax of the layer an ONNX node was exported from: the name in ``amax`` that ends with the
    longest dotted tail of the node's module path (the exporters name the component's root differently:
    ``module.transformer_blocks.0.attn.to_q`` is ``transformer.transformer_blocks.0.attn.to_q``); None where no
    tail names one layer alone."""
    parts = layer.module.split(".")
    for start in range(len(parts)):
        tail = ".".join(parts[start:])
        found = [name for name in amax if name == tail or name.endswith("." + tail)]
        if found:
            return amax[found[0]] if len(found) == 1 else None
    return None


def quantize_fp8(path: Path, amax: Mapping[str, float], exclude: Iterable[str] = (),
                 out: Path | None = None) -> dict[str, Any]:
    """Rewrites the ONNX file at ``path`` (or writes ``out``) with FP8 linear layers (see the module's doc).
    ``amax``: the calibration's amax by the component's layer names (amax_by_name); ``exclude``: modules kept
    float as well. What each layer got: {"layers": {module: {"weight_scale": [smallest, largest],
    "input_scale": s}}, "float_layers": {module: why}, "weight_bytes": {"float": before, "fp8": after}, ...}."""
    import ml_dtypes
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    out = Path(out or path)
    model = onnx.load(os.fspath(path))  # with its weights: they are rewritten
    if max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0) < 19:
        raise ValueError(f"{path}: FP8 Q/DQ needs ONNX opset 19 or later")
    float_bytes = initializer_bytes(model.graph)
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(
        os.fspath(path), load_external_data=False).graph.initializer)
    weights = {tensor.name: tensor for tensor in model.graph.initializer}
    excluded = set(exclude)
    chosen: list[tuple[LinearLayer, float]] = []
    kept: dict[str, str] = {}
    for layer in linear_layers(model):
        found = _amax_of(layer, amax)
        if layer.module in excluded or layer.node in excluded:
            kept[layer.module] = "kept float (asked)"
        elif not in_a_block(layer.module):
            kept[layer.module] = "outside the transformer blocks"
        elif not found:
            kept[layer.module] = "its input was not reached by the calibration"
        else:
            chosen.append((layer, found))
    nodes = {node.name: node for node in model.graph.node}
    weight_nodes, input_pairs, record = [], {}, {}
    dequantized: dict[str, str] = {}  # weight -> its DequantizeLinear's output
    weight_scales: dict[str, list[float]] = {}
    for layer, input_amax in chosen:
        node = nodes[layer.node]
        if layer.weight not in dequantized:
            weight = numpy_helper.to_array(weights[layer.weight]).astype(np.float32)
            transposed = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
            axis = 0 if transposed else weight.ndim - 1  # the output channels
            reduce = tuple(i for i in range(weight.ndim) if i != axis)
            scale = np.maximum(np.abs(weight).max(axis=reduce) / FP8_MAX, _SMALLEST_SCALE).astype(np.float32)
            shape = [1] * weight.ndim
            shape[axis] = -1
            codes = np.clip(weight / scale.reshape(shape), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
            stored = numpy_helper.from_array(codes, f"{layer.weight}_fp8")
            model.graph.initializer.extend([stored, numpy_helper.from_array(scale, f"{layer.weight}_fp8_scale")])
            weight_nodes.append(helper.make_node("DequantizeLinear", [stored.name, f"{layer.weight}_fp8_scale"],
                                                 [f"{layer.weight}_dequantized"], axis=axis,
                                                 name=f"{layer.weight}_DequantizeLinear"))
            dequantized[layer.weight] = f"{layer.weight}_dequantized"
            weight_scales[layer.weight] = [float(scale.min()), float(scale.max())]
        pair = input_pairs.setdefault(layer.input, {"amax": 0.0, "first": layer.node})
        pair["amax"] = max(pair["amax"], input_amax)
        record[layer.module if layer.module not in record else f"{layer.module} ({layer.node})"] = {
            "weight_scale": weight_scales[layer.weight], "input": layer.input}
    _rewire(model, chosen, dequantized, input_pairs, weight_nodes)
    used = {name for node in model.graph.node for name in node.input}
    kept_initializers = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept_initializers)
    for entry in record.values():
        entry["input_scale"] = max(input_pairs[entry.pop("input")]["amax"], _SMALLEST_SCALE) / FP8_MAX
    out.parent.mkdir(parents=True, exist_ok=True)
    for item in out.parent.glob(out.name + "*"):  # its old external data, rewritten below
        if item.is_file():
            item.unlink()
    onnx.save_model(model, os.fspath(out), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=out.name + ".data")
    return {"precision": "fp8", "weights": "float8 E4M3, symmetric, a scale per output channel",
            "activations": "float8 E4M3, a scale per tensor from the calibration prompts' largest |input| "
                           "(static)",
            "operators": list(QUANTIZED_OPS), "layers": record, "float_layers": dict(sorted(kept.items())),
            "weight_bytes": {"float": float_bytes, "fp8": onnx_weight_bytes(out)}}


def _rewire(model, chosen: Sequence[tuple[LinearLayer, float]], dequantized: Mapping[str, str],
            input_pairs: Mapping[str, dict], weight_nodes: list) -> None:
    """The graph's nodes again, in order: the weights' DequantizeLinear first, each quantized input's
    Quantize/Dequantize pair just before the first layer that reads it, and the layers reading both."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    by_node = {layer.node: layer for layer, _ in chosen}
    emitted: set[str] = set()
    rewritten = list(weight_nodes)
    for node in model.graph.node:
        layer = by_node.get(node.name)
        if layer is not None:
            source = layer.input
            if source not in emitted:
                scale = np.float32(max(input_pairs[source]["amax"], _SMALLEST_SCALE) / FP8_MAX)
                zero = helper.make_tensor(f"{source}_fp8_zero", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0])
                model.graph.initializer.extend([numpy_helper.from_array(np.array(scale), f"{source}_fp8_scale"),
                                                zero])
                rewritten += [
                    helper.make_node("QuantizeLinear", [source, f"{source}_fp8_scale", zero.name],
                                     [f"{source}_fp8"], name=f"{source}_QuantizeLinear"),
                    helper.make_node("DequantizeLinear", [f"{source}_fp8", f"{source}_fp8_scale", zero.name],
                                     [f"{source}_fp8_dequantized"], name=f"{source}_DequantizeLinear")]
                emitted.add(source)
            node.input[0] = f"{source}_fp8_dequantized"
            node.input[1] = dequantized[layer.weight]
        rewritten.append(node)
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
