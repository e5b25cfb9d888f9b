"""Unified sequence parallel (USP): Ulysses inside ring. The Ulysses
all-to-all gives each rank whole ring-chunks of its share of the heads; ring
attention then runs over the ring group; the output goes back by the second
all-to-all. With one axis of degree 1 it is plain Ulysses or plain ring, so
this is the attention every sequence layout runs.

Self-attention only: queries, keys and values are chunks of one sequence.
Attention whose keys are not split (a video model's text cross-attention)
needs no exchange: each rank attends from its own query chunk.
"""

from __future__ import annotations

import torch

from machgen.parallel.mesh import RankMesh
from machgen.parallel.ring import ring_attention
from machgen.parallel.state import stale_blocks
from machgen.parallel.ulysses import ulysses_attention


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: RankMesh,
                                scale: float | None = None, overlap: bool = True,
                                values: list | None = None) -> torch.Tensor:
    """Softmax attention over the whole sequence of ``mesh``'s sequence group,
    each rank holding its chunk ([B, T/(u*r), H, D], chunks in sequence-rank order);
    ``values``: v's Ulysses exchange, already under way (ulysses.start_values)."""
    stale = stale_blocks() if mesh.layout.stale and mesh.ring_group is not None else None

    def ring(whole_q, whole_k, whole_v):
        if stale is not None:  # the layout's stale-keys ring (parallel/stale.py)
            return stale.attend(whole_q, whole_k, whole_v, mesh.ring_group, scale)
        return ring_attention(whole_q, whole_k, whole_v, mesh.ring_group, scale, overlap)

    return ulysses_attention(q, k, v, mesh.ulysses_group, ring, overlap, values)


def shard_sequence(tensor: torch.Tensor, axis: int, mesh: RankMesh) -> torch.Tensor:
    """This rank's chunk of ``tensor``'s token axis (chunks in sequence-rank order)."""
    return tensor.chunk(mesh.layout.sequence_degree, dim=axis)[mesh.sequence_rank].contiguous()


def gather_sequence(chunk: torch.Tensor, axis: int, mesh: RankMesh) -> torch.Tensor:
    """Every sequence rank's chunk (shard_sequence's) as the whole tensor, on every rank of the group."""
    import torch.distributed as dist

    chunk = chunk.contiguous()
    chunks = [torch.empty_like(chunk) for _ in range(mesh.layout.sequence_degree)]
    dist.all_gather(chunks, chunk, group=mesh.sequence_group)
    return torch.cat(chunks, dim=axis)
