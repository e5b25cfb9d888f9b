"""Values first: a rank's program sends V on its Ulysses exchange as soon as
V is projected, while Q and K are still being projected, normalised and
rotated, and only Q and K leave at the attention itself (TensorRT-LLM's
async Ulysses does the same). So the largest part of the exchange that
precedes attention has the queries' and keys' compute to hide under.

Diffusers' attention processors project V last, and the torch target's
program computes in the order they did. ``values_first`` rewrites a loaded
program's graph, whatever the family: for every sequence attention
(``machgen::sequence_attention``, ``machgen::sequence_sparse_attention``),
the nodes that V needs and the previous attention did not (the layer's
norm and modulation, V's projection, a joint attention's concatenation)
move up to just after the previous attention, a ``machgen::send_values``
node after them starts V's exchange, and the attention becomes its
``..._values_sent`` twin, which takes the exchange by its ticket. Moving a
node up past nodes it does not depend on changes no value: the program
computes exactly what it did. The rank processes load every program so
(parallel/rank_programs.py); a call whose sequence is not split, or a layout
without Ulysses, sends nothing (ticket -1) and attends as before.
"""

from __future__ import annotations

from typing import Any

import torch

from machgen.parallel import op
from machgen.parallel.state import hold_values, split_mesh, take_values

NOT_SENT = -1


@torch.library.custom_op("machgen::send_values", mutates_args=())
def send_values(v: torch.Tensor) -> torch.Tensor:
    """Start ``v``'s ([B, N, H, D]) Ulysses exchange where this call's sequence is split over Ulysses ranks; a
    ticket for the attention that takes it ([1] int64; NOT_SENT where nothing was sent)."""
    mesh = split_mesh()
    if mesh is None or mesh.layout.ulysses == 1:
        return torch.full((1,), NOT_SENT, dtype=torch.int64)
    from machgen.parallel.ulysses import start_values

    return torch.full((1,), hold_values(start_values(v, mesh.ulysses_group)), dtype=torch.int64)


@send_values.register_fake
def _(v):
    return v.new_empty((1,), dtype=torch.int64)


def _received(ticket: torch.Tensor) -> list | None:
    number = int(ticket.item())
    return None if number == NOT_SENT else take_values(number)


@torch.library.custom_op("machgen::sequence_attention_values_sent", mutates_args=())
def sequence_attention_values_sent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ticket: torch.Tensor,
                                   scale: float) -> torch.Tensor:
    """``machgen::sequence_attention`` whose values left already, on ``ticket``."""
    return op.attend_sequence(q, k, v, scale, values=_received(ticket))


@sequence_attention_values_sent.register_fake
def _(q, k, v, ticket, scale):
    return torch.empty_like(q)


@torch.library.custom_op("machgen::sequence_sparse_attention_values_sent", mutates_args=())
def sequence_sparse_attention_values_sent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ticket: torch.Tensor,
                                          leading_tokens: int, block_q: int, block_k: int, mask_method: str,
                                          topk_ratio: float, cdf_threshold: float, dense_prefix_tokens: int,
                                          dense_diagonal: int, precision: str, softmax_scale: float) -> torch.Tensor:
    """``machgen::sequence_sparse_attention`` whose values left already, on ``ticket``."""
    attributes = (block_q, block_k, mask_method, topk_ratio, cdf_threshold, dense_prefix_tokens, dense_diagonal,
                  precision, softmax_scale)
    return op.attend_sequence_sparse(q, k, v, leading_tokens, attributes, values=_received(ticket))


@sequence_sparse_attention_values_sent.register_fake
def _(q, k, v, ticket, *attributes):
    return torch.empty_like(q)


def _twins() -> dict[Any, Any]:
    """Each sequence attention and the twin that takes its values by ticket."""
    machgen = torch.ops.machgen
    return {machgen.sequence_attention.default: machgen.sequence_attention_values_sent.default,
            machgen.sequence_sparse_attention.default: machgen.sequence_sparse_attention_values_sent.default}


def values_first(module: torch.fx.GraphModule) -> int:
    """Rewrite ``module``'s graph in place so that every sequence attention's values leave first (the module
    docstring); the number of attentions rewritten."""
    graph, twins = module.graph, _twins()
    attentions = [node for node in graph.nodes if node.op == "call_function" and node.target in twins]
    if not attentions:
        return 0
    # Moved nodes go after this one: first the last node before any computation (inputs, weights, guards).
    anchor = next(node for node in graph.nodes if node.op == "call_function").prev
    for attention in attentions:
        values = attention.args[2]
        position = {node: index for index, node in enumerate(graph.nodes)}
        needed = _ancestors_after(values, position, position[anchor])
        for node in sorted(needed, key=position.__getitem__):
            anchor.append(node)
            anchor = node
        with graph.inserting_after(values):
            ticket = graph.call_function(torch.ops.machgen.send_values.default, (values,))
        attention.target = twins[attention.target]
        attention.args = (*attention.args[:3], ticket, *attention.args[3:])
        anchor = attention
    graph.lint()
    module.recompile()
    return len(attentions)


def _ancestors_after(node: torch.fx.Node, position: dict, after: int) -> set:
    """``node`` and the nodes it depends on that come after position ``after``."""
    found, pending = set(), [node]
    while pending:
        current = pending.pop()
        if current in found or position[current] <= after:
            continue
        found.add(current)
        pending.extend(current.all_input_nodes)
    return found
