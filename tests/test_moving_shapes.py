"""The moving-shapes dataset and its detector (machgen/datasets/moving_shapes.py)."""

import numpy as np

from machgen.datasets import moving_shapes, shapes


def test_clips_are_deterministic_from_their_seed():
    a, b = moving_shapes.batch(4, seed=3), moving_shapes.batch(4, seed=3)
    assert all(np.array_equal(x.frames, y.frames) and x.caption == y.caption for x, y in zip(a, b))
    assert not np.array_equal(a[0].frames, moving_shapes.batch(1, seed=4)[0].frames)


def test_the_shape_crosses_the_frame_the_captioned_way_inside_it():
    for clip in moving_shapes.batch(300, seed=1):
        assert clip.frames.shape == (moving_shapes.FRAMES, 64, 64, 3) and clip.frames.dtype == np.uint8
        assert clip.caption == moving_shapes.caption(clip.motion)
        assert clip.caption.startswith(f"a {clip.motion.colour} {clip.motion.shape} moves ")
        colour = np.array(shapes.PALETTE[clip.motion.colour])
        assert all(np.all(frame[mask] == colour) for frame, mask in zip(clip.frames, clip.masks))
        rows, cols = np.nonzero(clip.masks.any(axis=0))
        assert rows.min() >= 2 and cols.min() >= 2 and rows.max() <= 61 and cols.max() <= 61  # never at the border
        centres = np.array([(np.nonzero(m)[1].mean(), np.nonzero(m)[0].mean()) for m in clip.masks])
        dx, dy = moving_shapes.DIRECTIONS[clip.motion.direction]
        travel = (centres[-1] - centres[0]) @ np.array([dx, dy])
        assert 20 <= travel <= 34
        assert np.all(np.diff(centres @ np.array([dx, dy])) > 0)  # forward in every frame
        # the background does not change: only the shape's pixels differ between frames
        still = ~clip.masks.any(axis=0)
        assert np.all(clip.frames[:, still] == clip.frames[0, still])


def test_every_motion_is_in_the_dataset_and_captions_name_it():
    motions = {clip.motion for clip in moving_shapes.batch(2000, seed=5)}
    assert motions == set(moving_shapes.all_motions())
    assert len(moving_shapes.all_captions()) == 7 * 3 * 4 == len(set(moving_shapes.all_captions()))


def test_detector_reads_the_dataset_and_refuses_what_does_not_move():
    clips = moving_shapes.batch(300, seed=99)
    assert np.mean([moving_shapes.detect(clip.frames) == clip.motion for clip in clips]) == 1.0
    still = np.repeat(clips[0].frames[:1], moving_shapes.FRAMES, axis=0)
    assert moving_shapes.detect(still) is None
    assert moving_shapes.detect(np.full((17, 64, 64, 3), 20, np.uint8)) is None
    reversed_clip = clips[0].frames[::-1]
    opposite = {"right": "left", "left": "right", "up": "down", "down": "up"}
    assert moving_shapes.detect(reversed_clip).direction == opposite[clips[0].motion.direction]


def test_flicker_counts_changes_off_the_path_only():
    clip = moving_shapes.batch(1, seed=7)[0]
    assert moving_shapes.flicker(clip.frames) == 0.0  # the shape moves; nothing flickers
    noisy = clip.frames.astype(np.int16) + np.random.default_rng(0).integers(-4, 5, clip.frames.shape)
    assert 1.0 < moving_shapes.flicker(np.clip(noisy, 0, 255).astype(np.uint8)) < 4.0


def test_evaluation_sets_cover_every_motion_with_held_out_seeds():
    prompts = moving_shapes.evaluation_prompts()
    assert prompts == moving_shapes.evaluation_prompts()
    assert {motion for _, _, motion in prompts} == set(moving_shapes.all_motions())
    assert all(prompt == moving_shapes.caption(motion) for prompt, _, motion in prompts)
    pictures = moving_shapes.evaluation_pictures(8)
    for prompt, _, picture, motion in pictures:
        found = shapes.detect(picture)
        assert (found.colour, found.shape) == (motion.colour, motion.shape) and prompt == moving_shapes.caption(motion)
