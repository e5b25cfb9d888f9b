"""The operator in torch: its block mask, a CPU reference that skips the
blocks the mask drops, and the same computation written as masked dense
attention in standard ops (what the ONNX Runtime target runs).

Rounding (``precision``), identical in both forms so that they agree to
float32 accuracy: ``fp8_e4m3`` rounds q, k and v to float8 e4m3 with one
scale per block of tokens and head (the block's absolute maximum maps to
448), and the unnormalised probabilities exp(s - rowmax), which lie in
(0, 1], with the fixed scale 448, as FP8 attention kernels do; the row sums
stay in float32. ``bf16`` rounds the same operands to bfloat16. A kept
block always holds at least one key (every query block keeps at least one
key block), so no row is empty and no NaN can appear.
"""

from __future__ import annotations

import math

import torch

from machgen.plugins.schema import FP8_E4M3_MAX, SparseAttentionConfig


def _blocks(tokens: int, block: int) -> int:
    return (tokens + block - 1) // block


def padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[B, H, N, D] -> [B, H, blocks, block, D], zero-padded at the end."""
    tokens = x.shape[2]
    count = _blocks(tokens, block)
    x = torch.nn.functional.pad(x, (0, 0, 0, count * block - tokens))
    return x.unflatten(2, (count, block))


def block_bounds(tokens: int, block: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.arange(_blocks(tokens, block), device=like.device) * block
    return starts, torch.clamp(starts + block, max=tokens)


def pooled(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over the real tokens of each block: [B, H, N, D] -> [B, H, blocks, D]."""
    starts, ends = block_bounds(x.shape[2], block, x)
    counts = (ends - starts).to(x.dtype)
    return padded_blocks(x, block).sum(dim=3) / counts[:, None]


def block_mask(q: torch.Tensor, k: torch.Tensor, config: SparseAttentionConfig) -> torch.Tensor:
    """Which key blocks each query block attends to: bool [B, H, q_blocks, k_blocks]
    from q, k in [B, H, N, D]."""
    return mask_of_pooled(pooled(q.float(), config.block_q), pooled(k.float(), config.block_k),
                          block_bounds(q.shape[2], config.block_q, q), block_bounds(k.shape[2], config.block_k, k),
                          config)


def mask_of_pooled(pooled_q: torch.Tensor, pooled_k: torch.Tensor, q_bounds: tuple[torch.Tensor, torch.Tensor],
                   k_bounds: tuple[torch.Tensor, torch.Tensor], config: SparseAttentionConfig) -> torch.Tensor:
    """block_mask's rows for the query blocks of ``pooled_q`` [B, H, qb, D] over the key blocks of ``pooled_k``
    [B, H, kb, D] (float32 block means), given each block's (start, end) token in the whole sequence: a
    query block's row depends only on its own mean and every key block's, so a rank holding some query
    blocks computes their rows exactly (parallel/sparse_ring.py)."""
    scores = pooled_q @ pooled_k.transpose(-1, -2) * config.scale_for(pooled_q.shape[-1])
    probabilities = torch.softmax(scores, dim=-1)
    ranked = torch.sort(probabilities, dim=-1, descending=True).values
    if config.mask_method == "topk":
        kept = torch.ceil(config.topk_ratio * torch.ones_like(ranked).sum(dim=-1, keepdim=True))
    else:  # cdf: the fewest blocks whose probabilities reach the threshold
        before = torch.cumsum(ranked, dim=-1) - ranked
        kept = (before < config.cdf_threshold).to(ranked.dtype).sum(dim=-1, keepdim=True)
    kept = torch.clamp(kept, min=1).to(torch.int64)
    mask = probabilities >= torch.gather(ranked, -1, kept - 1)

    (q_starts, q_ends), (k_starts, k_ends) = q_bounds, k_bounds
    dense = (q_starts[:, None] < config.dense_prefix_tokens) | (k_starts[None, :] < config.dense_prefix_tokens)
    if config.dense_diagonal:
        dense = dense | ((q_starts[:, None] < k_ends[None, :]) & (k_starts[None, :] < q_ends[:, None]))
    return mask | dense


def round_blocks(blocks: torch.Tensor, precision: str) -> torch.Tensor:
    """q, k or v as [B, H, blocks, block, D], rounded as ``precision`` says."""
    if precision == "fp8_e4m3":
        scale = torch.clamp(blocks.abs().amax(dim=(-2, -1), keepdim=True), min=1e-12) / FP8_E4M3_MAX
        return (blocks / scale).to(torch.float8_e4m3fn).to(blocks.dtype) * scale
    if precision == "bf16":
        return blocks.to(torch.bfloat16).to(blocks.dtype)
    return blocks


def round_probabilities(p: torch.Tensor, precision: str) -> torch.Tensor:
    if precision == "fp8_e4m3":
        return (p * FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(p.dtype) / FP8_E4M3_MAX
    if precision == "bf16":
        return p.to(torch.bfloat16).to(p.dtype)
    return p


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, N, H, D] <-> [B, H, N, D]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            precision: str) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return (round_probabilities(p, precision) @ v) / p.sum(dim=-1, keepdim=True)


def masked_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           config: SparseAttentionConfig) -> torch.Tensor:
    """The operator as one masked dense attention in standard ops ([B, N, H, D]
    in and out): the form exported for ONNX Runtime. It does every product,
    so it is no faster than dense; it exists to give the same result."""
    q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
    tokens, kv_tokens = q.shape[2], k.shape[2]
    mask = block_mask(q, k, config)
    allowed = mask.repeat_interleave(config.block_q, dim=2).repeat_interleave(config.block_k, dim=3)
    allowed = allowed[:, :, :tokens, :kv_tokens]
    rounded = [round_blocks(padded_blocks(x, block), config.precision).flatten(2, 3)[:, :, :x.shape[2]]
               for x, block in ((q, config.block_q), (k, config.block_k), (v, config.block_k))]
    out = _attend(*rounded, allowed, config.scale_for(q.shape[-1]), config.precision)
    return _heads_first(out.to(q.dtype))


def kept_block_lists(mask: torch.Tensor, trim: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask [B, H, qb, kb] as per-query-block index lists: (indices
    [B, H, qb, most kept] (``trim``) or [B, H, qb, kb], the kept ones first
    in key order, then the dropped ones; counts [B, H, qb] int32)."""
    counts = mask.sum(dim=-1, dtype=torch.int32)
    blocks = mask.shape[-1]
    # Distinct sort keys (exact in float32 below 2^24 blocks), so that every sort, TensorRT's TopK included,
    # gives this order.
    keys = (~mask).to(torch.float32) * blocks + torch.arange(blocks, device=mask.device, dtype=torch.float32)
    order = torch.argsort(keys, dim=-1)
    if trim:
        order = order[..., :int(counts.max())]
    return order.contiguous(), counts.contiguous()


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: SparseAttentionConfig,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU reference ([B, N, H, D] in and out): per query block, gathers
    only the key blocks its mask keeps, so its time falls with sparsity."""
    q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
    if mask is None:
        mask = block_mask(q, k, config)
    tokens, kv_tokens, head_dim = q.shape[2], k.shape[2], q.shape[-1]
    q_blocks = round_blocks(padded_blocks(q, config.block_q), config.precision)
    k_blocks = round_blocks(padded_blocks(k, config.block_k), config.precision)
    v_blocks = round_blocks(padded_blocks(v, config.block_k), config.precision)
    key_is_real = (torch.arange(k_blocks.shape[2] * config.block_k, device=q.device) < kv_tokens)
    key_is_real = key_is_real.view(-1, config.block_k)
    scale = config.scale_for(head_dim)
    out = torch.empty_like(q_blocks)
    kept, counts = kept_block_lists(mask)
    for index in range(q_blocks.shape[2]):
        row = mask[:, :, index]  # [B, H, k_blocks]
        chosen = kept[:, :, index, :int(counts[:, :, index].max())]
        picked = chosen[..., None, None].expand(-1, -1, -1, config.block_k, head_dim)
        keys = torch.gather(k_blocks, 2, picked).flatten(2, 3)
        values = torch.gather(v_blocks, 2, picked).flatten(2, 3)
        allowed = torch.gather(row, -1, chosen)[..., None] & key_is_real[chosen]
        out[:, :, index] = _attend(q_blocks[:, :, index], keys, values, allowed.flatten(-2)[:, :, None, :],
                                   scale, config.precision)
    return _heads_first(out.flatten(2, 3)[:, :, :tokens].to(q.dtype))


def dense_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float = 0.0,
                            chunk: int = 2048) -> torch.Tensor:
    """Exact attention in float64 ([B, N, H, D]), in chunks of queries to bound memory."""
    q, k, v = (_heads_first(x).double() for x in (q, k, v))
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    parts = [torch.softmax(q[:, :, i:i + chunk] @ k.transpose(-1, -2) * scale, dim=-1) @ v
             for i in range(0, q.shape[2], chunk)]
    return _heads_first(torch.cat(parts, dim=2))


def oracle_block_mask(q: torch.Tensor, k: torch.Tensor, like: torch.Tensor, config: SparseAttentionConfig,
                      chunk_blocks: int = 16) -> torch.Tensor:
    """The best mask keeping as many key blocks per query block as ``like``:
    the blocks holding most of the exact attention (q, k in [B, H, N, D]).
    What a perfect predictor would choose; for judging ``block_mask``."""
    scale = config.scale_for(q.shape[-1])
    k_blocks = _blocks(k.shape[2], config.block_k)
    k_padded = torch.nn.functional.pad(k.double(), (0, 0, 0, k_blocks * config.block_k - k.shape[2]))
    key_is_real = torch.arange(k_padded.shape[2], device=k.device) < k.shape[2]
    masses = []
    for start in range(0, like.shape[2], chunk_blocks):
        rows = q[:, :, start * config.block_q:(start + chunk_blocks) * config.block_q].double()
        scores = (rows @ k_padded.transpose(-1, -2) * scale).masked_fill(~key_is_real, float("-inf"))
        mass = torch.softmax(scores, dim=-1).unflatten(-1, (k_blocks, config.block_k)).sum(-1)
        masses.append(padded_blocks(mass, config.block_q).sum(dim=3))
    mass = torch.cat(masses, dim=2)[:, :, :like.shape[2]]
    ranked = torch.sort(mass, dim=-1, descending=True).values
    kept = like.sum(dim=-1, keepdim=True).clamp(min=1)
    return mass >= torch.gather(ranked, -1, kept - 1)


def skipped_fraction(mask: torch.Tensor, q_tokens: int, k_tokens: int, block_q: int, block_k: int) -> float:
    """Share of the query-key products (FLOPs of QK and PV) the mask skips."""
    q_sizes = torch.diff(torch.clamp(torch.arange(mask.shape[2] + 1) * block_q, max=q_tokens)).double()
    k_sizes = torch.diff(torch.clamp(torch.arange(mask.shape[3] + 1) * block_k, max=k_tokens)).double()
    kept = (mask.double() * q_sizes[:, None] * k_sizes[None, :]).sum(dim=(-2, -1))
    return float(1.0 - (kept / (q_tokens * k_tokens)).mean())


def relative_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.double(), reference.double()
    return float(torch.linalg.vector_norm(value - reference) / torch.linalg.vector_norm(reference))
