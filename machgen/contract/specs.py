"""The shapes of what a family exports and serves: tensors, components,
axis ranges, served defaults and capabilities. Plain frozen dataclasses; a
family's ``spec.py`` declares them, the builder exports by them, the
repository writer renders them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of an exported component.

    ``shape`` holds ints for fixed sizes and names for dynamic axes; the axis
    named ``"batch"`` (always first when present) is the one Triton's dynamic
    batcher groups requests along. Equal names mean equal sizes.
    """

    name: str
    dtype: str  # a numpy dtype name: "float32", "int64", "uint8"
    shape: tuple[int | str, ...]

    @property
    def batched(self) -> bool:
        return bool(self.shape) and self.shape[0] == "batch"


@dataclass(frozen=True)
class ComponentSpec:
    """How one pipeline component is exported and served as one Triton model."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Largest max-abs difference allowed between the exported file and the
    # torch module on the sample inputs.
    tolerance: float
    # Called once per denoising step rather than once per request: its
    # batcher has its own queue delay and no preferred batch size (a request
    # sends one or a few rows).
    per_step: bool = False
    # Run inside the sampler's own process (one thread) rather than as a
    # Triton model: for graphs so small that a BLS round trip costs more
    # than their work.
    in_sampler: bool = False


# The step-reuse policies a request may name (runtime/cache.py implements them; docs/cache-reuse.md).
CACHE_POLICY_NAMES = ("none", "fbcache", "magcache")


def is_denoiser(component: str) -> bool:
    """Whether ``component`` is (a part of) a denoiser: ``denoiser``, ``denoiser_2``, their ``_head``, ``_tail``
    and ``_reuse``. Their calls are the steps (they pass the sampler's step gate; a lone request's rows are
    spread); the others are a request's stages (text encoders, VAE encoder and decoders)."""
    return component.startswith("denoiser")


@dataclass(frozen=True)
class AxisRange:
    """Sizes a named dynamic axis takes when served: an engine's optimization
    profile covers min..max and is tuned for opt."""

    min: int
    opt: int
    max: int

    def scaled(self, factor: float) -> "AxisRange":
        """Each size divided by ``factor`` (pixels to latents, latents to patches)."""
        return AxisRange(int(self.min // factor), int(self.opt // factor), int(self.max // factor))

    def times(self, other: "AxisRange") -> "AxisRange":
        """Sizes of the product of two axes (tokens of frames x rows x columns)."""
        return AxisRange(self.min * other.min, self.opt * other.opt, self.max * other.max)


@dataclass(frozen=True)
class Capabilities:
    """What a family can do; the API, the builder and the client consult this, never the name."""

    tasks: tuple[str, ...] = ("text-to-image",)
    # guidance_scale is the classifier-free guidance scale (a negative-prompt
    # pass when > 1, as WanPipeline), not a guidance value the model embeds
    # (FluxPipeline, whose CFG scale is true_cfg_scale).
    guidance_is_cfg: bool = False
    # The model makes a sound track with its video (the ``audio`` output).
    audio: bool = False


@dataclass(frozen=True)
class ServedDefaults:
    """The request defaults and limits a served model applies.

    These are the values a model card recommends; a model folder can carry
    them in ``machgen.json`` (key ``"serving"``), otherwise the family's
    defaults (those of the matching diffusers pipeline) apply.
    """

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float = 1.0
    negative_prompt: str | None = None
    max_sequence_length: int = 512
    max_height: int = 2048
    max_width: int = 2048
    max_inference_steps: int = 1000
    # Video models: frames per request by default and at most, and the
    # frame rate the clip plays at (image models: one frame).
    num_frames: int = 1
    max_frames: int = 1
    fps: int = 0
    # Defaults of the family's own API inputs (its declared FamilyInputs), by input name.
    family_inputs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "family_inputs": dict(self.family_inputs)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ServedDefaults":
        return cls(**{**data, "family_inputs": dict(data.get("family_inputs", {}))})
