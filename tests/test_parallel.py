"""The parallel layouts' building blocks on CPU ranks (gloo, float32): the
layout and what a model allows of it, which rank does what, and the exact
modes (CFG rows, Ulysses, ring, Ulysses x ring) against whole-sequence
attention; every rank process gone afterwards."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest

from machgen.parallel.layout import (
    STALE_WARMUP,
    LayoutError,
    ParallelLayout,
    ParallelSupport,
    check_layout,
    refusals,
)
from machgen.parallel.mesh import axis_groups, coordinates
from machgen.parallel.program import STALE_IDLE_S

from conftest import build_tiny_repository, single_rank_pipeline, under_layout, wait_until
from parallel_ranks import full_inputs, reference_attention

# Exact modes in float32: the merge by log-sum-exp and the exchanges reorder sums only.
ATTENTION_TOLERANCE = 1e-5


def test_a_layout_is_parsed_printed_and_stored():
    layout = ParallelLayout.parse("ring=2, cfg=2,ulysses=2")
    assert (layout.cfg, layout.ulysses, layout.ring, layout.world_size, layout.sequence_degree) == (2, 2, 2, 8, 4)
    assert str(layout) == "cfg=2,ulysses=2,ring=2" and ParallelLayout.parse(str(layout)) == layout
    assert ParallelLayout.from_json(layout.to_json()) == layout
    assert ParallelLayout.parse("none") == ParallelLayout() == ParallelLayout.from_json(None)
    assert str(ParallelLayout()) == "none" and ParallelLayout().is_single


@pytest.mark.parametrize("text, message", [
    ("tensor=2", "AXIS=DEGREE"), ("cfg", "AXIS=DEGREE"), ("cfg=two", "'two' is not a whole number"),
    ("cfg=0", "cfg must be a whole number of at least 1"), ("ring=2,ring=4", "ring given twice"),
])
def test_a_malformed_layout_is_refused_naming_the_part(text, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout.parse(text)


def test_a_layout_the_model_does_not_allow_is_refused_with_every_reason():
    embedded_guidance = ParallelSupport(heads=6, guidance_rows=False)
    assert refusals(ParallelLayout(ulysses=2, ring=3), embedded_guidance) == []
    reasons = refusals(ParallelLayout(cfg=2, ulysses=4), embedded_guidance)
    assert len(reasons) == 2 and "guidance rows" in reasons[0] and "does not divide" in reasons[1], reasons
    assert "at most cfg=2" in refusals(ParallelLayout(cfg=4), ParallelSupport(8, True))[0]
    assert "cannot split its sequence" in refusals(ParallelLayout(ring=2), ParallelSupport(8, True, False))[0]
    with pytest.raises(LayoutError, match="tiny cannot run the parallel layout cfg=2,ulysses=4: "):
        check_layout(ParallelLayout(cfg=2, ulysses=4), embedded_guidance, "tiny")
    # sparse attention: on a Ulysses exchange's whole sequences or a ring's chunks, in one rank's order only
    joint = ParallelSupport(8, True, sparse_sequence_reason="its image tokens lead")
    assert refusals(ParallelLayout(cfg=2, ulysses=2), ParallelSupport(8, True), sparse=True) == []
    assert refusals(ParallelLayout(ulysses=2, ring=2), ParallelSupport(8, True), sparse=True) == []
    assert refusals(ParallelLayout(cfg=2), joint, sparse=True) == []
    assert "with sparse attention: its image tokens lead" in refusals(ParallelLayout(ulysses=2), joint, True)[0]


def test_ranks_are_numbered_cfg_then_ring_then_ulysses():
    layout = ParallelLayout(cfg=2, ulysses=2, ring=2)
    places = [coordinates(rank, layout) for rank in range(8)]
    assert [(p.cfg, p.ring, p.ulysses) for p in places[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [p.sequence_rank(layout) for p in places] == [0, 1, 2, 3] * 2
    assert axis_groups(layout, "ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(layout, "ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(layout, "cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(layout, "sequence") == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("layout", ["ulysses=2", "ring=2", "ulysses=2,ring=2", "cfg=2,ulysses=2"])
def test_sequence_parallel_attention_equals_attention_on_whole_sequences(layout):
    from machgen.parallel.ranks import run_on_ranks

    layout = ParallelLayout.parse(layout)
    batch, tokens, heads, dim = 4, 24, 4, 8
    outputs = run_on_ranks(layout, "parallel_ranks:attention_chunks", batch, tokens, heads, dim)
    assert not multiprocessing.active_children()
    expected = reference_attention(*full_inputs(batch, tokens, heads, dim)).numpy()
    for overlapped in (True, False):
        chunks = [output[0 if overlapped else 1] for output in outputs]
        # cfg-major: each cfg group's sequence chunks in order, then the next group's rows
        groups = [np.concatenate(chunks[start:start + layout.sequence_degree], axis=1)
                  for start in range(0, layout.world_size, layout.sequence_degree)]
        whole = np.concatenate(groups, axis=0)
        assert whole.shape == expected.shape
        assert np.abs(whole - expected).max() <= ATTENTION_TOLERANCE


@pytest.mark.parametrize("layout, heads", [  # heads 4: two head groups a rank; 2: one
    ("ulysses=2", 4), ("ulysses=2", 2), ("ulysses=2,ring=2", 4), ("cfg=2,ulysses=2", 4), ("ring=2", 4)])
def test_values_first_sends_v_before_q_and_k_are_projected_and_attends_as_before(layout, heads):
    import torch

    from machgen.parallel.ranks import run_on_ranks
    from machgen.parallel.values_first import values_first

    from parallel_ranks import two_layer_inputs, two_layer_program

    layout = ParallelLayout.parse(layout)
    batch, tokens, dim = 2, 16, 8
    module = two_layer_program(heads, dim, batch, tokens)
    with torch.no_grad():
        expected = module(*two_layer_inputs(batch, tokens, heads, dim)).numpy()
    assert values_first(module) == 2
    order = list(module.graph.nodes)
    sends = [node for node in order if node.target == torch.ops.machgen.send_values.default]
    projections = [node for node in order if node.target == torch.ops.aten.linear.default]
    for layer, send in enumerate(sends):
        # this layer's to_q, to_k, to_v, to_out: V's projection, its send, then Q's and K's
        to_q, to_k, to_v, _ = (next(p for p in projections if p.args[1].target == f"layers.{layer}.{name}.weight")
                               for name in ("to_q", "to_k", "to_v", "to_out"))
        assert order.index(to_v) < order.index(send) < min(order.index(to_q), order.index(to_k))
    with torch.no_grad():  # on one process (nothing sent) the rewritten program computes what it did
        assert np.array_equal(module(*two_layer_inputs(batch, tokens, heads, dim)).numpy(), expected)

    outputs = run_on_ranks(layout, "parallel_ranks:values_first_chunks", batch, tokens, heads, dim)
    assert not multiprocessing.active_children()
    chunks = [np.asarray(output) for output, _ in outputs]
    groups = [np.concatenate(chunks[start:start + layout.sequence_degree], axis=1)
              for start in range(0, layout.world_size, layout.sequence_degree)]
    assert np.abs(np.concatenate(groups, axis=0) - expected).max() <= ATTENTION_TOLERANCE
    # each layer's values left on their own exchange where Ulysses exchanges heads (a ring sends none)
    assert all(sent == (2 if layout.ulysses > 1 else 0) for _, sent in outputs)


def test_a_call_that_fails_between_a_send_and_its_attention_leaves_no_exchange_in_flight():
    """A rank's call (RankPrograms runs each under state.one_call) that fails after a layer's values
    left and before its attention took them: the exchange is dropped when the call ends, not kept until the
    rank process ends."""
    from machgen.parallel.ranks import run_on_ranks

    outputs = run_on_ranks(ParallelLayout.parse("ulysses=2"), "parallel_ranks:values_first_call_failing_after_a_send",
                           2, 16, 4, 8)
    assert not multiprocessing.active_children()
    assert outputs == [(1, 0), (1, 0)]


@pytest.mark.parametrize("layout, reused", [  # per call: the earlier call whose blocks it reuses, or None
    ("ring=2,stale=1", [None, 0, None, None, 3, 1, 4]),
    ("ulysses=2,ring=2,stale=1", [None, 0, None, None, 3, 1, 4]),
    ("ring=2,stale=2", [None, None, None, None, None, 1, 4]),
])
def test_a_stale_ring_attends_over_the_other_ranks_keys_of_the_previous_call_of_the_same_batch(layout, reused):
    """DistriFusion's displaced blocks: a ring rank's own keys and values are this call's, the other ring ranks'
    those of the batch's previous call; exact (every block this call's) on a batch's first calls (stale=N: N of
    them), where the inputs' shapes changed and where they moved too far; two batches' calls alternating each
    continue their own; Ulysses inside the ring stays exact."""
    import torch

    from machgen.parallel.ranks import run_on_ranks

    from parallel_ranks import STALE_CALLS

    layout = ParallelLayout.parse(layout)
    batch, tokens, heads, dim = 2, 24, 4, 8
    per_rank = run_on_ranks(layout, "parallel_ranks:stale_attention_chunks", batch, tokens, heads, dim)
    assert not multiprocessing.active_children()
    calls = [full_inputs(batch, tokens, heads, dim, seed) for seed in range(len(STALE_CALLS))]
    ring_chunk = tokens // layout.ring
    for call, earlier in enumerate(reused):
        assert all(results[call][1] is (earlier is not None) for results in per_rank)
        q, k, v = calls[call]
        whole = np.concatenate([results[call][0] for results in per_rank], axis=1)
        if earlier is None:
            expected = reference_attention(q, k, v).numpy()
        else:  # each ring chunk's queries: its own chunk's keys now, the other ring chunks' from the earlier call
            parts = []
            for ring_rank in range(layout.ring):
                own = slice(ring_rank * ring_chunk, (ring_rank + 1) * ring_chunk)
                keys, values = calls[earlier][1].clone(), calls[earlier][2].clone()
                keys[:, own], values[:, own] = k[:, own], v[:, own]
                parts.append(reference_attention(q[:, own], keys, values))
            expected = torch.cat(parts, dim=1).numpy()
            assert np.abs(expected - reference_attention(q, k, v).numpy()).max() > 1e-2  # stale is not exact
        assert np.abs(whole - expected).max() <= ATTENTION_TOLERANCE, call


def test_stale_keys_are_a_ring_layouts_and_asked_for_by_name():
    layout = ParallelLayout.parse("ring=2,cfg=2,stale")
    assert layout.stale == STALE_WARMUP and str(layout) == "cfg=2,ring=2,stale"
    assert ParallelLayout.parse(str(layout)) == layout
    assert ParallelLayout.from_json(layout.to_json()) == layout
    warmed = ParallelLayout.parse("stale=9,ring=2")
    assert warmed.stale == 9 and str(warmed) == "ring=2,stale=9" and ParallelLayout.parse(str(warmed)) == warmed
    assert ParallelLayout.parse("ring=2,stale=0") == ParallelLayout(ring=2)  # the exact ring
    assert not ParallelLayout.from_json({"cfg": 1, "ulysses": 2, "ring": 1}).stale  # a manifest from before
    with pytest.raises(LayoutError, match="stale keys are a ring's"):
        ParallelLayout.parse("ulysses=2,stale")
    with pytest.raises(LayoutError, match="'many' is not a whole number"):
        ParallelLayout.parse("ring=2,stale=many")
    assert refusals(ParallelLayout(ring=2, stale=1), ParallelSupport(8, True), sparse=True) == []


# Ulysses: whole sequences. A ring: each ring rank's chunk of whole blocks (ring=2 with the 8 leading tokens
# too: 4 of them a chunk), or gathered where the chunks are not (ulysses=2,ring=2 with them: 2 a chunk); fp32
# products take the one-round path (no probabilities rounded against the row's maximum).
@pytest.mark.parametrize("layout, leading, precision", [
    (layout, leading, "fp8_e4m3") for layout in ("ulysses=2", "cfg=2,ulysses=2", "ring=2", "ulysses=2,ring=2")
    for leading in (0, 8)] + [("ring=2", 0, "fp32"), ("cfg=2,ring=2", 8, "bf16")])
def test_sparse_attention_on_split_sequences_equals_one_rank_on_whole_ones(layout, leading, precision):
    """The block mask and the rounding of a sharded sparse attention are one rank's: the Ulysses exchange
    gives each rank whole sequences, put back in one rank's order where a joint attention's leading stream
    (text) is split beside the rest; a ring computes each chunk's mask rows from every rank's mean keys and
    rounds the probabilities against the maxima of a first round."""
    import torch

    from machgen.parallel.ranks import run_on_ranks
    from machgen.plugins.ops import sparse_attention
    from machgen.plugins.schema import SparseAttentionConfig

    layout = ParallelLayout.parse(layout)
    batch, tokens, heads, dim = 4, 32, 4, 8
    config = SparseAttentionConfig(block_q=4, block_k=4, topk_ratio=0.5, dense_prefix_tokens=leading,
                                   precision=precision)
    chunks = run_on_ranks(layout, "parallel_ranks:sparse_attention_chunks", batch, tokens, heads, dim, leading,
                          config.onnx_attributes())
    assert not multiprocessing.active_children()
    q, k, v = full_inputs(batch, tokens, heads, dim)
    expected = sparse_attention(q, k, v, config).numpy()
    assert np.abs(expected - reference_attention(q, k, v).numpy()).max() > 1e-3  # blocks were skipped
    rows = []
    for start in range(0, layout.world_size, layout.sequence_degree):
        group = chunks[start:start + layout.sequence_degree]
        share = leading // layout.sequence_degree  # each chunk: its share of the leading tokens, then the rest
        rows.append(np.concatenate([c[:, :share] for c in group] + [c[:, share:] for c in group], axis=1))
    assert np.abs(np.concatenate(rows, axis=0) - expected).max() <= ATTENTION_TOLERANCE


# Two ranks and four; every Wan and LTX-2 layout test decodes by rows on the layouts it runs too.
@pytest.mark.parametrize("family, layout", [("wan", "cfg=2,ulysses=2"), ("wan-ti2v", "ring=2"),
                                            ("ltx2", "cfg=2,ulysses=2")])
def test_a_video_decoder_split_by_rows_decodes_what_diffusers_decodes_each_rank_holding_its_band(family, layout):
    """Parallel VAE decode: every rank of the layout decodes a band of the latent's rows, its convolutions
    reading their neighbours' rows (zeros, or LTX-2's reflection, at the picture's edges), Wan's mid-block
    attention every rank's keys; the bands, put together, are what diffusers' VAE decodes, and no
    convolution on a rank reads more than its share (plus the rows it borrows)."""
    import torch

    from machgen.parallel.ranks import run_on_ranks
    from parallel_ranks import decode, tiny_video_vae

    layout = ParallelLayout.parse(layout)
    vae, exporter = tiny_video_vae(family)
    # 3 latent frames, 8 latent rows: 4 or 2 a rank.
    latent_shape = (1, vae.config.latent_channels if family == "ltx2" else vae.config.z_dim, 3, 8, 4)
    latents = torch.randn(*latent_shape, generator=torch.Generator().manual_seed(5))
    bands = run_on_ranks(layout, "parallel_ranks:decoded_by_rows", family, latent_shape)
    assert not multiprocessing.active_children()
    whole, whole_widest = decode(family, vae, exporter, latents, split=False)
    if family != "ltx2":  # LTX-2's whole decoder is diffusers' decode itself (ltx/export.VaeDecoder)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        with torch.no_grad():
            expected = vae.decode(latents * std + mean).sample.clamp(-1, 1)
        assert (whole - expected).abs().max() <= ATTENTION_TOLERANCE
    split = torch.cat([torch.as_tensor(frames) for frames, _ in bands], dim=3)
    assert split.shape == whole.shape
    assert (split - whole).abs().max() <= ATTENTION_TOLERANCE
    # A band of 8 / N latent rows, and at every scale one row from each neighbour.
    for _, widest in bands:
        assert widest <= whole_widest * (1 / layout.world_size + 2 / 8)


def test_cfg_rows_are_split_padded_and_gathered_whole():
    from machgen.parallel.ranks import run_on_ranks

    (part0, whole0), (part1, whole1) = run_on_ranks(ParallelLayout(cfg=2), "parallel_ranks:gathered_rows", 3)
    batch = np.arange(9, dtype=np.float32).reshape(3, 3)
    assert np.array_equal(part0, batch[:2]) and np.array_equal(part1, batch[[2, 2]])  # the last row padded
    assert np.array_equal(whole0, batch * 2) and np.array_equal(whole1, batch * 2)


@pytest.mark.parametrize("rows, adapted, groups", [
    (5, [0, 3, 4], [([0], [[0, 1]]), ([0, 1, 2], [[2, 3], [4, 5], [4, 5]])]),  # group 1: rows 3, 4 and 4 padded
    (4, [3], [([], []), ([1], [[0, 1]])]),  # group 0 runs no adapted row
])
def test_adapter_rows_split_over_cfg_groups_numbered_as_each_groups_rows(rows, adapted, groups):
    from machgen.parallel.ranks import run_on_ranks

    shares = run_on_ranks(ParallelLayout(cfg=2), "parallel_ranks:adapter_rows", rows, adapted)
    for (got_rows, got_scales), (want_rows, want_scales) in zip(shares, groups):
        assert got_rows.tolist() == want_rows
        assert got_scales.reshape(-1, 2).tolist() == want_scales


def test_kept_inputs_reach_the_ranks_exactly_and_once_they_repeat():
    """What the ranks rebuild from each call's packing is that call's inputs, bit for bit, whatever repeats,
    changes or is forgotten; a repeated input travels twice, then as a reference; the held bytes stay within
    the budget; after a failed call the ranks drop everything."""
    from machgen.parallel.kept import Kept, KeptInputs, RankStore

    rng = np.random.default_rng(0)
    texts = [rng.standard_normal((2, 64, 8)).astype(np.float32) for _ in range(3)]  # 4 KiB each
    parent, rank = KeptInputs(budget=9 * 1024), RankStore()
    sent = []
    for call in range(40):
        inputs = {"latents": rng.standard_normal((2, 16, 4)).astype(np.float32),  # new every call
                  "text": texts[(call // 5) % 3], "step": np.array([call], np.int64)}
        payload, forget = parent.pack(inputs)
        received = rank.unpack(payload, forget)
        assert received.keys() == inputs.keys()
        assert all(np.array_equal(received[name], inputs[name]) for name in inputs)
        sent.append(not isinstance(payload["text"], Kept))
        assert parent.held_bytes <= parent.budget and len(rank) <= 2
    assert sent[:5] == [True, True, False, False, False]  # seen, kept, then referenced
    assert parent.saved_bytes > 0
    parent.lost()
    payload, forget = parent.pack({"text": texts[0]})
    assert forget is None and not isinstance(payload["text"], Kept)
    rank.unpack(payload, forget)
    assert len(rank) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process names are set through Linux's prctl")
def test_ranks_are_named_and_forked_from_a_forkserver_not_from_their_owner():
    import os

    from machgen.parallel.ranks import run_on_ranks

    first = run_on_ranks(ParallelLayout(ring=2), "parallel_ranks:identity")
    again = run_on_ranks(ParallelLayout(ulysses=2), "parallel_ranks:identity")
    assert [name for name, _ in first] == ["machgen-rank-0", "machgen-rank-1"]
    parents = {parent for _, parent in first + again}
    assert len(parents) == 1 and os.getpid() not in parents  # one forkserver for every pool of this process
    assert not multiprocessing.active_children()


def test_a_failing_rank_is_reported_and_every_rank_process_is_gone():
    from machgen.parallel.ranks import RankError, run_on_ranks

    with pytest.raises(RankError, match="^rank 1 failed:(.|\n)*rank one fails on purpose"):
        run_on_ranks(ParallelLayout(ring=2), "parallel_ranks:fails_on_rank_one", timeout=60)
    assert not multiprocessing.active_children()


def test_a_rank_that_dies_in_a_call_fails_it_and_every_rank_process_is_gone():
    from machgen.parallel.ranks import RankError, run_on_ranks

    with pytest.raises(RankError, match=r"^rank 1 died \(exit code 3\)"):
        run_on_ranks(ParallelLayout(ring=2), "parallel_ranks:dies_on_rank_one", timeout=60)
    assert not multiprocessing.active_children()


# --- a family under every layout it allows: the tiny Flux's torch-target build, in process ---------------------

# The build's own layout; the others below run its programs as the build allows (LocalPipeline(layout=...)).
BUILT_LAYOUT = "cfg=2,ulysses=2"
# One image and its negative prompt (two guidance rows), true CFG; 1x1 latent packing of 64x64 gives 16 image
# tokens and the T5 32: every sequence degree here divides both.
GUIDED = dict(prompt="a red cat", negative_prompt="a blue dog", true_cfg_scale=4.0, seed=7)
SAME_PIXELS = 1  # of 255: exact modes, float32 sums reordered
CACHED = dict(num_inference_steps=8, cache_policy="fbcache", cache_threshold=0.5)
# Stale keys on the tiny random Flux against its one-rank image (dB; measured 62-64 dB after the warm-up, at
# most one level off: its 16 image tokens move little from step to step).
STALE_PSNR = 40.0


@pytest.fixture(scope="module")
def parallel_repository(tiny_flux_dir, tmp_path_factory):
    """The tiny Flux for BUILT_LAYOUT, with per-request adapters (one added: "attn"); the layout tests' requests
    name none, test_per_request_adapters_under_cfg2_give_the_single_rank_image's do."""
    from machgen.builder.adapters import add_adapter

    from test_lora_adapters import ADAPTERS, write_random_adapter

    repository = build_tiny_repository(tmp_path_factory, tiny_flux_dir, "flux", in_flight=1, target="torch",
                                       parallel=ParallelLayout.parse(BUILT_LAYOUT), max_lora_rank=8)
    rank, alpha, targets = ADAPTERS["attn"]
    add_adapter(repository, "attn", write_random_adapter(tiny_flux_dir, tmp_path_factory.mktemp("attn"), rank,
                                                         alpha, targets, seed=0))
    return repository


@pytest.fixture(scope="module")
def local_parallel(parallel_repository):
    with single_rank_pipeline(parallel_repository, "flux") as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def single_rank(local_parallel):
    """The parallel build's programs on one rank: the reference every layout must give."""
    return {"uncached": local_parallel.generate(**GUIDED, cache_policy="none"),
            "cached": local_parallel.generate(**GUIDED, **CACHED)}


@pytest.mark.export
def test_the_layout_is_stored_and_the_steps_run_the_sequence_attention(parallel_repository):
    import json

    from machgen.contract.manifest import PipelineManifest, pipeline_dir

    manifest = PipelineManifest.read(pipeline_dir(parallel_repository, "flux"))
    assert ParallelLayout.from_json(manifest.parallel) == ParallelLayout.parse(BUILT_LAYOUT)
    for component in ("denoiser_head", "denoiser_tail"):
        info = json.loads((parallel_repository / f"flux_{component}" / "1" / "component.json").read_text())
        assert info["parallel"]["layout"] == ParallelLayout.parse(BUILT_LAYOUT).to_json()
        assert info["parallel"]["sequence"]["img_ids"] == 1 and "temb" not in info["parallel"]["sequence"]
    tail = json.loads((parallel_repository / "flux_denoiser_tail" / "1" / "component.json").read_text())
    assert tail["parallel"]["sequence"]["noise_pred"] == 1
    # Encoders and decoders run once per request, on one device; the reuse step has no attention.
    for component in ("text_encoder_2", "vae_decoder"):
        assert json.loads((parallel_repository / f"flux_{component}" / "1" / "component.json").read_text())[
            "parallel"] is None


@pytest.mark.export
def test_on_one_rank_the_parallel_build_equals_diffusers(single_rank, parallel_repository, tiny_flux_pipeline):
    from machgen.contract.manifest import PipelineManifest, pipeline_dir

    from test_integration import MAX_PIXEL_DIFF, diffusers_image

    defaults = PipelineManifest.read(pipeline_dir(parallel_repository, "flux")).defaults.to_json()
    prompt = GUIDED["prompt"]
    expected = diffusers_image(tiny_flux_pipeline, defaults, prompt, GUIDED["seed"],
                               negative_prompt=GUIDED["negative_prompt"], true_cfg_scale=GUIDED["true_cfg_scale"])
    images, _ = single_rank["uncached"]
    assert np.abs(images[0].astype(int) - expected.astype(int)).max() <= MAX_PIXEL_DIFF


def sequence_attentions(folder) -> int:
    """The machgen::sequence_attention calls of the program a build wrote to ``folder``."""
    import torch

    from machgen.runtime.program_load import load_program
    from machgen.runtime.torch_runner import PROGRAM_FILE

    program = load_program(Path(folder) / PROGRAM_FILE)
    return sum(node.target == torch.ops.machgen.sequence_attention.default for node in program.graph.nodes)


@pytest.mark.export
@pytest.mark.parametrize("layout", ["cfg=2", "ulysses=2", "ring=2", "ulysses=2,ring=2", "cfg=2,ulysses=2"])
def test_every_layout_gives_the_single_rank_image_with_cache_reuse_on_and_off(layout, local_parallel, single_rank):
    layout = ParallelLayout.parse(layout)
    with under_layout(local_parallel, layout) as pipeline:
        uncached, _ = pipeline.generate(**GUIDED, cache_policy="none")
        cached, stats = pipeline.generate(**GUIDED, **CACHED)
        tail = pipeline.runner("denoiser_tail")
        # every call's sequence split where the layout splits it (16 image and 32 text tokens)
        assert tail.split_calls == (tail.calls if layout.sequence_degree > 1 else 0) and tail.calls
        # the prompt's conditioning travelled to the ranks twice (once seen, once kept), then stayed there
        assert tail.kept.saved_bytes > tail.kept.held_bytes > 0
        # every sequence attention's values leave first on the ranks (the rank programs, rewritten at load)
        assert tail.values_first == sequence_attentions(tail.folder) > 0
    assert np.abs(uncached.astype(int) - single_rank["uncached"][0].astype(int)).max() <= SAME_PIXELS
    assert np.abs(cached.astype(int) - single_rank["cached"][0].astype(int)).max() <= SAME_PIXELS
    # cache reuse did skip steps, and decided alike (the same steps computed)
    assert stats.denoiser_tail_passes == single_rank["cached"][1].denoiser_tail_passes < 2 * CACHED[
        "num_inference_steps"]


@pytest.mark.export
def test_a_stale_ring_computes_its_warm_up_exactly_then_attends_over_the_previous_steps_keys(
        local_parallel, single_rank):
    """ring=2,stale: a request's first steps exact (the warm-up), most later ones over the other rank's keys of
    the step before, near one rank's image (that they are not exact: the attention test above); a request after
    another of the same prompt and seed warms up all the same, its first timestep far from the last call's. The
    ranks hold the blocks for the next call until the program has been idle for its stale_idle_s."""
    from machgen.builder.evaluate import psnr

    steps = 16  # the tiny model's 4 steps (8: the tail's time embedding) move too far for stale blocks
    with under_layout(local_parallel, ParallelLayout.parse("ring=2,stale")) as pipeline:
        uncached, _ = pipeline.generate(**GUIDED, cache_policy="none", num_inference_steps=steps)
        tail, head = pipeline.runner("denoiser_tail"), pipeline.runner("denoiser_head")
        # the warm-up's steps exact, then stale but for a late step whose timestep embedding moved by more than
        # STALE_MAX_CHANGE
        assert head.calls == tail.calls == steps
        assert 0 < head.stale_calls <= steps - STALE_WARMUP and 0 < tail.stale_calls <= steps - STALE_WARMUP
        first = head.stale_calls
        cached, stats = pipeline.generate(**GUIDED, **CACHED)
        assert head.calls == steps + CACHED["num_inference_steps"]
        assert 0 < head.stale_calls - first <= CACHED["num_inference_steps"] - STALE_WARMUP
        assert head.stale_batches_held() >= 1 and tail.stale_batches_held() >= 1  # 30 s idle by default
        programs = [getattr(runner, "runner", runner) for runner in (head, tail)]  # inside their adapters
        for program in programs:
            program.stale_idle_s = 0.5
        wait_until(lambda: head.stale_batches_held() == tail.stale_batches_held() == 0, timeout=30,
                   what="the idle program's stale blocks let go")
        for program in programs:
            program.stale_idle_s = STALE_IDLE_S
        before = head.stale_calls
        pipeline.generate(**GUIDED, **CACHED)  # warms up again, then goes stale
        assert 0 < head.stale_calls - before <= CACHED["num_inference_steps"] - STALE_WARMUP
        assert head.stale_batches_held() >= 1
    exact, _ = local_parallel.generate(**GUIDED, cache_policy="none", num_inference_steps=steps)
    for image, reference in ((uncached, exact), (cached, single_rank["cached"][0])):
        difference = np.abs(image.astype(int) - reference.astype(int)).max()
        print(f"stale ring: max {difference} levels, {psnr(image, reference):.1f} dB against one rank")
        assert psnr(image, reference) >= STALE_PSNR


@pytest.mark.export
def test_layouts_of_one_world_size_share_their_ranks_and_programs(local_parallel, single_rank):
    """use_layout puts a layout's ranks aside and the next layout of as many ranks takes them up (its process
    groups made again, its programs still loaded); another world size starts its own."""
    with under_layout(local_parallel, ParallelLayout(ulysses=2)) as pipeline:
        pipeline.generate(**GUIDED, cache_policy="none")
        ranks = pipeline.runner("denoiser_tail").pool.pids
    with under_layout(local_parallel, ParallelLayout(cfg=2)) as pipeline:
        image, _ = pipeline.generate(**GUIDED, cache_policy="none")
        tail = pipeline.runner("denoiser_tail")
        assert tail.pool.pids == ranks and tail.layout == ParallelLayout(cfg=2)
        assert tail.calls and tail.split_calls == 0  # counted under cfg2 alone: nothing split
        assert pipeline.runner("denoiser_head").pool is tail.pool
    assert np.abs(image.astype(int) - single_rank["uncached"][0].astype(int)).max() <= SAME_PIXELS
    with under_layout(local_parallel, ParallelLayout(cfg=2, ulysses=2)) as pipeline:
        pipeline.generate(**GUIDED, num_inference_steps=1, cache_policy="none")
        four = pipeline.runner("denoiser_tail").pool.pids
        assert len(four) == 4 and not set(four) & set(ranks)
    import psutil

    assert all(psutil.pid_exists(pid) for pid in ranks + four)  # both put aside until the pipeline closes


@pytest.fixture(scope="module")
def sparse_parallel_repository(tiny_flux_dir, tmp_path_factory):
    """The tiny Flux with FP8 sparse attention for ulysses=2 (its text encoders and decoder: the export cache's
    from parallel_repository's build)."""
    from machgen.builder.build import AttentionOptions

    return build_tiny_repository(tmp_path_factory, tiny_flux_dir, "flux", in_flight=1, target="torch",
                                 parallel=ParallelLayout(ulysses=2), max_lora_rank=8,
                                 attention=AttentionOptions("sparse-fp8", block=2, mask_method="topk"))


@pytest.mark.export
def test_sparse_attention_under_every_layout_gives_the_single_rank_image(sparse_parallel_repository,
                                                                         single_rank):
    """FP8 sparse attention inside the sharded attention (the mask computed on whole sequences after the Ulysses
    exchange, or per ring chunk) gives what the same build gives on one rank, with cache reuse on and off."""
    import json

    tail = json.loads((sparse_parallel_repository / "flux_denoiser_tail" / "1" / "component.json").read_text())
    assert tail["parallel"]["layout"] == ParallelLayout(ulysses=2).to_json()
    with single_rank_pipeline(sparse_parallel_repository, "flux") as pipeline:
        one_rank = {"uncached": pipeline.generate(**GUIDED, cache_policy="none")[0],
                    "cached": pipeline.generate(**GUIDED, **CACHED)[0]}
        # sparse: not the dense build's image
        assert np.abs(one_rank["uncached"].astype(int) - single_rank["uncached"][0].astype(int)).max() > SAME_PIXELS
        for layout in ("ulysses=2", "cfg=2,ulysses=2", "ring=2"):
            with under_layout(pipeline, ParallelLayout.parse(layout)):
                uncached, _ = pipeline.generate(**GUIDED, cache_policy="none")
                cached, _ = pipeline.generate(**GUIDED, **CACHED)
                runner = pipeline.runner("denoiser_tail")
                assert runner.split_calls == runner.calls > 0
            assert np.abs(uncached.astype(int) - one_rank["uncached"].astype(int)).max() <= SAME_PIXELS, layout
            assert np.abs(cached.astype(int) - one_rank["cached"].astype(int)).max() <= SAME_PIXELS, layout


@pytest.mark.parametrize("target, layout, message", [
    ("onnxruntime", "ulysses=2", "parallel layouts run on the torch target"),
    ("torch", "ulysses=4", "ulysses=4 does not divide the model's 2 attention heads"),
    ("torch", "cfg=4", "at most cfg=2"),
])
def test_a_layout_the_build_cannot_run_is_refused_before_any_export(target, layout, message, tiny_flux_dir,
                                                                     tmp_path):
    from machgen.builder.build import AttentionOptions, build_repository

    layout, _, attention = layout.partition(" ")
    logged = []
    with pytest.raises(LayoutError, match=message):
        build_repository(tiny_flux_dir, "flux", tmp_path / "repository", target=target, log=logged.append,
                         preview=False, parallel=ParallelLayout.parse(layout),
                         attention=AttentionOptions("sparse-fp8" if attention else "dense"))
    assert not any("exporting" in line for line in logged) and not (tmp_path / "repository").exists()


def _command(process) -> str:
    """A process's command line; empty for one that has ended (a killed rank not yet reaped: a zombie)."""
    import psutil

    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _name(process) -> str:
    import psutil

    try:
        return process.name()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def rank_processes(stub_pids) -> list:
    """The running rank processes started by the given Triton stubs (machgen-rank-N, forked from the stub's
    forkserver)."""
    import psutil

    found = []
    for pid in stub_pids:
        try:
            found += [child for child in psutil.Process(pid).children(recursive=True)
                      if _name(child).startswith("machgen-rank-")]
        except psutil.NoSuchProcess:
            pass
    return found


def component_stubs(served, component: str) -> list[int]:
    """The pids of the Python backend stubs serving ``component`` under ``machgen serve``."""
    import psutil

    server = next(p for p in psutil.Process(served.process.pid).children(recursive=True)
                  if p.name() == "tritonserver")
    return [p.pid for p in server.children() if f"flux_{component}" in _command(p)]


@pytest.mark.integration
def test_served_by_triton_a_killed_rank_loses_no_request_and_stop_leaves_no_rank(parallel_repository, single_rank,
                                                                                 local_parallel):
    """machgen serve of the parallel build: each parallel component's stub starts its ranks; a request equals
    the single-rank image; a SIGKILLed rank makes the component unhealthy, the step in flight is run again
    once machgen serve has loaded it with new ranks; a stop leaves no rank process, no forkserver and no shared
    memory."""
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    from machgen.client import MachgenClient

    from conftest import ServeProcess

    local_parallel.close()  # the ranks the layout tests put aside (a server started beside them started slowly)
    served = ServeProcess(parallel_repository)
    try:
        with MachgenClient(served.grpc_url) as client:
            image = client.generate("flux", GUIDED["prompt"], negative_prompt=GUIDED["negative_prompt"],
                                    true_cfg_scale=GUIDED["true_cfg_scale"], seed=GUIDED["seed"], cache_policy="none")
        assert np.abs(image.astype(int) - single_rank["uncached"][0].astype(int)).max() <= SAME_PIXELS
        tail_ranks = rank_processes(component_stubs(served, "denoiser_tail"))
        assert len(tail_ranks) == ParallelLayout.parse(BUILT_LAYOUT).world_size
        assert len(rank_processes(component_stubs(served, "denoiser_head"))) == len(tail_ranks)

        answers = []
        under_way = threading.Event()

        def request() -> None:
            with MachgenClient(served.grpc_url) as client:
                answers.append(client.generate("flux", GUIDED["prompt"], negative_prompt=GUIDED["negative_prompt"],
                                               true_cfg_scale=GUIDED["true_cfg_scale"], seed=GUIDED["seed"],
                                               num_inference_steps=24, cache_policy="none",
                                               on_progress=lambda progress: under_way.set()))

        with MachgenClient(served.grpc_url) as client:
            expected = client.generate("flux", GUIDED["prompt"], negative_prompt=GUIDED["negative_prompt"],
                                       true_cfg_scale=GUIDED["true_cfg_scale"], seed=GUIDED["seed"],
                                       num_inference_steps=24, cache_policy="none")
        sender = threading.Thread(target=request)
        sender.start()
        assert under_way.wait(timeout=60)  # its first step done: the kill comes mid-request
        killed_at = time.monotonic()
        os.kill(tail_ranks[-1].pid, signal.SIGKILL)
        sender.join(timeout=180)
        assert answers and np.array_equal(answers[0], expected)
        assert time.monotonic() - killed_at < 60, "the component served again within a minute"
        new_ranks = rank_processes(component_stubs(served, "denoiser_tail"))
        assert len(new_ranks) == len(tail_ranks) and not {p.pid for p in new_ranks} & {p.pid for p in tail_ranks}
        all_ranks = new_ranks + rank_processes(component_stubs(served, "denoiser_head"))
        forkservers = list({rank.parent().pid: rank.parent() for rank in all_ranks}.values())
        assert forkservers and "forkserver" in " ".join(_command(server) for server in forkservers)
    finally:
        served.stop()
    assert served.process.returncode == 0, served.output()
    import psutil

    _, alive = psutil.wait_procs(all_ranks + forkservers, timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    # The regions of this server's Python backend (machgen/server.py names them after machgen serve's pid);
    # other tests' servers run beside it.
    assert not list(Path("/dev/shm").glob(f"machgen_{served.process.pid}_*"))


@pytest.mark.export
def test_per_request_adapters_under_cfg2_give_the_single_rank_image(local_parallel, single_rank):
    """Both guidance rows name the adapter; the second cfg group's row is row 1 of the batch and row 0 of its
    own share (the unit test above covers rows without adapters and padding)."""
    adapter = dict(lora=["attn"], lora_scale=[1.0])
    single, _ = local_parallel.generate(**GUIDED, cache_policy="none", **adapter)
    with under_layout(local_parallel, ParallelLayout(cfg=2)) as pipeline:
        split, _ = pipeline.generate(**GUIDED, cache_policy="none", **adapter)
        assert pipeline.runner("denoiser_tail").calls
    plain = single_rank["uncached"][0]
    assert np.abs(single.astype(int) - plain.astype(int)).max() > 8 * SAME_PIXELS  # the adapter does something
    assert np.abs(split.astype(int) - single.astype(int)).max() <= SAME_PIXELS


@pytest.mark.parametrize("layout, message", [
    ("tensor=2", "Invalid value for --parallel: parallel layout 'tensor=2'"),
    ("ulysses=4", "family 'flux' cannot run the parallel layout ulysses=4"),
])
def test_machgen_build_refuses_a_layout_naming_it(layout, message, tiny_flux_dir, tmp_path):
    import subprocess
    import sys

    built = subprocess.run([sys.executable, "-m", "machgen.builder.cli", "build", str(tiny_flux_dir), "--name", "flux",
                            "--out", str(tmp_path / "repository"), "--target", "torch", "--parallel", layout],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode != 0 and message in " ".join((built.stdout + built.stderr).split()), built.stderr
    assert not (tmp_path / "repository").exists()
