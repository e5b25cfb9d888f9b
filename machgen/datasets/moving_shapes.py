"""The `moving shapes` dataset: procedural clips whose ground truth is known,
and the detector that reads colour, shape and direction of motion back.

Deterministic from a seed. A clip is ``FRAMES`` frames of 64x64: one filled
shape of the image dataset (machgen/datasets/shapes.py: its shapes and seven
colours) crossing a flat dark background (mild noise, the same in every
frame) in a straight line at constant speed, to the right, the left, up or
down, 24-32 px over the clip, wholly inside the frame throughout. Its
caption: "a red circle moves to the right".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from machgen.datasets import shapes

FRAMES = 17
SIZE = shapes.SIZE
# Unit steps in image coordinates (x right, y down), and how a caption says each.
DIRECTIONS: dict[str, tuple[int, int]] = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}
DIRECTION_PHRASES = {"right": "to the right", "left": "to the left", "up": "up", "down": "down"}
_SIZES = (14, 22)  # px across, inclusive
_TRAVEL = (24, 32)  # px over the whole clip, inclusive
_ACROSS_JITTER = 10  # px off the centre line, across the motion
_ALONG_JITTER = 3


@dataclass(frozen=True)
class Motion:
    colour: str
    shape: str
    direction: str


@dataclass(frozen=True)
class Clip:
    frames: np.ndarray  # uint8 [FRAMES, 64, 64, 3]
    caption: str
    motion: Motion
    masks: np.ndarray  # bool [FRAMES, 64, 64]: the shape's pixels in each frame


def caption(motion: Motion) -> str:
    return f"a {motion.colour} {motion.shape} moves {DIRECTION_PHRASES[motion.direction]}"


def all_motions(colours=tuple(shapes.PALETTE), shapes_=shapes.SHAPES) -> list[Motion]:
    return [Motion(c, s, d) for c in colours for s in shapes_ for d in DIRECTIONS]


def all_captions() -> list[str]:
    return sorted(caption(motion) for motion in all_motions())


def centres(direction: str, size: int, travel: int, along_offset: int, across_offset: int,
            frames: int = FRAMES) -> np.ndarray:
    """[frames, 2] (x, y) centres: the path crosses the frame's middle, offset as given."""
    dx, dy = DIRECTIONS[direction]
    progress = np.linspace(-0.5, 0.5, frames) * travel + along_offset
    middle = SIZE / 2
    x = middle + dx * progress + (dy != 0) * across_offset
    y = middle + dy * progress + (dx != 0) * across_offset
    return np.stack([x, y], axis=1)


def render(motion: Motion, path: np.ndarray, size: int, background: np.ndarray, noise: np.ndarray,
           palette=shapes.PALETTE) -> tuple[np.ndarray, np.ndarray]:
    base = np.broadcast_to(background.astype(np.float64), (SIZE, SIZE, 3)) + noise
    base = np.clip(np.round(base), 0, 255).astype(np.uint8)
    frames = np.repeat(base[None], len(path), axis=0)
    masks = np.stack([shapes.shape_mask(motion.shape, (float(x), float(y)), size) for x, y in path])
    frames[masks] = palette[motion.colour]
    return frames, masks


def sample(rng: np.random.Generator, frames: int = FRAMES, motions: list[Motion] | None = None) -> Clip:
    motions = motions or all_motions()
    motion = motions[rng.integers(len(motions))]
    size = int(rng.integers(_SIZES[0], _SIZES[1] + 1))
    travel = int(rng.integers(_TRAVEL[0], _TRAVEL[1] + 1))
    # The whole path stays inside the frame with 2 px to spare (the detector reads the border as background).
    room = SIZE / 2 - size / 2 - 2
    along = int(rng.integers(-_ALONG_JITTER, _ALONG_JITTER + 1))
    along = int(np.clip(along, -(room - travel / 2), room - travel / 2))
    across = int(rng.integers(-_ACROSS_JITTER, _ACROSS_JITTER + 1))
    across = int(np.clip(across, -room, room))
    background = rng.integers(0, 51, 3)
    noise = rng.normal(0, 3, (SIZE, SIZE, 3))
    path = centres(motion.direction, size, travel, along, across, frames)
    pixels, masks = render(motion, path, size, background, noise)
    return Clip(pixels, caption(motion), motion, masks)


def batch(count: int, seed: int, **kwargs) -> list[Clip]:
    rng = np.random.default_rng(seed)
    return [sample(rng, **kwargs) for _ in range(count)]


# ----------------------------------------------------------------- detector
# The shape's centre must travel at least this far between the first and the
# last frames for a direction to be read (the dataset's travel is 24-32 px).
MIN_TRAVEL = 8.0


def detect(frames: np.ndarray, palette=shapes.PALETTE) -> Motion | None:
    """Read (colour, shape, direction) from a clip, or None when there is no
    single shape moving along one axis.

    Each frame is read by the image detector (shapes.find); colour and shape
    are the majority over the frames where a shape was found (at least
    half of them); the direction is that of the larger component of the
    displacement between the mean centre of the first quarter of those frames
    and that of the last quarter, which must be at least ``MIN_TRAVEL`` px.
    """
    found = [(index, shapes.find(frame, palette)) for index, frame in enumerate(frames)]
    found = [(index, hit) for index, hit in found if hit is not None]
    if len(found) < max(2, len(frames) // 2):
        return None
    labels = [(hit[0].colour, hit[0].shape) for _, hit in found]
    colour, shape = max(set(labels), key=labels.count)
    path = np.array([hit[1] for _, hit in found])
    quarter = max(1, len(path) // 4)
    dx, dy = path[-quarter:].mean(axis=0) - path[:quarter].mean(axis=0)
    if max(abs(dx), abs(dy)) < MIN_TRAVEL:
        return None
    direction = ("right" if dx > 0 else "left") if abs(dx) >= abs(dy) else ("down" if dy > 0 else "up")
    return Motion(colour, shape, direction)


def flicker(frames: np.ndarray) -> float:
    """Mean absolute difference of consecutive frames outside the shape's
    path, in 0-255 units: the background does not change in the dataset, so
    what changes there is flicker. The path (every pixel a frame's detected
    foreground covers) is left out, so that motion is not counted."""
    pixels = frames.astype(np.float64)
    background = np.median(np.concatenate([pixels[:, 0], pixels[:, -1], pixels[:, :, 0], pixels[:, :, -1]]
                                          ).reshape(-1, 3), axis=0)
    moving = (np.linalg.norm(pixels - background, axis=-1) > 30).any(axis=0)
    still = ~moving
    if not still.any() or len(frames) < 2:
        return 0.0
    return float(np.abs(np.diff(pixels, axis=0))[:, still].mean())


# ------------------------------------------------------------ evaluation set
def evaluation_prompts(count: int = 84, seed: int = 2025) -> list[tuple[str, int, Motion]]:
    """A fixed (prompt, seed, motion) set, every colour, shape and direction
    once before any repeats; the seeds are not the training's."""
    rng = np.random.default_rng(seed)
    motions = all_motions()
    order = rng.permutation(len(motions))
    chosen = [motions[order[i % len(motions)]] for i in range(count)]
    return [(caption(motion), int(rng.integers(0, 2**31)), motion) for motion in chosen]


def evaluation_pictures(count: int = 84, seed: int = 2026) -> list[tuple[str, int, np.ndarray, Motion]]:
    """Image-to-video cases: (prompt, seed, first frame, motion), the first
    frame of a held-out clip of that motion (drawn with seeds the training
    never used)."""
    cases = []
    for prompt, case_seed, motion in evaluation_prompts(count, seed):
        clip = sample(np.random.default_rng(case_seed), motions=[motion])
        cases.append((prompt, case_seed, clip.frames[0], motion))
    return cases
