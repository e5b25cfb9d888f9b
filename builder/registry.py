"""The model-family registry.

A family (Flux, Wan, ...) is defined in one file under ``builder/families/``
and registered with :func:`register_family`. Everything else -- CLI choices,
the generated model repository, the sampler running inside Triton, request
validation and perf inputs -- is derived from what the family declares here.

Importing this module (and listing the families) must stay cheap: it does not
import torch, diffusers or tritonclient; the families import those lazily,
inside the functions that need them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch


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
    # Largest max-abs difference allowed between the ONNX file under ONNX
    # Runtime and the torch module on the sample inputs.
    tolerance: float
    # Called once per denoising step rather than once per request: its
    # batcher has its own queue delay and no preferred batch size (a request
    # sends one or two rows).
    per_step: bool = False
    # Run inside the sampler's own process (ONNX Runtime, one thread) rather
    # than as a Triton model: for graphs so small that a BLS round trip costs
    # more than their work.
    in_sampler: bool = False


@dataclass(frozen=True)
class AxisRange:
    """Sizes a named dynamic axis takes when served: an engine's optimization
    profile covers min..max and is tuned for opt."""

    min: int
    opt: int
    max: int


@dataclass
class ExportableComponent:
    """A component ready for export: its spec, a torch module whose forward
    takes the spec's inputs in order, and sample inputs to trace and check."""

    spec: ComponentSpec
    module: "torch.nn.Module"
    sample_inputs: dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class Capabilities:
    """What a family can do; the API and the builder consult this, never the name."""

    tasks: tuple[str, ...] = ("text-to-image",)
    # diffusers' true classifier-free guidance (a second, negative-prompt pass).
    true_cfg: bool = True
    # guidance_scale is the classifier-free guidance scale (a negative-prompt
    # pass when > 1, as WanPipeline), not a guidance value the model embeds
    # (FluxPipeline, whose CFG scale is true_cfg_scale).
    guidance_is_cfg: bool = False
    # The model makes a sound track with its video (the ``audio`` output).
    audio: bool = False
    # The API's FAMILY_INPUTS this family takes (ensembles/api.py; its
    # conditioning's ``parse_guidance`` validates them).
    guidance_inputs: tuple[str, ...] = ()


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
    # Defaults of the family's own guidance inputs (Capabilities.guidance_inputs), by input name.
    family_guidance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "family_guidance": dict(self.family_guidance)}


@dataclass
class Family:
    """Base of a model family: the few things every family must answer.

    Build-time methods take a loaded diffusers pipeline; run-time methods
    (used by the sampler inside Triton) take plain settings and callables, so
    that the sampler can be tested without Triton, ONNX or a real model.
    """

    name: ClassVar[str]
    diffusers_pipeline: ClassVar[str]  # the diffusers pipeline class name
    capabilities: ClassVar[Capabilities] = Capabilities()
    # The model-folder subfolders the sampler needs at run time (tokenizers,
    # scheduler config); they are copied into the sampler's model folder.
    sampler_assets: ClassVar[tuple[str, ...]] = ()
    # The modules whose ``dispatch_attention_fn`` calls are the denoiser's
    # attention: ``--attention sparse-fp8`` swaps those calls for the
    # SparseAttention operator during export (plugins/ops.py).
    attention_modules: ClassVar[tuple[str, ...]] = ()

    # --- build time ---
    def tiny_pipeline(self) -> Any:
        """A deterministic tiny random-weight pipeline for tests and demos."""
        raise NotImplementedError

    def tiny_defaults(self) -> ServedDefaults:
        raise NotImplementedError

    def pipeline_defaults(self, pipe: Any) -> ServedDefaults:
        """The defaults of the diffusers pipeline for this model."""
        raise NotImplementedError

    def components(self, pipe: Any) -> list[ExportableComponent]:
        raise NotImplementedError

    def sparse_attention_layers(self, pipe: Any) -> list | None:
        """The attention modules whose calls ``--attention sparse-fp8`` swaps,
        where the rule of plugins/ops.attention_swapped (unmasked, keys as
        long as the queries) would also take a cross-attention; None: every
        call in ``attention_modules`` that the rule takes."""
        return None

    def dense_attention_tokens(self, defaults: ServedDefaults) -> int:
        """Leading tokens of the denoiser's attention whose blocks stay dense
        under sparse attention (the text tokens of a joint-attention model)."""
        return 0

    def sampler_settings(self, pipe: Any, defaults: ServedDefaults) -> dict[str, Any]:
        """JSON-able settings the run-time half needs (shapes, factors, flags)."""
        raise NotImplementedError

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        """The range of every named axis of the components' inputs except
        ``batch``, from the served sizes (``settings``: sampler_settings)."""
        raise NotImplementedError

    # --- run time ---
    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable) -> Any:
        raise NotImplementedError


_FAMILIES: dict[str, type[Family]] = {}


def register_family(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family known under ``cls.name``."""
    if cls.name in _FAMILIES and _FAMILIES[cls.name] is not cls:
        raise ValueError(f"model family {cls.name!r} is registered twice")
    _FAMILIES[cls.name] = cls
    return cls


def _load_family_modules() -> None:
    from machgen.builder import families

    for info in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{info.name}")


def family_names() -> list[str]:
    _load_family_modules()
    return sorted(_FAMILIES)


def get_family(name: str) -> Family:
    _load_family_modules()
    try:
        return _FAMILIES[name]()
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(sorted(_FAMILIES))}") from None


def family_for_pipeline(pipeline_class_name: str) -> Family:
    """The family serving a diffusers pipeline class (from model_index.json)."""
    _load_family_modules()
    for cls in _FAMILIES.values():
        if cls.diffusers_pipeline == pipeline_class_name:
            return cls()
    known = ", ".join(sorted(c.diffusers_pipeline for c in _FAMILIES.values()))
    raise KeyError(f"no model family serves {pipeline_class_name!r}; supported pipelines: {known}")


__all__ = [
    "AxisRange",
    "Capabilities",
    "ComponentSpec",
    "ExportableComponent",
    "Family",
    "ServedDefaults",
    "TensorSpec",
    "family_for_pipeline",
    "family_names",
    "get_family",
    "register_family",
]
