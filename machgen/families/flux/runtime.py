"""Flux's run-time half: prompts, latents, position ids, timesteps.

Mirrors FluxPipeline and FluxImg2ImgPipeline step for step (encode_prompt,
prepare_latents, calculate_shift, get_timesteps, _unpack_latents) so that a
seed gives the same image.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from machgen.families.flux.spec import FLUX
from machgen.runtime.family import FamilyRuntime, RequestState, RunComponent, decode_image, flow_shift
from machgen.runtime.tensors import as_torch


@functools.lru_cache(maxsize=16)
def _image_ids(lat_h: int, lat_w: int, rows: int, device: str):
    ids = torch.zeros(lat_h // 2, lat_w // 2, 3)
    ids[..., 1] += torch.arange(lat_h // 2)[:, None]
    ids[..., 2] += torch.arange(lat_w // 2)[None, :]
    # Shared by every request of this size on this device: never written to.
    return ids.reshape(1, -1, 3).repeat(rows, 1, 1).to(device)


def pack(latents):
    """FluxPipeline._pack_latents: [1, C, h, w] -> [1, h/2 * w/2, 4C] tokens of 2x2 patches."""
    _, channels, height, width = latents.shape
    latents = latents.view(1, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(1, (height // 2) * (width // 2), channels * 4)


def picture_pixels(image: np.ndarray) -> np.ndarray:
    """VaeImageProcessor.preprocess of a uint8 [H, W, 3] picture: [1, 3, H, W] float32 in [-1, 1]."""
    return np.ascontiguousarray((image.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)[None])


class FluxRuntime(FamilyRuntime):
    family = FLUX

    def __init__(self, settings: Mapping[str, Any], assets_dir: str, run_component: RunComponent):
        super().__init__(settings, assets_dir, run_component)
        classes = settings["tokenizer_classes"]
        self.tokenizer = self.load_tokenizer("tokenizer", classes["tokenizer"])
        self.tokenizer_2 = self.load_tokenizer("tokenizer_2", classes["tokenizer_2"])
        self.scheduler_config = self.load_scheduler_config()

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """FluxPipeline.encode_prompt for a list of prompts, one row each
        (torch tensors, where the text encoders left them)."""
        clip_ids = self.tokenize(self.tokenizer, prompts, padding="max_length", truncation=True, return_tensors="np",
                                 max_length=self.settings["clip_max_length"]).input_ids.astype(np.int64)
        t5_ids = self.tokenize(self.tokenizer_2, prompts, padding="max_length", truncation=True, return_tensors="np",
                               max_length=self.settings["max_sequence_length"]).input_ids.astype(np.int64)
        encoded = self.run_components({"text_encoder": {"input_ids": clip_ids},
                                       "text_encoder_2": {"input_ids": t5_ids}})
        pooled = as_torch(encoded["text_encoder"]["pooled_prompt_embeds"])
        embeds = as_torch(encoded["text_encoder_2"]["prompt_embeds"])
        return {
            "encoder_hidden_states": embeds,
            "pooled_projections": pooled,
            "txt_ids": embeds.new_zeros((len(prompts), embeds.shape[1], 3)),
        }

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.settings["vae_scale_factor"]
        return 2 * (height // (factor * 2)), 2 * (width // (factor * 2))

    def image_ids(self, height: int, width: int, rows: int = 1, device: str = "cpu"):
        """FluxPipeline's latent image ids, one copy per row; built once per
        size and device (read-only), not once per denoising step."""
        return _image_ids(*self.latent_size(height, width), rows, str(device))

    def scheduler(self, request):
        """A fresh scheduler with FluxPipeline's sigmas and resolution-dependent
        shift, starting where image-to-image starts (FluxImg2ImgPipeline.get_timesteps)."""
        steps = request.num_inference_steps
        lat_h, lat_w = self.latent_size(request.height, request.width)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        cfg = scheduler.config
        mu = flow_shift((lat_h // 2) * (lat_w // 2), cfg.get("base_image_seq_len", 256),
                        cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        if getattr(cfg, "use_flow_sigmas", False):
            scheduler.set_timesteps(steps, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        return scheduler

    def initial_latents(self, state: RequestState):
        """Packed noise exactly as FluxPipeline.prepare_latents draws it; for
        image-to-image, FluxImg2ImgPipeline's start: the picture's latents
        sampled from the VAE encoder's distribution and noised to the first
        step, drawn from one generator in the pipeline's order (the latent
        sample, then the noise)."""
        request = state.request
        # A CPU generator on any device, as diffusers draws it.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        if request.image is None:
            lat_h, lat_w = self.latent_size(request.height, request.width)
            return pack(randn_tensor((1, self.settings["latent_channels"], lat_h, lat_w), generator=generator,
                                     dtype=torch.float32))
        encoded = self.run_component("vae_encoder", {"image": picture_pixels(request.image)})
        mean, std = (as_torch(encoded[name]) for name in ("latent_mean", "latent_std"))
        image_latents = mean + std * randn_tensor(mean.shape, generator=generator, device=mean.device,
                                                  dtype=torch.float32)
        noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        return pack(state.scheduler.scale_noise(image_latents, state.timesteps[:1], noise))

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        """The denoiser_head inputs for one step, on the latents' device."""
        conditioning, request = state.conditioning, state.request
        rows = conditioning["encoder_hidden_states"].shape[0]
        device = latents.device
        inputs = {
            "hidden_states": latents.expand(rows, -1, -1).contiguous(),
            "encoder_hidden_states": conditioning["encoder_hidden_states"],
            "pooled_projections": conditioning["pooled_projections"],
            # FluxPipeline passes t / 1000 in the latents' dtype.
            "timestep": torch.full((rows, 1), float(timestep.float() / 1000), device=device),
        }
        if self.settings["guidance_embeds"]:
            inputs["guidance"] = torch.full((rows, 1), request.guidance_scale, device=device)
        inputs["img_ids"] = self.image_ids(request.height, request.width, rows, device)
        inputs["txt_ids"] = conditioning["txt_ids"]
        return inputs

    def finish(self, state: RequestState, latents):
        """FluxPipeline._unpack_latents: packed tokens -> [1, C, h, w] for the VAE."""
        return unpack(latents, *self.latent_size(state.request.height, state.request.width))

    def decode(self, latents):
        return decode_image(self.run_component, latents)


def unpack(latents, lat_h: int, lat_w: int):
    """FluxPipeline._unpack_latents: [B, tokens, 4C] -> [B, C, h, w]."""
    batch, _, channels = latents.shape
    latents = latents.view(batch, lat_h // 2, lat_w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(batch, channels // 4, lat_h, lat_w).contiguous()
