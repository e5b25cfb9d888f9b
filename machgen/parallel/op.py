"""``machgen::sequence_attention``: the self-attention of a denoiser built
for parallel layouts, as a torch custom op that the torch target's program
keeps as one node.

On one rank, or when a call's sequence is not split, it is softmax attention
(SDPA). In a rank process whose call has its sequence split over the ranks
(``split_sequence``), it is Ulysses x ring attention over the rank mesh
(usp.py), each rank holding its chunk of the tokens. So one exported
program serves every layout the model allows, and a build's parity check
runs it on one rank as any other program.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from machgen.parallel.mesh import RankMesh

_context = threading.local()
_MESH: RankMesh | None = None


def set_mesh(mesh: RankMesh | None) -> None:
    """The rank mesh of this process (a rank process sets it once)."""
    global _MESH
    _MESH = mesh


@contextlib.contextmanager
def split_sequence(split: bool) -> Iterator[None]:
    """Calls inside run on the rank's chunk of the sequence (``split``) or on
    the whole of it (a sequence the degree does not divide: every rank of the
    sequence group then computes the same, unsplit)."""
    previous = getattr(_context, "split", False)
    _context.split = split
    try:
        yield
    finally:
        _context.split = previous


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          scale=scale).transpose(1, 2)


@torch.library.custom_op("machgen::sequence_attention", mutates_args=())
def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention on q, k, v in [B, N, H, D] (``scale`` <= 0: 1/sqrt(D))."""
    chosen = scale if scale > 0 else None
    if _MESH is None or _MESH.layout.sequence_degree == 1 or not getattr(_context, "split", False):
        return _sdpa(q, k, v, chosen).contiguous()
    from machgen.parallel.usp import sequence_parallel_attention

    return sequence_parallel_attention(q, k, v, _MESH, chosen).contiguous()


@sequence_attention.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


def sequence_attention_swapped(modules: Sequence[str]):
    """Inside the block, every unmasked, non-causal self-attention call of
    ``dispatch_attention_fn`` in ``modules`` (keys as long as the queries)
    runs ``machgen::sequence_attention``. Cross-attention to keys that are
    not split (a video model's text) stays as it is: each rank attends from
    its own query chunk."""
    from machgen.plugins.ops import dispatch_swapped

    return dispatch_swapped(modules, lambda q, k, v, scale: sequence_attention(q, k, v, scale or 0.0))
