"""The uncached references of realtime sessions: a chunk's denoising computed
by one forward over the whole sequence (the clean chunks before it at the
context timestep, then the chunk), each chunk's tokens attending by a dense
mask to what the streaming mode lets it see, as diffusers' SkyReels-V2
transformer computes block-causal attention without a cache.

``diffusers_block_causal`` is diffusers' own forward (every earlier frame
visible); ``dense_forward`` is the same computation on SkyReels-V2's blocks
with any mask and explicit frame positions (a sink and a window, a prompt
switch's re-cached frames, one-frame chunks, where diffusers' forward applies
no mask), checked equal to diffusers' where both apply: it lives in
machgen/families/wan/block_causal_reference.py, which perf/bench_realtime.py
uses too."""

from __future__ import annotations

import torch

from machgen.contract.streaming import StreamingSettings
from machgen.families.wan.block_causal_reference import allowed_mask, dense_forward  # noqa: F401 - the tests' names
from machgen.runtime.streaming.session import chunk_noise


def diffusers_block_causal(sky, latents, timesteps, text):
    """SkyReelsV2Transformer3DModel.forward with diffusion forcing: a timestep per latent frame, its own
    block-causal mask over ``num_frame_per_block`` frames."""
    return sky(latents, timesteps.reshape(1, -1), text, enable_diffusion_forcing=True, return_dict=False)[0]


def reference_chunk(forward, settings: StreamingSettings, context, context_frames: list[int], seed: int,
                    chunk: int, shape: tuple[int, ...]):
    """The clean latents of a session's chunk ``chunk`` denoised without a cache: every step one forward of
    ``forward(latents, timesteps per frame, positions)`` over the ``context`` chunks' clean latents (at the
    context timestep, starting at ``context_frames``) followed by the chunk; the same noise as the session."""
    sigmas = settings.sigmas()
    frames = settings.chunk_frames
    first = chunk * frames
    positions = torch.tensor([f + i for f in context_frames + [first] for i in range(frames)])
    latents = chunk_noise(seed, chunk, 0, shape)
    with torch.no_grad():
        for step, sigma in enumerate(sigmas):
            timesteps = torch.tensor([settings.context_timestep] * (len(context_frames) * frames)
                                     + [sigma * 1000] * frames)
            whole = torch.cat(list(context) + [latents], dim=2)
            clean = latents - sigma * forward(whole, timesteps, positions)[:, :, -frames:]
            if step + 1 < len(sigmas):
                latents = (1 - sigmas[step + 1]) * clean + sigmas[step + 1] * chunk_noise(seed, chunk, step + 1,
                                                                                          shape)
    return clean
