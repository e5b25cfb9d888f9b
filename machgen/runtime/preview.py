"""Previews that cost nothing: latents to a small RGB picture by one linear map.

Each latent pixel's channels z [C] map to RGB = W^T z + b (W [C, 3], b [3],
in 0-255 levels), fitted per model at build time by least squares on the
model's own VAE decodes (builder/preview_fit.py) and stored beside the
manifest as ``preview.json``. A preview is one matmul over the latent grid,
no VAE: a picture of the grid's size (the image's over the VAE's factor, 8
for Flux).

A video's latent frame j stands for the pixel frames it was encoded from:
frame 0 for j = 0, frames t (j - 1) + 1 .. t j for j >= 1 (t the VAE's
temporal factor, the runtime's ``frame_multiple``). The fit pairs each
latent pixel with the mean of the decoded pixels it covers, in space and
in time. Only numpy is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

PREVIEW_FILE = "preview.json"
MAX_PREVIEW_FRAMES = 4


@dataclass(frozen=True, eq=False)
class LatentPreview:
    """RGB = latents' channels @ ``weights`` + ``bias``, clipped to 0-255."""

    weights: np.ndarray  # [C, 3] float32
    bias: np.ndarray  # [3] float32
    # For the record: the fit's PSNR against the downsampled decodes it was fitted on, and how many there were.
    psnr: float = 0.0
    generations: int = 0

    def __post_init__(self):
        weights = np.array(self.weights, dtype=np.float32).reshape(-1, 3)
        bias = np.array(self.bias, dtype=np.float32).reshape(3)
        weights.flags.writeable = bias.flags.writeable = False  # shared by every request's previews
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "bias", bias)

    @property
    def channels(self) -> int:
        return len(self.weights)

    # ------------------------------------------------------------ the file
    @classmethod
    def load(cls, folder: Path) -> "LatentPreview | None":
        """The projection saved in ``folder``, or None when it has none (built with --no-preview)."""
        path = Path(folder) / PREVIEW_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(np.array(data["weights"]), np.array(data["bias"]), float(data.get("psnr", 0.0)),
                   int(data.get("generations", 0)))

    def save(self, folder: Path) -> Path:
        path = Path(folder) / PREVIEW_FILE
        data = {"weights": self.weights.tolist(), "bias": self.bias.tolist(), "psnr": round(self.psnr, 2),
                "generations": self.generations}
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    # ------------------------------------------------------------ previews
    def render(self, latents: Any, max_frames: int = MAX_PREVIEW_FRAMES) -> np.ndarray:
        """uint8 [k, h, w, 3] of latents [C, F, h, w]: k = min(F, max_frames)
        latent frames, evenly spaced, the first and the last among them."""
        latents = np.asarray(latents)
        if latents.ndim != 4 or latents.shape[0] != self.channels:
            raise ValueError(f"expected latents [{self.channels}, frames, height, width], got {list(latents.shape)}")
        return self._project(latents, preview_frames(latents.shape[1], max_frames))

    def _project(self, latents: np.ndarray, frames: Sequence[int]) -> np.ndarray:
        channels, _, height, width = latents.shape
        rgb = np.empty((len(frames), height * width, 3), np.float32)
        for index, frame in enumerate(frames):
            # A frame's (pixels, C) is a transposed view of its [C, pixels]: BLAS reads float32 latents in place
            # (other dtypes: only the frames shown are converted), and the product comes out [pixels, 3],
            # already the picture's layout.
            plane = latents[:, frame].astype(np.float32, copy=False).reshape(channels, -1)
            np.matmul(plane.T, self.weights, out=rgb[index])
        rgb += self.bias + 0.5  # then the cast's truncation rounds: one pass fewer than np.rint
        np.clip(rgb, 0.0, 255.0, out=rgb)
        return rgb.astype(np.uint8).reshape(len(frames), height, width, 3)

    # ------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, latent_list: Sequence[Any], frames_list: Sequence[np.ndarray],
            temporal_factor: int = 1) -> "LatentPreview":
        """The least-squares projection (with its bias) from each latent
        [C, F, h, w] to its decode uint8 [N, H, W, 3], downsampled to the
        latent grid; its ``psnr`` is measured on the same pairs."""
        if not latent_list or len(latent_list) != len(frames_list):
            raise ValueError(f"expected as many latents as decodes, at least one: got {len(latent_list)} latents "
                             f"and {len(frames_list)} decodes")
        channels = np.asarray(latent_list[0]).shape[0]
        # Normal equations summed pair by pair: memory stays one pair's whatever the count and size.
        gram = np.zeros((channels + 1, channels + 1))
        moment = np.zeros((channels + 1, 3))
        for latents, frames in zip(latent_list, frames_list):
            inputs, targets = _paired(latents, frames, temporal_factor)
            gram += inputs.T @ inputs
            moment += inputs.T @ targets
        # lstsq rather than solve: a channel the model never uses (constant) leaves the system singular.
        solution = np.linalg.lstsq(gram, moment, rcond=None)[0]
        fitted = cls(solution[:-1], solution[-1], generations=len(latent_list))
        return replace(fitted, psnr=preview_psnr(fitted, latent_list, frames_list, temporal_factor))


def preview_frames(frames: int, max_frames: int = MAX_PREVIEW_FRAMES) -> np.ndarray:
    """Indices of min(frames, max_frames) evenly spaced frames of ``frames``, the first and the last included."""
    count = max(1, min(frames, max_frames))
    return np.rint(np.linspace(0, frames - 1, count)).astype(int)


def downsampled_decode(frames: np.ndarray, latent_shape: Sequence[int], temporal_factor: int = 1) -> np.ndarray:
    """float32 [F, h, w, 3] of decoded frames uint8 [N, H, W, 3]: each latent
    pixel's mean of the pixels it covers (H/h x W/w of the frames its latent
    frame covers, clamped to the frames there are)."""
    frames = np.asarray(frames)
    latent_frames, height, width = latent_shape[-3:]
    scale_y, scale_x = frames.shape[1] // height, frames.shape[2] // width
    if not scale_y or not scale_x:
        raise ValueError(f"decoded frames {list(frames.shape)} are smaller than the latent grid {height}x{width}")
    pooled = (frames[:, :height * scale_y, :width * scale_x].astype(np.float32)
              .reshape(len(frames), height, scale_y, width, scale_x, 3).mean(axis=(2, 4)))
    last = len(frames) - 1
    picked = []
    for j in range(latent_frames):
        first, end = (0, 0) if j == 0 else (temporal_factor * (j - 1) + 1, temporal_factor * j)
        first, end = min(first, last), min(end, last)
        picked.append(pooled[first:end + 1].mean(axis=0))
    return np.stack(picked)


def _paired(latents: Any, frames: np.ndarray, temporal_factor: int) -> tuple[np.ndarray, np.ndarray]:
    """(latent pixels with a 1 for the bias [P, C + 1], their downsampled decode [P, 3]), float64."""
    latents = np.asarray(latents, dtype=np.float64)
    targets = downsampled_decode(frames, latents.shape, temporal_factor).reshape(-1, 3)
    inputs = np.concatenate([latents.reshape(len(latents), -1).T, np.ones((len(targets), 1))], axis=1)
    return inputs, targets.astype(np.float64)


def preview_psnr(preview: LatentPreview, latent_list: Sequence[Any], frames_list: Sequence[np.ndarray],
                 temporal_factor: int = 1) -> float:
    """PSNR (dB, 99 when exact) of the previews of every latent frame against
    the downsampled decodes, over all pairs together."""
    squared, count = 0.0, 0
    for latents, frames in zip(latent_list, frames_list):
        latents = np.asarray(latents)
        rendered = preview._project(latents, range(latents.shape[1])).astype(np.float32)
        squared += float(np.sum((rendered - downsampled_decode(frames, latents.shape, temporal_factor)) ** 2))
        count += rendered.size
    mse = squared / max(count, 1)
    return 99.0 if mse == 0 else float(10 * np.log10(255.0**2 / mse))
