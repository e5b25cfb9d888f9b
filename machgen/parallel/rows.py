"""Parallel VAE decode: a decoder's activations split by rows of pixels
over every rank of the layout (xDiT's patch-parallel VAE, exact).

Each rank holds a band of rows of every activation, from the latent to the
decoded frames, so its activations take about 1/N of one device's memory.
A convolution reads ``padding`` rows beyond its band: each neighbouring rank
sends them (``machgen::halo_rows``), the picture's edges read zeros, which
is the convolution's own zero padding. An attention over a frame's pixels
(a decoder's mid-block) attends from the rank's rows over every rank's keys
(``machgen::rows_attention``, swapped in as plugins/ops swaps attention). A normalisation over channels needs nothing;
one over space (group norm) would need partial sums: the families that
decode by rows declare only decoders without one.

Like machgen::sequence_attention, these ops are plain padding and attention
on one rank or where a call's rows are not split, so a build's parity check
runs the program as any other. The ranks run a call split when every rank
gets as many rows (ShardPlan ``ranks="all"``: parallel/rank_programs.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from machgen.parallel.state import split_mesh


# How a convolution pads at the picture's top and bottom: its padding_mode.
EDGES = ("zeros", "reflect")


def _edge_rows(x: torch.Tensor, axis: int, count: int, edge: str, top: bool) -> torch.Tensor:
    """The ``count`` rows a convolution padded by ``edge`` reads beyond x's first (``top``) or last row."""
    if edge == "zeros" or count == 0:
        shape = list(x.shape)
        shape[axis] = count
        return x.new_zeros(shape)
    start = 1 if top else x.shape[axis] - 1 - count
    return x.narrow(axis, start, count).flip(axis)  # reflect: the rows next to the edge row, mirrored


@torch.library.custom_op("machgen::halo_rows", mutates_args=())
def halo_rows(x: torch.Tensor, axis: int, before: int, after: int, edge: str) -> torch.Tensor:
    """``x`` with ``before`` rows in front of its ``axis`` and ``after``
    behind it: the neighbouring ranks' rows where the call's rows are split
    over the ranks, at the picture's top and bottom the padding ``edge``
    makes ("zeros", or "reflect": the rows next to the edge, mirrored)."""
    mesh = split_mesh(all_ranks=True)
    rank, ranks = (mesh.rank, mesh.layout.world_size) if mesh is not None else (0, 1)
    # Neighbours lend as many rows as they read; a reflection mirrors the rows after the edge row.
    needed = max(before, after) + 1 if edge == "reflect" else max(before, after) if ranks > 1 else 0
    if x.shape[axis] < needed:
        raise RuntimeError(f"a band of {x.shape[axis]} rows cannot pad {max(before, after)} ({edge}): too many "
                           "ranks for this picture's height")
    above = _edge_rows(x, axis, before, edge, top=True)
    below = _edge_rows(x, axis, after, edge, top=False)
    if ranks > 1 and (before or after):
        import torch.distributed as dist

        operations = []
        if rank > 0:  # the rank above reads our first rows and lends us its last
            above = torch.empty_like(above)
            operations += [dist.P2POp(dist.isend, x.narrow(axis, 0, after).contiguous(), rank - 1),
                           dist.P2POp(dist.irecv, above, rank - 1)]
        if rank < ranks - 1:
            below = torch.empty_like(below)
            operations += [dist.P2POp(dist.isend, x.narrow(axis, x.shape[axis] - before, before).contiguous(),
                                      rank + 1),
                           dist.P2POp(dist.irecv, below, rank + 1)]
        for request in dist.batch_isend_irecv([op for op in operations if op.tensor.numel()]):
            request.wait()
    return torch.cat([above, x, below], dim=axis)


@halo_rows.register_fake
def _(x, axis, before, after, edge):
    shape = list(x.shape)
    shape[axis] = shape[axis] + before + after
    return x.new_empty(shape)


@torch.library.custom_op("machgen::rows_attention", mutates_args=())
def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention on q, k, v in [B, pixels, heads, D] (dispatch_attention_fn's layout; pixels
    row-major, so a band of rows is a run of pixels; ``scale`` <= 0: 1/sqrt(D)) from this rank's pixels over
    every rank's keys and values, gathered in rank order (one all-gather)."""
    mesh = split_mesh(all_ranks=True)
    if mesh is not None:
        import torch.distributed as dist

        keys_values = torch.stack([k, v]).contiguous()
        bands = [torch.empty_like(keys_values) for _ in range(mesh.layout.world_size)]
        dist.all_gather(bands, keys_values)
        k, v = torch.cat(bands, dim=2).unbind(0)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         scale=scale if scale > 0 else None)
    return out.transpose(1, 2).contiguous()


@rows_attention.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


@contextlib.contextmanager
def attention_by_rows(module_name: str, layers: list[torch.nn.Module]) -> Iterator[None]:
    """Inside, the self-attention calls made inside ``layers`` (attention over a frame's pixels, in the
    module ``module_name``) run machgen::rows_attention (plugins/ops.dispatch_swapped)."""
    from machgen.plugins.ops import dispatch_swapped

    with dispatch_swapped((module_name,), lambda q, k, v, scale: rows_attention(q, k, v, scale or 0.0), layers):
        yield


def conv_by_rows(conv: torch.nn.Conv2d | torch.nn.Conv3d) -> Callable[[torch.Tensor], torch.Tensor]:
    """``conv``'s forward (2-D or 3-D, rows its last but one axis) with its row padding read from the
    neighbouring ranks' rows; its other padding as its own."""
    if conv.padding_mode not in EDGES or conv.stride[-2] != 1 or isinstance(conv.padding, str):
        raise ValueError(f"{conv}: only a convolution of stride 1 along the rows, padded with "
                         f"{' or '.join(EDGES)}, is split by rows")
    rows = conv.padding[-2]
    others = [0, 0, *(side for pad in reversed(conv.padding[:-2]) for side in (pad, pad))]  # F.pad: last axis first
    others[:2] = [conv.padding[-1]] * 2
    convolve = F.conv3d if isinstance(conv, torch.nn.Conv3d) else F.conv2d

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = halo_rows(x, x.dim() - 2, rows, rows, conv.padding_mode)
        x = F.pad(x, [*others[:2], 0, 0, *others[2:]], mode="constant" if conv.padding_mode == "zeros" else
                  conv.padding_mode)
        return convolve(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    return forward


def by_rows(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The forward a decoder's ``module`` runs split by rows where it reads beyond its own rows (a
    convolution padded along the rows), None where it does not; a normalisation over space is refused (it
    would need every rank's partial sums). A family adds its own modules that mix rows (attention)."""
    if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
        return conv_by_rows(module) if module.padding[-2] else None
    if isinstance(module, (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm)):
        raise ValueError(f"{type(module).__name__} normalises over space: a decoder with one is not split by rows")
    return None


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
