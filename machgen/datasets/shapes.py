"""The `shapes` dataset: procedural 64x64 images whose ground truth is known,
and the detector that reads colour, shape and position back from an image.

Deterministic from a seed. One filled shape (circle, square, upright
equilateral triangle, 16-28 px across) of one of seven exact colours, centred
within 6 px of one of five places, on a flat dark background with mild noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SIZE = 64
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 220, 50),
    "magenta": (220, 50, 220), "cyan": (50, 210, 220), "white": (235, 235, 235),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (16, 16), "top right": (48, 16), "bottom left": (16, 48), "bottom right": (48, 48),
    "center": (32, 32),
}
# Offsets stay within 6 px of the anchor in both axes' combined distance.
_MAX_OFFSET = 4
_SHORT_CAPTION_SHARE = 0.25


@dataclass(frozen=True)
class Label:
    colour: str
    shape: str
    position: str


@dataclass(frozen=True)
class Sample:
    image: np.ndarray  # uint8 [64, 64, 3]
    caption: str
    label: Label


_ROWS, _COLS = np.mgrid[0:SIZE, 0:SIZE] + 0.5


def shape_mask(shape: str, centre: tuple[float, float], size: float) -> np.ndarray:
    """Pixels covered by a filled shape ``size`` px across centred at (x, y)."""
    cx, cy = centre
    radius = size / 2
    if shape == "circle":
        return (_COLS - cx) ** 2 + (_ROWS - cy) ** 2 <= radius * radius
    if shape == "square":
        return (np.abs(_COLS - cx) <= radius) & (np.abs(_ROWS - cy) <= radius)
    if shape == "triangle":  # upright, equilateral, centred on its bounding box
        height = size * np.sqrt(3) / 2
        top = cy - height / 2
        half_width = (_ROWS - top) / height * radius
        return (_ROWS >= top) & (_ROWS <= top + height) & (np.abs(_COLS - cx) <= half_width)
    raise ValueError(f"unknown shape {shape!r}")


def render(label: Label, size: int, offset: tuple[int, int], background: np.ndarray,
           noise: np.ndarray, palette: dict[str, tuple[int, int, int]] = PALETTE) -> np.ndarray:
    x, y = POSITIONS[label.position]
    image = np.broadcast_to(background.astype(np.float64), (SIZE, SIZE, 3)) + noise
    image[shape_mask(label.shape, (x + offset[0], y + offset[1]), size)] = palette[label.colour]
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def caption(label: Label, with_position: bool = True) -> str:
    base = f"a {label.colour} {label.shape}"
    return f"{base} at the {label.position}" if with_position else base


def sample(rng: np.random.Generator, colours=tuple(PALETTE), shapes=SHAPES,
           palette: dict[str, tuple[int, int, int]] = PALETTE) -> Sample:
    label = Label(colours[rng.integers(len(colours))], shapes[rng.integers(len(shapes))],
                  tuple(POSITIONS)[rng.integers(len(POSITIONS))])
    size = int(rng.integers(16, 29))
    offset = tuple(int(v) for v in rng.integers(-_MAX_OFFSET, _MAX_OFFSET + 1, 2))
    background = rng.integers(0, 51, 3)
    noise = rng.normal(0, 3, (SIZE, SIZE, 3))
    image = render(label, size, offset, background, noise, palette)
    return Sample(image, caption(label, with_position=rng.random() >= _SHORT_CAPTION_SHARE), label)


def batch(count: int, seed: int, **kwargs) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [sample(rng, **kwargs) for _ in range(count)]


def all_captions(colours=tuple(PALETTE), shapes=SHAPES) -> list[str]:
    labels = [Label(c, s, p) for c in colours for s in shapes for p in POSITIONS]
    return sorted({caption(label, with_position) for label in labels for with_position in (True, False)})


# ----------------------------------------------------------------- detector
_FOREGROUND_DISTANCE = 60.0
_MIN_PIXELS = 40


def detect(image: np.ndarray, palette: dict[str, tuple[int, int, int]] = PALETTE) -> Label | None:
    """Read (colour, shape, position) from an image, or None when no shape is found (see ``find``)."""
    found = find(image, palette)
    return found[0] if found is not None else None


def find(image: np.ndarray, palette: dict[str, tuple[int, int, int]] = PALETTE
         ) -> tuple[Label, tuple[float, float]] | None:
    """The shape's label and the (x, y) centre of its outline's bounding box,
    or None when no shape is found.

    The background is the median of the border pixels; the foreground is what
    differs from it by more than a fixed colour distance, kept to its largest
    connected part. Colour is the nearest palette colour of the foreground's
    median; the outline is re-drawn halfway between background and that
    colour; shape is the ideal shape (drawn in the outline's bounding box)
    that overlaps the foreground best -- sturdier than the bare fill ratio
    (circle 0.79, square 1, triangle 0.5) when edges are soft; position, the
    anchor nearest to the bounding box's centre.
    """
    pixels = image.astype(np.float64)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = np.median(border, axis=0)
    distance = np.linalg.norm(pixels - background, axis=2)
    mask = _largest_component(distance > _FOREGROUND_DISTANCE)
    if mask.sum() < _MIN_PIXELS:
        return None
    colour_value = np.median(pixels[mask], axis=0)
    colour = min(palette, key=lambda name: np.linalg.norm(colour_value - np.asarray(palette[name])))
    # The outline is where the image is halfway between background and shape
    # colour: soft (decoded) edges then keep their corners.
    halfway = np.linalg.norm(colour_value - background) / 2
    mask = _largest_component(distance > max(halfway, _FOREGROUND_DISTANCE / 2))
    rows, cols = np.nonzero(mask)
    centre = ((cols.min() + cols.max() + 1) / 2, (rows.min() + rows.max() + 1) / 2)
    width = cols.max() - cols.min() + 1
    shape = max(SHAPES, key=lambda name: _overlap(mask, shape_mask(name, centre, width)))
    position = min(POSITIONS, key=lambda name: np.hypot(centre[0] - POSITIONS[name][0],
                                                       centre[1] - POSITIONS[name][1]))
    return Label(colour, shape, position), centre


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two masks."""
    return float((a & b).sum()) / max(float((a | b).sum()), 1.0)


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of ``mask`` (noise specks are dropped)."""
    labels = np.zeros(mask.shape, np.int32)
    best, best_size, current = 0, 0, 0
    for start in zip(*np.nonzero(mask)):
        if labels[start]:
            continue
        current += 1
        stack, size = [start], 0
        labels[start] = current
        while stack:
            r, c = stack.pop()
            size += 1
            for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= nr < SIZE and 0 <= nc < SIZE and mask[nr, nc] and not labels[nr, nc]:
                    labels[nr, nc] = current
                    stack.append((nr, nc))
        if size > best_size:
            best, best_size = current, size
    return labels == best if best else np.zeros_like(mask)


# ------------------------------------------------------------ evaluation set
def evaluation_prompts(count: int = 70, seed: int = 2024, colours=tuple(PALETTE),
                       shapes=SHAPES) -> list[tuple[str, int, Label]]:
    """A fixed (prompt, seed, label) set covering every colour, shape and position."""
    rng = np.random.default_rng(seed)
    labels = [Label(c, s, p) for c in colours for s in shapes for p in POSITIONS]
    order = rng.permutation(len(labels))
    chosen = [labels[i] for i in order[:count]] if count <= len(labels) else \
        [labels[i % len(labels)] for i in range(count)]
    return [(caption(label), int(rng.integers(0, 2**31)), label) for label in chosen]
