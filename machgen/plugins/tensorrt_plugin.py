"""SparseAttention for TensorRT: the graph it parses, and the ahead-of-time
plugins that run our Triton kernels inside the engine.

An ahead-of-time plugin (``tensorrt.plugin``'s ``aot_impl``, TensorRT >=
10.9) is one precompiled kernel that TensorRT launches itself, with no
Python at run time, which is what Triton's C++ TensorRT backend needs. The
operator is three steps, so ``lower_for_tensorrt`` rewrites each
``machgen::SparseAttention`` node of an exported file into

- its mask prediction in standard ONNX ops (``machgen::SparseAttentionBlockLists``
  of plugins/ops.py, inlined): the kept key blocks of every query block;
- three ``BlockQuantize`` plugins (q, k, and v transposed), kernel ``_block_quantize``;
- one ``BlockSparseAttention`` plugin, kernel ``_block_sparse_attention``,

each plugin node marked for TensorRT's ONNX parser (``plugin_namespace``,
``aot``). ``PLUGINS`` says, per plugin, how its inputs, its int32 scalars
(symbolic shape expressions) and its outputs map onto the kernel's
parameters, and what it outputs; ``register`` hands that to TensorRT (an
``aot_impl`` compiling PTX for the build GPU, and an ``impl`` launching the
same kernel from Python for JIT use). ``launch_plan`` is the part that
needs no TensorRT: the CPU tests run the lowered graph with it, the
kernels under Triton's interpreter launched exactly as the plan says.

TensorRT cannot be installed on the machines this was written on: the
registration and an engine build have not run anywhere (their tests skip
without TensorRT). What ran: the lowering, the plans and the kernels
(tests/test_tensorrt_plugin.py), the PTX compiled for sm_90 and assembled
by ptxas on a CPU machine.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from machgen.plugins.schema import ATTRIBUTES, DOMAIN, OP_TYPE, Attribute, SparseAttentionConfig

PLUGIN_NAMESPACE = DOMAIN
_PYTHON_TYPES = {"int": int, "float": float, "string": str}
# Element types by Triton's names (the kernels' pointer types) and their ONNX codes.
_ONNX_TYPES = {"fp32": 1, "fp16": 10, "bf16": 16, "fp8e4nv": 17, "i32": 6}
OPERAND_TYPES = {"fp8_e4m3": "fp8e4nv", "bf16": "bf16", "fp32": "fp32"}


def _cdiv(a, b):
    return -(-a // b)


def _schema_field(name: str) -> Attribute:
    return next(a for a in ATTRIBUTES if a.name == name)


_HEAD_DIM = Attribute("head_dim", "int", "last axis of q, k and v (a constant of the compiled kernel)")


@dataclass(frozen=True)
class Launch:
    """One launch of a plugin's kernel: the kernel's constants and pointer
    types (what it is compiled with), its grid and its int32 scalars in
    parameter order (ints, or TensorRT shape expressions)."""

    constants: dict
    pointer_types: dict
    grid: tuple
    scalars: tuple


@dataclass(frozen=True)
class Plugin:
    """A TensorRT plugin over one of plugins/triton_kernel.py's kernels. The
    kernel's runtime parameters are ``inputs + scalars + outputs``, the
    order TensorRT launches an ahead-of-time kernel with."""

    name: str
    kernel: str
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    fields: tuple[Attribute, ...]
    # (input shapes, input types, field values, cdiv) -> [(shape, type)] of the outputs
    output_shapes: Callable
    # (input shapes, input types, output types, field values, cdiv) -> Launch
    launch: Callable


def _quantize_outputs(shapes, types, fields, cdiv):
    from machgen.plugins import triton_kernel

    batch, tokens, heads, head_dim = shapes[0]
    padded = triton_kernel.padded_tokens(tokens, fields["block"], cdiv)
    rounded = (batch, heads, head_dim, padded) if fields["transpose"] else (batch, tokens, heads, head_dim)
    return [(rounded, OPERAND_TYPES[fields["precision"]]), ((batch, heads, cdiv(tokens, fields["block"])), "fp32")]


def _quantize_launch(shapes, types, out_types, fields, cdiv) -> Launch:
    from machgen.plugins import triton_kernel

    batch, tokens, heads, _ = shapes[0]
    return Launch(
        constants=triton_kernel.quantize_constants(fields["block"], fields["head_dim"], fields["precision"],
                                                   bool(fields["transpose"])),
        pointer_types={"X": types[0], "Out": out_types[0], "Scale": out_types[1]},
        grid=triton_kernel.quantize_grid(tokens, batch * heads, fields["block"], cdiv),
        scalars=(tokens, heads))


def _attention_outputs(shapes, types, fields, cdiv):
    return [(tuple(shapes[0]), fields["out_type"])]


def _attention_launch(shapes, types, out_types, fields, cdiv) -> Launch:
    from machgen.plugins import triton_kernel

    batch, tokens, heads, _ = shapes[0]
    config = SparseAttentionConfig(block_q=fields["block_q"], block_k=fields["block_k"],
                                   precision=fields["precision"], softmax_scale=fields["qk_scale"])
    attention = PLUGINS["BlockSparseAttention"]
    return Launch(
        constants=triton_kernel.attention_constants(config, fields["head_dim"]),
        pointer_types={**dict(zip(attention.inputs, types)), "Out": out_types[0]},
        grid=triton_kernel.attention_grid(tokens, batch * heads, fields["block_q"], cdiv),
        scalars=(heads, tokens, shapes[1][1], shapes[6][3]))  # max_kept: the lists' last axis


PLUGINS = {plugin.name: plugin for plugin in (
    Plugin("BlockQuantize", "block_quantize", inputs=("X",), scalars=("tokens", "heads"), outputs=("Out", "Scale"),
           fields=(Attribute("block", "int", "tokens per block (block_q for q, block_k for k and v)"), _HEAD_DIM,
                   _schema_field("precision"),
                   Attribute("transpose", "int", "1: write [B, H, D, N in whole blocks] (for v)")),
           output_shapes=_quantize_outputs, launch=_quantize_launch),
    Plugin("BlockSparseAttention", "block_sparse_attention",
           inputs=("Q", "K", "VT", "QScale", "KScale", "VScale", "KeptBlocks", "KeptCount"),
           scalars=("heads", "tokens", "kv_tokens", "max_kept"), outputs=("Out",),
           fields=(_schema_field("block_q"), _schema_field("block_k"), _HEAD_DIM, _schema_field("precision"),
                   Attribute("qk_scale", "float", "scale of q . k: the operator's softmax_scale, resolved (never 0)"),
                   Attribute("out_type", "string", "element type of the output (Triton's name: fp32, fp16, bf16)")),
           output_shapes=_attention_outputs, launch=_attention_launch),
)}


def launch_plan(plugin: Plugin, shapes: Sequence[Sequence], types: Sequence[str], fields: Mapping,
                cdiv: Callable = _cdiv) -> tuple[list, Launch]:
    """The outputs [(shape, type)] and the launch of ``plugin`` on inputs of
    these shapes and element types (Triton's names)."""
    outputs = plugin.output_shapes(shapes, types, fields, cdiv)
    return outputs, plugin.launch(shapes, types, [t for _, t in outputs], fields, cdiv)


# The graph TensorRT parses -------------------------------------------------------------------------------------

def lower_for_tensorrt(model, aot: bool = True) -> int:
    """Rewrite ``model`` (ModelProto, changed in place) so that TensorRT's
    parser builds every SparseAttention node from the plugins; returns how
    many nodes it rewrote. The operator's function body is dropped, so that
    nothing falls back to the masked dense form."""
    import onnx
    import onnx.inliner

    from machgen.plugins import ops

    nodes = ops.sparse_attention_nodes(model)
    if not nodes:
        return 0
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    marks = {"plugin_namespace": PLUGIN_NAMESPACE, "aot": int(aot)}
    functions = {}
    lowered = []
    for node in model.graph.node:
        if node not in nodes:
            lowered.append(node)
            continue
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        config = SparseAttentionConfig(**{name: value.decode() if isinstance(value, bytes) else value
                                          for name, value in attributes.items()})
        dim = ops.head_dim(model, node)
        out_type = next(name for name, code in _ONNX_TYPES.items()
                        if code == ops.tensor_type(model, node.output[0]).elem_type)
        functions[(config, dim)] = ops.block_lists_function(config, dim, opset)
        q, k, v = node.input
        name = node.name or node.output[0]

        def value(suffix: str) -> str:
            return f"{name}/{suffix}"

        lowered.append(onnx.helper.make_node(ops.BLOCK_LISTS, [q, k], [value("kept"), value("counts")],
                                             name=value("block_lists"), domain=DOMAIN))
        for role, source, block in (("q", q, config.block_q), ("k", k, config.block_k), ("v", v, config.block_k)):
            lowered.append(onnx.helper.make_node(
                "BlockQuantize", [source], [value(f"{role}_rounded"), value(f"{role}_scale")],
                name=value(f"quantize_{role}"), domain=DOMAIN, block=block, head_dim=dim,
                precision=config.precision, transpose=int(role == "v"), **marks))
        lowered.append(onnx.helper.make_node(
            "BlockSparseAttention",
            [value(f"{role}_rounded") for role in "qkv"] + [value(f"{role}_scale") for role in "qkv"]
            + [value("kept"), value("counts")],
            list(node.output), name=value("attention"), domain=DOMAIN, block_q=config.block_q,
            block_k=config.block_k, head_dim=dim, precision=config.precision,
            qk_scale=config.scale_for(dim), out_type=out_type, **marks))
    del model.graph.node[:]
    model.graph.node.extend(lowered)
    kept_functions = [f for f in model.functions if (f.domain, f.name) != (DOMAIN, OP_TYPE)]
    del model.functions[:]
    model.functions.extend(kept_functions)
    if len(functions) > 1:  # one function body per name: the exporter's attach_onnx_function refuses them too
        raise ValueError(f"SparseAttention nodes with different attributes or head_dims: {sorted(functions)}")
    model.functions.append(next(iter(functions.values())))
    inlined = onnx.inliner.inline_selected_functions(model, [(DOMAIN, ops.BLOCK_LISTS)], exclude=False)
    model.CopyFrom(inlined)
    return len(nodes)


# Registration with TensorRT ------------------------------------------------------------------------------------

_TENSORRT_TYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8e4nv": "fp8", "i32": "int32"}
_registered = False


def plugin_signature(plugin: Plugin, tensor_type, *tail: inspect.Parameter,
                     returns=inspect.Signature.empty) -> inspect.Signature:
    """(inputs..., fields..., *tail) with the annotations tensorrt.plugin reads."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter(name.lower(), positional, annotation=tensor_type) for name in plugin.inputs]
    parameters += [inspect.Parameter(f.name, positional, annotation=_PYTHON_TYPES[f.kind]) for f in plugin.fields]
    return inspect.Signature([*parameters, *tail], return_annotation=returns)


@functools.lru_cache(maxsize=None)  # TensorRT asks for the kernel of one plugin node several times per build
def _compiled(kernel: str, pointer_types: tuple, constants: tuple, capability: tuple):
    from machgen.plugins import triton_kernel

    return triton_kernel.compile_ahead(kernel, dict(pointer_types), dict(constants), capability)


def register() -> tuple[str, ...]:
    """Register the plugins with TensorRT (once per process); returns their ids."""
    global _registered
    import tensorrt as trt
    import tensorrt.plugin as trtp

    ids = tuple(f"{PLUGIN_NAMESPACE}::{name}" for name in PLUGINS)
    if _registered:
        return ids
    trt_types = {name: getattr(trt, value) for name, value in _TENSORRT_TYPES.items()}
    triton_types = {value: name for name, value in trt_types.items()}
    for plugin, plugin_id in zip(PLUGINS.values(), ids):
        _register_one(trt, trtp, plugin, plugin_id, trt_types, triton_types)
    _registered = True
    return ids


def _register_one(trt, trtp, plugin: Plugin, plugin_id: str, trt_types, triton_types) -> None:
    from typing import Tuple, Union

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD

    def split(signature, args, kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        tensors = [bound[name.lower()] for name in plugin.inputs]
        fields = {f.name: _PYTHON_TYPES[f.kind](bound[f.name]) for f in plugin.fields}
        return bound, tensors, fields

    def describe(*args, **kwargs):
        _, tensors, fields = split(describe.__signature__, args, kwargs)
        outputs = plugin.output_shapes([t.shape_expr for t in tensors], [triton_types[t.dtype] for t in tensors],
                                       fields, trtp.cdiv)
        descs = tuple(trtp.from_shape_expr(shape, dtype=trt_types[kind]) for shape, kind in outputs)
        return descs if len(descs) > 1 else descs[0]

    returns = Tuple[tuple(trtp.TensorDesc for _ in plugin.outputs)] if len(plugin.outputs) > 1 else trtp.TensorDesc
    describe.__signature__ = plugin_signature(plugin, trtp.TensorDesc, returns=returns)
    trtp.register(plugin_id)(describe)

    def ahead_of_time(*args, **kwargs):
        import torch

        bound, tensors, fields = split(ahead_of_time.__signature__, args, kwargs)
        out_types = [triton_types[o.dtype] for o in bound["outputs"]]
        launch = plugin.launch([t.shape_expr for t in tensors], [triton_types[t.dtype] for t in tensors],
                               out_types, fields, trtp.cdiv)
        compiled = _compiled(plugin.kernel, tuple(sorted(launch.pointer_types.items())),
                             tuple(sorted(launch.constants.items())), torch.cuda.get_device_capability())
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y = launch.grid
        params.block_x = compiled.threads
        params.shared_mem = compiled.shared_bytes
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in launch.scalars])
        return compiled.name, compiled.ptx, params, extra

    ahead_of_time.__signature__ = plugin_signature(
        plugin, trtp.TensorDesc, inspect.Parameter("outputs", positional, annotation=Tuple[trtp.TensorDesc, ...]),
        inspect.Parameter("tactic", positional, annotation=int),
        returns=Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs])
    trtp.aot_impl(plugin_id)(ahead_of_time)

    def just_in_time(*args, **kwargs):
        import torch

        bound, tensors, fields = split(just_in_time.__signature__, args, kwargs)
        inputs = [torch.as_tensor(t, device="cuda") for t in tensors]
        outputs = [torch.as_tensor(t, device="cuda") for t in bound["outputs"]]
        with torch.cuda.stream(torch.cuda.ExternalStream(bound["stream"])):
            launch_kernel(plugin, inputs, outputs, fields)

    just_in_time.__signature__ = plugin_signature(
        plugin, trtp.Tensor, inspect.Parameter("outputs", positional, annotation=Tuple[trtp.Tensor, ...]),
        inspect.Parameter("stream", positional, annotation=int))
    trtp.impl(plugin_id)(just_in_time)


def launch_kernel(plugin: Plugin, inputs: Sequence, outputs: Sequence, fields: Mapping) -> None:
    """Run ``plugin``'s kernel on torch tensors the way TensorRT launches it
    ahead of time: the plan's grid, the inputs, the plan's scalars and the
    outputs as positional parameters, the plan's constants compiled in."""
    from machgen.plugins import triton_kernel

    types = [triton_kernel.TRITON_TYPES[t.dtype] for t in inputs]
    _, launch = launch_plan(plugin, [tuple(t.shape) for t in inputs], types, fields)
    triton_kernel.KERNELS[plugin.kernel][launch.grid](*inputs, *launch.scalars, *outputs, **launch.constants,
                                                      num_warps=triton_kernel.NUM_WARPS,
                                                      num_stages=triton_kernel.NUM_STAGES)
