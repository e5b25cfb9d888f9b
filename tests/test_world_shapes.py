"""The world-shapes dataset (machgen/datasets/world_shapes.py): episodes steered by actions chunk by chunk,
and the chunk detector read back on procedural episodes whose ground truth is known."""

from __future__ import annotations

import numpy as np
import pytest

from machgen.datasets import world_shapes


def test_chunks_follow_the_causal_vae():
    assert world_shapes.chunk_lengths(4, 2) == [5, 8, 8, 8]
    assert world_shapes.chunk_starts(4, 2) == [0, 5, 13, 21]
    assert world_shapes.chunk_lengths(3, 3) == [9, 12, 12]
    episode = world_shapes.sample(np.random.default_rng(0), 6, 2)
    assert episode.frames.shape == (1 + 4 * (6 * 2 - 1), 64, 64, 3)
    assert sum(len(episode.chunk(i)) for i in range(6)) == len(episode.frames)


def test_each_chunk_moves_its_action_and_stops_at_walls():
    rng = np.random.default_rng(1)
    for _ in range(20):
        episode = world_shapes.sample(rng, 10)
        low, high = world_shapes.bounds(episode.size)
        assert episode.centres.min() >= low - 1e-9 and episode.centres.max() <= high + 1e-9
        steps = np.diff(episode.centres, axis=0)
        starts = world_shapes.chunk_starts(10)
        for chunk, action in enumerate(episode.actions):
            first = max(starts[chunk] - 1, 0)
            moved = steps[first:first + world_shapes.chunk_lengths(10)[chunk] - (chunk == 0)]
            dx, dy = world_shapes.MOVES[action]
            # Every step goes the action's way, by SPEED or less (less only against a wall), never sideways.
            along = moved @ np.array([dx, dy]) if action != "stop" else np.zeros(len(moved))
            assert np.all(along <= world_shapes.SPEED + 1e-9) and np.all(along >= -1e-9)
            assert np.allclose(np.abs(moved).sum(axis=1), along)


def test_walk_never_pushes_into_a_wall():
    rng = np.random.default_rng(2)
    for _ in range(30):
        episode = world_shapes.sample(rng, 24, walk=True)
        steps = np.linalg.norm(np.diff(episode.centres, axis=0), axis=1)
        moving = np.repeat([a != "stop" for a in episode.actions], world_shapes.chunk_lengths(24))[1:]
        assert np.allclose(steps[moving], world_shapes.SPEED) and np.allclose(steps[~moving], 0)


def test_captions_are_the_action_templates_around_the_subject():
    subject = world_shapes.Subject("red", "circle")
    assert world_shapes.chunk_caption(subject, "left") == "a red circle moves to the left"
    assert world_shapes.chunk_caption(subject, "stop") == "a red circle stays still"
    assert world_shapes.ACTION_TEMPLATES["up"].format(prompt="a red circle") == "a red circle moves up"
    assert len(world_shapes.all_captions()) == 21 * 6


def test_a_drifted_colour_repaints_only_the_shape_part_of_the_way():
    rng = np.random.default_rng(5)
    episode = world_shapes.sample(rng, 3)
    true = np.asarray(world_shapes.shapes.PALETTE[episode.subject.colour], float)
    for _ in range(20):
        drifted = world_shapes.drifted_colour(rng, episode.subject.colour)
        # On the segment from the true colour to another palette colour, 15-60 % of the way.
        shares = []
        for name, other in world_shapes.shapes.PALETTE.items():
            direction = np.asarray(other, float) - true
            if name == episode.subject.colour:
                continue
            share = (drifted - true) @ direction / (direction @ direction)
            if np.allclose(true + share * direction, drifted):
                shares.append(share)
        assert any(0.15 <= share <= 0.6 for share in shares)
        frames = world_shapes.recolour(episode, drifted)
        assert np.array_equal(frames[~episode.masks], episode.frames[~episode.masks])
        assert np.allclose(frames[episode.masks], np.round(drifted))


def _readings(walk: bool, count: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        episode = world_shapes.sample(rng, 12, walk=walk)
        yield episode, world_shapes.detect_episode(episode.frames, 12)


def test_detector_reads_every_clean_chunk_of_wall_free_walks():
    read = total = 0
    for episode, readings in _readings(True, 24, 3):
        for action, reading in zip(episode.actions, readings):
            total += 1
            read += reading == world_shapes.ChunkReading(episode.subject.colour, episode.subject.shape, action,
                                                         reading.speed if reading else 0.0)
    assert read / total >= 0.99, f"{read} of {total}"


def test_detector_reads_one_frame_chunks_their_lone_first_frame_as_still():
    """Chunks of one latent frame: a session's first chunk is one video frame (the walk keeps it still, the only
    thing it can show), each later one four; the detector reads every one, the first one by its frame alone."""
    rng = np.random.default_rng(7)
    read = total = 0
    for _ in range(12):
        episode = world_shapes.sample(rng, 24, 1, walk=True)
        assert len(episode.chunk(0)) == 1 and len(episode.chunk(1)) == 4 and episode.actions[0] == "stop"
        readings = world_shapes.detect_episode(episode.frames, 24, 1)
        assert readings[0] == world_shapes.ChunkReading(episode.subject.colour, episode.subject.shape, "stop", 0.0)
        for action, reading in zip(episode.actions, readings):
            total += 1
            read += reading == world_shapes.ChunkReading(episode.subject.colour, episode.subject.shape, action,
                                                         reading.speed if reading else 0.0)
    assert read / total >= 0.99, f"{read} of {total}"
    assert world_shapes.detect_chunk(np.zeros((1, 64, 64, 3), np.uint8)) is None


def test_still_threshold_sits_between_the_ground_truth_speeds():
    """The calibration of STILL_BELOW: clean chunks read 1 px a frame moving and 0 still, within 0.1."""
    moving, still = [], []
    for episode, readings in _readings(True, 16, 4):
        for action, reading in zip(episode.actions, readings):
            (still if action == "stop" else moving).append(reading.speed)
    assert still and moving
    assert max(still) < 0.1 and min(moving) > 0.9
    assert max(still) < world_shapes.STILL_BELOW < min(moving)


def test_detector_refuses_an_empty_chunk():
    assert world_shapes.detect_chunk(np.zeros((8, 64, 64, 3), np.uint8)) is None


def test_evaluation_sessions_are_fixed_and_cover_every_subject():
    sessions = world_shapes.evaluation_sessions(21)
    assert sessions == world_shapes.evaluation_sessions(21)
    assert {subject for subject, _ in sessions} == set(world_shapes.all_subjects())
    assert len({seed for _, seed in world_shapes.evaluation_sessions(64)}) == 64


def test_training_forward_equals_the_streamed_chunks():
    """The world model's training forward (one dense forward, block-causal mask, explicit positions: a sink
    and a window far from it) equals what the streaming denoiser computes chunk by chunk with its cache."""
    torch = pytest.importorskip("torch")
    from machgen.builder.world_training import BlockCausalForward, block_causal_mask
    from machgen.builder.video_training import VideoModelConfig, build_video_transformer
    from machgen.families.wan.streaming import StreamingChunkDenoiser

    torch.manual_seed(0)
    transformer = build_video_transformer(VideoModelConfig(layers=2)).eval()
    frames, chunk_positions = 2, [0, 40, 41, 42]
    latents = torch.randn(1, 16, frames * len(chunk_positions), 8, 8)
    text = torch.randn(1, 7, 64)
    positions = torch.tensor([[p * frames + f for p in chunk_positions for f in range(frames)]])
    timesteps = torch.zeros(1, positions.shape[1])
    timesteps[:, -frames:] = 700.0
    with torch.no_grad():
        dense = BlockCausalForward(transformer, 128)(latents, timesteps, positions, text,
                                                     block_causal_mask(len(chunk_positions), frames * 16))
        stream = StreamingChunkDenoiser(transformer, 128)
        keys = values = torch.zeros(1, 2, 0, 4, 32)
        for index, position in enumerate(chunk_positions):
            chunk = latents[:, :, index * frames:(index + 1) * frames]
            timestep = torch.tensor([[700.0 if index == len(chunk_positions) - 1 else 0.0]])
            out, key, value = stream(chunk, timestep, torch.tensor([position * frames]), text, keys, values,
                                     torch.ones(1, keys.shape[2]))
            keys, values = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)
    assert torch.allclose(dense[:, :, -frames:], out, atol=1e-5)


def test_world_eval_scores_ground_truth_sessions_as_fully_steered():
    """world_eval's scoring on procedural sessions read by the detector: every chunk steered and kept, every
    key shown at once; a chunk read one action late counts as a lag of one."""
    from machgen.builder.world_eval import SessionRecord, score

    records = []
    for episode, readings in _readings(True, 6, 6):
        records.append(SessionRecord(episode.subject, 0, list(episode.actions), readings))
    figures = score(records)
    assert figures["all"]["steered"] == 1.0 and figures["all"]["subject_kept"] == 1.0
    keys = sum(1 + sum(a != b for a, b in zip(r.actions, r.actions[1:])) for r in records)
    assert figures["keys"] == keys and figures["lag_chunks"] == {"0": keys} and figures["keys_missed"] == 0

    late = records[0]
    switch = next(i for i in range(1, len(late.actions)) if late.actions[i] != late.actions[i - 1])
    runs_on = switch + 1 < len(late.actions) and late.actions[switch + 1] == late.actions[switch]
    late.readings[switch] = late.readings[switch - 1]  # the old action still shows in the first chunk
    figures = score([late])
    assert figures["all"]["steered"] == round(1 - 1 / len(late.actions), 4)
    assert (figures["lag_chunks"].get("1") == 1) if runs_on else (figures["keys_missed"] == 1)
