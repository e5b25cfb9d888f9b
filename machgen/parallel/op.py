"""``machgen::sequence_attention``: the self-attention of a denoiser built
for parallel layouts, as a torch custom op that the torch target's program
keeps as one node.

On one rank, or when a call's sequence is not split, it is softmax attention
(SDPA). In a rank process whose call has its sequence split over the ranks
(parallel/state.py's ``split_sequence``), it is Ulysses x ring attention over the rank mesh
(usp.py), each rank holding its chunk of the tokens. So one exported
program serves every layout the model allows, and a build's parity check
runs it on one rank as any other program.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from machgen.parallel.state import current_mesh, split_mesh


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          scale=scale).transpose(1, 2)


@torch.library.custom_op("machgen::sequence_attention", mutates_args=())
def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention on q, k, v in [B, N, H, D] (``scale`` <= 0: 1/sqrt(D))."""
    return attend_sequence(q, k, v, scale)


def attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    values: list | None = None) -> torch.Tensor:
    """``machgen::sequence_attention``; ``values``: v's Ulysses exchange, already under way (values_first.py)."""
    chosen = scale if scale > 0 else None
    mesh = split_mesh()
    if mesh is None:
        return _sdpa(q, k, v, chosen).contiguous()
    from machgen.parallel.usp import sequence_parallel_attention

    return sequence_parallel_attention(q, k, v, mesh, chosen, values=values).contiguous()


@sequence_attention.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


@torch.library.custom_op("machgen::sequence_shard", mutates_args=())
def sequence_shard(x: torch.Tensor, axis: int, marker: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of ``x``'s token ``axis``, of ``marker``'s length
    (the call's sequence degree: 1 for a sequence run whole) chunks. For a
    model whose program computes what its tokens need from the whole input
    (positions from a latent's shape): the split then happens inside."""
    degree = marker.shape[0]
    if degree == 1:
        return x.clone()
    mesh = current_mesh()
    rank = mesh.sequence_rank if mesh is not None else 0  # no mesh: one process, as rank 0 (a build's check)
    return x.chunk(degree, dim=axis)[rank].clone()


@sequence_shard.register_fake
def _(x, axis, marker):
    shape = list(x.shape)
    shape[axis] = shape[axis] // marker.shape[0]
    return x.new_empty(shape)


@torch.library.custom_op("machgen::sequence_gather", mutates_args=())
def sequence_gather(x: torch.Tensor, axis: int, like: torch.Tensor) -> torch.Tensor:
    """Every sequence rank's chunk (sequence_shard's) of a tensor shaped as
    ``like`` along ``axis``, whole, on every rank."""
    if x.shape[axis] == like.shape[axis]:
        return x.clone()
    mesh = current_mesh()
    if mesh is None:  # a build's check in one process: rank 0's chunk where the others' would be
        return torch.cat([x] * (like.shape[axis] // x.shape[axis]), dim=axis)
    from machgen.parallel.usp import gather_sequence

    return gather_sequence(x, axis, mesh)


@sequence_gather.register_fake
def _(x, axis, like):
    shape = list(x.shape)
    shape[axis] = like.shape[axis]
    return x.new_empty(shape)


@torch.library.custom_op("machgen::sequence_sparse_attention", mutates_args=())
def sequence_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leading_tokens: int,
                              block_q: int, block_k: int, mask_method: str, topk_ratio: float,
                              cdf_threshold: float, dense_prefix_tokens: int, dense_diagonal: int, precision: str,
                              softmax_scale: float) -> torch.Tensor:
    """``machgen::sparse_attention`` (its attributes after ``leading_tokens``)
    on q, k, v in [B, N, H, D]; with the sequence split, on whole sequences
    after the Ulysses exchange, so that its block mask is the one a single
    rank computes; with a ring, on each ring rank's chunks as one rank
    computes them (parallel/sparse_ring.py). ``leading_tokens``: the tokens
    of a joint attention's leading stream (Flux's text) in the whole
    sequence; each rank's chunk starts with its share of them, and the whole
    sequence is put back in single-rank order (every chunk's leading tokens
    first) around the op."""
    attributes = (block_q, block_k, mask_method, topk_ratio, cdf_threshold, dense_prefix_tokens, dense_diagonal,
                  precision, softmax_scale)
    return attend_sequence_sparse(q, k, v, leading_tokens, attributes)


def attend_sequence_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leading_tokens: int,
                           attributes: tuple, values: list | None = None) -> torch.Tensor:
    """``machgen::sequence_sparse_attention`` (``attributes``: its own after ``leading_tokens``); ``values``: v's
    Ulysses exchange, already under way (values_first.py)."""
    from machgen.plugins.ops import sparse_attention_op

    mesh = split_mesh()
    if mesh is None:
        return sparse_attention_op(q, k, v, *attributes).contiguous()
    from machgen.parallel.ulysses import ulysses_attention

    layout = mesh.layout
    if layout.ring > 1:
        from machgen.parallel.sparse_ring import ring_chunks, ring_sparse_attention
        from machgen.plugins.schema import SparseAttentionConfig

        block_q, block_k = attributes[:2]
        chunks = ring_chunks(q.shape[1] * layout.sequence_degree, leading_tokens, layout.ulysses, layout.ring,
                             block_q, block_k)

        def on_the_ring(chunk_q, chunk_k, chunk_v):
            return ring_sparse_attention(chunk_q, chunk_k, chunk_v, mesh.ring_group,
                                         SparseAttentionConfig(*attributes), chunks)

        return ulysses_attention(q, k, v, mesh.ulysses_group, on_the_ring, values=values).contiguous()
    degree = layout.ulysses

    def whole_sequences(whole_q, whole_k, whole_v):
        ordered = [single_rank_order(t, degree, leading_tokens) for t in (whole_q, whole_k, whole_v)]
        return chunk_order(sparse_attention_op(*ordered, *attributes), degree, leading_tokens)

    # Its block mask and FP8 scales are per head: heads exchanged in groups give the same.
    return ulysses_attention(q, k, v, mesh.ulysses_group, whole_sequences, values=values).contiguous()


@sequence_sparse_attention.register_fake
def _(q, k, v, *attributes):
    return torch.empty_like(q)


def single_rank_order(gathered: torch.Tensor, degree: int, leading_tokens: int) -> torch.Tensor:
    """[B, N, ...] of ``degree`` chunks each led by its share of ``leading_tokens`` -> every chunk's leading
    tokens, then every chunk's others (the order of one rank's joint sequence)."""
    if not leading_tokens:
        return gathered
    chunks = gathered.unflatten(1, (degree, -1))
    share = leading_tokens // degree
    return torch.cat([chunks[:, :, :share].flatten(1, 2), chunks[:, :, share:].flatten(1, 2)], dim=1)


def chunk_order(whole: torch.Tensor, degree: int, leading_tokens: int) -> torch.Tensor:
    """single_rank_order's inverse."""
    if not leading_tokens:
        return whole
    leading = whole[:, :leading_tokens].unflatten(1, (degree, -1))
    others = whole[:, leading_tokens:].unflatten(1, (degree, -1))
    return torch.cat([leading, others], dim=2).flatten(1, 2)


def sequence_sparse_attention_swapped(modules: Sequence[str], config, layers=None, leading_tokens: int = 0):
    """plugins/ops.attention_swapped for a parallel build: its sparse calls
    run ``machgen::sequence_sparse_attention`` (``leading_tokens``: its
    argument). Inside ``sequence_attention_swapped``, the calls the sparse
    swap leaves run the sequence attention."""
    from machgen.plugins.ops import attention_swapped

    def operator(q, k, v, chosen):
        return sequence_sparse_attention(q, k, v, leading_tokens, *chosen.onnx_attributes().values())

    return attention_swapped(modules, config, layers, operator=operator)


@torch.library.custom_op("machgen::sequence_keys_attention", mutates_args=())
def sequence_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of whole queries over keys and values split over the
    sequence ranks (LTX-2's sound attending its video), q, k, v in [B, N, H, D]:
    each rank attends over its chunk of the keys, and the partial results of
    every rank are merged by their log-sum-exp in rank order, the same on each
    rank (whose queries' stream goes on replicated)."""
    chosen = scale if scale > 0 else None
    mesh = split_mesh()
    if mesh is None:
        return _sdpa(q, k, v, chosen).contiguous()
    import torch.distributed as dist

    from machgen.parallel.ring import attention_with_lse, merge

    partial = attention_with_lse(q, k, v, chosen)
    gathered = [[torch.empty_like(part) for _ in range(mesh.layout.sequence_degree)] for part in partial]
    for parts, part in zip(gathered, partial):
        dist.all_gather(parts, part.contiguous(), group=mesh.sequence_group)
    out = lse = None
    for block_out, block_lse in zip(*gathered):
        out, lse = merge(out, lse, block_out, block_lse)
    return out.to(q.dtype).contiguous()


@sequence_keys_attention.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


def sequence_attention_swapped(modules: Sequence[str], layers: Sequence[torch.nn.Module] | None = None):
    """Inside the block, every unmasked, non-causal self-attention call of
    ``dispatch_attention_fn`` in ``modules`` (keys as long as the queries;
    ``layers``: only those made inside these attention modules) runs
    ``machgen::sequence_attention``. Cross-attention to keys that are not
    split (a video model's text) stays as it is: each rank attends from its
    own query chunk."""
    from machgen.plugins.ops import dispatch_swapped

    return dispatch_swapped(modules, lambda q, k, v, scale: sequence_attention(q, k, v, scale or 0.0), layers)


def sequence_keys_attention_swapped(modules: Sequence[str], layers: Sequence[torch.nn.Module]):
    """Inside the block, every unmasked call inside ``layers`` (attention
    modules whose keys, not queries, are the split sequence) runs
    ``machgen::sequence_keys_attention``."""
    from machgen.plugins.ops import dispatch_swapped

    return dispatch_swapped(modules, lambda q, k, v, scale: sequence_keys_attention(q, k, v, scale or 0.0),
                            layers, any_keys=True)
