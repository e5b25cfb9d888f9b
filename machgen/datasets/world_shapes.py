"""The `world shapes` dataset: one shape steered chunk by chunk by a sequence
of actions (left, right, up, down, stop), and the detector that reads each
chunk's motion back. The ground truth of the world model
``models/shapes-world`` (realtime sessions, docs/realtime.md).

Deterministic from a seed, numpy only. The shapes, colours and backgrounds
of the moving-shapes dataset (machgen/datasets/moving_shapes.py): one
filled shape on a flat dark background with mild noise (the same in every
frame). Every episode starts with the shape, 18 px across, at the frame's
centre: a session's first chunk is then what its prompt says, not one of
many places and sizes, which a few denoising steps without guidance would
blur into their mean (a model trained on random starts drew no shape at
all); from there the actions decide everything. A clip is a sequence of chunks, each
``chunk_frames`` latent frames of the causal Wan VAE: the first chunk
1 + 4 (chunk_frames - 1) video frames, each later one 4 chunk_frames (the
VAE encodes the first frame alone, then four at a time). Each chunk obeys
one action: every frame of it moves the shape ``SPEED`` px that way (the
first frame of the clip is where the shape starts), or, for "stop", keeps it
where it is. At a wall the shape stays against it (2 px from the frame's
edge, as in moving shapes): an action into the wall moves it only up to
the wall, and no further.

Action sequences: ``training_actions`` draws random ones (pushes into a
wall are redrawn most of the time, so that a caption mostly says what the
frames show); ``walk_actions`` is the evaluation's random walk, which never
pushes into a wall (every action it takes moves the whole chunk's way).

Captions, one per chunk: "a red circle moves to the left" (right, up,
down) and "a red circle stays still"; the subject alone ("a red circle",
a session's starting prompt) also means staying still.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from machgen.datasets import moving_shapes, shapes

SIZE = shapes.SIZE
ACTIONS = ("left", "right", "up", "down", "stop")
MOVES: dict[str, tuple[int, int]] = {**moving_shapes.DIRECTIONS, "stop": (0, 0)}
# The prompt each action switches a session to; {prompt} is the session's starting prompt (the subject).
ACTION_TEMPLATES = {**{direction: "{prompt} moves " + phrase
                       for direction, phrase in moving_shapes.DIRECTION_PHRASES.items()},
                    "stop": "{prompt} stays still"}
SPEED = 1.0  # px per video frame
CHUNK_FRAMES = 2  # latent frames a chunk (the world model's streaming chunk)
START = (SIZE / 2, SIZE / 2)
START_SIZE = 18  # px across
_MARGIN = 2  # px between the shape and the frame's edge at a wall
# Training sequences: the previous action again this often (runs of one action), and a push into a wall
# (the shape already against it) redrawn this often.
_REPEAT_SHARE = 0.4
_REDRAW_WALL_SHARE = 0.8


@dataclass(frozen=True)
class Subject:
    colour: str
    shape: str

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.shape}"


def all_subjects() -> list[Subject]:
    return [Subject(colour, shape) for colour in shapes.PALETTE for shape in shapes.SHAPES]


def chunk_caption(subject: Subject | str, action: str) -> str:
    """The caption of a chunk under ``action``: the action's template around the subject."""
    phrase = subject.phrase if isinstance(subject, Subject) else subject
    return ACTION_TEMPLATES[action].format(prompt=phrase)


def all_captions() -> list[str]:
    """Every chunk caption and every bare subject, sorted."""
    subjects = all_subjects()
    return sorted([chunk_caption(s, a) for s in subjects for a in ACTIONS] + [s.phrase for s in subjects])


def chunk_lengths(chunks: int, chunk_frames: int = CHUNK_FRAMES) -> list[int]:
    """Video frames of each chunk: the first 1 + 4 (chunk_frames - 1), the others 4 chunk_frames."""
    return [1 + 4 * (chunk_frames - 1) if index == 0 else 4 * chunk_frames for index in range(chunks)]


def chunk_starts(chunks: int, chunk_frames: int = CHUNK_FRAMES) -> list[int]:
    """The first video frame of each chunk."""
    return [int(v) for v in np.cumsum([0] + chunk_lengths(chunks, chunk_frames))[:-1]]


def bounds(size: int) -> tuple[float, float]:
    """The lowest and highest centre coordinate that keeps a shape ``size`` px across inside the frame."""
    return size / 2 + _MARGIN, SIZE - size / 2 - _MARGIN


def path(start: tuple[float, float], actions: list[str], size: int, chunk_frames: int = CHUNK_FRAMES,
         speed: float = SPEED) -> np.ndarray:
    """[frames, 2] (x, y) centres: frame 0 at ``start``; each later frame one step of its chunk's action
    from the frame before, held at the walls."""
    low, high = bounds(size)
    centre = np.array(start, dtype=np.float64)
    centres = []
    for chunk, length in enumerate(chunk_lengths(len(actions), chunk_frames)):
        step = np.array(MOVES[actions[chunk]], dtype=np.float64) * speed
        for frame in range(length):
            if chunk or frame:
                centre = np.clip(centre + step, low, high)
            centres.append(centre.copy())
    return np.array(centres)


def _blocked(centre: np.ndarray, action: str, size: int) -> bool:
    """Whether ``action`` pushes a shape at ``centre`` into a wall it is already against."""
    low, high = bounds(size)
    dx, dy = MOVES[action]
    moved = np.clip(centre + (dx, dy), low, high)
    return action != "stop" and bool(np.allclose(moved, centre))


def _fits(centre: np.ndarray, action: str, frames: int, size: int, speed: float) -> bool:
    """Whether ``frames`` steps of ``action`` from ``centre`` stay within the walls."""
    low, high = bounds(size)
    end = centre + np.array(MOVES[action]) * speed * frames
    return bool(np.all(end >= low - 1e-9) and np.all(end <= high + 1e-9))


def training_actions(rng: np.random.Generator, chunks: int, start: tuple[float, float], size: int,
                     chunk_frames: int = CHUNK_FRAMES, speed: float = SPEED) -> list[str]:
    """Random actions, one a chunk: the previous one again 40 % of the time, else any of the five; an action
    into a wall the shape is already against is redrawn 80 % of the time (the rest teach the wall)."""
    actions: list[str] = []
    centre = np.array(start, dtype=np.float64)
    for _ in range(chunks):
        if actions and rng.random() < _REPEAT_SHARE:
            action = actions[-1]
        else:
            action = ACTIONS[rng.integers(len(ACTIONS))]
        while _blocked(centre, action, size) and rng.random() < _REDRAW_WALL_SHARE:
            action = ACTIONS[rng.integers(len(ACTIONS))]
        actions.append(action)
        centre = path(start, actions, size, chunk_frames, speed)[-1]
    return actions


def allowed_actions(centre, size: float, moves: int, speed: float = SPEED) -> list[str]:
    """The actions whose ``moves`` steps from ``centre`` keep a shape ``size`` px across within the walls
    (stop always does): the evaluation walk's choices."""
    return [a for a in ACTIONS if _fits(np.asarray(centre, dtype=np.float64), a, moves, size, speed)]


def walk_actions(rng: np.random.Generator, chunks: int, start: tuple[float, float], size: int,
                 chunk_frames: int = CHUNK_FRAMES, speed: float = SPEED) -> list[str]:
    """The evaluation's random walk: each chunk's action drawn uniformly from those whose whole chunk stays
    within the walls (stop always does), so that every chunk shows its action in full."""
    actions: list[str] = []
    centre = np.array(start, dtype=np.float64)
    for length in chunk_lengths(chunks, chunk_frames):
        moves = length - 1 if not actions else length
        # A first chunk of one frame (chunks of one latent frame) shows no motion: it can only stay still.
        allowed = allowed_actions(centre, size, moves, speed) if moves else ["stop"]
        action = allowed[rng.integers(len(allowed))]
        actions.append(action)
        centre = centre + np.array(MOVES[action]) * speed * moves
    return actions


@dataclass(frozen=True)
class Episode:
    frames: np.ndarray  # uint8 [frames, 64, 64, 3]
    masks: np.ndarray  # bool [frames, 64, 64]
    centres: np.ndarray  # [frames, 2] (x, y)
    subject: Subject
    size: int
    actions: tuple[str, ...]  # one a chunk
    chunk_frames: int

    @property
    def captions(self) -> list[str]:
        return [chunk_caption(self.subject, action) for action in self.actions]

    def chunk(self, index: int) -> np.ndarray:
        """The video frames of chunk ``index``."""
        start = chunk_starts(len(self.actions), self.chunk_frames)[index]
        return self.frames[start:start + chunk_lengths(len(self.actions), self.chunk_frames)[index]]


def sample(rng: np.random.Generator, chunks: int, chunk_frames: int = CHUNK_FRAMES, walk: bool = False,
           subject: Subject | None = None, speed: float = SPEED, start: tuple[float, float] = START,
           size: int = START_SIZE) -> Episode:
    """An episode of ``chunks`` chunks: a random subject and background, and actions (random ones for
    training, ``walk`` for the evaluation's wall-free walk), from ``start`` at ``size``."""
    subjects = all_subjects()
    subject = subject or subjects[rng.integers(len(subjects))]
    background = rng.integers(0, 51, 3)
    noise = rng.normal(0, 3, (SIZE, SIZE, 3))
    chooser = walk_actions if walk else training_actions
    actions = chooser(rng, chunks, start, size, chunk_frames, speed)
    centres = path(start, actions, size, chunk_frames, speed)
    frames, masks = moving_shapes.render(moving_shapes.Motion(subject.colour, subject.shape, "right"), centres,
                                         size, background, noise)
    return Episode(frames, masks, centres, subject, size, tuple(actions), chunk_frames)


def drifted_colour(rng: np.random.Generator, colour: str, low: float = 0.15, high: float = 0.6) -> np.ndarray:
    """A shape colour part of the way (``low`` to ``high``) from ``colour`` towards another palette colour: what
    a world model's colour drift over a long rollout looks like (blue towards cyan, yellow towards magenta)."""
    others = [name for name in shapes.PALETTE if name != colour]
    other = others[rng.integers(len(others))]
    share = rng.uniform(low, high)
    return (1 - share) * np.asarray(shapes.PALETTE[colour], float) + share * np.asarray(shapes.PALETTE[other], float)


def recolour(episode: Episode, rgb) -> np.ndarray:
    """The episode's frames with its shape painted ``rgb`` (same place, size and background)."""
    frames = episode.frames.copy()
    frames[episode.masks] = np.clip(np.round(np.asarray(rgb, float)), 0, 255).astype(np.uint8)
    return frames


# ----------------------------------------------------------------- detector
# A chunk whose shape moves slower than this (px per frame, along its larger axis) stayed still. Calibrated on
# ground-truth episodes (tests/test_world_shapes.py): clean moving chunks read 1.0 px/frame, still ones 0.0,
# each within 0.1; the threshold sits halfway, so a generated chunk must show at least half the speed.
STILL_BELOW = 0.5


@dataclass(frozen=True)
class ChunkReading:
    colour: str
    shape: str
    action: str  # left, right, up, down or stop
    speed: float  # px per frame along the larger axis of the motion


def detect_chunk(frames: np.ndarray, before: np.ndarray | None = None,
                 palette=shapes.PALETTE) -> ChunkReading | None:
    """Read a chunk's colour, shape and action from its frames (and, where given, the frame ``before`` it,
    so that each of the chunk's frames counts one step), or None when no single shape shows in most frames.

    Each frame is read by the image detector (shapes.find); colour and shape are the majority over the frames
    where a shape was found; the velocity is the least-squares slope of the shape's centre over the frame
    index; the action is its larger axis's direction, or stop below ``STILL_BELOW`` px a frame. A lone frame
    (a session's first chunk of one latent frame) reads as still: it shows where the shape starts, no motion."""
    video = frames if before is None else np.concatenate([before[None], frames])
    if len(video) == 1:
        hit = shapes.find(video[0], palette)
        return None if hit is None else ChunkReading(hit[0].colour, hit[0].shape, "stop", 0.0)
    found = [(index, shapes.find(frame, palette)) for index, frame in enumerate(video)]
    found = [(index, hit) for index, hit in found if hit is not None]
    if len(found) < max(2, (len(video) + 1) // 2):
        return None
    labels = [(hit[0].colour, hit[0].shape) for _, hit in found]
    colour, shape = max(set(labels), key=labels.count)
    index = np.array([i for i, _ in found], dtype=np.float64)
    centres = np.array([hit[1] for _, hit in found])
    centred = index - index.mean()
    vx, vy = (centred[:, None] * (centres - centres.mean(axis=0))).sum(axis=0) / (centred ** 2).sum()
    speed = float(max(abs(vx), abs(vy)))
    if speed < STILL_BELOW:
        action = "stop"
    elif abs(vx) >= abs(vy):
        action = "right" if vx > 0 else "left"
    else:
        action = "down" if vy > 0 else "up"
    return ChunkReading(colour, shape, action, round(speed, 3))


def detect_episode(frames: np.ndarray, chunks: int, chunk_frames: int = CHUNK_FRAMES) -> list[ChunkReading | None]:
    """Each chunk's reading of a whole clip (every chunk after the first read with the frame before it)."""
    readings = []
    for index, (start, length) in enumerate(zip(chunk_starts(chunks, chunk_frames),
                                                chunk_lengths(chunks, chunk_frames))):
        before = frames[start - 1] if index else None
        readings.append(detect_chunk(frames[start:start + length], before))
    return readings


# ------------------------------------------------------------ evaluation set
def evaluation_sessions(count: int = 64, seed: int = 4048) -> list[tuple[Subject, int]]:
    """Held-out sessions: (subject, session seed), every subject before any repeats, the seeds ones the
    training never drew. Their actions are drawn as they play (world_eval: a walk from where the model put
    the shape), as a ground-truth episode's are by ``walk_actions``."""
    rng = np.random.default_rng(seed)
    subjects = all_subjects()
    order = rng.permutation(len(subjects))
    return [(subjects[order[index % len(subjects)]], int(rng.integers(0, 2**31))) for index in range(count)]
