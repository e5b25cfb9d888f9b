"""CFG parallel: the rows of a step's denoiser call (an image's conditional
and unconditional rows, the rows of other requests batched with it) split
over the cfg groups, one gather per step.

A batch whose rows do not divide by the degree is padded with copies of its
last row, which the gather drops again: every group runs the same number of
rows, as its collectives need. Per-request adapters name the batch's rows
that have any (and their scales): each group gets those of its own rows,
numbered as its rows are.
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


def group_rows(rows: int, group) -> list[int]:
    """The batch rows this cfg group runs (split_rows'), in order; a padding row is the last row again."""
    if group is None or dist.get_world_size(group) == 1:
        return list(range(rows))
    degree, me = dist.get_world_size(group), dist.get_rank(group)
    share = rows_per_group(rows, degree)
    return [min(me * share + index, rows - 1) for index in range(share)]


def split_adapter_rows(adapted: torch.Tensor, scales: torch.Tensor, rows: int, group
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """This cfg group's share of a forward's adapter selection: ``adapted``
    (the indices of the batch's rows that have adapters, contract.adapters'
    ROWS_INPUT) and their ``scales`` [len(adapted), rank], as indices into
    the group's own rows (a padding row has the last row's)."""
    if group is None or dist.get_world_size(group) == 1:
        return adapted, scales
    position = {int(row): index for index, row in enumerate(adapted.tolist())}
    kept = [(mine, position[row]) for mine, row in enumerate(group_rows(rows, group)) if row in position]
    return (torch.tensor([mine for mine, _ in kept], dtype=adapted.dtype),
            scales[torch.tensor([index for _, index in kept], dtype=torch.int64)])


def gather_rows(part: torch.Tensor, rows: int, group) -> torch.Tensor:
    """Every group's rows (split_rows' parts) as one batch of ``rows`` rows, on every rank."""
    if group is None or dist.get_world_size(group) == 1:
        return part
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts)[:rows]
