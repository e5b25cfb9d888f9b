"""LTX-2's run-time half: prompts, both streams' noise and positions,
timesteps, its guidance, and the decode of picture and sound.

LTX-Video's runtime lends it the tokenizer and scheduler loading and the
latent packing (LTX2Pipeline's _pack_latents is LTXPipeline's). Mirrors
LTX2Pipeline step for step (_get_gemma_prompt_embeds with left padding,
prepare_latents then prepare_audio_latents from one generator,
calculate_shift on the video's token count, prepare_video_coords at the
conditioning frame rate, prepare_audio_coords, convert_velocity_to_x0 and
back around the guidance, _unpack_latents, _unpack_audio_latents).

The sampler's latents are both streams' packed latents side by side in one
flat row, [1, video tokens x channels + sound tokens x channels]: the
pipeline steps its two schedulers with the same sigmas, and FlowMatchEuler's
step is elementwise, so one scheduler over the row is the same.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
from diffusers.utils.torch_utils import randn_tensor

from machgen.families.ltx.runtime import KeepFirstFrame, LtxRuntime, video_pixels
from machgen.families.ltx2.spec import LTX2, LTX2_I2V
from machgen.runtime.family import Guidance, RequestState, RunComponent
from machgen.runtime.tensors import as_numpy, as_torch

# The rows a step runs, by what each pass is for; the first is always the prompt's.
CONDITIONAL, UNCONDITIONAL, PERTURBED, ISOLATED = "conditional", "unconditional", "perturbed", "isolated"


def _ropes(settings: Mapping[str, Any]):
    """The video's and the sound's LTX2AudioVideoRotaryPosEmbed, rebuilt from
    their settings: what prepares the positions of a request's tokens."""
    return tuple(LTX2AudioVideoRotaryPosEmbed(**{**settings[key], "scale_factors": tuple(
        settings[key]["scale_factors"])}) for key in ("video_rope", "audio_rope"))


class Ltx2Guidance(Guidance):
    """LTX2Pipeline's guidance of one step, per stream: every pass's velocity
    to x0, the deltas of the passes that ran (classifier-free, spatio-temporal,
    modality isolation), the rescale, back to a velocity; packed again. The
    sound takes its own scales, the video's where its own are 0."""

    def __init__(self, runtime: "Ltx2Runtime", scales: Mapping[str, Any]):
        self.runtime = runtime
        self.scales = dict(scales)
        for name in ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale"):
            self.scales[f"audio_{name}"] = self.scales[f"audio_{name}"] or self.scales[name]
        scale = self.scales
        # The rows a step runs, in order (LTX2Pipeline's do_* properties).
        self.passes = [CONDITIONAL]
        if scale["guidance_scale"] > 1 or scale["audio_guidance_scale"] > 1:
            self.passes.append(UNCONDITIONAL)
        if scale["stg_scale"] > 0 or scale["audio_stg_scale"] > 0:
            self.passes.append(PERTURBED)
        if scale["modality_scale"] > 1 or scale["audio_modality_scale"] > 1:
            self.passes.append(ISOLATED)
        self.prompt_rows = tuple(1 if name == UNCONDITIONAL else 0 for name in self.passes)

    def combine(self, prediction, state: RequestState, latents):
        prediction = as_torch(prediction).float()
        sigma = state.scheduler.sigmas[state.first_step + state.step]
        split = self.runtime.split
        guided = []
        for stream, prefix, sample in zip(split(prediction, state), ("", "audio_"),
                                          split(latents.to(prediction.device), state)):
            x0 = {name: sample - stream[index:index + 1] * sigma for index, name in enumerate(self.passes)}
            conditional = x0[CONDITIONAL]
            total = conditional
            if UNCONDITIONAL in x0:
                total = total + (self.scales[f"{prefix}guidance_scale"] - 1) * (conditional - x0[UNCONDITIONAL])
            if PERTURBED in x0:
                total = total + self.scales[f"{prefix}stg_scale"] * (conditional - x0[PERTURBED])
            if ISOLATED in x0:
                total = total + (self.scales[f"{prefix}modality_scale"] - 1) * (conditional - x0[ISOLATED])
            rescale = self.scales[f"{prefix}guidance_rescale"]
            if rescale > 0:
                total = rescale_noise_cfg(total, conditional, guidance_rescale=rescale)
            guided.append(((sample - total) / sigma).flatten(1))
        return torch.cat(guided, dim=1)


class Ltx2Runtime(LtxRuntime):
    family = LTX2

    def __init__(self, settings: Mapping[str, Any], assets_dir: str, run_component: RunComponent):
        super().__init__(settings, assets_dir, run_component)  # its tokenizer, scheduler; LTX's packing
        # Gemma's prompts are padded on the left, with its end token when it has no pad token (the pipeline).
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.video_rope, self.audio_rope = _ropes(settings)

    @property
    def sample_rate(self) -> int:
        return self.settings["sample_rate"]

    def audio_frames(self, num_frames: int, fps: int) -> int:
        """The sound's latent length for a clip of ``num_frames`` at ``fps``."""
        return round(num_frames / fps * self.settings["audio_latents_per_second"])

    def guidance(self, request) -> Ltx2Guidance:
        return Ltx2Guidance(self, {**request.inputs, "guidance_scale": request.guidance_scale})

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """_get_gemma_prompt_embeds and the connectors, one row per prompt."""
        tokens = self.tokenize(self.tokenizer, [p.strip() for p in prompts], padding="max_length",
                               max_length=self.settings["max_sequence_length"], truncation=True,
                               add_special_tokens=True, return_tensors="np")
        encoded = self.run_component("text_encoder", {"input_ids": tokens.input_ids.astype(np.int64),
                                                      "attention_mask": tokens.attention_mask.astype(np.int64)})
        return {name: as_torch(encoded[name]) for name in
                ("encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask")}

    def sound_noise(self, generator, request):
        """The sound's noise as LTX2Pipeline.prepare_audio_latents draws it, packed: [1, tokens x C]."""
        audio = randn_tensor((1, self.settings["audio_latent_channels"],
                              self.audio_frames(request.num_frames, request.fps),
                              self.settings["audio_latent_mel_bins"]), generator=generator, dtype=torch.float32)
        return audio.transpose(1, 2).flatten(2, 3).flatten(1)

    def initial_latents(self, state: RequestState):
        """Both streams' noise, as the pipeline draws it from one generator
        (the video's, then the sound's), packed side by side: [1, P]."""
        generator = torch.Generator("cpu").manual_seed(state.request.seed)
        video = self.noise(generator, state.request)
        return torch.cat([self.pack(video).flatten(1), self.sound_noise(generator, state.request)], dim=1)

    def sequence_length(self, request) -> int:
        """LTX2Pipeline shifts by the video's tokens (patches)."""
        frames, rows, columns = self.token_grid(request)
        return frames * rows * columns

    def shift(self, tokens: int, config) -> float:
        return calculate_shift(tokens, config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                               config.get("base_shift", 0.95), config.get("max_shift", 2.05))

    def request_conditioning(self, state: RequestState) -> dict[str, Any]:
        """This clip's positions (the video's at its frame rate, the sound's)
        and each guidance row's masks, on the prompt embeddings' device."""
        request, passes = state.request, state.guidance.passes
        device = state.conditioning["encoder_hidden_states"].device
        rows = len(passes)
        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        perturbation = torch.ones(rows, self.settings["layers"])
        if PERTURBED in passes:
            perturbation[passes.index(PERTURBED), request.inputs["stg_blocks"]] = 0
        coords = {
            "video_coords": self.video_rope.prepare_video_coords(1, frames, lat_h, lat_w, "cpu", fps=request.fps),
            "audio_coords": self.audio_rope.prepare_audio_coords(
                1, self.audio_frames(request.num_frames, request.fps), "cpu"),
        }
        return {
            **{name: value.expand(rows, -1, -1, -1).contiguous().to(device) for name, value in coords.items()},
            "perturbation_mask": perturbation.to(device),
            "cross_modal_mask": torch.tensor([[0.0 if name == ISOLATED else 1.0] for name in passes], device=device),
        }

    def split(self, packed, state: RequestState):
        """Packed rows [R, P] -> (video [R, tokens, C], sound [R, tokens, C'])."""
        video_tokens = state.conditioning["video_coords"].shape[2]
        audio_tokens = state.conditioning["audio_coords"].shape[2]
        split = video_tokens * self.settings["latent_channels"]
        return (packed[:, :split].reshape(len(packed), video_tokens, -1),
                packed[:, split:].reshape(len(packed), audio_tokens, -1))

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        conditioning = state.conditioning
        rows = state.guidance.rows
        video, audio = self.split(latents, state)
        return {
            "hidden_states": video.expand(rows, -1, -1).contiguous(),
            "audio_hidden_states": audio.expand(rows, -1, -1).contiguous(),
            "timestep": torch.full((rows, 1), float(timestep), device=latents.device),
            **{name: conditioning[name] for name in (
                "encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask", "video_coords",
                "audio_coords", "perturbation_mask", "cross_modal_mask")},
        }

    def finish(self, state: RequestState, latents):
        """(video latents [1, C, frames, h, w] as _unpack_latents gives them,
        the sound's packed latents [1, tokens, C x mel bins]) of the final row."""
        frames, rows, columns = self.token_grid(state.request)
        split = frames * rows * columns * self.settings["latent_channels"]
        audio_channels = self.settings["audio_latent_channels"] * self.settings["audio_latent_mel_bins"]
        return (self.unpack(latents[:, :split], state.request),
                latents[:, split:].reshape(1, -1, audio_channels).contiguous())

    def decode(self, latents):
        video, _ = latents
        return super().decode(video)

    def decode_audio(self, latents):
        """The sound track [channels, samples] (audio VAE, then the vocoder)."""
        _, audio = latents
        return as_numpy(self.run_component("audio_decoder", {"audio_latents": audio})["waveform"])[0]

    def preview_latents(self, latents):
        video, _ = latents
        return super().preview_latents(video)


class Ltx2ImageToVideoRuntime(Ltx2Runtime):
    """LTX2ImageToVideoPipeline: the picture, re-compressed as H.264 at the
    model's quality and encoded, is the first latent frame, kept as it is
    through the loop (its tokens at timestep 0); the sound is made as for
    text-to-video."""

    family = LTX2_I2V

    def frame_elements(self, request) -> int:
        """The first latent frame's share of the packed row (its tokens x channels)."""
        _, rows, columns = self.token_grid(request)
        return rows * columns * self.settings["latent_channels"]

    def scheduler(self, request):
        return KeepFirstFrame(super().scheduler(request), self.frame_elements(request))

    def initial_latents(self, state: RequestState):
        """The picture's latents on the first frame and noise after it (the
        encoder's mode draws nothing), then the sound's noise, from one
        generator in the pipeline's order; packed."""
        request = state.request
        picture = apply_image_conditioning_crf(request.image, self.settings["image_crf"])
        encoded = as_torch(self.run_component("vae_encoder", {"frames": video_pixels(picture)})["latents"])
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = self.noise(generator, request)
        video = torch.cat([encoded.to(noise.device), noise[:, :, 1:]], dim=2)
        return torch.cat([self.pack(video).flatten(1), self.sound_noise(generator, request)], dim=1)

    def denoiser_inputs(self, state: RequestState, latents, timestep) -> dict[str, Any]:
        inputs = super().denoiser_inputs(state, latents, timestep)
        _, rows, columns = self.token_grid(state.request)
        # t on every video token but the first frame's, which stay at 0 (the picture is clean).
        video_timestep = inputs["timestep"].expand(-1, inputs["hidden_states"].shape[1]).clone()
        video_timestep[:, :rows * columns] = 0
        return {**inputs, "video_timestep": video_timestep}
