"""LTX-Video's run-time half: prompts, noise, timesteps, positions.

Mirrors LTXPipeline and LTXImageToVideoPipeline step for step
(_get_t5_prompt_embeds, prepare_latents and _pack_latents, calculate_shift
on the video's token count, rope_interpolation_scale from the frame rate,
the picture's latents as the first frame kept through the loop,
_unpack_latents).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from machgen.families.ltx.spec import LTX, LTX_I2V
from machgen.runtime.family import FamilyRuntime, RequestState, RunComponent, flow_shift
from machgen.runtime.tensors import as_numpy, as_torch


def video_coords(frames: int, height: int, width: int, scale: tuple[float, float, float], patch: int, patch_t: int):
    """LTXVideoRotaryPosEmbed's positions of the latent tokens before its
    division by the base sizes: [1, 3, tokens] (frame, row, column), each
    times its rope_interpolation_scale and patch, as _prepare_video_coords."""
    grid = torch.stack(torch.meshgrid(torch.arange(frames, dtype=torch.float32),
                                      torch.arange(height, dtype=torch.float32),
                                      torch.arange(width, dtype=torch.float32), indexing="ij"), dim=0)[None]
    grid[:, 0:1] = grid[:, 0:1] * scale[0] * patch_t
    grid[:, 1:2] = grid[:, 1:2] * scale[1] * patch
    grid[:, 2:3] = grid[:, 2:3] * scale[2] * patch
    return grid.flatten(2, 4)


def video_pixels(picture) -> np.ndarray:
    """VideoProcessor.preprocess of a uint8 [H, W, 3] picture: [1, 3, 1, H, W] float32 in [-1, 1]."""
    return np.ascontiguousarray((picture.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)[None, :, None])


class KeepFirstFrame:
    """A scheduler whose step leaves the first latent frame's values (the
    first ``frame_elements`` along the latents' second axis) as they are:
    the image-to-video pipelines step only the others (FlowMatchEuler's step
    is elementwise, so this is the same)."""

    def __init__(self, scheduler, frame_elements: int):
        self.scheduler = scheduler
        self.frame_elements = frame_elements
        self.timesteps = scheduler.timesteps
        self.sigmas = scheduler.sigmas

    def set_begin_index(self, index: int) -> None:
        self.scheduler.set_begin_index(index)

    def step(self, model_output, timestep, sample, return_dict: bool = False):
        stepped = self.scheduler.step(model_output, timestep, sample, return_dict=False)[0]
        stepped[:, :self.frame_elements] = sample[:, :self.frame_elements]
        return (stepped,)


class LtxRuntime(FamilyRuntime):
    family = LTX

    def __init__(self, settings: Mapping[str, Any], assets_dir: str, run_component: RunComponent):
        super().__init__(settings, assets_dir, run_component)
        self.tokenizer = self.load_tokenizer("tokenizer", settings["tokenizer_class"])
        self.scheduler_config = self.load_scheduler_config()

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        spatial = self.settings["vae_spatial_ratio"]
        return (num_frames - 1) // self.frame_multiple + 1, height // spatial, width // spatial

    def token_grid(self, request) -> tuple[int, int, int]:
        """The video's tokens as (frames, rows, columns) of patches."""
        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        return frames // patch_t, lat_h // patch, lat_w // patch

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """LTXPipeline._get_t5_prompt_embeds for a list of prompts, one row each, with their masks."""
        tokens = self.tokenize(self.tokenizer, prompts, padding="max_length",
                               max_length=self.settings["max_sequence_length"], truncation=True,
                               add_special_tokens=True, return_tensors="np")
        mask = tokens.attention_mask.astype(np.int64)
        embeds = as_torch(self.run_component("text_encoder", {"input_ids": tokens.input_ids.astype(np.int64)})[
            "prompt_embeds"])
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": as_torch(mask.astype(np.float32))}

    def noise(self, generator, request):
        """The video's noise [1, C, frames, h, w] as LTXPipeline.prepare_latents draws it."""
        shape = (1, self.settings["latent_channels"],
                 *self.latent_shape(request.height, request.width, request.num_frames))
        return randn_tensor(shape, generator=generator, dtype=torch.float32)

    def initial_latents(self, state: RequestState):
        """Packed noise exactly as LTXPipeline.prepare_latents draws it: [1, tokens, C]."""
        return self.pack(self.noise(torch.Generator("cpu").manual_seed(state.request.seed), state.request))

    def pack(self, latents):
        """LTXPipeline._pack_latents: [1, C, F, h, w] -> [1, tokens, C x patches]."""
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        _, channels, frames, lat_h, lat_w = latents.shape
        latents = latents.reshape(1, channels, frames // patch_t, patch_t, lat_h // patch, patch, lat_w // patch,
                                  patch)
        return latents.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)

    def unpack(self, latents, request):
        """LTXPipeline._unpack_latents: [1, tokens, C] -> [1, C, frames, h, w]."""
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        frames, rows, columns = self.token_grid(request)
        latents = latents.reshape(1, frames, rows, columns, -1, patch_t, patch, patch)
        return latents.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3).contiguous()

    def sequence_length(self, request) -> int:
        """What the pipeline's timestep shift is a function of: LTXPipeline's latent frames x rows x columns."""
        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        return frames * lat_h * lat_w

    def shift(self, tokens: int, config) -> float:
        """The pipeline's timestep shift for a sequence of ``tokens``."""
        return flow_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                          config.get("base_shift", 0.5), config.get("max_shift", 1.15))

    def scheduler(self, request):
        """A fresh scheduler with the pipeline's sigmas and shift for the video's token count."""
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        steps = request.num_inference_steps
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps),
                                mu=self.shift(self.sequence_length(request), scheduler.config))
        return scheduler

    def request_conditioning(self, state: RequestState) -> dict[str, Any]:
        """The rotary positions of this video's tokens at its frame rate."""
        request = state.request
        frames, rows, columns = self.token_grid(request)
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        spatial = self.settings["vae_spatial_ratio"]
        scale = (self.frame_multiple / request.fps, spatial, spatial)
        return {"video_coords": video_coords(frames, rows, columns, scale, patch, patch_t)}

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        conditioning = state.conditioning
        rows = conditioning["encoder_hidden_states"].shape[0]
        device = latents.device
        return {
            "hidden_states": latents.expand(rows, -1, -1).contiguous(),
            "encoder_hidden_states": conditioning["encoder_hidden_states"],
            "encoder_attention_mask": conditioning["encoder_attention_mask"],
            "timestep": torch.full((rows, 1), float(timestep), device=device),
            "video_coords": conditioning["video_coords"].to(device).expand(rows, -1, -1).contiguous(),
        }

    def finish(self, state: RequestState, latents):
        return self.unpack(latents, state.request)

    def decode(self, latents):
        """uint8 frames [F, H, W, 3]: the whole video in one decoder call."""
        frames = self.run_component("vae_decoder", {"latents": latents})["frames"]
        return as_numpy(self.run_component("postprocess", {"frames": frames})["images"])[0]


class LtxImageToVideoRuntime(LtxRuntime):
    """LTXImageToVideoPipeline.prepare_latents and its per-token timesteps:
    the picture's latents are the first latent frame, kept as they are
    through the loop (its tokens denoised at timestep 0)."""

    family = LTX_I2V

    def frame_tokens(self, request) -> int:
        _, rows, columns = self.token_grid(request)
        return rows * columns

    def scheduler(self, request):
        return KeepFirstFrame(super().scheduler(request), self.frame_tokens(request))

    def initial_latents(self, state: RequestState):
        """The picture's latents (sampled from the VAE encoder's distribution)
        as the first latent frame, noise after it, drawn from one generator in
        the pipeline's order (the sample, then the noise); packed."""
        request = state.request
        encoded = self.run_component("vae_encoder", {"frames": video_pixels(request.image)})
        mean, std = (as_torch(encoded[name]) for name in ("latent_mean", "latent_std"))
        generator = torch.Generator("cpu").manual_seed(request.seed)
        picture = mean + std * randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        noise = self.noise(generator, request).to(mean.device)
        return self.pack(torch.cat([picture, noise[:, :, 1:]], dim=2))

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        inputs = super().denoiser_inputs(state, latents, timestep)
        # t on every token but the first frame's, which stay at 0 (the picture is clean).
        inputs["timestep"] = inputs["timestep"].expand(-1, latents.shape[1]).clone()
        inputs["timestep"][:, :self.frame_tokens(state.request)] = 0
        return inputs
