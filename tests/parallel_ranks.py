"""What the parallel tests run on each rank (imported by the spawned rank processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def full_inputs(batch: int, tokens: int, heads: int, dim: int, seed: int = 0):
    """q, k, v [B, T, H, D], the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, tokens, heads, dim, generator=generator) for _ in range(3))


def reference_attention(q, k, v):
    """SDPA on whole sequences, in diffusers' [B, T, H, D] layout."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def sequence_chunk(tensor, mesh):
    degree = mesh.layout.sequence_degree
    return tensor.chunk(degree, dim=1)[mesh.sequence_rank]


def attention_chunks(mesh, batch: int, tokens: int, heads: int, dim: int):
    """This rank's output chunk of sequence-parallel attention (overlapped and serialized ring), of its
    cfg group's rows."""
    from machgen.parallel.cfg import split_rows
    from machgen.parallel.usp import sequence_parallel_attention

    q, k, v = (sequence_chunk(split_rows(t, mesh.cfg_group), mesh) for t in full_inputs(batch, tokens, heads, dim))
    return (sequence_parallel_attention(q, k, v, mesh),
            sequence_parallel_attention(q, k, v, mesh, overlap=False))


# A stale layout's calls in stale_attention_chunks: (input shapes, the size of an input that moves).
STALE_CALLS = [("a", 1.0), ("a", 1.01), ("b", 1.01), ("b", 3.0), ("b", 3.03), ("a", 1.02), ("b", 3.06)]


def stale_attention_chunks(mesh, batch: int, tokens: int, heads: int, dim: int):
    """This rank's output chunks of a stale layout's sequence attention over STALE_CALLS with seeded inputs
    0, 1, ... (call 1's input 1 % off call 0's, call 2 of other shapes, call 3 its input tripled, then calls of
    the batches of calls 1 and 3 alternating, each 1 % on), and whether each reused earlier blocks."""
    from machgen.parallel.op import sequence_attention
    from machgen.parallel.stale import StaleBatches
    from machgen.parallel.state import attending, set_mesh, split_sequence

    set_mesh(mesh)
    stale, results = StaleBatches(mesh.layout.stale), []
    moving = torch.ones(4)
    for seed, (fingerprint, change) in enumerate(STALE_CALLS):
        q, k, v = (sequence_chunk(t, mesh) for t in full_inputs(batch, tokens, heads, dim, seed))
        blocks = stale.begin(fingerprint, {"latents": moving * change})
        with split_sequence(True), attending(blocks):
            results.append((sequence_attention(q, k, v, 0.0).numpy(), blocks.reusing))
    stale.drop()
    return results


def gathered_rows(mesh, rows: int):
    """split_rows then gather_rows of a [rows, 3] batch: every rank's view of the whole batch again."""
    from machgen.parallel.cfg import gather_rows, split_rows

    batch = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    part = split_rows(batch, mesh.cfg_group)
    return part, gather_rows(part * 2, rows, mesh.cfg_group)


def fails_on_rank_one(mesh):
    if mesh.rank == 1:
        raise ValueError("rank one fails on purpose")
    torch.distributed.barrier()  # rank 0 waits for a rank that never comes: the parent must end it


def identity(mesh):
    """This rank's process name and its parent's pid."""
    import os

    with open(f"/proc/{os.getpid()}/comm") as comm:
        return comm.read().strip(), os.getppid()


def dies_on_rank_one(mesh):
    """Rank one's process ends in the middle of a call (as if killed), the other waits for it in a collective."""
    import os

    if mesh.rank == 1:
        os._exit(3)
    torch.distributed.barrier()


def adapter_rows(mesh, rows: int, adapted: list[int]):
    """This cfg group's share (cfg.split_adapter_rows) of adapters on ``adapted`` of a ``rows``-row batch,
    each adapted row's scales [2 * its position, 2 * its position + 1]."""
    from machgen.parallel.cfg import split_adapter_rows

    scales = torch.arange(2 * len(adapted), dtype=torch.float32).reshape(len(adapted), 2)
    return split_adapter_rows(torch.tensor(adapted, dtype=torch.int64), scales, rows, mesh.cfg_group)


def joint_chunk(tensor, mesh, leading: int):
    """This rank's chunk of a joint sequence [B, leading + others, ...] split as a joint-attention model's
    streams are: its chunk of the leading stream, then its chunk of the others."""
    return torch.cat([sequence_chunk(tensor[:, :leading], mesh), sequence_chunk(tensor[:, leading:], mesh)], dim=1)


def sparse_attention_chunks(mesh, batch: int, tokens: int, heads: int, dim: int, leading: int, attributes: dict):
    """This rank's output chunk of machgen::sequence_sparse_attention (``attributes``: the sparse op's) on
    its cfg group's rows of a joint sequence led by ``leading`` tokens."""
    from machgen.parallel.cfg import split_rows
    from machgen.parallel.op import sequence_sparse_attention
    from machgen.parallel.state import set_mesh, split_sequence

    set_mesh(mesh)
    q, k, v = (joint_chunk(split_rows(t, mesh.cfg_group), mesh, leading)
               for t in full_inputs(batch, tokens, heads, dim))
    with split_sequence(True):
        return sequence_sparse_attention(q, k, v, leading, *attributes.values())


def sharded_denoiser_parts(mesh, model_dir: str):
    """The outputs of a family's sharded denoiser head and tail (FamilyExport.sequence_parallel's), eager on
    their sample inputs, with this rank's chunk of the sequence."""
    from pathlib import Path

    from machgen.builder.model_folder import detect_family, load_pipeline
    from machgen.parallel.layout import SEQUENCE_MARKER
    from machgen.parallel.rank_programs import sequence_marker
    from machgen.parallel.state import set_mesh, split_sequence

    family = detect_family(Path(model_dir))
    exporter = family.exporter()
    pipe = load_pipeline(Path(model_dir), family)
    set_mesh(mesh)
    outputs = {}
    for component in exporter.components(pipe):
        variant = exporter.sequence_parallel(component) if component.spec.per_step else None
        if variant is None or variant.module is component.module:
            continue
        inputs = {**variant.sample_inputs, SEQUENCE_MARKER: sequence_marker(mesh.layout.sequence_degree)}
        with torch.no_grad(), exporter.sequence_attention_swap(pipe), split_sequence(True):
            outputs[component.spec.name] = [output.numpy() for output in variant.module(**inputs)]
    return outputs


def assert_sharded_parts_equal_whole(model_dir, layout, tolerance: float = 1e-5) -> list[str]:
    """Every rank's outputs of ``model_dir``'s sharded denoiser parts under ``layout`` (sharded_denoiser_parts)
    equal the whole parts' in this process, within ``tolerance``; the parts' names."""
    import multiprocessing

    import numpy as np

    from machgen.builder.model_folder import detect_family, load_pipeline
    from machgen.parallel.ranks import run_on_ranks

    family = detect_family(model_dir)
    whole = {component.spec.name: component
             for component in family.exporter().components(load_pipeline(model_dir, family))}
    others = set(multiprocessing.active_children())  # a module's pipeline's ranks, put aside
    per_rank = run_on_ranks(layout, "parallel_ranks:sharded_denoiser_parts", str(model_dir))
    assert not set(multiprocessing.active_children()) - others
    assert per_rank[0], "no sharded part"
    for name in per_rank[0]:
        with torch.no_grad():
            expected = [output.numpy() for output in whole[name].module(**whole[name].sample_inputs)]
        for outputs in per_rank:
            assert len(outputs[name]) == len(expected)
            for got, want in zip(outputs[name], expected):
                assert got.shape == want.shape and np.abs(got - want).max() <= tolerance, name
    return list(per_rank[0])


def tiny_video_vae(family: str):
    """A tiny video family's VAE (Wan 2.1's, Wan 2.2 TI2V's patchified one, LTX-2's), the same weights on
    every rank, and the module of the family's decoder classes, whole and split by rows (Wan's vae_chunks,
    else its export module)."""
    import importlib

    torch.manual_seed(0)
    if family == "wan":
        from machgen.families.wan.tiny import tiny_text_encoder_and_vae

        vae = tiny_text_encoder_and_vae()[2]
    else:
        tiny = importlib.import_module(f"machgen.families.{family.replace('-', '_')}.tiny")
        vae = getattr(tiny, f"tiny_{family.replace('-', '_')}")()[0].vae
    classes = "vae_chunks" if family == "wan" else "export"
    return vae.eval(), importlib.import_module(f"machgen.families.{family.replace('-', '_')}.{classes}")


def decode(family: str, vae, exporter, latents, split: bool):
    """The frames the family's served decoder makes of ``latents`` (``split``: its classes split by rows;
    Wan's chunk by chunk with the flat cache, LTX-2's in one call), and the most elements any convolution
    read in one call."""
    from machgen.families.wan.vae_chunks import chunk_layout

    widest = [0]

    def measure(module, args):
        widest[0] = max(widest[0], args[0].numel())

    hooks = [sub.register_forward_pre_hook(measure) for sub in vae.decoder.modules()
             if isinstance(sub, torch.nn.Conv3d)]
    try:
        with torch.no_grad():
            if family == "ltx2":
                return (exporter.SplitVaeDecoder if split else exporter.VaeDecoder)(vae)(latents), widest[0]
            prefix = "Split" if split else ""
            first_class, next_class = (getattr(exporter, f"{prefix}VaeDecoder{chunk}") for chunk in ("First", "Next"))
            frames, cache = first_class(vae)(latents[:, :, :1])
            decoded = [frames]
            following = next_class(vae, *chunk_layout(vae, "decoder", {"decoder": (first_class, next_class)}))
            for index in range(1, latents.shape[2]):
                frames, cache = following(latents[:, :, index:index + 1], cache)
                decoded.append(frames)
            return torch.cat(decoded, dim=2), widest[0]
    finally:
        for hook in hooks:
            hook.remove()


def decoded_by_rows(mesh, family: str, latent_shape: tuple[int, ...]):
    """This rank's band of rows of the video its family's split decoder makes of seeded latents, and the
    most elements a convolution read on this rank."""
    from machgen.parallel.state import set_mesh, split_sequence

    vae, exporter = tiny_video_vae(family)
    latents = torch.randn(*latent_shape, generator=torch.Generator().manual_seed(5))
    band = latents.chunk(mesh.layout.world_size, dim=3)[mesh.rank]
    set_mesh(mesh)
    with split_sequence(True):
        return decode(family, vae, exporter, band, split=True)


class TwoAttentionLayers(torch.nn.Module):
    """Two pre-norm attention layers as diffusers' processors write them: Q, K, then V projected, Q and K
    normalised and rotated by the positions, then machgen::sequence_attention."""

    def __init__(self, heads: int, dim: int):
        super().__init__()
        width = heads * dim
        self.heads = heads
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({
            name: torch.nn.Linear(width, width) for name in ("to_q", "to_k", "to_v", "to_out")}) for _ in range(2))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            normed = F.layer_norm(hidden, hidden.shape[-1:])
            q, k, v = (layer[name](normed).unflatten(-1, (self.heads, -1)) for name in ("to_q", "to_k", "to_v"))
            q, k = (F.rms_norm(t, t.shape[-1:]) * torch.cos(positions)[..., None, None] for t in (q, k))
            attended = torch.ops.machgen.sequence_attention(q, k, v, 0.0)
            hidden = hidden + layer["to_out"](attended.flatten(2))
        return hidden


def two_layer_inputs(batch: int, tokens: int, heads: int, dim: int):
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(batch, tokens, heads * dim, generator=generator),
            torch.rand(batch, tokens, generator=generator))


def two_layer_program(heads: int, dim: int, batch: int, tokens: int):
    """TwoAttentionLayers (seeded weights) exported, as a torch-target program's graph module."""
    import machgen.parallel.op  # noqa: F401  (registers machgen::sequence_attention)

    torch.manual_seed(0)
    rows, sequence = torch.export.Dim("rows"), torch.export.Dim("sequence")
    program = torch.export.export(TwoAttentionLayers(heads, dim).eval(), two_layer_inputs(batch, tokens, heads, dim),
                                  dynamic_shapes=({0: rows, 1: sequence}, {0: rows, 1: sequence}))
    return program.module()


def values_first_chunks(mesh, batch: int, tokens: int, heads: int, dim: int):
    """This rank's output chunk of two_layer_program rewritten values first, of its cfg group's rows, and how
    many values exchanges it started."""
    from machgen.parallel import state, values_first
    from machgen.parallel.cfg import split_rows
    from machgen.parallel.state import set_mesh, split_sequence

    set_mesh(mesh)
    module = two_layer_program(heads, dim, batch, tokens)
    assert values_first.values_first(module) == 2
    inputs = [sequence_chunk(split_rows(t, mesh.cfg_group), mesh) for t in two_layer_inputs(batch, tokens, heads, dim)]
    first = next(state._tickets)
    with torch.no_grad(), split_sequence(True):
        output = module(*inputs)
    assert not state.values_in_flight()  # every exchange was taken by its attention
    return output, next(state._tickets) - first - 1


def values_first_call_failing_after_a_send(mesh, batch: int, tokens: int, heads: int, dim: int):
    """two_layer_program rewritten values first, called under state.one_call where the second
    attention fails after its values left but before it takes them: (exchanges in flight when the call
    failed, exchanges in flight after one_call ended)."""
    from machgen.parallel import state, values_first
    from machgen.parallel.cfg import split_rows
    from machgen.parallel.state import set_mesh, split_sequence

    set_mesh(mesh)
    module = two_layer_program(heads, dim, batch, tokens)
    values_first.values_first(module)
    inputs = [sequence_chunk(split_rows(t, mesh.cfg_group), mesh) for t in two_layer_inputs(batch, tokens, heads, dim)]
    received, taken = values_first._received, []

    def fails_the_second(ticket):
        taken.append(ticket)
        if len(taken) == 2:
            raise RuntimeError("the second attention fails")
        return received(ticket)

    values_first._received = fails_the_second
    left_by_the_failure = None
    try:
        with state.one_call():
            try:
                with torch.no_grad(), split_sequence(True):
                    module(*inputs)
            except RuntimeError:
                left_by_the_failure = state.values_in_flight()
    finally:
        values_first._received = received
    return left_by_the_failure, state.values_in_flight()
