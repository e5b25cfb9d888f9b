"""HiDream's run-time half: size, prompts, patches, timesteps.

Mirrors HiDreamImagePipeline step for step (the size it renders,
encode_prompt with its four encoders, prepare_latents, the transformer's
patchify and unpatchify, retrieve_timesteps) so that a seed gives the same
image.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import diffusers
import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from machgen.families.hidream.spec import HIDREAM
from machgen.runtime.family import FamilyRuntime, RequestState, RunComponent, decode_image, flow_shift
from machgen.runtime.tensors import as_torch


@functools.lru_cache(maxsize=16)
def _image_layout(patches_h: int, patches_w: int, tokens: int, rows: int, device: str):
    """(mask, ids) of an image of patches_h x patches_w patches in ``tokens``
    tokens (zero past the image), one copy per row; shared, never written to."""
    mask = torch.zeros(rows, tokens)
    mask[:, :patches_h * patches_w] = 1.0
    ids = torch.zeros(patches_h, patches_w, 3)
    ids[..., 1] += torch.arange(patches_h)[:, None]
    ids[..., 2] += torch.arange(patches_w)[None, :]
    padded = torch.zeros(rows, tokens, 3)
    padded[:, :patches_h * patches_w] = ids.reshape(1, -1, 3)
    return mask.to(device), padded.to(device)


class HiDreamRuntime(FamilyRuntime):
    family = HIDREAM

    def __init__(self, settings: Mapping[str, Any], assets_dir: str, run_component: RunComponent):
        super().__init__(settings, assets_dir, run_component)
        self.tokenizers = {name: self.load_tokenizer(name, class_name)
                           for name, class_name in settings["tokenizer_classes"].items()}
        # HiDreamImagePipeline.__init__ pads Llama's input with its end-of-text token.
        self.tokenizers["tokenizer_4"].pad_token = self.tokenizers["tokenizer_4"].eos_token
        self.scheduler_config = self.load_scheduler_config()
        self._scheduler_class = getattr(diffusers, settings["scheduler_class"])

    def rendered_size(self, height: int, width: int) -> tuple[int, int]:
        """The size HiDreamImagePipeline renders for a requested one: the
        aspect ratio kept, the area that of its default size, rounded down to
        its multiple (the same float arithmetic as the pipeline)."""
        division = self.settings["size_multiple"]
        scale = math.sqrt(self.settings["sample_pixels"] ** 2 / (width * height))
        return int(height * scale // division * division), int(width * scale // division * division)

    def _tokens(self, name: str, prompts: list[str], length: int) -> dict[str, Any]:
        encoded = self.tokenize(self.tokenizers[name], prompts, padding="max_length", max_length=length,
                                truncation=True, add_special_tokens=True, return_tensors="np")
        return {"input_ids": encoded.input_ids.astype(np.int64),
                "attention_mask": encoded.attention_mask.astype(np.int64)}

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """HiDreamImagePipeline.encode_prompt for a list of prompts, one row each."""
        settings = self.settings
        encoded = self.run_components({
            "text_encoder": {"input_ids": self._tokens("tokenizer", prompts, settings["clip_tokens"])["input_ids"]},
            "text_encoder_2": {"input_ids": self._tokens("tokenizer_2", prompts, settings["clip_tokens"])["input_ids"]},
            "text_encoder_3": self._tokens("tokenizer_3", prompts, settings["t5_tokens"]),
            "text_encoder_4": self._tokens("tokenizer_4", prompts, settings["llama_tokens"])})
        pooled = [as_torch(encoded[encoder]["text_embeds"]) for encoder in ("text_encoder", "text_encoder_2")]
        return {"pooled_embeds": torch.cat(pooled, dim=-1),
                "t5_embeds": as_torch(encoded["text_encoder_3"]["t5_embeds"]),
                "llama_embeds": as_torch(encoded["text_encoder_4"]["llama_embeds"])}

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """The latents' height and width for a requested size (prepare_latents of the rendered size)."""
        height, width = self.rendered_size(height, width)
        factor = self.settings["vae_scale_factor"] * 2
        return 2 * (height // factor), 2 * (width // factor)

    def _patches(self, height: int, width: int) -> tuple[int, int, int]:
        """(patch rows, patch columns, tokens): a non-square image is padded to max_seq tokens."""
        lat_h, lat_w = self.latent_size(height, width)
        patch = self.settings["patch_size"]
        rows, columns = lat_h // patch, lat_w // patch
        return rows, columns, rows * columns if lat_h == lat_w else self.settings["max_image_tokens"]

    def initial_latents(self, state: RequestState):
        """Noise exactly as HiDreamImagePipeline.prepare_latents draws it, in
        the transformer's patches: [1, tokens, patch x patch x C]."""
        request = state.request
        lat_h, lat_w = self.latent_size(request.height, request.width)
        rows, columns, tokens = self._patches(request.height, request.width)
        patch, channels = self.settings["patch_size"], self.settings["latent_channels"]
        noise = randn_tensor((1, channels, lat_h, lat_w), generator=torch.Generator("cpu").manual_seed(request.seed),
                             dtype=torch.float32)
        # HiDreamImageTransformer2DModel.patchify's layout: (patch row, patch column, channel) per token.
        patches = noise.reshape(1, channels, rows, patch, columns, patch).permute(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(1, rows * columns, patch * patch * channels)
        return torch.nn.functional.pad(patches, (0, 0, 0, tokens - rows * columns))

    def scheduler(self, request):
        """A fresh scheduler set as HiDreamImagePipeline sets it (UniPC: plain; otherwise the shift of max_seq)."""
        scheduler = self._scheduler_class.from_config(self.scheduler_config)
        if isinstance(scheduler, diffusers.UniPCMultistepScheduler):
            scheduler.set_timesteps(request.num_inference_steps)
        else:  # retrieve_timesteps without custom steps is set_timesteps; calculate_shift is flow_shift
            scheduler.set_timesteps(request.num_inference_steps, device="cpu",
                                    mu=flow_shift(self.settings["max_image_tokens"]))
        return scheduler

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        conditioning, request = state.conditioning, state.request
        rows = conditioning["t5_embeds"].shape[0]
        device = latents.device
        patch_rows, patch_columns, tokens = self._patches(request.height, request.width)
        mask, ids = _image_layout(patch_rows, patch_columns, tokens, rows, str(device))
        return {
            # The padding enters as zeros at every step, as patchify makes it (the scheduler moves it).
            "hidden_states": (latents * mask[:1, :, None]).expand(rows, -1, -1).contiguous(),
            "image_mask": mask,
            "img_ids": ids,
            "timestep": torch.full((rows, 1), float(timestep), device=device),
            "pooled_embeds": conditioning["pooled_embeds"],
            "t5_embeds": conditioning["t5_embeds"],
            "llama_embeds": conditioning["llama_embeds"],
        }

    def finish(self, state: RequestState, latents):
        """HiDreamImageTransformer2DModel.unpatchify of the image's tokens: [1, C, h, w] for the VAE."""
        rows, columns, _ = self._patches(state.request.height, state.request.width)
        patch = self.settings["patch_size"]
        channels = latents.shape[-1] // (patch * patch)
        image = latents[:, :rows * columns].reshape(1, rows, columns, patch, patch, channels)
        return image.permute(0, 5, 1, 3, 2, 4).reshape(1, channels, rows * patch, columns * patch).contiguous()

    def decode(self, latents):
        return decode_image(self.run_component, latents)
