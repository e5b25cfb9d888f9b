import numpy as np

from machgen.datasets import shapes


def test_dataset_is_deterministic_from_its_seed():
    a, b = shapes.batch(8, seed=3), shapes.batch(8, seed=3)
    assert all(np.array_equal(x.image, y.image) and x.caption == y.caption for x, y in zip(a, b))
    assert not np.array_equal(a[0].image, shapes.batch(1, seed=4)[0].image)


def test_images_follow_the_specification():
    samples = shapes.batch(400, seed=1)
    short = 0
    for s in samples:
        assert s.image.shape == (64, 64, 3) and s.image.dtype == np.uint8
        colour = np.array(shapes.PALETTE[s.label.colour])
        painted = np.all(s.image == colour, axis=2)
        rows, cols = np.nonzero(painted)
        width, height = cols.max() - cols.min() + 1, rows.max() - rows.min() + 1
        assert 14 <= max(width, height) <= 29
        centre = ((cols.min() + cols.max() + 1) / 2, (rows.min() + rows.max() + 1) / 2)
        anchor = shapes.POSITIONS[s.label.position]
        assert np.hypot(centre[0] - anchor[0], centre[1] - anchor[1]) <= 6.5
        background = s.image[~painted].astype(float)
        assert background.mean(axis=0).max() <= 55
        short += s.caption == f"a {s.label.colour} {s.label.shape}"
        assert s.caption in (f"a {s.label.colour} {s.label.shape}", shapes.caption(s.label))
    assert 0.18 <= short / len(samples) <= 0.32


def test_detector_reads_dataset_images():
    samples = shapes.batch(600, seed=99)
    correct = np.mean([shapes.detect(s.image) == s.label for s in samples])
    assert correct >= 0.98


def test_detector_finds_nothing_on_a_blank_image():
    assert shapes.detect(np.full((64, 64, 3), 20, np.uint8)) is None


def test_evaluation_prompts_are_fixed_and_cover_every_value():
    prompts = shapes.evaluation_prompts(70)
    assert prompts == shapes.evaluation_prompts(70)
    labels = [label for _, _, label in prompts]
    assert {l.colour for l in labels} == set(shapes.PALETTE)
    assert {l.shape for l in labels} == set(shapes.SHAPES)
    assert {l.position for l in labels} == set(shapes.POSITIONS)
    assert all(prompt == shapes.caption(label) for prompt, _, label in prompts)
