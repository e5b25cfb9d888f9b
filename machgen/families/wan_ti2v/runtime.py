"""Wan 2.2 TI2V-5B's run-time half: Wan's, with a timestep per token and
the picture (image-to-video) as the first latent frame.

Mirrors WanPipeline and WanImageToVideoPipeline with ``expand_timesteps``:
every step's transformer input has the picture's latents in place of the
first latent frame (``(1 - mask) * condition + mask * latents``, the same
values), its tokens at timestep 0 and every other token at the step's; the
result has the picture's latents as its first frame too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from machgen.families.wan.runtime import WanRuntime, picture_pixels
from machgen.families.wan_ti2v.spec import WAN_TI2V
from machgen.runtime.family import RequestState
from machgen.runtime.tensors import as_torch


@dataclass
class Ti2vState(RequestState):
    # Image-to-video: the picture's normalised latents [1, C, 1, h, w], the video's first latent frame.
    first_frame: Any = None


class WanTi2vRuntime(WanRuntime):
    family = WAN_TI2V
    state_class = Ti2vState

    def initial_latents(self, state: Ti2vState):
        latents = super().initial_latents(state)
        if state.request.image is not None:
            encoded = self.run_component("vae_encoder_first", {"frames": picture_pixels(state.request.image)})
            state.first_frame = as_torch(encoded["latents"])
        return latents

    def with_first_frame(self, state: Ti2vState, latents):
        """``latents`` with the picture's latents as their first frame (image-to-video)."""
        if state.first_frame is None:
            return latents
        return torch.cat([state.first_frame.to(latents.device), latents[:, :, 1:]], dim=2)

    def frame_tokens(self, request) -> int:
        _, patch_h, patch_w = self.settings["patch_size"]
        lat_h, lat_w = self.latent_size(request.height, request.width)
        return (lat_h // patch_h) * (lat_w // patch_w)

    def denoiser_inputs(self, state: Ti2vState, latents, timestep) -> dict[str, Any]:
        inputs = super().denoiser_inputs(state, self.with_first_frame(state, latents), timestep)
        frames = latents.shape[2]
        per_token = inputs["timestep"].expand(-1, frames * self.frame_tokens(state.request)).clone()
        if state.first_frame is not None:  # the picture is clean
            per_token[:, :self.frame_tokens(state.request)] = 0
        return {**inputs, "timestep": per_token}

    def finish(self, state: Ti2vState, latents):
        return self.with_first_frame(state, latents)
