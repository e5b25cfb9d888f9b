"""Ulysses sequence parallel: each rank holds a chunk of the sequence with
every head; one all-to-all gives it every chunk of a share of the heads,
attention runs on whole sequences, and a second all-to-all takes the output
back to the sequence chunks.

Q, K and V travel in one stacked ``all_to_all_single``. Per layer a rank
sends and receives 4(k-1)/k^2 x S x hidden elements (3 for Q, K, V and 1
for the output; S the whole sequence, k the degree). Tensors are in
diffusers' attention layout [batch, tokens, heads, head_dim].

Overlapped (the default where a rank's share of the heads splits in two):
the heads go in groups, every group's exchange started at once; attention
runs on a group as soon as it has arrived, while the next is in flight, and
its output leaves while the next group is computed. Attention is per head,
so the result is the same as in one exchange; the bytes are too.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

# Head groups of an overlapped exchange.
OVERLAP_GROUPS = 2


def _all_to_all(outgoing: torch.Tensor, group, arrived: Callable[[torch.Tensor], torch.Tensor]
                ) -> Callable[[], torch.Tensor]:
    """Start the exchange of ``outgoing`` (slice j of dim 0 to rank j); the returned call waits for it and
    gives ``arrived(incoming)``."""
    incoming = torch.empty_like(outgoing, memory_format=torch.contiguous_format)
    work = dist.all_to_all_single(incoming, outgoing.contiguous(), group=group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return arrived(incoming)

    return finish


def start_scatter_heads(stacked: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """[n, B, T/k, H, D] sequence chunks with every head -> (once waited for) [n, B, T, H/k, D] whole
    sequences (chunks in rank order) with this rank's share of the heads."""
    degree = dist.get_world_size(group)
    n, batch, tokens, heads, dim = stacked.shape
    # [k (head share: whose), n, B, T/k, H/k, D]
    outgoing = stacked.reshape(n, batch, tokens, degree, heads // degree, dim).permute(3, 0, 1, 2, 4, 5)
    # dim 0 of what arrives is the sequence chunk each slice came from.
    return _all_to_all(outgoing, group, lambda incoming: incoming.permute(1, 2, 0, 3, 4, 5).reshape(
        n, batch, degree * tokens, heads // degree, dim))


def start_gather_heads(output: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """[B, T, H/k, D] whole sequences of this rank's heads -> (once waited for) [B, T/k, H, D] this rank's
    sequence chunk with every head (scatter_heads' inverse)."""
    degree = dist.get_world_size(group)
    batch, tokens, heads, dim = output.shape
    # [k (sequence chunk: whose), B, T/k, H/k, D]
    outgoing = output.reshape(batch, degree, tokens // degree, heads, dim).permute(1, 0, 2, 3, 4)
    # dim 0 of what arrives is the head share each slice came from.
    return _all_to_all(outgoing, group, lambda incoming: incoming.permute(1, 2, 0, 3, 4).reshape(
        batch, tokens // degree, degree * heads, dim))


def scatter_heads(stacked: torch.Tensor, group) -> torch.Tensor:
    return start_scatter_heads(stacked, group)()


def gather_heads(output: torch.Tensor, group) -> torch.Tensor:
    return start_gather_heads(output, group)()


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, attention,
                      overlap: bool = True) -> torch.Tensor:
    """``attention(q, k, v)`` over the whole sequence of the ranks in
    ``group``, each holding its chunk of q, k and v ([B, T/k, H, D]);
    ``attention`` must treat heads independently where ``overlap`` (head
    groups pipelined, the module docstring) is on; off: one exchange each way."""
    if group is None or dist.get_world_size(group) == 1:
        return attention(q, k, v)
    degree = dist.get_world_size(group)
    share = q.shape[2] // degree
    if not overlap or share % OVERLAP_GROUPS:
        whole_q, whole_k, whole_v = scatter_heads(torch.stack([q, k, v]), group).unbind(0)
        return gather_heads(attention(whole_q, whole_k, whole_v), group)
    # Group g takes the g-th part of every rank's share of the heads: [3, B, T/k, k, groups, share/groups, D].
    stacked = torch.stack([q, k, v]).unflatten(3, (degree, OVERLAP_GROUPS, share // OVERLAP_GROUPS))
    arriving = [start_scatter_heads(stacked[:, :, :, :, group_index].flatten(3, 4), group)
                for group_index in range(OVERLAP_GROUPS)]
    leaving = []
    for arrived in arriving:
        whole_q, whole_k, whole_v = arrived().unbind(0)
        leaving.append(start_gather_heads(attention(whole_q, whole_k, whole_v), group))
    # Each group's output [B, T/k, k x share/groups, D], heads by rank: back to every rank's share in order.
    outputs = [left().unflatten(2, (degree, -1)) for left in leaving]
    return torch.stack(outputs, dim=3).flatten(2, 4)
