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
    "fps": int, "preview_interval": int,
}
# Per-request LoRA adapters: a name or a list of names, a weight or a list of weights (the API's lora, lora_scale).
ADAPTER_FIELDS: dict[str, type] = {"lora": str, "lora_scale": float}
# OpenAI's fields that change nothing here (one output format, no moderation), accepted as they are.
IGNORED_OPENAI_FIELDS = {"quality", "style", "user", "moderation", "output_compression", "output_format",
                         "partial_images", "input_fidelity"}
MAX_VARIANTS = 10
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


def typed(name: str, value: Any, kind: type) -> Any:
    """A field's value as ``kind``: JSON's own types, or a form's text converted."""
    if kind is str:
        if not isinstance(value, str):
            raise invalid(name, f"'{name}' must be a string")
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise invalid(name, f"'{name}' must be true or false")
    if isinstance(value, bool):
        raise invalid(name, f"'{name}' must be a number")
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        raise invalid(name, f"'{name}' must be {'an integer' if kind is int else 'a number'}") from None
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
        "expires_at": job.expires_at, "error": job.error,
        "outputs": [content_url(job, i) for i in range(len(job.outputs) if job.kind == "image" else
                                                       min(len(job.outputs), 1))],
        "stats": job.stats,
    }


def video_object(job: Job) -> dict[str, Any]:
    """OpenAI's video object, with machgen's job fields besides."""
    request = job.request
    seconds = request["num_frames"] / request["fps"] if request.get("fps") else None
    return {
        "id": job.id, "object": "video", "model": job.model, "status": job.status, "progress": job.progress,
        "created_at": job.created_at, "completed_at": job.completed_at, "expires_at": job.expires_at,
        "prompt": request.get("prompt"), "size": f"{request.get('width')}x{request.get('height')}",
        "seconds": f"{seconds:g}" if seconds is not None else None, "num_frames": request.get("num_frames"),
        "fps": request.get("fps"), "seed": (request.get("seeds") or [None])[0], "remixed_from_video_id": None,
        "error": job.error, "stats": job.stats,
    }


def public_object(job: Job) -> dict[str, Any]:
    return video_object(job) if job.kind == "video" else job_object(job)
