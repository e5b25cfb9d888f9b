"""The parallel layouts' building blocks on CPU ranks (gloo, float32): the
layout and what a model allows of it, which rank does what, and the exact
modes (CFG rows, Ulysses, ring, Ulysses x ring) against whole-sequence
attention; every rank process gone afterwards."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from machgen.parallel.layout import LayoutError, ParallelLayout, ParallelSupport, check_layout, refusals
from machgen.parallel.mesh import axis_groups, coordinates

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
    embedded_guidance = ParallelSupport(heads=6, guidance_rows=False, min_tokens=64)
    assert refusals(ParallelLayout(ulysses=2, ring=3), embedded_guidance) == []
    reasons = refusals(ParallelLayout(cfg=2, ulysses=4), embedded_guidance)
    assert len(reasons) == 2 and "guidance rows" in reasons[0] and "does not divide" in reasons[1], reasons
    assert "at most cfg=2" in refusals(ParallelLayout(cfg=4), ParallelSupport(8, True, 64))[0]
    assert "more than the 4 tokens" in refusals(ParallelLayout(ring=8), ParallelSupport(8, True, 4))[0]
    with pytest.raises(LayoutError, match="tiny cannot run the parallel layout cfg=2,ulysses=4: "):
        check_layout(ParallelLayout(cfg=2, ulysses=4), embedded_guidance, "tiny")


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


def test_cfg_rows_are_split_padded_and_gathered_whole():
    from machgen.parallel.ranks import run_on_ranks

    (part0, whole0), (part1, whole1) = run_on_ranks(ParallelLayout(cfg=2), "parallel_ranks:gathered_rows", 3)
    batch = np.arange(9, dtype=np.float32).reshape(3, 3)
    assert np.array_equal(part0, batch[:2]) and np.array_equal(part1, batch[[2, 2]])  # the last row padded
    assert np.array_equal(whole0, batch * 2) and np.array_equal(whole1, batch * 2)


def test_a_failing_rank_is_reported_and_every_rank_process_is_gone():
    from machgen.parallel.ranks import RankError, run_on_ranks

    with pytest.raises(RankError, match="^rank 1 failed:(.|\n)*rank one fails on purpose"):
        run_on_ranks(ParallelLayout(ring=2), "parallel_ranks:fails_on_rank_one", timeout=60)
    assert not multiprocessing.active_children()
