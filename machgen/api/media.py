"""The media the API answers and sends: pictures as PNG, JPEG or WebP, clips as MP4, data URLs, previews."""

from __future__ import annotations

import base64
import io

import numpy as np


def png_bytes(picture: np.ndarray) -> bytes:
    return picture_bytes(picture, "png")


def picture_bytes(picture: np.ndarray, output_format: str, compression: int | None = None) -> bytes:
    """``picture`` as OpenAI's ``output_format`` (png, jpeg or webp); ``compression`` is OpenAI's
    output_compression, 0-100, the encoder's quality (100, the default: a lossless WebP, JPEG's best)."""
    from PIL import Image

    quality = 100 if compression is None else compression
    options = {"png": {"format": "PNG"}, "jpeg": {"format": "JPEG", "quality": quality},
               "webp": {"format": "WEBP", "quality": quality, "lossless": quality == 100}}[output_format]
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, **options)
    return buffer.getvalue()


def data_url(file: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(file).decode()


def mp4_bytes(frames: np.ndarray, fps: int, audio: np.ndarray | None = None, sample_rate: int | None = None) -> bytes:
    import tempfile
    from pathlib import Path

    from machgen.client.video import write_mp4

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "video.mp4"
        write_mp4(frames, path, fps=fps, audio=audio, sample_rate=sample_rate)
        return path.read_bytes()


def preview_picture(preview: np.ndarray) -> np.ndarray:
    """A preview's frames side by side (a video's few frames in one picture)."""
    return preview[0] if len(preview) == 1 else np.concatenate(list(preview), axis=1)


def sse(event: str, data: dict) -> bytes:
    """One Server-Sent Event."""
    import json

    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
