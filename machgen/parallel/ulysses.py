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

Values first (in the rank processes: parallel/values_first.py): V's
exchange starts as soon as V is projected, before Q and K are, and only Q
and K leave at the attention itself.
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


def _groups(heads: int, degree: int, overlap: bool) -> int:
    """Head groups an exchange of ``heads`` heads over ``degree`` ranks goes in (1: one exchange each way)."""
    share = heads // degree
    return OVERLAP_GROUPS if overlap and share % OVERLAP_GROUPS == 0 else 1


def _start_groups(stacked: torch.Tensor, group, groups: int) -> list[Callable[[], torch.Tensor]]:
    """start_scatter_heads of ``stacked`` ([n, B, T/k, H, D]) in ``groups`` head groups, every one started:
    group g takes the g-th part of every rank's share of the heads."""
    if groups == 1:
        return [start_scatter_heads(stacked, group)]
    degree = dist.get_world_size(group)
    # [n, B, T/k, k, groups, share/groups, D]
    grouped = stacked.unflatten(3, (degree, groups, stacked.shape[3] // degree // groups))
    return [start_scatter_heads(grouped[:, :, :, :, index].flatten(3, 4), group) for index in range(groups)]


def start_values(v: torch.Tensor, group, overlap: bool = True) -> list[Callable[[], torch.Tensor]]:
    """The values' part of ``ulysses_attention``'s exchange ([B, T/k, H, D]), started ahead of the queries and
    keys (values first: parallel/values_first.py); hand the result to ``ulysses_attention(values=...)``."""
    degree = dist.get_world_size(group)
    return _start_groups(v.unsqueeze(0), group, _groups(v.shape[2], degree, overlap))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, attention,
                      overlap: bool = True, values: list[Callable[[], torch.Tensor]] | None = None) -> torch.Tensor:
    """``attention(q, k, v)`` over the whole sequence of the ranks in
    ``group``, each holding its chunk of q, k and v ([B, T/k, H, D]);
    ``attention`` must treat heads independently where ``overlap`` (head
    groups pipelined, the module docstring) is on; off: one exchange each way.
    ``values``: v's exchange, already under way (``start_values`` with the
    same ``overlap``); then only q and k leave here."""
    if group is None or dist.get_world_size(group) == 1:
        return attention(q, k, v)
    degree = dist.get_world_size(group)
    groups = _groups(q.shape[2], degree, overlap)
    if values is None:
        arriving = [lambda arrived=arrived: arrived().unbind(0)
                    for arrived in _start_groups(torch.stack([q, k, v]), group, groups)]
    else:
        if len(values) != groups:
            raise ValueError(f"the values left in {len(values)} head groups, the queries and keys go in {groups}")
        arriving = [lambda queries_keys=queries_keys, value=value: (*queries_keys().unbind(0), value()[0])
                    for queries_keys, value in zip(_start_groups(torch.stack([q, k]), group, groups), values)]
    leaving = []
    for arrived in arriving:
        whole_q, whole_k, whole_v = arrived()
        leaving.append(start_gather_heads(attention(whole_q, whole_k, whole_v), group))
    if groups == 1:
        return leaving[0]()
    # Each group's output [B, T/k, k x share/groups, D], heads by rank: back to every rank's share in order.
    outputs = [left().unflatten(2, (degree, -1)) for left in leaving]
    return torch.stack(outputs, dim=3).flatten(2, 4)
