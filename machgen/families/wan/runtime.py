"""Wan's run-time half: prompts, noise, timesteps, experts, the picture and
reference conditions, and the chunked decode.

Mirrors WanPipeline, WanImageToVideoPipeline and WanVACEPipeline step for
step (_get_t5_prompt_embeds, prepare_latents, the expert switch at the
boundary timestep with its own guidance scale, the VAE's frame-by-frame
decode) so that a seed gives the same video.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any, Mapping

import diffusers
import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from machgen.families.wan.spec import EXPERT_PREFIXES, WAN, WAN_I2V, WAN_VACE
from machgen.runtime.family import ClassifierFreeGuidance, FamilyRuntime, RequestState, RunComponent
from machgen.runtime.tensors import as_numpy, as_torch, concat

try:
    import ftfy
except ImportError:  # as diffusers: its repair only where it is installed
    ftfy = None


def prompt_clean(text: str) -> str:
    """WanPipeline's prompt_clean: ftfy's repair where ftfy is installed, HTML entities unescaped twice,
    whitespace runs made one space, ends stripped. Here because importing diffusers' Wan pipeline module
    imports transformers' models and torch._dynamo: 2.8 s of a sampler's start and 210 MB."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class ExpertGuidance(ClassifierFreeGuidance):
    """WanPipeline's classifier-free guidance: the high-noise expert's scale,
    then the low-noise expert's (guidance_scale_2) once it takes over."""

    def __init__(self, scale: float, low_noise_scale: float):
        super().__init__(scale)
        self.low_noise_scale = low_noise_scale

    def scale_at(self, state: RequestState) -> float:
        return self.scale if state.denoiser == EXPERT_PREFIXES[0] else self.low_noise_scale


def picture_pixels(picture) -> np.ndarray:
    """VideoProcessor.preprocess of a uint8 [H, W, 3] picture: [1, 3, 1, H, W] float32 in [-1, 1]."""
    return np.ascontiguousarray((picture.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)[None, :, None])


def decode_chunks(chunks: list, caches: list, run_component: RunComponent) -> list[tuple[np.ndarray, object]]:
    """uint8 frames [F, H, W, 3] (numpy) of each of ``chunks`` (latents [1, C, latent frames, h, w], one size),
    and the decoder's causal cache after them, each chunk following its cache in ``caches`` (None: its video's
    start). The decoder components run latent frame by latent frame, each latent frame of every chunk in one
    call (those starting their video in one of ``vae_decoder_first``), made uint8 by ``postprocess`` before the
    next: memory stays that of one latent frame whatever the length (AutoencoderKLWan.decode walks the frames
    the same way, keeping the whole float video); realtime sessions' chunks decode together."""
    latents = torch.cat([as_torch(chunk) for chunk in chunks])
    caches = list(caches)
    frames: list[list[np.ndarray]] = [[] for _ in chunks]
    for index in range(latents.shape[2]):
        frame = latents[:, :, index:index + 1].contiguous()
        for component, rows, cache_name in (("vae_decoder_first", [r for r, c in enumerate(caches) if c is None],
                                             "decoder_cache"),
                                            ("vae_decoder_next", [r for r, c in enumerate(caches) if c is not None],
                                             "updated_cache")):
            if not rows:
                continue
            inputs = {"latents": frame[rows]}
            if component == "vae_decoder_next":
                inputs["decoder_cache"] = concat([caches[r] for r in rows])
            outputs = run_component(component, inputs)
            images = as_numpy(run_component("postprocess", {"frames": outputs["frames"]})["images"])
            for position, row in enumerate(rows):
                frames[row].append(images[position])
                caches[row] = outputs[cache_name][position:position + 1]
    return [(np.concatenate(row_frames), cache) for row_frames, cache in zip(frames, caches)]


def decode_video(latents, run_component: RunComponent) -> np.ndarray:
    """uint8 frames [F, H, W, 3] (numpy) of a whole video's latents [1, C, latent frames, h, w]."""
    return decode_chunks([latents], [None], run_component)[0][0]


class WanRuntime(FamilyRuntime):
    family = WAN

    def __init__(self, settings: Mapping[str, Any], assets_dir: str, run_component: RunComponent):
        super().__init__(settings, assets_dir, run_component)
        self.tokenizer = self.load_tokenizer("tokenizer", settings["tokenizer_class"])
        self.scheduler_config = self.load_scheduler_config()
        self._scheduler_class = getattr(diffusers, settings["scheduler_class"])

    def guidance(self, request):
        if not request.uses_true_cfg:
            return super().guidance(request)
        low_noise_scale = request.inputs.get("guidance_scale_2")
        return ExpertGuidance(request.true_cfg_scale,
                              request.true_cfg_scale if low_noise_scale is None else low_noise_scale)

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """WanPipeline._get_t5_prompt_embeds for a list of prompts, one row each."""
        tokens = self.tokenize(self.tokenizer, [prompt_clean(p) for p in prompts], padding="max_length",
                               max_length=self.settings["max_sequence_length"], truncation=True,
                               add_special_tokens=True, return_attention_mask=True, return_tensors="np")
        outputs = self.run_component("text_encoder", {"input_ids": tokens.input_ids.astype(np.int64),
                                                      "attention_mask": tokens.attention_mask.astype(np.int64)})
        return {"encoder_hidden_states": as_torch(outputs["prompt_embeds"])}

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.settings["vae_scale_factor"]
        return height // factor, width // factor

    def latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.frame_multiple + 1

    def noise(self, state: RequestState, latent_frames: int):
        """Noise exactly as WanPipeline.prepare_latents draws it: [1, C, latent frames, h, w]."""
        request = state.request
        shape = (1, self.settings["latent_channels"], latent_frames, *self.latent_size(request.height, request.width))
        return randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(request.seed), dtype=torch.float32)

    def initial_latents(self, state: RequestState):
        return self.noise(state, self.latent_frames(state.request.num_frames))

    def scheduler(self, request):
        scheduler = self._scheduler_class.from_config(self.scheduler_config)
        scheduler.set_timesteps(request.num_inference_steps)
        return scheduler

    def denoiser(self, state: RequestState, timestep) -> str:
        """Wan 2.2's high-noise expert from the start down to the boundary, the low-noise one after."""
        boundary = self.settings["boundary_timestep"]
        return EXPERT_PREFIXES[0] if boundary is None or float(timestep) >= boundary else EXPERT_PREFIXES[1]

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        rows = state.conditioning["encoder_hidden_states"].shape[0]
        return {
            "hidden_states": latents.expand(rows, -1, -1, -1, -1).contiguous(),
            "timestep": torch.full((rows, 1), float(timestep), device=latents.device),
            "encoder_hidden_states": state.conditioning["encoder_hidden_states"],
        }

    def decode(self, latents):
        return decode_video(latents, self.run_component)

    def decode_chunks(self, chunks: list, caches: list) -> list[tuple[np.ndarray, object]]:
        """Streaming sessions' chunks (one each, one size), batched: each one's frames and decoder cache after."""
        return decode_chunks(chunks, caches, self.run_component)

    def encode_frames(self, first, black_chunks: int):
        """The normalised latent means [1, C, 1 + black_chunks, h, w] of a
        video: the frame ``first`` ([1, 3, 1, H, W] in [-1, 1]) followed by
        ``black_chunks`` x frame_multiple black frames, encoded chunk by chunk
        (the chunked VAE encoder; AutoencoderKLWan.encode walks them the same way)."""
        outputs = self.run_component("vae_encoder_first", {"frames": first})
        latents, cache = [as_torch(outputs["latents"])], outputs["encoder_cache"]
        black = np.zeros((1, 3, self.frame_multiple, *first.shape[3:]), np.float32)
        for _ in range(black_chunks):
            outputs = self.run_component("vae_encoder_next", {"frames": black, "encoder_cache": cache})
            latents.append(as_torch(outputs["latents"]).to(latents[0].device))
            cache = outputs["updated_cache"]
        return torch.cat(latents, dim=2)


class WanImageToVideoRuntime(WanRuntime):
    """WanImageToVideoPipeline.prepare_latents' condition, and the transformer
    input it makes with the latents."""

    family = WAN_I2V

    def request_conditioning(self, state: RequestState) -> dict[str, Any]:
        """The mask (first latent frame 1, the others 0) and the normalised
        latent means of the picture followed by num_frames - 1 black frames."""
        request = state.request
        latent_condition = self.encode_frames(picture_pixels(request.image),
                                              (request.num_frames - 1) // self.frame_multiple)
        mask = torch.zeros_like(latent_condition[:, :self.frame_multiple])
        mask[:, :, 0] = 1
        return {"image_condition": torch.cat([mask, latent_condition], dim=1)}

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        condition = state.conditioning["image_condition"].to(latents.device)
        return super().denoiser_inputs(state, torch.cat([latents, condition], dim=1), timestep)


@dataclass
class VaceState(RequestState):
    # Latent frames of the reference images, denoised in front of the video and dropped before the decode.
    reference_frames: int = 0


class WanVaceRuntime(WanRuntime):
    """WanVACEPipeline's control latents (preprocess_conditions,
    prepare_video_latents, prepare_masks without video or mask) and the
    reference frames in front of the video."""

    family = WAN_VACE
    state_class = VaceState

    def initial_latents(self, state: VaceState):
        references = state.request.reference_images
        state.reference_frames = 0 if references is None else len(references)
        return self.noise(state, self.latent_frames(state.request.num_frames) + state.reference_frames)

    def request_conditioning(self, state: VaceState) -> dict[str, Any]:
        """[1, control channels, references + latent frames, h, w]: the empty
        video's latents twice (its inactive and reactive parts are both
        empty), each reference's latents beside zeros in front of them (the
        last reference first, as the pipeline prepends them), then the mask:
        0 on the references' frames, 1 on the video's."""
        request = state.request
        empty_first = np.zeros((1, 3, 1, request.height, request.width), np.float32)
        empty = self.encode_frames(empty_first, (request.num_frames - 1) // self.frame_multiple)
        control = torch.cat([empty, empty], dim=1)
        for picture in request.reference_images if request.reference_images is not None else ():
            latent = self.encode_frames(picture_pixels(picture), 0)
            control = torch.cat([torch.cat([latent, torch.zeros_like(latent)], dim=1), control], dim=2)
        spatial = self.settings["vae_scale_factor"]
        mask = control.new_ones(1, spatial * spatial, *control.shape[2:])
        mask[:, :, :state.reference_frames] = 0
        return {"control_hidden_states": torch.cat([control, mask], dim=1)}

    def denoiser_inputs(self, state: VaceState, latents, timestep) -> dict[str, Any]:
        inputs = super().denoiser_inputs(state, latents, timestep)
        control = state.conditioning["control_hidden_states"].to(latents.device)
        inputs["control_hidden_states"] = control.expand(len(inputs["hidden_states"]), -1, -1, -1, -1).contiguous()
        return inputs

    def finish(self, state: VaceState, latents):
        return latents[:, :, state.reference_frames:]
