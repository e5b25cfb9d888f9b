"""Sparse attention (plugins/reference.py's operator: its block mask, its FP8 or bf16 rounding) on a ring:
each ring rank keeps its chunk of the queries and passes its keys and values round the ring (ring.py's
``circulate``), and gets what one rank computes on the whole sequence.

What makes it one rank's result:
- the block mask: a query block's row depends only on its own mean query and every key block's mean; each
  rank averages its own key blocks, one all-gather gives every rank all of them (a block-th of the keys), and
  each rank computes the rows of its own query blocks (reference.mask_of_pooled).
- the rounding of q, k and v: per block of tokens and head, so a rank whose chunk is made of whole blocks
  rounds them as one rank does.
- the rounding of the probabilities: relative to the row's maximum over every key it may attend to, which no
  rank knows before it has seen every chunk: the keys then go round twice, first alone for the maxima. With
  fp32 products there is no such rounding: one round, the partial sums rescaled as the maximum grows.
A chunk that is not made of whole blocks of one rank's sequence (a token count the blocks do not divide, a
joint sequence's leading stream split into parts smaller than a block) is attended after an all-gather of the
ring's queries, keys and values: the same result, without the ring's saving of memory.

A query chunk's products with a key chunk are masked dense torch products (exact on any device; the Triton
kernel's skipping of dropped blocks is not used here).

Tensors are in diffusers' attention layout [batch, tokens, heads, head_dim]. ``positions`` (one per ring rank,
in ring order): where that rank's tokens, in the order it holds them, sit in one rank's sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from machgen.parallel.ring import circulate
from machgen.plugins.ops import sparse_attention
from machgen.plugins.reference import mask_of_pooled, padded_blocks, pooled, round_blocks, round_probabilities
from machgen.plugins.schema import SparseAttentionConfig

ROUNDED_PROBABILITIES = ("fp8_e4m3", "bf16")


def joint_positions(chunks: Sequence[int], tokens: int, leading_tokens: int, degree: int) -> torch.Tensor:
    """The places in one rank's sequence of ``tokens`` (its ``leading_tokens`` first: a joint attention's text)
    of sequence chunks ``chunks`` (of ``degree``), each its share of the leading tokens, then of the others."""
    lead, rest = leading_tokens // degree, (tokens - leading_tokens) // degree
    parts = []
    for chunk in chunks:
        parts += [torch.arange(chunk * lead, (chunk + 1) * lead),
                  leading_tokens + torch.arange(chunk * rest, (chunk + 1) * rest)]
    return torch.cat(parts)


def _whole_blocks(positions: torch.Tensor, block: int) -> bool:
    """Whether ``positions`` run through whole blocks of ``block`` tokens, each in order."""
    if len(positions) % block:
        return False
    rows = positions.view(-1, block)
    return bool((rows[:, 0] % block == 0).all() and (rows == rows[:, :1] + torch.arange(block)).all())


@dataclass(frozen=True)
class RingChunks:
    """Where each ring rank's tokens sit in one rank's sequence (``positions``, in ring order), and whether
    every chunk is made of whole blocks (``whole_blocks``: else the ring is gathered)."""

    positions: tuple[torch.Tensor, ...]
    whole_blocks: bool


@functools.lru_cache(maxsize=64)
def ring_chunks(tokens: int, leading_tokens: int, ulysses: int, ring: int, block_q: int, block_k: int) -> RingChunks:
    """The ring ranks' chunks of a sequence of ``tokens`` under USP (after the Ulysses exchange each ring rank
    holds its Ulysses group's sequence chunks, in order). The same for every layer and step of a shape: kept."""
    degree = ulysses * ring
    positions = tuple(joint_positions(range(index * ulysses, (index + 1) * ulysses), tokens, leading_tokens, degree)
                      for index in range(ring))
    return RingChunks(positions, all(_whole_blocks(p, block) for p in positions for block in (block_q, block_k)))


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def ring_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, config: SparseAttentionConfig,
                          chunks: RingChunks) -> torch.Tensor:
    """This ring rank's output chunk of the sparse attention over every ring rank's chunk of q, k and v."""
    positions = chunks.positions
    if not chunks.whole_blocks:
        return _gathered(q, k, v, group, config, positions)
    block_q, block_k = config.block_q, config.block_k
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, chunk, D]
    own = positions[dist.get_rank(group)]
    key_blocks = [p[::block_k] // block_k for p in positions]
    means = _all_gather(pooled(k.float(), block_k), group)
    pooled_k = means[0].new_empty(*means[0].shape[:2], sum(len(ids) for ids in key_blocks), means[0].shape[-1])
    for ids, mean in zip(key_blocks, means):
        pooled_k[:, :, ids] = mean
    q_starts = own[::block_q]
    k_starts = torch.arange(pooled_k.shape[2]) * block_k
    rows = mask_of_pooled(pooled(q.float(), block_q), pooled_k, (q_starts, q_starts + block_q),
                          (k_starts, k_starts + block_k), config)  # [B, H, own query blocks, key blocks]
    q, k, v = (round_blocks(padded_blocks(t, block), config.precision).flatten(2, 3)
               for t, block in ((q, block_q), (k, block_k), (v, block_k)))
    scale = config.scale_for(q.shape[-1])

    def scores(source: int, keys: torch.Tensor) -> torch.Tensor:
        allowed = rows[..., key_blocks[source]].repeat_interleave(block_q, dim=2).repeat_interleave(block_k, dim=3)
        return ((q @ keys.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))

    total = sums = None
    if config.precision in ROUNDED_PROBABILITIES:
        maximum = None
        for source, keys in circulate(k, group):
            row_max = scores(source, keys).amax(dim=-1, keepdim=True)
            maximum = row_max if maximum is None else torch.maximum(maximum, row_max)
        for source, block in circulate(torch.stack([k, v]), group):
            p = torch.exp(scores(source, block[0]) - maximum)  # every row keeps a key: the maximum is finite
            part, part_sums = round_probabilities(p, config.precision) @ block[1], p.sum(dim=-1, keepdim=True)
            total, sums = (part, part_sums) if total is None else (total + part, sums + part_sums)
    else:
        maximum = None
        for source, block in circulate(torch.stack([k, v]), group):
            s = scores(source, block[0])
            grown = s.amax(dim=-1, keepdim=True) if maximum is None else torch.maximum(maximum, s.amax(-1, True))
            shift = torch.where(torch.isinf(grown), torch.zeros_like(grown), grown)  # no key yet: nothing to scale
            p = torch.exp(s - shift)
            part, part_sums = p @ block[1], p.sum(dim=-1, keepdim=True)
            if total is not None:
                kept = torch.exp(maximum - shift)
                part, part_sums = total * kept + part, sums * kept + part_sums
            total, sums, maximum = part, part_sums, grown
    return (total / sums).transpose(1, 2).to(q.dtype).contiguous()


def _gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, config: SparseAttentionConfig,
              positions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every ring rank's q, k and v gathered, put in one rank's order, attended whole; this rank's rows."""
    places = torch.cat(list(positions))
    whole = []
    for tensor in (q, k, v):
        gathered = torch.cat(_all_gather(tensor, group), dim=1)
        ordered = torch.empty_like(gathered)
        ordered[:, places] = gathered
        whole.append(ordered)
    return sparse_attention(*whole, config)[:, positions[dist.get_rank(group)]].contiguous()
