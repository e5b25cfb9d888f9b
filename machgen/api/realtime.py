"""Realtime video sessions over the API's WebSocket (routes/realtime.py): the protocol's messages and errors,
what a realtime model's card says of its sessions, the chunks as fragmented MP4 or JPEG pictures, and the
metrics. docs/http-api.md, "Realtime video", documents each message field by field."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from machgen.api.triton import ServedModel
from machgen.contract.sessions import MAX_SESSION_PROMPT_CHARACTERS

FORMATS = ("m4s", "jpeg")
JPEG_QUALITY = 90
# A session's name on its connection; its Triton id is "TOKEN.NAME" (16 hex digits of the connection first),
# within the 128 characters Triton's session ids may have.
NAME = re.compile(r"^[A-Za-z0-9._:-]{1,100}$")
FMP4_FLAGS = "frag_keyframe+empty_moov+default_base_moof"


class RealtimeMetrics:
    def __init__(self, registry):
        from prometheus_client import Counter, Gauge, Histogram

        by_model = ["model"]
        self.sessions = Gauge("machgen_api_realtime_sessions", "Realtime sessions open through this API process",
                              by_model, registry=registry)
        self.chunk_seconds = Histogram(
            "machgen_api_realtime_chunk_seconds", "Seconds from a session asking for a chunk (its previous chunk "
            "received, or its stream opened) to the chunk sent to the client", by_model, registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30))
        self.first_chunk_seconds = Histogram(
            "machgen_api_realtime_first_chunk_seconds", "Seconds from session.start (or session.fork) to the "
            "session's first chunk sent", by_model, registry=registry, buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.chunks = Counter("machgen_api_realtime_chunks", "Chunks sent to realtime clients", by_model,
                              registry=registry)
        self.deadline_misses = Counter("machgen_api_realtime_deadline_misses", "Chunks the server finished after "
                                       "their first frame's deadline (chunk stats deadline_missed)", by_model,
                                       registry=registry)
        self.cache_bytes = Gauge("machgen_api_realtime_cache_bytes", "Bytes of keys and values the model's "
                                 "sessions cache on the server, as it last said (a session op, a stream's end)",
                                 by_model, registry=registry)
        self.refused = Counter("machgen_api_realtime_refused", "Realtime connections and sessions refused, by "
                               "reason", ["reason"], registry=registry)


class RealtimeParts:
    """The API process's realtime state: its metrics and the sessions open per key (the cap counts them: a
    connection's sessions and those handed off and not yet claimed)."""

    def __init__(self, registry):
        self.metrics = RealtimeMetrics(registry)
        self.open_by_owner: collections.Counter = collections.Counter()

    def release(self, owner: str, model: str) -> None:
        """A session of ``owner`` gone: its seat under the key's cap back."""
        self.open_by_owner[owner] -= 1
        if self.open_by_owner[owner] <= 0:
            del self.open_by_owner[owner]
        self.metrics.sessions.labels(model).dec()


class RealtimeError(Exception):
    """An ``error`` message: ``code``, the message, the ``field`` at fault, and the session it concerns."""

    def __init__(self, code: str, message: str, field: str | None = None, session: str | None = None, **extra):
        super().__init__(message)
        self.code, self.field, self.session, self.extra = code, field, session, extra

    def body(self) -> dict[str, Any]:
        body = {"type": "error", "code": self.code, "message": str(self), "field": self.field}
        if self.session is not None:
            body["session"] = body["request_id"] = self.session
        return {**body, **self.extra}


def invalid(field: str, message: str, code: str = "invalid_value") -> RealtimeError:
    return RealtimeError(code, message, field)


class Fields:
    """A client message's fields, each taken once with its type checked; ``finish`` refuses the rest by name."""

    def __init__(self, values: dict, kind: str, prefix: str = ""):
        self.values, self.kind, self.prefix, self.taken = values, kind, prefix, {"type"} if not prefix else set()

    def where(self, name: str) -> str:
        return self.prefix + name

    def take(self, name: str) -> Any:
        self.taken.add(name)
        return self.values.get(name)

    def text(self, name: str, missing: str | None = None, limit: int = MAX_SESSION_PROMPT_CHARACTERS) -> str | None:
        value = self.take(name)
        if value is None:
            if missing:
                raise invalid(self.where(name), f"'{self.where(name)}' is missing: {missing}")
            return None
        if not isinstance(value, str) or not value.strip():
            raise invalid(self.where(name), f"'{self.where(name)}' must be a non-empty string, not {value!r:.40}")
        if len(value) > limit:
            raise invalid(self.where(name), f"'{self.where(name)}' is {len(value)} characters long; at most {limit}")
        return value

    def name(self, field: str) -> str | None:
        value = self.text(field, limit=100)
        if value is not None and not NAME.match(value):
            raise invalid(self.where(field), f"'{self.where(field)}' must be 1-100 letters, digits, '.', '_', ':' "
                                             f"or '-', not {value!r:.40}")
        return value

    def integer(self, name: str, low: int, high: int) -> int | None:
        value = self.take(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise invalid(self.where(name), f"'{self.where(name)}' must be an integer from {low} to {high}, "
                                            f"not {value!r:.40}")
        return value

    def flag(self, name: str) -> bool:
        value = self.take(name)
        if value is not None and not isinstance(value, bool):
            raise invalid(self.where(name), f"'{self.where(name)}' must be true or false, not {value!r:.40}")
        return bool(value)

    def nested(self, name: str, missing: str) -> "Fields":
        value = self.take(name)
        if not isinstance(value, dict):
            raise invalid(self.where(name), f"'{self.where(name)}' must be an object: {missing}")
        return Fields(value, self.kind, f"{self.where(name)}.")

    def finish(self) -> None:
        unknown = sorted(set(self.values) - self.taken)
        if unknown:
            raise invalid(self.where(unknown[0]), f"{self.kind} takes no field '{self.where(unknown[0])}'; it takes "
                                                  f"{', '.join(self.where(n) for n in sorted(self.taken - {'type'}))}",
                          code="unknown_parameter")


@dataclass
class Realtime:
    """What a realtime model's card says of its sessions."""

    fps: int
    chunk_latents: int
    frame_multiple: int
    size_multiple: int
    defaults: dict[str, Any]
    actions: tuple[str, ...]

    @classmethod
    def of(cls, model: ServedModel) -> "Realtime | None":
        streaming = model.card.get("family_settings", {}).get("streaming")
        if not streaming:
            return None
        defaults = model.defaults
        return cls(int(streaming.get("fps") or defaults.get("fps") or 16), int(streaming["chunk_frames"]),
                   int(model.card.get("frame_multiple", 1)), int(model.card.get("size_multiple", 16)), defaults,
                   tuple(sorted(streaming.get("actions", {}))))

    def chunk_frames(self, first: bool) -> int:
        """Video frames in a chunk: a causal VAE makes one frame of the session's first latent frame."""
        return 1 + self.frame_multiple * (self.chunk_latents - 1) if first else self.frame_multiple * self.chunk_latents

    def chunks_for(self, frames: int, from_start: bool) -> int:
        """The fewest chunks that bring at least ``frames`` frames."""
        first = self.chunk_frames(from_start)
        return 1 if frames <= first else 1 + -(-(frames - first) // self.chunk_frames(False))


@dataclass
class Session:
    name: str
    triton_id: str
    model: ServedModel
    realtime: Realtime
    width: int
    height: int
    output_format: str
    lossless: bool
    encoder: Any
    opened_at: float
    stream: asyncio.Task | None = None
    # Set once the server has the session (a start's first response; a fork's answer).
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    chunks_sent: int = 0
    stopping: bool = False
    last_send_ms: float | None = None
    # The next chunk the session makes, as far as this connection knows (its last chunk sent, its pause).
    next_chunk: int = 0


def encoder_for(output_format: str, width: int, height: int, fps: int, lossless: bool):
    return JpegEncoder() if output_format == "jpeg" else Fmp4Encoder(width, height, fps, lossless)


# Fragmented MP4: each chunk is encoded by its own ffmpeg run (so its fragment is out as soon as its frames are
# in: a running ffmpeg holds a fragment until the next keyframe arrives), its fragment renumbered and moved to
# the chunk's time in the session's video; the init segment goes with the first fragment (again only if the
# encoder's changed).

def _boxes(data: bytes, start: int = 0, end: int | None = None):
    end = len(data) if end is None else end
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, start)
        if size < 8:
            raise ValueError(f"a {kind!r} box of {size} bytes")
        yield kind, start, size
        start += size


def _retimed(moof: bytes, sequence: int, decode_time: int) -> bytes:
    """A movie fragment with its sequence number and its tracks' base media decode time set."""
    patched = bytearray(moof)

    def visit(start: int, end: int) -> None:
        for kind, at, size in _boxes(patched, start, end):
            if kind == b"mfhd":
                struct.pack_into(">I", patched, at + 12, sequence)
            elif kind == b"traf":
                visit(at + 8, at + size)
            elif kind == b"tfdt":
                struct.pack_into(">Q" if patched[at + 8] == 1 else ">I", patched, at + 12, decode_time)

    visit(8, len(patched))
    return bytes(patched)


def _timescale(moov: bytes) -> int:
    at = moov.find(b"mdhd")
    return struct.unpack_from(">I", moov, at + (16 if moov[at + 4] == 0 else 24))[0]


def _mime_type(moov: bytes) -> str:
    """MediaSource's type of the stream: H.264's profile, constraints and level from the avcC box."""
    at = moov.find(b"avcC")
    return f'video/mp4; codecs="avc1.{moov[at + 5:at + 8].hex().upper()}"'


class Fmp4Encoder:
    def __init__(self, width: int, height: int, fps: int, lossless: bool):
        import imageio_ffmpeg

        codec = (["-c:v", "libx264rgb", "-qp", "0", "-pix_fmt", "rgb24"] if lossless
                 else ["-c:v", "libx264", "-crf", "18", "-pix_fmt", "yuv420p"])
        self.command = [imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24",
                        "-s", f"{width}x{height}", "-r", str(fps), "-i", "-", *codec, "-preset", "ultrafast",
                        "-tune", "zerolatency", "-g", "100000", "-movflags", FMP4_FLAGS, "-f", "mp4", "-"]
        self.fps, self.init, self.sequence = fps, None, 0

    async def encode(self, frames, first_frame: int) -> tuple[list[bytes], dict[str, Any]]:
        # No preexec_fn (client/video.py says why); asyncio's subprocess sets none.
        ffmpeg = await asyncio.create_subprocess_exec(*self.command, stdin=asyncio.subprocess.PIPE,
                                                      stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        output, errors = await ffmpeg.communicate(frames.tobytes())
        if ffmpeg.returncode:
            raise RealtimeError("server_error", f"ffmpeg could not encode the chunk: {errors.decode()[-300:]}")
        boxes = {kind: output[at:at + size] for kind, at, size in _boxes(output) if kind in (b"ftyp", b"moov")}
        init = boxes[b"ftyp"] + boxes[b"moov"]
        fragment, extra = [], {"init": init != self.init}
        if init != self.init:
            self.init, self.timescale = init, _timescale(boxes[b"moov"])
            fragment.append(init)
            extra["mime_type"] = _mime_type(boxes[b"moov"])
        for kind, at, size in _boxes(output):
            if kind == b"moof":
                self.sequence += 1
                fragment.append(_retimed(output[at:at + size], self.sequence,
                                         first_frame * self.timescale // self.fps))
            elif kind == b"mdat":
                fragment.append(output[at:at + size])
        return [b"".join(fragment)], extra


class JpegEncoder:
    async def encode(self, frames, first_frame: int) -> tuple[list[bytes], dict[str, Any]]:
        from machgen.api.media import picture_bytes

        return await asyncio.to_thread(lambda: [picture_bytes(frame, "jpeg", JPEG_QUALITY) for frame in frames]), {}


def session_info(array) -> dict[str, Any]:
    return json.loads(bytes(array.reshape(-1)[0]).decode("utf-8"))
