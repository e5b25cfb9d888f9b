"""What the API reads and answers: request fields (JSON or form), OpenAI's
error body, and the job, video and image objects."""

from __future__ import annotations

import io
import math
from typing import Any, Mapping

import numpy as np

from machgen.api.store import Job

# Fields passed to the model as its inputs of the same name, typed.
MODEL_FIELDS: dict[str, type] = {
    "negative_prompt": str, "seed": int, "num_inference_steps": int, "guidance_scale": float,
    "true_cfg_scale": float, "cache_policy": str, "cache_threshold": float, "strength": float, "num_frames": int,
    "fps": int, "preview_interval": int, "priority": str,
}
# Per-request LoRA adapters: a name or a list of names, a weight or a list of weights (the API's lora, lora_scale).
ADAPTER_FIELDS: dict[str, type] = {"lora": str, "lora_scale": float}
# OpenAI's image fields that take one of a set of values: (every value OpenAI defines, those honoured here).
# A value OpenAI defines that is not honoured is refused as unsupported, naming the field (never ignored).
OPENAI_CHOICES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "response_format": (("url", "b64_json"), ("url", "b64_json")),
    "output_format": (("png", "jpeg", "webp"), ("png", "jpeg", "webp")),
    "background": (("transparent", "opaque", "auto"), ("opaque", "auto")),
    "quality": (("standard", "hd", "low", "medium", "high", "auto"), ("auto",)),
    "moderation": (("low", "auto"), ()),
    "style": (("vivid", "natural"), ()),
    "input_fidelity": (("high", "low"), ()),
}
_UNSUPPORTED = {
    "background": "the models served here draw opaque pictures",
    "quality": "the quality is the model's own, set by num_inference_steps (a machgen extension)",
    "moderation": "this server moderates nothing; leave the field out",
    "style": "a dall-e-3 option; these models take no style (describe it in the prompt)",
    "input_fidelity": "how much of the picture is redrawn is 'strength' (a machgen extension, 0-1)",
}
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4"}
MAX_VARIANTS = 10
# OpenAI's longest prompt, of images (its GPT image models') and of videos.
MAX_PROMPT_CHARACTERS = 32000
SEED_LIMIT = 2**63


class ApiError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind or {401: "authentication_error", 429: "rate_limit_error", 503: "server_error",
                             500: "server_error"}.get(status, "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def openai_choice(name: str, value: Any, default: str | None) -> str | None:
    """One of OpenAI's enumerated fields: its value (``default`` when absent), or 400 naming the field for
    a value OpenAI does not define (invalid_value) or one this server does not honour (unsupported_value)."""
    if value is None:
        return default
    known, honoured = OPENAI_CHOICES[name]
    if not isinstance(value, str) or value not in known:
        raise invalid(name, f"'{name}' must be one of {', '.join(known)}, not {value!r}")
    if value not in honoured:
        raise invalid(name, f"'{name}' {value!r} is not supported here: {_UNSUPPORTED[name]}",
                      code="unsupported_value")
    return value


def bounded(name: str, value: Any, low: int, high: int) -> int:
    """An integer field in [low, high], or 400 naming it."""
    number = typed(name, value, int)
    if not low <= number <= high:
        raise invalid(name, f"'{name}' must be in [{low}, {high}], not {number}")
    return number


class TextValue(str):
    """A value given as text, a form's field or a query parameter, which its field's type reads ("2" is 2 where
    the field is an integer). A JSON value has its own type: "2" for an integer is refused, as OpenAI's
    schemas refuse it."""


def typed(name: str, value: Any, kind: type) -> Any:
    """A field's value as ``kind``: JSON's own types, or a TextValue converted."""
    if kind is str:
        if not isinstance(value, str):
            raise invalid(name, f"'{name}' must be a string")
        return str(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, TextValue) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise invalid(name, f"'{name}' must be true or false")
    if isinstance(value, bool):
        raise invalid(name, f"'{name}' must be a number")
    wanted = "an integer" if kind is int else "a number"
    if isinstance(value, str) and not isinstance(value, TextValue):
        raise invalid(name, f"'{name}' must be {wanted} (a JSON number), not the string {value[:40]!r}")
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        raise invalid(name, f"'{name}' must be {wanted}") from None
    if kind is int and not (isinstance(number, int) or (isinstance(number, float) and number.is_integer())):
        raise invalid(name, f"'{name}' must be an integer")
    if not isinstance(number, (int, float)) or (isinstance(number, float) and not math.isfinite(number)):
        raise invalid(name, f"'{name}' must be a finite number")
    return kind(number)


def typed_list(name: str, value: Any, kind: type) -> list:
    """A field that takes one value or a list of them, as a list of ``kind``."""
    return [typed(name, item, kind) for item in (value if isinstance(value, list) else [value])]


def parse_size(value: Any, defaults: Mapping[str, Any]) -> tuple[int, int]:
    """(width, height) of OpenAI's ``size`` "WxH" ("auto" or absent: the model's default)."""
    if value is None or value == "auto":
        return int(defaults["width"]), int(defaults["height"])
    if not isinstance(value, str) or value.count("x") != 1:
        raise invalid("size", f"'size' must be WIDTHxHEIGHT in pixels, like '1024x768', not {value!r}")
    width, height = value.split("x")
    if not (width.isdigit() and height.isdigit()) or not int(width) or not int(height):
        raise invalid("size", f"'size' must be WIDTHxHEIGHT in pixels, like '1024x768', not {value!r}")
    return int(width), int(height)


def decode_picture(name: str, data: bytes) -> np.ndarray:
    """uint8 [H, W, 3] of an uploaded image file (PNG, JPEG, WebP, ...)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise invalid(name, f"'{name}' is not an image this server can read ({err})", code="invalid_image") from None


def content_url(job: Job, index: int) -> str:
    return f"/v1/jobs/{job.id}/content?index={index}"


def job_object(job: Job) -> dict[str, Any]:
    """machgen's job object (any job: images or a video)."""
    request = job.request
    return {
        "id": job.id, "object": "job", "kind": job.kind, "model": job.model, "status": job.status,
        "progress": job.progress, "prompt": request.get("prompt"),
        "size": f"{request.get('width')}x{request.get('height')}", "n": request.get("n", 1),
        "seeds": request.get("seeds"), "created_at": job.created_at, "completed_at": job.completed_at,
        "expires_at": job.expires_at, "error": job.error, "priority": request.get("priority", "interactive"),
        "outputs": [content_url(job, i) for i in range(len(job.outputs) if job.kind == "image" else
                                                       sum(name.startswith("video") for name in job.outputs))],
        "stats": job.stats,
        # Agents' fields: the latents kept for refines ([{index, variant, steps, bytes}]), the job refined
        # ({parent, parent_index, step}) and an explore's every variant ranked.
        "latents": request.get("latents"),
        "refines": _refines(request),
        "explored": request.get("explored"),
    }


def _refines(request: dict[str, Any]) -> dict[str, Any] | None:
    return {name: request[name] for name in ("parent", "parent_index", "step")} if request.get("parent") else None


def video_object(job: Job) -> dict[str, Any]:
    """OpenAI's video object, with machgen's job fields besides (num_frames, fps, seed, stats, and the
    latents kept and the refined job as job_object's). OpenAI's statuses are queued, in_progress, completed
    and failed: a video cancelled through /v1/jobs is failed, its error's code ``cancelled``. A refine names
    its parent as OpenAI's remix does (remixed_from_video_id). An explore's object lists its variants ranked
    (``explored``); its ``seed`` is then the best one's, whose video is the content (``n`` videos, best first,
    ``?index=``)."""
    request = job.request
    explored = request.get("explored")
    seed = explored["variants"][0]["seed"] if explored else (request.get("seeds") or [None])[0]
    seconds = request["num_frames"] / request["fps"] if request.get("fps") else 0
    status, error = job.status, job.error
    if status == "cancelled":
        status, error = "failed", error or {"code": "cancelled", "message": "cancelled by the caller"}
    return {
        "id": job.id, "object": "video", "model": job.model, "status": status, "progress": job.progress,
        "created_at": job.created_at, "completed_at": job.completed_at, "expires_at": job.expires_at,
        "prompt": request.get("prompt"), "size": f"{request.get('width')}x{request.get('height')}",
        "seconds": f"{seconds:g}", "num_frames": request.get("num_frames"),
        "fps": request.get("fps"), "seed": seed,
        "remixed_from_video_id": request.get("parent"), "error": error, "stats": job.stats,
        "latents": request.get("latents"), "refines": _refines(request),
        **({"n": request.get("n", 1), "explored": explored} if request.get("explore") else {}),
    }


def public_object(job: Job) -> dict[str, Any]:
    return video_object(job) if job.kind == "video" else job_object(job)
