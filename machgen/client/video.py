"""Generated frames as an MP4 file (H.264, with the sound track in AAC when
there is one) and sound as WAV, through the ffmpeg binary that the pinned
imageio-ffmpeg wheel bundles (no system ffmpeg needed)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np


def _imageio_ffmpeg():
    """imageio_ffmpeg, set to start ffmpeg without a preexec_fn. With the one it sets by default, the forked
    child runs Python's at-fork handlers (gRPC's among them) before it execs: in a process with gRPC's threads
    running (the HTTP API's jobs, a client, the tests) ffmpeg was seen gone before its first frame (a broken
    pipe, no output), in the API when two videos finished together and in a test writing its expected video.
    Without one, subprocess spawns ffmpeg without running them."""
    import imageio_ffmpeg

    os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")
    return imageio_ffmpeg


class Mp4Writer:
    """An MP4 file (H.264) written frame by frame as frames come (a realtime session's chunks): ``write`` uint8
    frames [F, H, W, 3] any number of times, then ``close`` (a context manager closes it). ``quality`` is
    imageio-ffmpeg's 0-10 scale (10: best); ``audio`` float [channels, samples] at ``sample_rate`` is its
    sound, known up front."""

    def __init__(self, path: Path, fps: int, quality: float = 9.0, audio: np.ndarray | None = None,
                 sample_rate: int | None = None):
        if fps < 1:
            raise ValueError(f"fps must be at least 1, not {fps}")
        self.path, self.fps, self.quality = Path(path), fps, quality
        self.audio, self.sample_rate = audio, sample_rate
        self.frames_written = 0
        self._writer = None
        self._size: tuple[int, int] | None = None
        self._folder = tempfile.TemporaryDirectory()

    def write(self, frames: np.ndarray) -> None:
        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or not len(frames):
            raise ValueError(f"expected uint8 frames [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        if self._writer is None:
            self._start(frames.shape[1], frames.shape[2])
        elif frames.shape[1:3] != self._size:
            raise ValueError(f"frames of {list(frames.shape[1:3])} after frames of {list(self._size)}")
        for frame in frames:
            self._writer.send(np.ascontiguousarray(frame))
        self.frames_written += len(frames)

    def _start(self, height: int, width: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sound = {}
        if self.audio is not None:
            sound = {"audio_path": str(Path(self._folder.name) / "audio.wav"), "audio_codec": "aac"}
            write_wav(self.audio, sound["audio_path"], self.sample_rate)
        # yuv420p (what players expect) needs even sizes; the models' sizes are multiples of 4 or more,
        # so frames are never rescaled (macro_block_size 2).
        self._size = (height, width)
        self._writer = _imageio_ffmpeg().write_frames(
            str(self.path), (width, height), fps=self.fps, codec="libx264", quality=self.quality,
            pix_fmt_in="rgb24", pix_fmt_out="yuv420p", macro_block_size=2, ffmpeg_log_level="error", **sound)
        self._writer.send(None)  # starts ffmpeg

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._folder.cleanup()

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_mp4(frames: np.ndarray, path: Path, fps: int, quality: float = 9.0, audio: np.ndarray | None = None,
              sample_rate: int | None = None) -> None:
    """Write uint8 frames [F, H, W, 3] to ``path`` at ``fps`` frames per
    second, with ``audio`` float [channels, samples] at ``sample_rate`` as
    its sound. ``quality`` is imageio-ffmpeg's 0-10 scale (10: best)."""
    with Mp4Writer(path, fps, quality, audio, sample_rate) as writer:
        writer.write(frames)


def read_mp4(path: Path) -> tuple[np.ndarray, float]:
    """(uint8 frames [F, H, W, 3], fps) of a video file."""
    reader = _imageio_ffmpeg().read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(frame, np.uint8).reshape(height, width, 3) for frame in reader]
    return np.stack(frames), float(meta["fps"])


def write_wav(audio: np.ndarray, path: Path, sample_rate: int | None) -> None:
    """float samples [channels, samples] in [-1, 1] as 16-bit PCM WAV (clipped there)."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 2 or not audio.size:
        raise ValueError(f"expected audio [channels, samples], got {list(audio.shape)}")
    if not sample_rate or sample_rate < 1:
        raise ValueError(f"a sample rate is needed for audio, got {sample_rate}")
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).round().astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(audio.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(sample_rate))
        out.writeframes(np.ascontiguousarray(pcm.T).tobytes())


def read_audio(path: Path) -> tuple[np.ndarray, int]:
    """(float32 [channels, samples], sample rate) of a WAV file or a video's
    sound track (decoded to 16-bit PCM by the bundled ffmpeg)."""
    import imageio_ffmpeg

    if Path(path).suffix.lower() != ".wav":
        with tempfile.TemporaryDirectory() as folder:
            decoded = Path(folder) / "audio.wav"
            subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-i", str(path), "-vn",
                            "-acodec", "pcm_s16le", str(decoded)], check=True)
            return read_audio(decoded)
    with wave.open(str(path), "rb") as source:
        channels, rate = source.getnchannels(), source.getframerate()
        pcm = np.frombuffer(source.readframes(source.getnframes()), dtype="<i2")
    return (pcm.reshape(-1, channels).T.astype(np.float32) / 32767), rate
