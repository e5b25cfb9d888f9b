"""The public API of a served pipeline: its tensors (inputs, outputs, the
streaming twin's), and the inputs a family declares.

Every model takes ``API_INPUTS`` (each checked against what the model can
do: an image model refuses ``num_frames``; contract/request.py parses and
checks a request); a family may declare inputs of its own (``FamilyInput``:
type, shape, doc, default and validation, once), which only its models'
configs list, and which a served model publishes in its card
(``FamilyInput.published``; clients read them back with
``published_inputs``, so they need not know the family). Clients, the
generated configs, the sampler, docs/model-api.md's table and the perf
inputs all read this module. Only numpy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from machgen.contract.adapters import MAX_ADAPTERS_PER_REQUEST
from machgen.contract.validation import InvalidArgument, scalar_input, text_input


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
# The most pictures ``reference_images`` may hold.
MAX_REFERENCE_IMAGES = 8


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
        return text_input(field, value) if value.dtype.kind in "OSU" else scalar_input(field, value).item()
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
