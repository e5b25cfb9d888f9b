"""``machgen::sparse_attention`` as a torch custom op, its ONNX form, and the
swap that puts it in place of a family's attention during export.

In torch the op runs the CPU reference (plugins/reference.py) on CPU
tensors and the Triton kernel (plugins/triton_kernel.py) on CUDA ones. The
dynamo exporter writes it as one ``machgen::SparseAttention`` node carrying
the schema's attributes, and ``attach_onnx_function`` adds to the file an
ONNX function of that name whose body is ``masked_dense_attention`` in
standard ops: ONNX Runtime runs the body; for TensorRT the node is lowered
into its mask prediction (``block_lists_function``) and plugins
(plugins/tensorrt_plugin.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from typing import Callable, Iterator, Sequence

import torch

from machgen.plugins import reference
from machgen.plugins.schema import DOMAIN, OP_TYPE, OP_VERSION, SparseAttentionConfig, register_onnx_schema


@torch.library.custom_op("machgen::sparse_attention", mutates_args=())
def sparse_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                        mask_method: str, topk_ratio: float, cdf_threshold: float, dense_prefix_tokens: int,
                        dense_diagonal: int, precision: str, softmax_scale: float) -> torch.Tensor:
    config = SparseAttentionConfig(block_q, block_k, mask_method, topk_ratio, cdf_threshold, dense_prefix_tokens,
                                   dense_diagonal, precision, softmax_scale)
    return reference.sparse_attention(q, k, v, config)  # the CPU kernel; CUDA's is registered below


@sparse_attention_op.register_fake
def _(q, k, v, *attributes):
    return torch.empty_like(q)


@sparse_attention_op.register_kernel("cuda")
def _(q, k, v, *attributes):
    # On a GPU the op is the Triton kernel (imported here: OpenAI Triton is needed only then).
    from machgen.plugins import triton_kernel

    return triton_kernel.sparse_attention(q, k, v, SparseAttentionConfig(*attributes))


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     config: SparseAttentionConfig) -> torch.Tensor:
    """The op on q, k, v in [B, N, H, D]."""
    return sparse_attention_op(q, k, v, *config.onnx_attributes().values())


def onnx_translation() -> dict:
    """The exporter's ``custom_translation_table`` entry for the op."""
    import onnxscript

    register_onnx_schema()
    machgen = onnxscript.values.Opset(DOMAIN, OP_VERSION)

    def translate(q, k, v, block_q: int, block_k: int, mask_method: str, topk_ratio: float,
                  cdf_threshold: float, dense_prefix_tokens: int, dense_diagonal: int, precision: str,
                  softmax_scale: float):
        return machgen.SparseAttention(
            q, k, v, block_q=block_q, block_k=block_k, mask_method=mask_method, topk_ratio=topk_ratio,
            cdf_threshold=cdf_threshold, dense_prefix_tokens=dense_prefix_tokens, dense_diagonal=dense_diagonal,
            precision=precision, softmax_scale=softmax_scale)

    return {torch.ops.machgen.sparse_attention.default: translate}


class _MaskedDense(torch.nn.Module):
    def __init__(self, config: SparseAttentionConfig):
        super().__init__()
        self.config = config

    def forward(self, q, k, v):
        return reference.masked_dense_attention(q, k, v, self.config)


class _BlockLists(torch.nn.Module):
    def __init__(self, config: SparseAttentionConfig):
        super().__init__()
        self.config = config

    def forward(self, q, k):
        mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), self.config)
        kept, counts = reference.kept_block_lists(mask, trim=False)
        return kept.to(torch.int32), counts


BLOCK_LISTS = "SparseAttentionBlockLists"


@functools.lru_cache(maxsize=None)  # the head and the tail of one build share it (an export takes ~10 s)
def onnx_function(config: SparseAttentionConfig, head_dim: int, opset: int):
    """``machgen::SparseAttention`` as an ONNX FunctionProto: the masked dense
    form in standard ops (batch, tokens and heads dynamic; head_dim fixed)."""
    return _exported_function(_MaskedDense(config), OP_TYPE, ["q", "k", "v"], ["output"], head_dim, opset,
                              attributes=list(config.onnx_attributes()))


@functools.lru_cache(maxsize=None)
def block_lists_function(config: SparseAttentionConfig, head_dim: int, opset: int):
    """``machgen::SparseAttentionBlockLists`` (q, k in [B, N, H, D]) -> (kept
    key blocks per query block [B, H, q_blocks, k_blocks] int32, kept ones
    first in key order; their counts [B, H, q_blocks] int32): the operator's
    mask prediction in standard ops, for the TensorRT form of the graph."""
    return _exported_function(_BlockLists(config), BLOCK_LISTS, ["q", "k"], ["kept", "counts"], head_dim, opset)


def _exported_function(module: torch.nn.Module, name: str, inputs: list[str], outputs: list[str], head_dim: int,
                       opset: int, attributes: Sequence[str] = ()):
    """``module`` exported by the dynamo exporter (inputs [B, N, H, D],
    batch, tokens and heads dynamic) and its weights-free graph turned into
    the body of the function ``machgen::name``."""
    import onnx
    from torch.export import Dim

    config = module.config
    # Distinct tensors: the exporter folds one tensor passed several times into one input.
    samples = tuple(torch.randn(2, 2 * max(config.block_q, config.block_k) + 3, 3, head_dim) for _ in inputs)
    axes = {0: Dim("batch", min=1), 1: Dim("tokens", min=2), 2: Dim("heads", min=1)}
    with torch.no_grad(), contextlib.redirect_stdout(None), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module.eval(), samples, dynamo=True, input_names=inputs, output_names=outputs,
                                    dynamic_shapes=tuple(axes for _ in inputs), opset_version=opset, verbose=False)
    graph = program.model_proto.graph
    constants = [onnx.helper.make_node("Constant", [], [tensor.name], value=tensor) for tensor in graph.initializer]
    return onnx.helper.make_function(
        DOMAIN, name, inputs, outputs, [*constants, *graph.node],
        opset_imports=[o for o in program.model_proto.opset_import if o.domain != DOMAIN],
        attributes=list(attributes))


def tensor_type(model, name: str):
    """The recorded TypeProto.Tensor of the value ``name`` in ``model``'s graph."""
    for info in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if info.name == name:
            return info.type.tensor_type
    raise ValueError(f"the exporter recorded no type for {name!r}")


def head_dim(model, node) -> int:
    """head_dim of a SparseAttention node (its q's last axis, which the exporter records)."""
    return tensor_type(model, node.input[0]).shape.dim[-1].dim_value


def sparse_attention_nodes(model) -> list:
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def attach_onnx_function(model, config: SparseAttentionConfig) -> int:
    """Give ``model`` (ModelProto) the function body of its SparseAttention
    nodes; returns how many nodes there are. Every node must carry ``config``
    and the same head_dim (the body is exported for one)."""
    import onnx

    nodes = sparse_attention_nodes(model)
    for node in nodes:
        found = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if _as_float32(found) != _as_float32(config.onnx_attributes()):
            raise ValueError(f"{node.name}: attributes {found} differ from the build's {config}")
    head_dims = {head_dim(model, node) for node in nodes}
    if len(head_dims) > 1:
        raise ValueError(f"SparseAttention nodes with different head_dims {sorted(head_dims)}")
    if nodes:
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        function = model.functions.add()
        function.CopyFrom(onnx_function(config, head_dims.pop(), opset))
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OP_VERSION))
    return len(nodes)


def _as_float32(attributes: dict) -> dict:
    """Attributes as an ONNX node stores them (floats in float32, strings as bytes)."""
    import numpy as np

    return {name: np.float32(value) if isinstance(value, float) else
            value.encode() if isinstance(value, str) else value for name, value in attributes.items()}


def attention_swapped(modules: Sequence[str], config: SparseAttentionConfig,
                      layers: Sequence[torch.nn.Module] | None = None,
                      operator: Callable[..., torch.Tensor] | None = None):
    """Inside the block, every unmasked, non-causal self-attention call of
    ``dispatch_attention_fn`` in ``modules`` (diffusers model modules,
    [B, N, H, D] layout) runs the op. Cross-attention (keys of another
    length: a video model's text) stays dense: its few key blocks are all needed.
    ``layers``: only the calls made inside these attention modules, for a
    model whose cross-attention can have keys as long as its queries (LTX-2's
    audio-video attention), which the lengths cannot tell apart.
    ``operator(q, k, v, config)``: what runs instead of ``sparse_attention``
    (a parallel build's, which exchanges across the sequence ranks first)."""
    operator = operator or sparse_attention

    def sparse(query, key, value, scale):
        chosen = config if scale is None else SparseAttentionConfig(
            **{**config.onnx_attributes(), "softmax_scale": scale})
        return operator(query, key, value, chosen)

    return dispatch_swapped(modules, sparse, layers)


@contextlib.contextmanager
def dispatch_swapped(modules: Sequence[str], attention: Callable[..., torch.Tensor],
                     layers: Sequence[torch.nn.Module] | None = None, any_keys: bool = False) -> Iterator[None]:
    """Inside the block, every unmasked, non-causal call of
    ``dispatch_attention_fn`` in ``modules`` (or, in a module that calls
    ``F.scaled_dot_product_attention`` itself, of that) whose keys are as
    long as its queries runs ``attention(query, key, value, scale)`` instead
    ([B, N, H, D]; ``layers``: only the calls made inside these modules;
    ``any_keys``: with ``layers``, whatever its keys' length: a cross-attention)."""
    patched, hooks = [], []
    inside = [0]  # the calls in progress of one of ``layers``

    def make(original):
        def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *args,
                     **kwargs):
            if (attn_mask is not None or is_causal or dropout_p
                    or (not _same_length(query, key) and not (any_keys and layers is not None))
                    or (layers is not None and not inside[0])):
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale, *args, **kwargs)
            return attention(query, key, value, scale)
        return dispatch

    def enter(module, args):
        inside[0] += 1

    def leave(module, args, output):
        inside[0] -= 1

    try:
        for name in modules:
            module = importlib.import_module(name)
            if hasattr(module, "dispatch_attention_fn"):
                patched.append((module, "dispatch_attention_fn", module.dispatch_attention_fn))
                module.dispatch_attention_fn = make(module.dispatch_attention_fn)
            else:  # a model that calls F.scaled_dot_product_attention itself (HiDream)
                patched.append((module, "F", module.F))
                module.F = _FunctionalWith(module.F, make(_sdpa_as_dispatch(module.F.scaled_dot_product_attention)))
        for layer in layers or ():
            hooks.append(layer.register_forward_pre_hook(enter))
            hooks.append(layer.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, name, original in patched:
            setattr(module, name, original)


def _same_length(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the keys are as many as the queries, decided without a guard
    while a program is traced: as lengths the trace knows equal (one
    sequence's, a self-attention's). A plain comparison of two sequences'
    lengths (video and text tokens) would leave a guard that they differ,
    and the program would refuse every call whose lengths happen to match."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(key.shape[1] == query.shape[1])


def _sdpa_as_dispatch(sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """scaled_dot_product_attention ([B, H, N, D]) called as dispatch_attention_fn is ([B, N, H, D])."""
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *args, **kwargs):
        return sdpa(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p,
                    is_causal, *args, scale=scale, **kwargs).transpose(1, 2)
    return attention


class _FunctionalWith:
    """torch.nn.functional as a model module sees it (its ``F``), with
    scaled_dot_product_attention going through ``dispatch`` (the swap, in
    dispatch_attention_fn's layout); everything else is F's own."""

    def __init__(self, functional, dispatch: Callable[..., torch.Tensor]):
        self._functional, self._dispatch = functional, dispatch

    def scaled_dot_product_attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, **kwargs):
        return self._dispatch(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                              dropout_p, is_causal, scale, **kwargs).transpose(1, 2)

    def __getattr__(self, name: str):
        return getattr(self._functional, name)
