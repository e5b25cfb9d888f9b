"""Ulysses sequence parallel: each rank holds a chunk of the sequence with
every head; one all-to-all gives it every chunk of a share of the heads,
attention runs on whole sequences, and a second all-to-all takes the output
back to the sequence chunks.

Q, K and V travel in one stacked ``all_to_all_single``. Per layer a rank
sends and receives 4(k-1)/k^2 x S x hidden elements (3 for Q, K, V and 1
for the output; S the whole sequence, k the degree). Tensors are in
diffusers' attention layout [batch, tokens, heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def scatter_heads(stacked: torch.Tensor, group) -> torch.Tensor:
    """[n, B, T/k, H, D] sequence chunks with every head -> [n, B, T, H/k, D]
    whole sequences (chunks in rank order) with this rank's share of the heads."""
    degree = dist.get_world_size(group)
    n, batch, tokens, heads, dim = stacked.shape
    # [k (head share: whose), n, B, T/k, H/k, D]: all_to_all_single sends slice j of dim 0 to rank j.
    outgoing = stacked.reshape(n, batch, tokens, degree, heads // degree, dim).permute(3, 0, 1, 2, 4, 5)
    incoming = torch.empty_like(outgoing, memory_format=torch.contiguous_format)
    dist.all_to_all_single(incoming, outgoing.contiguous(), group=group)
    # dim 0 is now the sequence chunk each slice came from.
    return incoming.permute(1, 2, 0, 3, 4, 5).reshape(n, batch, degree * tokens, heads // degree, dim)


def gather_heads(output: torch.Tensor, group) -> torch.Tensor:
    """[B, T, H/k, D] whole sequences of this rank's heads -> [B, T/k, H, D]
    this rank's sequence chunk with every head (scatter_heads' inverse)."""
    degree = dist.get_world_size(group)
    batch, tokens, heads, dim = output.shape
    # [k (sequence chunk: whose), B, T/k, H/k, D]
    outgoing = output.reshape(batch, degree, tokens // degree, heads, dim).permute(1, 0, 2, 3, 4)
    incoming = torch.empty_like(outgoing, memory_format=torch.contiguous_format)
    dist.all_to_all_single(incoming, outgoing.contiguous(), group=group)
    # dim 0 is now the head share each slice came from.
    return incoming.permute(1, 2, 0, 3, 4).reshape(batch, tokens // degree, degree * heads, dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, attention) -> torch.Tensor:
    """``attention(q, k, v)`` over the whole sequence of the ranks in
    ``group``, each holding its chunk of q, k and v ([B, T/k, H, D])."""
    if group is None or dist.get_world_size(group) == 1:
        return attention(q, k, v)
    whole_q, whole_k, whole_v = scatter_heads(torch.stack([q, k, v]), group).unbind(0)
    return gather_heads(attention(whole_q, whole_k, whole_v), group)
