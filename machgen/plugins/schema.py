"""The one description of the ``SparseAttention`` operator.

Every other form of the operator is derived from ``ATTRIBUTES`` here: the
ONNX op schema (``register_onnx_schema``), the attributes the exporter writes
on the node (``SparseAttentionConfig.onnx_attributes``), the torch custom op's
arguments (plugins/ops.py) and the TensorRT plugins' fields of the same
names (plugins/tensorrt_plugin.py). Only the standard library is imported.

The operator: attention over q, k, v of shape [batch, tokens, heads,
head_dim] (the layout diffusers' attention processors hand to
``dispatch_attention_fn``), output in the same layout. Tokens are cut into
blocks; a block of queries attends only to the key blocks its mask keeps.
The mask is predicted from the blocks' mean query and mean key
(SpargeAttn): per query block, a softmax over the key blocks of
``pooled_q . pooled_k * softmax_scale`` ranks them, and the ``topk``
method keeps the best ``ceil(topk_ratio * key_blocks)`` while ``cdf``
keeps the fewest whose probabilities sum to ``cdf_threshold``. Blocks that
overlap the first ``dense_prefix_tokens`` tokens (the text tokens of a
joint-attention model), as queries or as keys, and blocks on the diagonal
stay dense. ``precision`` says how q, k, v and the probabilities are
rounded before their products (see plugins/reference.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

DOMAIN = "machgen"
OP_TYPE = "SparseAttention"
OP_VERSION = 1
MASK_METHODS = ("topk", "cdf")
PRECISIONS = ("fp8_e4m3", "bf16", "fp32")
# Largest finite float8 e4m3 value: per-block scales map a block's absolute maximum onto it.
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class Attribute:
    name: str
    kind: str  # "int", "float" or "string"
    doc: str


ATTRIBUTES = (
    Attribute("block_q", "int", "query tokens per block"),
    Attribute("block_k", "int", "key tokens per block"),
    Attribute("mask_method", "string", "topk: keep a fixed share of key blocks per query block; "
                                       "cdf: keep the fewest whose predicted probabilities reach cdf_threshold"),
    Attribute("topk_ratio", "float", "topk: share of key blocks kept per query block, in (0, 1]"),
    Attribute("cdf_threshold", "float", "cdf: predicted probability mass kept per query block, in (0, 1]"),
    Attribute("dense_prefix_tokens", "int", "leading tokens (text) whose blocks stay dense as queries and keys"),
    Attribute("dense_diagonal", "int", "1: a query block always attends to the key blocks it overlaps"),
    Attribute("precision", "string", "fp8_e4m3 (per-block scales), bf16 or fp32 products"),
    Attribute("softmax_scale", "float", "scale of q . k; 0 means 1 / sqrt(head_dim)"),
)


@dataclass(frozen=True)
class SparseAttentionConfig:
    """The operator's attributes; see ``ATTRIBUTES`` for what each means."""

    block_q: int = 64
    block_k: int = 64
    mask_method: str = "topk"
    topk_ratio: float = 0.5
    cdf_threshold: float = 0.9
    dense_prefix_tokens: int = 0
    dense_diagonal: int = 1
    precision: str = "fp8_e4m3"
    softmax_scale: float = 0.0

    def __post_init__(self):
        if [f.name for f in fields(self)] != [a.name for a in ATTRIBUTES]:
            raise AssertionError("SparseAttentionConfig and ATTRIBUTES disagree")  # pragma: no cover
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"block sizes must be positive, got {self.block_q}, {self.block_k}")
        if self.mask_method not in MASK_METHODS:
            raise ValueError(f"mask_method must be one of {MASK_METHODS}, got {self.mask_method!r}")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"topk_ratio must be in (0, 1], got {self.topk_ratio}")
        if not 0.0 < self.cdf_threshold <= 1.0:
            raise ValueError(f"cdf_threshold must be in (0, 1], got {self.cdf_threshold}")
        if self.dense_prefix_tokens < 0:
            raise ValueError(f"dense_prefix_tokens must be >= 0, got {self.dense_prefix_tokens}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")

    def scale_for(self, head_dim: int) -> float:
        return self.softmax_scale or 1.0 / math.sqrt(head_dim)

    def onnx_attributes(self) -> dict[str, Any]:
        return asdict(self)


def register_onnx_schema() -> None:
    """Make ONNX (and so the exporter) know ``machgen::SparseAttention``; idempotent."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "string": OpSchema.AttrType.STRING}
    tensor = [("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "q, k, v and output")]
    onnx.defs.register_schema(OpSchema(
        OP_TYPE, DOMAIN, OP_VERSION, doc=__doc__,
        inputs=[OpSchema.FormalParameter(name, "T", "[batch, tokens, heads, head_dim]") for name in ("q", "k", "v")],
        outputs=[OpSchema.FormalParameter("output", "T", "[batch, tokens, heads, head_dim]")],
        type_constraints=tensor,
        attributes=[OpSchema.Attribute(a.name, kinds[a.kind], a.doc, required=False) for a in ATTRIBUTES]))

