"""The operator's GPU kernel: block-sparse flash attention in OpenAI Triton,
with FP8 e4m3 QK and PV products on Hopper.

One program per (query block, batch x head) walks only the key blocks its
mask keeps (a list of indices per query block, predicted by
reference.block_mask), with the online softmax of FlashAttention. For
``fp8_e4m3`` q, k and v arrive as float8 with one float32 scale per block
of tokens and head (quantized by ``quantize``, as the reference rounds
them); the probabilities exp(s - running max), which lie in (0, 1], are
rounded to float8 with the fixed scale 448 before the PV product, and the
row sums stay in float32. v travels transposed ([B, H, D, N]) so that the
PV product's second operand is K-major, as Hopper's FP8 tensor-core
instructions want it.

Without a GPU the kernel runs under Triton's interpreter
(TRITON_INTERPRET=1 set before this module is imported): slow, and its
float8 conversion rounds differently from the hardware's, but the same
program, which is how the CPU tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from machgen.plugins import reference
from machgen.plugins.schema import FP8_E4M3_MAX, SparseAttentionConfig

_PRECISION_CODES = {"fp8_e4m3": 0, "bf16": 1, "fp32": 2}
_LOG2_E = 1.4426950408889634


@triton.jit
def _block_sparse_attention(
    Q, K, VT, Out, QScale, KScale, VScale, KeptBlocks, KeptCount,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vh, stride_vd,
    stride_ob, stride_on, stride_oh,
    heads, tokens, kv_tokens, q_blocks, k_blocks, max_kept, scale_log2,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    query_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    rows = query_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                mask=rows[:, None] < tokens, other=0.0)
    q_scale = tl.load(QScale + batch_head * q_blocks + query_block)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    kept = KeptBlocks + (batch_head * q_blocks + query_block) * max_kept
    count = tl.load(KeptCount + batch_head * q_blocks + query_block)
    for index in range(0, count):
        key_block = tl.load(kept + index)
        cols = key_block * BLOCK_K + tl.arange(0, BLOCK_K)
        k = tl.load(K + b * stride_kb + h * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=cols[:, None] < kv_tokens, other=0.0)
        vt = tl.load(VT + b * stride_vb + h * stride_vh + dims[:, None] * stride_vd + cols[None, :],
                     mask=cols[None, :] < kv_tokens, other=0.0)
        k_scale = tl.load(KScale + batch_head * k_blocks + key_block)
        v_scale = tl.load(VScale + batch_head * k_blocks + key_block)
        if PRECISION == 2:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * (q_scale * k_scale * scale_log2)  # log2 domain: exp2 below
        s = tl.where(cols[None, :] < kv_tokens, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if PRECISION == 0:
            pv = tl.dot((p * 448.0).to(tl.float8e4nv), tl.trans(vt)) * (v_scale / 448.0)
        elif PRECISION == 1:
            pv = tl.dot(p.to(tl.bfloat16), tl.trans(vt))
        else:
            pv = tl.dot(p, tl.trans(vt), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + dims[None, :],
             out.to(Out.dtype.element_ty), mask=rows[:, None] < tokens)


def quantize(x: torch.Tensor, block: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, N, H, D] in the kernel's operand type, and its per-(batch, head,
    block) float32 scales [B, H, blocks] (ones unless fp8)."""
    heads_first = x.transpose(1, 2)
    blocks = reference._padded_blocks(heads_first.float(), block)  # [B, H, nb, block, D]
    if precision != "fp8_e4m3":
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        return x.to(dtype), torch.ones(blocks.shape[:3], device=x.device)
    scale = torch.clamp(blocks.abs().amax(dim=(-2, -1)), min=1e-12) / FP8_E4M3_MAX
    scaled = (blocks / scale[..., None, None]).to(torch.float8_e4m3fn)
    scaled = scaled.flatten(2, 3)[:, :, :x.shape[1]].transpose(1, 2)
    return scaled, scale.contiguous()


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: SparseAttentionConfig,
                     mask: torch.Tensor | None = None, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """The operator on q, k, v [B, N, H, D] (float32 or bfloat16), output in q's dtype;
    ``num_warps``/``num_stages`` are the launch's (perf/gpu_attention.py --tune)."""
    batch, tokens, heads, head_dim = q.shape
    kv_tokens = k.shape[1]
    if mask is None:
        mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
    kept, counts = reference.kept_block_lists(mask)
    kept = kept.to(torch.int32)
    q_op, q_scale = quantize(q, config.block_q, config.precision)
    k_op, k_scale = quantize(k, config.block_k, config.precision)
    v_op, v_scale = quantize(v, config.block_k, config.precision)
    v_transposed = v_op.permute(0, 2, 3, 1).contiguous()  # [B, H, D, N]
    q_op, k_op = q_op.contiguous(), k_op.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: the kernel assumes it
    q_blocks, k_blocks = mask.shape[2], mask.shape[3]
    grid = (q_blocks, batch * heads)
    _block_sparse_attention[grid](
        q_op, k_op, v_transposed, out, q_scale, k_scale, v_scale, kept, counts,
        q_op.stride(0), q_op.stride(1), q_op.stride(2), k_op.stride(0), k_op.stride(1), k_op.stride(2),
        v_transposed.stride(0), v_transposed.stride(1), v_transposed.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, tokens, kv_tokens, q_blocks, k_blocks, kept.shape[-1],
        config.scale_for(head_dim) * _LOG2_E,
        BLOCK_Q=config.block_q, BLOCK_K=config.block_k, HEAD_DIM=head_dim,
        PRECISION=_PRECISION_CODES[config.precision], num_warps=num_warps, num_stages=num_stages,
    )
    return out
