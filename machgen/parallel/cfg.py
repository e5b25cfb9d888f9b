"""CFG parallel: the rows of a step's denoiser call (an image's conditional
and unconditional rows, the rows of other requests batched with it) split
over the cfg groups, one gather per step.

A batch whose rows do not divide by the degree is padded with copies of its
last row, which the gather drops again: every group runs the same number of
rows, as its collectives need.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rows_per_group(rows: int, degree: int) -> int:
    return -(-rows // degree)


def split_rows(batch: torch.Tensor, group) -> torch.Tensor:
    """This cfg group's rows of ``batch`` (its first axis)."""
    if group is None or dist.get_world_size(group) == 1:
        return batch
    degree, me = dist.get_world_size(group), dist.get_rank(group)
    share = rows_per_group(batch.shape[0], degree)
    padding = share * degree - batch.shape[0]
    if padding:
        batch = torch.cat([batch, batch[-1:].expand(padding, *batch.shape[1:])])
    return batch[me * share:(me + 1) * share]


def gather_rows(part: torch.Tensor, rows: int, group) -> torch.Tensor:
    """Every group's rows (split_rows' parts) as one batch of ``rows`` rows, on every rank."""
    if group is None or dist.get_world_size(group) == 1:
        return part
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts)[:rows]
