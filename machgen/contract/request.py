"""One generation request: its fields (``GenerationRequest``), parsed from
a request's inputs and checked against what the model serves
(``parse_request``), the served defaults filled in. Only numpy is
imported."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from machgen.contract.adapters import MAX_ADAPTERS_PER_REQUEST
from machgen.contract.api import (
    ANONYMOUS_OWNER,
    DEFAULT_PRIORITY,
    DEFAULT_STRENGTH,
    MAX_OWNER_LENGTH,
    MAX_REFERENCE_IMAGES,
    PRIORITIES,
    FamilyInput,
)
from machgen.contract.specs import Capabilities, ServedDefaults
from machgen.contract.validation import (
    MAX_GUIDANCE,
    InvalidArgument,
    fraction_input,
    guidance_scale_input,
    integer_input,
    real_input,
    scalar_input,
    text_input,
)

_MAX_CACHE_THRESHOLD = 10.0
_MAX_FPS = 240


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    negative_prompt: str | None
    seed: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float  # the CFG scale: guidance_scale's value for a model whose guidance is CFG
    height: int
    width: int
    cache_policy: str | None = None  # None: the served default
    cache_threshold: float | None = None  # None: the policy's calibrated threshold
    image: np.ndarray | None = None  # image-to-image, image-to-video: uint8 [height, width, 3]
    strength: float | None = None  # image-to-image only
    num_frames: int = 1  # 1 for an image model
    fps: int | None = None  # video only
    reference_images: np.ndarray | None = None  # reference-to-video: uint8 [count, height, width, 3]
    # The family's own inputs (its FamilyInputs) by name, validated, absent ones at their defaults.
    inputs: Mapping[str, Any] = field(default_factory=dict)
    # Per-request LoRA adapters: (name, scale) in the order asked.
    adapters: tuple[tuple[str, float], ...] = ()
    priority: str = DEFAULT_PRIORITY
    owner: str = ANONYMOUS_OWNER
    # Return the latents after these steps of the schedule (each in [1, num_inference_steps]).
    trajectory_steps: tuple[int, ...] = ()
    # Refine: the latents after ``start_step`` steps of this request's schedule (flat float32), to go on from.
    start_step: int = 0
    start_latents: np.ndarray | None = None
    # Stop after this step of the schedule (None: run to its end), returning the predicted clean result.
    stop_step: int | None = None

    @property
    def first_step(self) -> int:
        """The step of the schedule the loop starts at: a refine's start_step, or
        image-to-image's skip of the first (1 - strength) (diffusers' get_timesteps)."""
        steps = self.num_inference_steps
        if self.start_latents is not None:
            return self.start_step
        return 0 if self.strength is None else int(max(steps - steps * self.strength, 0))

    @property
    def last_step(self) -> int:
        """The step of the schedule the loop stops after."""
        return self.num_inference_steps if self.stop_step is None else self.stop_step

    @property
    def denoising_steps(self) -> int:
        """Steps actually run."""
        return self.last_step - self.first_step

    @property
    def uses_true_cfg(self) -> bool:
        # FluxPipeline: true CFG runs only with a scale > 1 and a negative prompt.
        return self.true_cfg_scale > 1 and self.negative_prompt is not None


def check_option_names(names: Iterable[str], taken: Collection[str], families_inputs: Collection[str]) -> None:
    """Options of an in-process call checked as the server checks a request's
    inputs: one the model does not take but another family does is refused
    by name (InvalidArgument); one nobody declares is a TypeError."""
    for name in names:
        if name in taken:
            continue
        if name in families_inputs:
            raise InvalidArgument(name, "this model does not take it")
        raise TypeError(f"unknown generation option {name!r}; this model takes {sorted(taken)}")


def _owner(field: str, value: np.ndarray) -> str:
    owner = text_input(field, value)
    if len(owner) > MAX_OWNER_LENGTH:
        raise InvalidArgument(field, f"{len(owner)} characters; at most {MAX_OWNER_LENGTH}")
    return owner


def _size(field: str, value: np.ndarray, multiple: int, maximum: int) -> int:
    number = int(scalar_input(field, value))
    if number < multiple or number > maximum:
        raise InvalidArgument(field, f"{number} is outside [{multiple}, {maximum}]")
    if number % multiple:
        raise InvalidArgument(field, f"{number} is not a multiple of {multiple}")
    return number


def _choice(field: str, value: np.ndarray, choices: tuple[str, ...]) -> str:
    text = text_input(field, value)
    if text not in choices:
        raise InvalidArgument(field, f"{text!r} is not one of {', '.join(choices)}")
    return text


def _picture(field: str, value: np.ndarray) -> np.ndarray:
    if value.dtype != np.uint8:
        raise InvalidArgument(field, f"expected UINT8 pixels, got {value.dtype}")
    if value.ndim != 3 or value.shape[2] != 3 or 0 in value.shape:
        raise InvalidArgument(field, f"expected shape [height, width, 3], got {list(value.shape)}")
    return value


def _image_size(image: np.ndarray, axis: int, requested: int | None, name: str, multiple: int,
                maximum: int) -> int:
    """The request's height or width when it sends an image: the image's own."""
    size = int(image.shape[axis])
    if requested is not None and requested != size:
        raise InvalidArgument("image", f"its {name} is {size}, but {name} asks for {requested}")
    if size < multiple or size > maximum or size % multiple:
        raise InvalidArgument("image", f"its {name} {size} must be a multiple of {multiple} in "
                                       f"[{multiple}, {maximum}]")
    return size


def _frames(field: str, value: np.ndarray, frame_multiple: int, maximum: int) -> int:
    count = integer_input(field, value, 1, maximum)
    if (count - 1) % frame_multiple:
        raise InvalidArgument(field, f"{count} is not {frame_multiple}k + 1 frames (the model's temporal factor)")
    return count


def _pictures(field: str, value: np.ndarray, height: int, width: int) -> np.ndarray:
    if value.dtype != np.uint8:
        raise InvalidArgument(field, f"expected UINT8 pixels, got {value.dtype}")
    if value.ndim != 4 or value.shape[3] != 3 or not 1 <= value.shape[0] <= MAX_REFERENCE_IMAGES:
        raise InvalidArgument(field, f"expected shape [1 to {MAX_REFERENCE_IMAGES} images, height, width, 3], "
                                     f"got {list(value.shape)}")
    if value.shape[1:3] != (height, width):
        raise InvalidArgument(field, f"their size {value.shape[2]}x{value.shape[1]} is not the video's "
                                     f"{width}x{height}")
    return value


def _video_fields(get_input: Callable[[str], np.ndarray | None], defaults: ServedDefaults,
                  tasks: tuple[str, ...], frame_multiple: int, height: int, width: int) -> dict[str, Any]:
    """num_frames, fps and reference_images of a request: refused by an image
    model, checked against a video model's frame rule and limits."""
    if not any(task.endswith("-to-video") for task in tasks):
        for name in ("num_frames", "fps", "reference_images"):
            if get_input(name) is not None:
                raise InvalidArgument(name, f"this model makes images, not video (it does {', '.join(tasks)})")
        return {}
    fields: dict[str, Any] = {
        "num_frames": int(defaults.num_frames), "fps": int(defaults.fps), "reference_images": None}
    if get_input("num_frames") is not None:
        fields["num_frames"] = _frames("num_frames", np.asarray(get_input("num_frames")), frame_multiple,
                                       int(defaults.max_frames))
    if get_input("fps") is not None:
        fields["fps"] = integer_input("fps", np.asarray(get_input("fps")), 1, _MAX_FPS)
    if get_input("reference_images") is not None:
        if "reference-to-video" not in tasks:
            raise InvalidArgument("reference_images", f"this model does not do reference-to-video (it does "
                                                      f"{', '.join(tasks)})")
        fields["reference_images"] = _pictures("reference_images", np.asarray(get_input("reference_images")),
                                               height, width)
    return fields


def _guidance_fields(get_input: Callable[[str], np.ndarray | None], value: Callable, defaults: ServedDefaults,
                     guidance_is_cfg: bool) -> dict[str, Any]:
    """guidance_scale and true_cfg_scale as the model reads them."""
    guidance = value("guidance_scale", guidance_scale_input, float(defaults.guidance_scale))
    if guidance_is_cfg:
        if get_input("true_cfg_scale") is not None:
            raise InvalidArgument("true_cfg_scale", "this model's classifier-free guidance scale is guidance_scale")
        return {"guidance_scale": guidance, "true_cfg_scale": guidance}
    return {"guidance_scale": guidance,
            "true_cfg_scale": value("true_cfg_scale", guidance_scale_input, float(defaults.true_cfg_scale))}


def _family_fields(get_input: Callable[[str], np.ndarray | None], defaults: ServedDefaults,
                   family_inputs: Sequence[FamilyInput], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The family's own inputs, each validated by its declaration or at its served default."""
    values = {}
    for declared in family_inputs:
        array = get_input(declared.name)
        values[declared.name] = (defaults.family_inputs.get(declared.name, declared.default) if array is None
                                 else declared.parse(declared.name, np.asarray(array), settings))
    return values


def _adapter_fields(get_input: Callable[[str], np.ndarray | None],
                    adapters: Callable[[], Collection[str]] | None) -> tuple[tuple[str, float], ...]:
    """``lora`` and ``lora_scale``: known adapter names, each once, with finite scales."""
    names, scales = get_input("lora"), get_input("lora_scale")
    names = None if names is None else np.asarray(names).reshape(-1)
    if names is None or not names.size:
        if scales is not None and np.asarray(scales).size:
            raise InvalidArgument("lora_scale", "given without lora")
        return ()
    if adapters is None:
        raise InvalidArgument("lora", "this model serves no adapters (build it with machgen-build build "
                                      "--max-lora-rank R, then machgen-build lora add)")
    if names.size > MAX_ADAPTERS_PER_REQUEST:
        raise InvalidArgument("lora", f"{names.size} adapters; at most {MAX_ADAPTERS_PER_REQUEST} per request")
    texts = [text_input("lora", np.asarray([name])) for name in names]
    if len(set(texts)) != len(texts):
        raise InvalidArgument("lora", f"{texts} names an adapter twice")
    available = adapters()
    unknown = [name for name in texts if name not in available]
    if unknown:
        raise InvalidArgument("lora", f"unknown adapter {unknown[0]!r}; this model has "
                                      f"{', '.join(sorted(available)) or 'none'} (machgen-build lora list)")
    if scales is None:
        return tuple((name, 1.0) for name in texts)
    scales = np.asarray(scales)
    if scales.dtype.kind not in "fiu" or scales.reshape(-1).size != len(texts):
        raise InvalidArgument("lora_scale", f"expected {len(texts)} numbers, one per lora name, got {scales.dtype} "
                                            f"{list(scales.shape)}")
    # As sent (float32), shown as such: 0.7, not 0.699999988.
    values = [float(str(np.float32(value))) for value in scales.reshape(-1)]
    if not all(math.isfinite(value) and abs(value) <= MAX_GUIDANCE for value in values):
        raise InvalidArgument("lora_scale", f"{values}: each must be finite, within +-{MAX_GUIDANCE:g}")
    return tuple(zip(texts, values))


def parse_request(get_input: Callable[[str], np.ndarray | None], defaults: ServedDefaults, *,
                  size_multiple: int, capabilities: Capabilities, cache_policies: tuple[str, ...] = ("none",),
                  frame_multiple: int = 1, family_inputs: Sequence[FamilyInput] = (),
                  settings: Mapping[str, Any] | None = None,
                  adapters: Callable[[], Collection[str]] | None = None) -> GenerationRequest:
    """Validate one request's inputs and fill in the served defaults.

    ``get_input(name)`` returns the input's array or None when it is absent;
    ``cache_policies`` are the policy names this model serves; a video
    model's ``num_frames`` is ``frame_multiple`` k + 1; ``family_inputs``
    are the family's own inputs, validated against the model's ``settings``
    (its manifest's family settings); ``adapters()`` names the LoRA
    adapters the model has now (None: it serves none). Raises InvalidArgument.
    """

    def value(name: str, parse: Callable[[str, np.ndarray], Any], default: Any) -> Any:
        array = get_input(name)
        return default if array is None else parse(name, np.asarray(array))

    tasks = capabilities.tasks
    prompt = get_input("prompt")
    if prompt is None:
        raise InvalidArgument("prompt", "missing; it is required")
    max_steps = int(defaults.max_inference_steps)
    image = value("image", _picture, None)
    if image is not None and not {"image-to-image", "image-to-video"} & set(tasks):
        raise InvalidArgument("image", f"this model does not start from an image (it does {', '.join(tasks)})")
    if image is None and not any(task.startswith("text-to-") for task in tasks):
        raise InvalidArgument("image", f"missing; this model starts from an image (it does {', '.join(tasks)})")
    redraws_image = image is not None and "image-to-image" in tasks
    if not redraws_image and get_input("strength") is not None:
        raise InvalidArgument("strength", "applies only to image-to-image, with an image")
    if image is None:
        height = value("height", lambda f, v: _size(f, v, size_multiple, int(defaults.max_height)),
                       int(defaults.height))
        width = value("width", lambda f, v: _size(f, v, size_multiple, int(defaults.max_width)), int(defaults.width))
    else:
        height = _image_size(image, 0, value("height", lambda f, v: int(scalar_input(f, v)), None), "height",
                             size_multiple, int(defaults.max_height))
        width = _image_size(image, 1, value("width", lambda f, v: int(scalar_input(f, v)), None), "width",
                            size_multiple, int(defaults.max_width))
    request = GenerationRequest(
        prompt=text_input("prompt", np.asarray(prompt)),
        negative_prompt=value("negative_prompt", text_input, defaults.negative_prompt),
        # Without a seed the noise is fresh each time, as diffusers does without a generator.
        seed=value("seed", lambda f, v: integer_input(f, v, 0, 2**63 - 1), secrets.randbelow(2**63)),
        num_inference_steps=value("num_inference_steps", lambda f, v: integer_input(f, v, 1, max_steps),
                                  int(defaults.num_inference_steps)),
        **_guidance_fields(get_input, value, defaults, capabilities.guidance_is_cfg),
        height=height,
        width=width,
        cache_policy=value("cache_policy", lambda f, v: _choice(f, v, cache_policies), None),
        cache_threshold=value("cache_threshold", lambda f, v: real_input(f, v, 0.0, _MAX_CACHE_THRESHOLD), None),
        image=image,
        strength=value("strength", fraction_input, DEFAULT_STRENGTH) if redraws_image else None,
        **_video_fields(get_input, defaults, tasks, frame_multiple, height, width),
        inputs=_family_fields(get_input, defaults, family_inputs, settings or {}),
        adapters=_adapter_fields(get_input, adapters),
        priority=value("priority", lambda f, v: _choice(f, v, PRIORITIES), DEFAULT_PRIORITY),
        owner=value("owner", _owner, ANONYMOUS_OWNER),
    )
    if request.strength is not None and request.num_inference_steps - request.first_step < 1:
        raise InvalidArgument("strength", f"{request.strength:g} leaves no denoising step of "
                                          f"{request.num_inference_steps}")
    return _trajectory_fields(get_input, request, redraws_image)


def _trajectory_fields(get_input: Callable[[str], np.ndarray | None], request: GenerationRequest,
                       redraws_image: bool) -> GenerationRequest:
    """trajectory_steps, start_step with start_latents (refine) and stop_step, checked against the schedule."""
    steps = request.num_inference_steps
    start_step, start_latents = get_input("start_step"), get_input("start_latents")
    if (start_step is None) != (start_latents is None):
        given, missing = ("start_step", "start_latents") if start_latents is None else ("start_latents", "start_step")
        raise InvalidArgument(missing, f"missing; {given} needs it (a refine starts at a step from its latents)")
    fields: dict[str, Any] = {}
    if start_step is not None:
        if redraws_image:
            raise InvalidArgument("start_step", "a refine starts from latents, image-to-image from a picture: "
                                                "not both")
        fields["start_step"] = integer_input("start_step", np.asarray(start_step), 0, steps - 1)
        latents = np.asarray(start_latents)
        if latents.dtype.kind != "f" or latents.ndim != 1 or not latents.size:
            raise InvalidArgument("start_latents", f"expected a flat FP32 array (a trajectory row), got "
                                                   f"{latents.dtype} {list(latents.shape)}")
        if not np.isfinite(latents).all():
            raise InvalidArgument("start_latents", "holds values that are not finite")
        fields["start_latents"] = latents.astype(np.float32, copy=False)
    first = fields.get("start_step", request.first_step)
    stop = get_input("stop_step")
    if stop is not None:
        fields["stop_step"] = integer_input("stop_step", np.asarray(stop), first + 1, steps)
    last = fields.get("stop_step", steps)
    kept = get_input("trajectory_steps")
    if kept is not None and np.asarray(kept).size:
        kept = np.asarray(kept)
        if kept.ndim != 1 or not np.issubdtype(kept.dtype, np.integer):
            raise InvalidArgument("trajectory_steps", f"expected a 1-D integer array, got {kept.dtype} "
                                                      f"{list(kept.shape)}")
        outside = [int(step) for step in kept if not first < step <= last]
        if outside:
            raise InvalidArgument("trajectory_steps", f"{outside}: this request runs steps {first + 1} to {last}")
        fields["trajectory_steps"] = tuple(sorted({int(step) for step in kept}))
    return replace(request, **fields) if fields else request
