"""Uint8 clips through a Wan VAE and back: the pixel and latent conversions video training, its checks and
the evaluation of image-to-video's first frame share."""

from __future__ import annotations

import numpy as np


def clips_to_tensor(frames: np.ndarray):
    """uint8 [N, F, H, W, 3] -> float [N, 3, F, H, W] in [-1, 1]."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1


def tensor_to_clips(tensor) -> np.ndarray:
    """float [N, 3, F, H, W] in [-1, 1] -> uint8 [N, F, H, W, 3]."""
    import torch

    pixels = ((tensor.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 4, 1).numpy()


def encode_clips(vae, frames: np.ndarray):
    """Posterior means of uint8 clips [N, F, H, W, 3], normalised as the Wan pipelines normalise latents."""
    import torch

    with torch.no_grad():
        mean = vae.encode(clips_to_tensor(frames)).latent_dist.mean
    shift = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    scale = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (mean - shift) / scale


def decode_latents(vae, latents) -> np.ndarray:
    """Uint8 clips [N, F, H, W, 3] of latents normalised as encode_clips gives them."""
    import torch

    shift = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    scale = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        return tensor_to_clips(vae.decode(latents * scale + shift).sample)
