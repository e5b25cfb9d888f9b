"""Generated frames as an MP4 file (H.264), through the ffmpeg binary that
the pinned imageio-ffmpeg wheel bundles (no system ffmpeg needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_mp4(frames: np.ndarray, path: Path, fps: int, quality: float = 9.0) -> None:
    """Write uint8 frames [F, H, W, 3] to ``path`` at ``fps`` frames per
    second. ``quality`` is imageio-ffmpeg's 0-10 scale (10: best)."""
    import imageio_ffmpeg

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or not len(frames):
        raise ValueError(f"expected uint8 frames [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    if fps < 1:
        raise ValueError(f"fps must be at least 1, not {fps}")
    height, width = frames.shape[1:3]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # yuv420p (what players expect) needs even sizes; the models' sizes are multiples of 4 or more,
    # so frames are never rescaled (macro_block_size 2).
    writer = imageio_ffmpeg.write_frames(str(path), (width, height), fps=fps, codec="libx264", quality=quality,
                                         pix_fmt_in="rgb24", pix_fmt_out="yuv420p", macro_block_size=2,
                                         ffmpeg_log_level="error")
    writer.send(None)  # starts ffmpeg
    try:
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
    finally:
        writer.close()


def read_mp4(path: Path) -> tuple[np.ndarray, float]:
    """(uint8 frames [F, H, W, 3], fps) of a video file."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(frame, np.uint8).reshape(height, width, 3) for frame in reader]
    return np.stack(frames), float(meta["fps"])
