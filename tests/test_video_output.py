"""MP4 output of video models: frames written through the bundled ffmpeg and read back."""

import numpy as np
import pytest

from machgen.client.video import read_mp4, write_mp4


def _frames(count: int, height: int = 48, width: int = 64) -> np.ndarray:
    """A smooth moving gradient, so that H.264 keeps it nearly intact."""
    rows, cols = np.mgrid[0:height, 0:width]
    frames = [np.stack([(rows * 4 + t * 10) % 256, (cols * 3) % 256, np.full_like(rows, 40 + t * 20)], axis=-1)
              for t in range(count)]
    return np.asarray(frames, np.uint8)


def test_mp4_keeps_every_frame_its_size_and_rate(tmp_path):
    frames = _frames(9)
    write_mp4(frames, tmp_path / "clip.mp4", fps=12)
    back, fps = read_mp4(tmp_path / "clip.mp4")
    assert back.shape == frames.shape and fps == 12
    # lossy (H.264, 4:2:0 chroma): close, not equal
    assert np.abs(back.astype(int) - frames.astype(int)).mean() < 6


@pytest.mark.parametrize("frames, fps, words", [
    (np.zeros((2, 8, 8, 3), np.float32), 8, "uint8 frames"),
    (np.zeros((8, 8, 3), np.uint8), 8, "uint8 frames"),
    (np.zeros((0, 8, 8, 3), np.uint8), 8, "uint8 frames"),
    (np.zeros((2, 8, 8, 3), np.uint8), 0, "fps"),
])
def test_bad_frames_are_refused(tmp_path, frames, fps, words):
    with pytest.raises(ValueError, match=words):
        write_mp4(frames, tmp_path / "clip.mp4", fps=fps)
    assert not (tmp_path / "clip.mp4").exists()
