"""A model's streaming mode (realtime sessions): how it generates a video
chunk by chunk with a cache of keys and values, as the model card
(``machgen.json``, key ``"streaming"``) declares it and the manifest carries
it to the runtime. docs/realtime.md documents each field for users."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping


class StreamingSettingsError(ValueError):
    """A model card's streaming section that cannot be served, naming the field."""


@dataclass(frozen=True)
class StreamingSettings:
    # Latent frames generated together: they attend to each other and to the cache, and are decoded together.
    chunk_frames: int = 3
    # The denoising timesteps of each chunk, on the 0-1000 scale before the shift (Self-Forcing's list).
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    # The flow schedule's shift, remapping each timestep t to sigma = shift s / (1 + (shift - 1) s), s = t / 1000.
    shift: float = 5.0
    # The timestep at which a finished chunk's clean latents run once more to write its keys and values.
    context_timestep: float = 0.0
    # The first latent frames, kept in the cache for the whole session (LongLive's frame sink; 0: none).
    sink_frames: int = 0
    # The most recent latent frames before a chunk that stay cached (None: every frame, Self-Forcing's default).
    window_frames: int | None = None
    # The latent frames a session may reach (its positions are absolute, tabled at build).
    max_frames: int = 1024
    # The actions a session may take, each the prompt it switches to (LongLive's prompt switch), by name;
    # "{prompt}" in one stands for the session's own prompt ("{prompt} moves to the left").
    actions: Mapping[str, str] = field(default_factory=dict)
    # The video frames a second a session plays at (its deadlines); 0: the model's served fps.
    fps: int = 0

    def __post_init__(self):
        def refuse(name: str, why: str):
            raise StreamingSettingsError(f"streaming.{name}: {why}")

        if self.chunk_frames < 1:
            refuse("chunk_frames", f"must be at least 1, not {self.chunk_frames}")
        if not self.timesteps or any(not 0 < float(t) <= 1000 for t in self.timesteps):
            refuse("timesteps", f"must be a non-empty list in (0, 1000], not {list(self.timesteps)}")
        if list(self.timesteps) != sorted(self.timesteps, reverse=True):
            refuse("timesteps", "must decrease")
        if self.shift <= 0:
            refuse("shift", f"must be positive, not {self.shift}")
        if not 0 <= self.context_timestep < 1000:
            refuse("context_timestep", f"must be in [0, 1000), not {self.context_timestep}")
        for name in ("sink_frames", "window_frames"):
            value = getattr(self, name)
            if value is not None and (value < 0 or value % self.chunk_frames):
                refuse(name, f"must be a non-negative multiple of chunk_frames ({self.chunk_frames}), not {value}")
        if self.max_frames < self.chunk_frames:
            refuse("max_frames", f"must hold at least one chunk ({self.chunk_frames}), not {self.max_frames}")
        object.__setattr__(self, "timesteps", tuple(float(t) for t in self.timesteps))
        object.__setattr__(self, "actions", dict(self.actions))

    def sigmas(self) -> list[float]:
        """Each step's noise level: the timesteps remapped onto the shifted flow schedule (Self-Forcing's
        warped denoising steps)."""
        return [self.shift * (t / 1000) / (1 + (self.shift - 1) * (t / 1000)) for t in self.timesteps]

    def kept(self, first_frame: int, next_frame: int) -> bool:
        """Whether a cached chunk starting at ``first_frame`` is attended by the chunk starting at ``next_frame``
        (and so stays cached): it is in the sink, or within the window before the chunk."""
        if first_frame < self.sink_frames:
            return True
        return self.window_frames is None or first_frame >= next_frame - self.window_frames

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["timesteps"] = list(self.timesteps)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StreamingSettings":
        known = {name for name in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StreamingSettingsError(f"streaming: unknown field(s) {', '.join(unknown)}; known: "
                                         f"{', '.join(sorted(known))}")
        return cls(**{**data, "timesteps": tuple(data.get("timesteps", cls.timesteps))})
