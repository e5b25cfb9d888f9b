"""Ring attention: each rank keeps its chunk of the queries and passes its
key/value block to the next rank, k-1 times, so that every query chunk meets
every key chunk. The next block is in flight (``batch_isend_irecv``) while
the current one is computed; the partial results are merged by their
log-sum-exp in float32, so the result is the whole softmax, not an
approximation.

Per layer a rank sends and receives 2(k-1)/k x S x hidden elements (K and
V, k-1 times a chunk). Tensors are in diffusers' attention layout
[batch, tokens, heads, head_dim].
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp: (output [B, Tq, H, D] float32,
    lse [B, Tq, H] float32). By the fused kernel where one returns the
    log-sum-exp (the CPU's flash kernel; CUDA's for 16-bit floats), else
    computed in float32."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    else:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.transpose(1, 2).float(), lse.transpose(1, 2).float()


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results (over disjoint keys) as one."""
    if out is None:
        return block_out, block_lse
    both = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - both).unsqueeze(-1) + block_out * torch.exp(block_lse - both).unsqueeze(-1),
            both)


def circulate(block: torch.Tensor, group, overlap: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
    """Every ring rank's ``block`` in turn, this rank's own first: (the ring index it came from, the block).
    Each block is passed on to the next rank, and the next one is received, while the caller computes on the
    current one (``overlap=False``: received before it is handed over, for measuring what overlap saves)."""
    degree, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    send_to, receive_from = ranks[(me + 1) % degree], ranks[(me - 1) % degree]
    block = block.contiguous()
    for step in range(degree):
        pending = []
        if step + 1 < degree:
            incoming = torch.empty_like(block)
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, block, send_to, group),
                                              dist.P2POp(dist.irecv, incoming, receive_from, group)])
            if not overlap:
                for request in pending:
                    request.wait()
                pending = []
        yield (me - step) % degree, block
        if step + 1 < degree:
            for request in pending:
                request.wait()
            block = incoming


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float | None = None,
                   overlap: bool = True) -> torch.Tensor:
    """Attention of this rank's query chunk over the keys and values of every
    rank in ``group`` ([B, T/k, H, D] each). ``overlap=False`` waits for each
    block before computing on the one held (for measuring what overlap saves)."""
    if group is None or dist.get_world_size(group) == 1:
        out, _ = attention_with_lse(q, k, v, scale)
        return out.to(q.dtype)
    out = lse = None
    for _, block in circulate(torch.stack([k, v]), group, overlap):
        block_out, block_lse = attention_with_lse(q, block[0], block[1], scale)
        out, lse = merge(out, lse, block_out, block_lse)
    return out.to(q.dtype)
