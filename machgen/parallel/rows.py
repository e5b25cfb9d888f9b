"""Parallel VAE decode: a decoder's activations split by rows of pixels
over every rank of the layout (xDiT's patch-parallel VAE, exact).

Each rank holds a band of rows of every activation, from the latent to the
decoded frames, so its activations take about 1/N of one device's memory.
A convolution reads ``padding`` rows beyond its band: each neighbouring rank
sends them (``machgen::halo_rows``), the picture's edges read zeros, which
is the convolution's own zero padding. An attention over a frame's pixels
(a decoder's mid-block) attends from the rank's rows over every rank's keys
(``machgen::rows_attention``). A normalisation over channels needs nothing;
one over space (group norm) would need partial sums: the families that
decode by rows declare only decoders without one.

Like machgen::sequence_attention, these ops are plain padding and attention
on one rank or where a call's rows are not split, so a build's parity check
runs the program as any other. The ranks run a call split when every rank
gets as many rows (ShardPlan ``ranks="all"``: parallel/program.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F


def _split_mesh():
    from machgen.parallel.op import split_mesh

    return split_mesh(all_ranks=True)


def _edge_rows(x: torch.Tensor, axis: int, count: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[axis] = count
    return x.new_zeros(shape)


@torch.library.custom_op("machgen::halo_rows", mutates_args=())
def halo_rows(x: torch.Tensor, axis: int, before: int, after: int) -> torch.Tensor:
    """``x`` with ``before`` rows in front of its ``axis`` and ``after``
    behind it: the neighbouring ranks' rows where the call's rows are split
    over the ranks, zeros at the picture's top and bottom."""
    mesh = _split_mesh()
    rank, ranks = (mesh.rank, mesh.layout.world_size) if mesh is not None else (0, 1)
    above = _edge_rows(x, axis, before)
    below = _edge_rows(x, axis, after)
    if ranks > 1 and (before or after):
        import torch.distributed as dist

        if x.shape[axis] < max(before, after):
            raise RuntimeError(f"a band of {x.shape[axis]} rows cannot lend its neighbours {max(before, after)}: "
                               "too many ranks for this picture's height")
        operations = []
        if rank > 0:  # the rank above reads our first rows and lends us its last
            operations += [dist.P2POp(dist.isend, x.narrow(axis, 0, after).contiguous(), rank - 1),
                           dist.P2POp(dist.irecv, above, rank - 1)]
        if rank < ranks - 1:
            operations += [dist.P2POp(dist.isend, x.narrow(axis, x.shape[axis] - before, before).contiguous(),
                                      rank + 1),
                           dist.P2POp(dist.irecv, below, rank + 1)]
        for request in dist.batch_isend_irecv([op for op in operations if op.tensor.numel()]):
            request.wait()
    return torch.cat([above, x, below], dim=axis)


@halo_rows.register_fake
def _(x, axis, before, after):
    shape = list(x.shape)
    shape[axis] = shape[axis] + before + after
    return x.new_empty(shape)


@torch.library.custom_op("machgen::rows_attention", mutates_args=())
def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA of q, k, v in [B, heads, pixels, D] (pixels row-major: a band
    of rows is a run of pixels) from this rank's pixels over every rank's
    keys and values, gathered in rank order (one all-gather)."""
    mesh = _split_mesh()
    if mesh is not None and mesh.layout.world_size > 1:
        import torch.distributed as dist

        keys_values = torch.stack([k, v]).contiguous()
        bands = [torch.empty_like(keys_values) for _ in range(mesh.layout.world_size)]
        dist.all_gather(bands, keys_values)
        k, v = torch.cat(bands, dim=3).unbind(0)
    return F.scaled_dot_product_attention(q, k, v).contiguous()


@rows_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def conv2d_by_rows(conv: torch.nn.Conv2d) -> Callable[[torch.Tensor], torch.Tensor]:
    """``conv``'s forward with its height padding read from the neighbouring ranks' rows."""
    if conv.padding_mode != "zeros" or conv.stride[0] != 1 or isinstance(conv.padding, str):
        raise ValueError(f"{conv}: only a zero-padded convolution of stride 1 along the rows is split by rows")
    pad_rows, pad_columns = conv.padding

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(halo_rows(x, 2, pad_rows, pad_rows), (pad_columns, pad_columns))
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    return forward


@contextlib.contextmanager
def split_by_rows(module: torch.nn.Module,
                  forward_by_rows: Callable[[torch.nn.Module], Callable[..., Any] | None]) -> Iterator[None]:
    """Inside, every submodule of ``module`` for which ``forward_by_rows``
    gives a forward runs it instead of its own (on the instance: the same
    classes elsewhere are untouched)."""
    swapped = []
    try:
        for sub in module.modules():
            forward = forward_by_rows(sub)
            if forward is not None:
                sub.forward = forward
                swapped.append(sub)
        yield
    finally:
        for sub in swapped:
            del sub.forward
