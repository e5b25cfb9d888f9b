"""Synthetic attention inputs with the locality of video latents.

Tokens sit on a (frames, height, width) grid in raster order, as a video
transformer flattens them. Queries and keys are one smooth random field
each (white noise blurred with a Gaussian of ``correlation`` tokens along
every axis) plus a shared part, so that a token's query resembles the keys
of its neighbours in space and time: attention falls off with distance,
with a diffuse remainder, as in the video models' attention maps.
"""

from __future__ import annotations

import torch


def _blur(field: torch.Tensor, correlation: float) -> torch.Tensor:
    """Gaussian blur of [C, T, H, W] along its last three axes (zero-padded)."""
    radius = max(1, int(3 * correlation))
    offsets = torch.arange(-radius, radius + 1, dtype=field.dtype)
    kernel = torch.exp(-0.5 * (offsets / correlation) ** 2)
    kernel = (kernel / kernel.sum()).view(1, 1, -1)
    for axis in (1, 2, 3):
        moved = field.movedim(axis, -1)
        shape = moved.shape
        flat = moved.reshape(-1, 1, shape[-1])
        flat = torch.nn.functional.conv1d(flat, kernel, padding=radius)
        field = flat.reshape(shape).movedim(-1, axis)
    return field


def video_like_qkv(frames: int, height: int, width: int, heads: int = 2, head_dim: int = 128,
                   correlation: float = 2.0, sharpness: float = 4.0, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as [1, frames * height * width, heads, head_dim] (float32).

    ``sharpness`` is about the logit of a token with itself over that of a
    distant token: higher concentrates attention nearer the diagonal.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = frames * height * width

    def field() -> torch.Tensor:
        noise = torch.randn(heads * head_dim, frames, height, width, generator=gen)
        smooth = _blur(noise, correlation)
        smooth = smooth / smooth.std()
        return smooth.reshape(heads, head_dim, tokens).permute(2, 0, 1)[None]  # [1, N, H, D]

    shared = field()
    q = shared + 0.5 * field()
    k = shared + 0.5 * field()
    scale = (sharpness / head_dim ** 0.5) ** 0.5
    return q * scale, k * scale, field()
