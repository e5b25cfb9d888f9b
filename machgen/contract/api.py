"""The public API of a served pipeline: its inputs, outputs and validation.

Every model takes ``API_INPUTS`` (each checked against what the model can
do: an image model refuses ``num_frames``); a family may declare inputs of
its own (``FamilyInput``: type, shape, doc, default and validation, once),
which only its models' configs list, and which a served model publishes in
its card (``FamilyInput.published``; clients read them back with
``published_inputs``, so they need not know the family). Clients, the
generated configs, the sampler, docs/model-api.md's table and the perf inputs all
read this module. Only numpy is imported.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from machgen.contract.adapters import MAX_ADAPTERS_PER_REQUEST
from machgen.contract.specs import Capabilities, ServedDefaults


@dataclass(frozen=True)
class ApiTensor:
    name: str
    triton_dtype: str
    dims: tuple[int, ...]
    doc: str
    required: bool = False


# FluxImg2ImgPipeline's default strength.
DEFAULT_STRENGTH = 0.6

API_INPUTS: tuple[ApiTensor, ...] = (
    ApiTensor("prompt", "BYTES", (1,), "UTF-8 text to generate from", required=True),
    ApiTensor("negative_prompt", "BYTES", (1,), "UTF-8 text to steer away from; used when classifier-free "
                                                "guidance runs (its scale > 1)"),
    ApiTensor("seed", "INT64", (1,), "noise seed, 0 <= seed < 2**63; random when absent"),
    ApiTensor("num_inference_steps", "INT32", (1,), "denoising steps"),
    ApiTensor("guidance_scale", "FP32", (1,), "the embedded guidance of guidance-distilled models (Flux), or the "
                                              "classifier-free guidance scale of models without one (Wan)"),
    ApiTensor("true_cfg_scale", "FP32", (1,), "classifier-free guidance scale with negative_prompt, for models "
                                              "whose guidance_scale is embedded"),
    ApiTensor("height", "INT32", (1,), "image height in pixels"),
    ApiTensor("width", "INT32", (1,), "image width in pixels"),
    ApiTensor("cache_policy", "BYTES", (1,), "step reuse: none, fbcache or magcache; the model's calibrated "
                                             "default when absent"),
    ApiTensor("cache_threshold", "FP32", (1,), "the policy's threshold (higher: more reuse, less fidelity); "
                                               "the calibrated one when absent"),
    ApiTensor("image", "UINT8", (-1, -1, 3), "image-to-image: the starting picture, [height, width, RGB]; "
                                             "height and width default to its size"),
    ApiTensor("strength", "FP32", (1,), f"image-to-image: how much of the picture is redrawn, in [0, 1] "
                                        f"(1: all of it); default {DEFAULT_STRENGTH:g}, as diffusers"),
    ApiTensor("num_frames", "INT32", (1,), "video: frames to generate (the model's frame rule and maximum)"),
    ApiTensor("fps", "INT32", (1,), "video: frames per second the clip is meant to play at"),
    ApiTensor("reference_images", "UINT8", (-1, -1, -1, 3), "reference-to-video: pictures of what the video "
                                                            "shows, [count, height, width, RGB]"),
    ApiTensor("lora", "BYTES", (-1,), f"LoRA adapters to apply, by the names `machgen-build lora add` gave them "
                                      f"(at most {MAX_ADAPTERS_PER_REQUEST}, each once); models built with "
                                      f"--max-lora-rank"),
    ApiTensor("lora_scale", "FP32", (-1,), "each adapter's weight, as diffusers' set_adapters(adapter_weights=...), "
                                           "one per name in lora; 1.0 each when absent"),
    ApiTensor("priority", "BYTES", (1,), "whose denoising steps run first when more requests are runnable than "
                                         "the model runs at once: interactive (default; a person waiting) before "
                                         "batch (an agent's burst), which keeps a minimum share"),
    ApiTensor("owner", "BYTES", (1,), "who the request is for (an API key, a tenant): within a priority, denoiser "
                                      "time is shared fairly between owners; one anonymous owner when absent"),
    ApiTensor("trajectory_steps", "INT32", (-1,), "return the latents after each of these steps (1 to "
                                                  "num_inference_steps) in the trajectory output"),
    ApiTensor("start_step", "INT32", (1,), "refine: start at this step of the schedule from start_latents (a "
                                           "trajectory row of an earlier request of the same size, steps and "
                                           "model); with that request's settings it gives that request's result"),
    ApiTensor("start_latents", "FP32", (-1,), "refine: the latents after start_step steps, one trajectory row"),
    ApiTensor("stop_step", "INT32", (1,), "stop after this step; images are then the clean result its prediction "
                                          "points to (decoded in full, for scoring an early look)"),
)
# Request priorities, first served first (runtime/scheduling.py).
PRIORITIES = ("interactive", "batch")
DEFAULT_PRIORITY = "interactive"
ANONYMOUS_OWNER = ""
MAX_OWNER_LENGTH = 256


@dataclass(frozen=True)
class FamilyInput:
    """An input only one family's models take, declared once in the family's
    spec. Its tensor goes into those models' configs and, rendered by
    ``markdown_row``, docs/model-api.md's table; the client and ``machgen generate``
    take it by name (the CLI as ``flag``, repeatable for a vector).
    ``parse(field, value, settings)`` validates a sent value against the
    model (its manifest's family settings), raising InvalidArgument;
    ``default`` stands in for an absent one (a model card may set another:
    ServedDefaults.family_inputs). Other families' models refuse it by name."""

    tensor: ApiTensor
    default: Any
    parse: Callable[[str, np.ndarray, Mapping[str, Any]], Any]
    cli_flag: str | None = None
    # The API table's default column (docs/model-api.md) where ``default`` alone does not say it.
    default_doc: str | None = None

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def flag(self) -> str:
        return self.cli_flag or "--" + self.name.replace("_", "-")

    @property
    def repeatable(self) -> bool:
        return self.tensor.dims != (1,)

    def published(self, default: Any) -> dict[str, Any]:
        """This input as a served model's card describes it (``default``: the
        model's own), for clients that do not know its family."""
        return {"name": self.name, "datatype": self.tensor.triton_dtype, "shape": list(self.tensor.dims),
                "doc": self.tensor.doc, "default": default, "default_doc": self.default_doc, "flag": self.flag,
                "repeatable": self.repeatable}

    def markdown_row(self) -> str:
        """This input's row of the API table in docs/model-api.md."""
        shape = "[" + ", ".join("K" if d < 0 else str(d) for d in self.tensor.dims) + "]"
        default = self.default_doc or f"model's ({self.default})"
        return f"| `{self.name}` | {self.tensor.triton_dtype} | {shape} | {self.tensor.doc} | {default} |"


# A served model's card (builder/repository.py model_card), as JSON text in the config parameter of this key of
# the public model NAME and of NAME_stream: a plain model-config call reads it.
MODEL_CARD_PARAMETER = "model"


def model_card_of(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The card a served model's config (as Triton's model-config answers it, JSON) carries; None: none."""
    import json

    text = config.get("parameters", {}).get(MODEL_CARD_PARAMETER, {}).get("string_value")
    return json.loads(text) if text else None


def published_inputs(entries: Iterable[Mapping[str, Any]]) -> dict[str, FamilyInput]:
    """A served model's own inputs, by name, from what it publishes: its
    card's ``inputs`` (FamilyInput.published), or only name, datatype and
    shape (a repository built before cards described them: its metadata's
    inputs). Each checks a value's type and shape alone; the server checks
    the value against the model."""
    found = {}
    for entry in entries:
        tensor = ApiTensor(entry["name"], entry["datatype"], tuple(int(d) for d in entry["shape"]),
                           entry.get("doc", ""))
        found[tensor.name] = FamilyInput(
            tensor, default=entry.get("default"), default_doc=entry.get("default_doc"), cli_flag=entry.get("flag"),
            parse=lambda field, value, settings, tensor=tensor: published_value(tensor, field, value))
    return found


def published_value(tensor: ApiTensor, field: str, value: np.ndarray) -> Any:
    """``value`` checked against the type and shape ``tensor`` declares: a scalar, or a list."""
    kinds = {str: "OSU", bool: "b", int: "iu", float: "fiu"}[python_type(tensor.triton_dtype)]
    if value.dtype.kind not in kinds:
        raise InvalidArgument(field, f"expected {tensor.triton_dtype} values, got {value.dtype}")
    if tensor.dims == (1,):
        return _text(field, value) if value.dtype.kind in "OSU" else _scalar(field, value).item()
    if value.ndim != len(tensor.dims) or any(0 <= d != n for d, n in zip(tensor.dims, value.shape)):
        raise InvalidArgument(field, f"expected shape {list(tensor.dims)} (-1: any length), got {list(value.shape)}")
    return value.tolist()


API_OUTPUTS: tuple[ApiTensor, ...] = (
    ApiTensor("images", "UINT8", (-1, -1, -1, 3), "the generated image, or every frame of the video, "
                                                   "[frames, height, width, RGB]"),
    ApiTensor("stats", "BYTES", (1,), "JSON: steps, cache_policy, cache_threshold, denoiser_head_calls, "
                                      "denoiser_tail_calls, denoiser_tail_passes, negative_rows_derived, "
                                      "text_cache_hits/misses, frames, fps, sample_rate, adapters (name: scale), "
                                      "expected_psnr(_worst), priority, waited_seconds (at the step gate), "
                                      "denoiser_seconds, passes_in_sampler (of the tail passes, those a lone "
                                      "request ran in the sampler)"),
    ApiTensor("trajectory", "FP32", (-1, -1), "the latents after each of trajectory_steps, one row each, flat "
                                              "(a row is a later request's start_latents)"),
    # Only in the configs of models that make sound (Capabilities.audio).
    ApiTensor("audio", "FP32", (-1, -1), "a video's sound track, [channels, samples] in [-1, 1] at stats' "
                                         "sample_rate"),
)
AUDIO_OUTPUT = "audio"
TRAJECTORY_OUTPUT = "trajectory"

# The streaming twin NAME_stream (decoupled): the public model's inputs plus
# STREAM_INPUTS; before its final response (API_OUTPUTS) it sends one with
# PROGRESS_OUTPUTS after every step, the preview every preview_interval steps,
# and the last step again after 5 s without one (step 0 of 0 before the first:
# a heartbeat, which progress consumers skip), so that a stream silent for
# STREAM_SILENCE_S is known lost (a stub that dies never ends its streams).
STREAM_SILENCE_S = 20.0
PREVIEW_INTERVAL_INPUT = "preview_interval"
PROGRESS_OUTPUT = "progress"
ELAPSED_OUTPUT = "elapsed"
PREVIEW_OUTPUT = "preview"
# A stream's error reaches a gRPC client as a message alone (no status):
# NAME_stream starts it with its status, "[INVALID_ARG] invalid input ...".
STREAM_ERROR_STATUSES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL", "UNKNOWN", "NOT_FOUND",
                         "UNSUPPORTED", "ALREADY_EXISTS")


def stream_error_message(status: str, message: str) -> str:
    return f"[{status}] {message}"


def stream_error_status(message: str) -> tuple[str | None, str]:
    """(status, message) of a stream's error message (None: it names none)."""
    status, separator, rest = message.partition("] ")
    if separator and status.startswith("[") and status[1:] in STREAM_ERROR_STATUSES:
        return status[1:], rest
    return None, message


STREAM_INPUTS: tuple[ApiTensor, ...] = (
    ApiTensor(PREVIEW_INTERVAL_INPUT, "INT32", (1,), "steps between previews (0: none); the model's default "
                                                     "when absent"),
)
PROGRESS_OUTPUTS: tuple[ApiTensor, ...] = (
    ApiTensor(PROGRESS_OUTPUT, "INT32", (2,), "[step, steps]: the steps done and the steps the request runs"),
    ApiTensor(ELAPSED_OUTPUT, "FP32", (1,), "seconds since the request started running"),
    ApiTensor(PREVIEW_OUTPUT, "UINT8", (-1, -1, -1, 3), "the predicted result at the latents' size, [frames, "
                                                         "height, width, RGB] (a few of a video's frames)"),
)


def public_outputs(audio: bool) -> tuple[ApiTensor, ...]:
    """The outputs a served model declares: ``audio`` only where it makes sound."""
    return tuple(t for t in API_OUTPUTS if audio or t.name != AUDIO_OUTPUT)


@dataclass(frozen=True)
class Generated:
    """What one request gave back: uint8 frames [N, H, W, 3], the sound
    track float32 [channels, samples] (None for a silent model), stats, and
    the latents after each of its trajectory_steps (float32 [steps, values];
    None where it asked for none)."""

    images: np.ndarray
    audio: np.ndarray | None
    stats: dict[str, Any]
    trajectory: np.ndarray | None = None


_NUMPY_DTYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
                 "INT64": np.int64, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
                 "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
_MAX_GUIDANCE = 100.0
_MAX_CACHE_THRESHOLD = 10.0
_MAX_FPS = 240
MAX_REFERENCE_IMAGES = 8


def numpy_dtype(triton_dtype: str):
    return _NUMPY_DTYPES[triton_dtype]


def python_type(triton_dtype: str) -> type:
    """The type a JSON field or a command-line word of ``triton_dtype`` is read as."""
    kind = np.dtype(numpy_dtype(triton_dtype)).kind
    return {"O": str, "b": bool, "f": float}.get(kind, int)


def input_array(tensor: ApiTensor, value: Any) -> np.ndarray:
    """A client-side value as the array the API takes: scalars as [1], arrays in their own shape."""
    if tensor.triton_dtype == "BYTES":
        values = list(value) if tensor.dims != (1,) and isinstance(value, (list, tuple, np.ndarray)) else [value]
        return np.array([item.encode("utf-8") if isinstance(item, str) else item for item in values],
                        dtype=np.object_)
    array = np.asarray(value, dtype=numpy_dtype(tensor.triton_dtype))
    return array.reshape(-1) if len(tensor.dims) == 1 else array


class InvalidArgument(ValueError):
    """A request input is missing or out of range; the message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"invalid input '{field}': {problem}")
        self.field = field


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


def _scalar(field: str, value: np.ndarray) -> Any:
    if value.size != 1:
        raise InvalidArgument(field, f"expected one element, got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def _text(field: str, value: np.ndarray) -> str:
    raw = _scalar(field, value)
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except (UnicodeDecodeError, TypeError) as err:
        raise InvalidArgument(field, "not valid UTF-8 text") from err


def _owner(field: str, value: np.ndarray) -> str:
    owner = _text(field, value)
    if len(owner) > MAX_OWNER_LENGTH:
        raise InvalidArgument(field, f"{len(owner)} characters; at most {MAX_OWNER_LENGTH}")
    return owner


def _integer(field: str, value: np.ndarray, low: int, high: int) -> int:
    number = int(_scalar(field, value))
    if not low <= number <= high:
        raise InvalidArgument(field, f"{number} is outside [{low}, {high}]")
    return number


def _real(field: str, value: np.ndarray, low: float, high: float) -> float:
    number = float(_scalar(field, value))
    if not math.isfinite(number) or not low <= number <= high:
        raise InvalidArgument(field, f"{number} is outside [{low:g}, {high:g}]")
    return number


def integer_input(field: str, value: np.ndarray, low: int, high: int) -> int:
    """One integer in [low, high]."""
    return _integer(field, value, low, high)


def guidance_scale_input(field: str, value: np.ndarray) -> float:
    """A guidance scale: finite, in [0, 100]."""
    return _real(field, value, 0.0, _MAX_GUIDANCE)


def fraction_input(field: str, value: np.ndarray) -> float:
    return _real(field, value, 0.0, 1.0)


def indices_input(field: str, value: np.ndarray, count: int) -> tuple[int, ...]:
    """Distinct integers in [0, count), as sent (a 1-D INT32 array; empty is allowed)."""
    if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
        raise InvalidArgument(field, f"expected a 1-D integer array, got {value.dtype} {list(value.shape)}")
    indices = tuple(int(i) for i in value)
    outside = [i for i in indices if not 0 <= i < count]
    if outside:
        raise InvalidArgument(field, f"{outside} outside [0, {count - 1}]")
    if len(set(indices)) != len(indices):
        raise InvalidArgument(field, f"{list(indices)} repeats an index")
    return indices


def _size(field: str, value: np.ndarray, multiple: int, maximum: int) -> int:
    number = int(_scalar(field, value))
    if number < multiple or number > maximum:
        raise InvalidArgument(field, f"{number} is outside [{multiple}, {maximum}]")
    if number % multiple:
        raise InvalidArgument(field, f"{number} is not a multiple of {multiple}")
    return number


def _choice(field: str, value: np.ndarray, choices: tuple[str, ...]) -> str:
    text = _text(field, value)
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
    count = _integer(field, value, 1, maximum)
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
        fields["fps"] = _integer("fps", np.asarray(get_input("fps")), 1, _MAX_FPS)
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
    texts = [_text("lora", np.asarray([name])) for name in names]
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
    if not all(math.isfinite(value) and abs(value) <= _MAX_GUIDANCE for value in values):
        raise InvalidArgument("lora_scale", f"{values}: each must be finite, within +-{_MAX_GUIDANCE:g}")
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
        height = _image_size(image, 0, value("height", lambda f, v: int(_scalar(f, v)), None), "height",
                             size_multiple, int(defaults.max_height))
        width = _image_size(image, 1, value("width", lambda f, v: int(_scalar(f, v)), None), "width",
                            size_multiple, int(defaults.max_width))
    request = GenerationRequest(
        prompt=_text("prompt", np.asarray(prompt)),
        negative_prompt=value("negative_prompt", _text, defaults.negative_prompt),
        # Without a seed the noise is fresh each time, as diffusers does without a generator.
        seed=value("seed", lambda f, v: _integer(f, v, 0, 2**63 - 1), secrets.randbelow(2**63)),
        num_inference_steps=value("num_inference_steps", lambda f, v: _integer(f, v, 1, max_steps),
                                  int(defaults.num_inference_steps)),
        **_guidance_fields(get_input, value, defaults, capabilities.guidance_is_cfg),
        height=height,
        width=width,
        cache_policy=value("cache_policy", lambda f, v: _choice(f, v, cache_policies), None),
        cache_threshold=value("cache_threshold", lambda f, v: _real(f, v, 0.0, _MAX_CACHE_THRESHOLD), None),
        image=image,
        strength=value("strength", lambda f, v: _real(f, v, 0.0, 1.0), DEFAULT_STRENGTH) if redraws_image else None,
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
        fields["start_step"] = _integer("start_step", np.asarray(start_step), 0, steps - 1)
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
        fields["stop_step"] = _integer("stop_step", np.asarray(stop), first + 1, steps)
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
