"""LTX-Video's build-time half: the torch wrappers each component exports,
and ``LtxExport`` (text-to-video and image-to-video)."""

from __future__ import annotations

import math
from typing import Any

import torch

from machgen.builder.family_export import ExportableComponent, FamilyExport
from machgen.contract.specs import AxisRange, ComponentSpec, ServedDefaults
from machgen.families.ltx.runtime import video_coords
from machgen.families.ltx.spec import ltx_specs


class TextEncoder(torch.nn.Module):
    def __init__(self, t5):
        super().__init__()
        self.t5 = t5

    def forward(self, input_ids):
        return self.t5(input_ids)[0]


def attention_bias(mask, dtype):
    # LTXVideoTransformer3DModel.forward's conversion of a [batch, tokens] mask.
    return ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)


def time_embedding(tr, timestep, batch: int, dtype):
    # [batch, timesteps per row, features], sized from the timestep (the model's view(batch, -1, ...)
    # of the same values leaves the exporter a count it cannot prove equal to the tokens').
    temb, embedded = tr.time_embed(timestep.reshape(-1), batch_size=batch, hidden_dtype=dtype)
    return (temb.reshape(batch, timestep.shape[1], temb.size(-1)),
            embedded.reshape(batch, timestep.shape[1], embedded.size(-1)))


def output(tr, hidden, embedded_timestep):
    shift_scale = tr.scale_shift_table[None, None] + embedded_timestep[:, :, None]
    shift, scale = shift_scale[:, :, 0], shift_scale[:, :, 1]
    return tr.proj_out(tr.norm_out(hidden) * (1 + scale) + shift)


class DenoiserHead(torch.nn.Module):
    """LTXVideoTransformer3DModel.forward up to and including the first block."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep, video_coords):
        tr = self.transformer
        batch = hidden_states.size(0)
        embedded = tr.proj_in(hidden_states)
        temb, embedded_timestep = time_embedding(tr, timestep, batch, embedded.dtype)
        text_hidden = tr.caption_projection(encoder_hidden_states)
        hidden = tr.transformer_blocks[0](
            hidden_states=embedded, encoder_hidden_states=text_hidden, temb=temb,
            image_rotary_emb=tr.rope(hidden_states, video_coords=video_coords),
            encoder_attention_mask=attention_bias(encoder_attention_mask, embedded.dtype))
        return hidden, text_hidden, temb, embedded_timestep, hidden - embedded


class DenoiserTail(torch.nn.Module):
    """The rest of LTXVideoTransformer3DModel.forward after the first block."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, image_hidden, text_hidden, temb, embedded_timestep, encoder_attention_mask, video_coords):
        tr = self.transformer
        rotary = tr.rope(image_hidden, video_coords=video_coords)
        bias = attention_bias(encoder_attention_mask, image_hidden.dtype)
        hidden = image_hidden
        for block in tr.transformer_blocks[1:]:
            hidden = block(hidden_states=hidden, encoder_hidden_states=text_hidden, temb=temb,
                           image_rotary_emb=rotary, encoder_attention_mask=bias)
        return output(tr, hidden, embedded_timestep), hidden - image_hidden


class DenoiserReuse(torch.nn.Module):
    """LTXVideoTransformer3DModel.forward with every block replaced by a kept residual."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, timestep, blocks_residual):
        tr = self.transformer
        embedded = tr.proj_in(hidden_states)
        _, embedded_timestep = time_embedding(tr, timestep, hidden_states.size(0), embedded.dtype)
        return output(tr, embedded + blocks_residual, embedded_timestep)


class VaeDecoder(torch.nn.Module):
    """LTXPipeline's latent denormalisation, then AutoencoderKLLTXVideo.decode
    (at decode_timestep 0, LTXPipeline's default, when the VAE is timestep-conditioned)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, latents):
        mean = self.vae.latents_mean.view(1, -1, 1, 1, 1)
        std = self.vae.latents_std.view(1, -1, 1, 1, 1)
        latents = latents * std / self.scaling_factor + mean
        timestep = latents.new_zeros(latents.shape[0]) if self.vae.config.timestep_conditioning else None
        return self.vae.decode(latents, timestep, return_dict=False)[0]


class Postprocess(torch.nn.Module):
    """VideoProcessor.postprocess_video(output_type="np") as uint8, [batch, frames, H, W, 3]."""

    def forward(self, frames):
        frames = (frames / 2 + 0.5).clamp(0, 1)
        return (frames.permute(0, 2, 3, 4, 1) * 255).round().to(torch.uint8)


class VaeEncoder(torch.nn.Module):
    """AutoencoderKLLTXVideo.encode's latent distribution in LTXPipeline's
    normalisation: (sample - mean) * scale / std = latent_mean + latent_std * noise."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)

    def forward(self, frames):
        distribution = self.vae.encode(frames).latent_dist
        scale = self.scaling_factor / self.vae.latents_std.view(1, -1, 1, 1, 1)
        return (distribution.mean - self.vae.latents_mean.view(1, -1, 1, 1, 1)) * scale, distribution.std * scale


class LtxExport(FamilyExport):
    sampler_assets = ("tokenizer", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_ltx",)

    def check(self, pipe) -> None:
        if pipe.vae.config.timestep_conditioning is None:
            raise ValueError("an LTX VAE without timestep_conditioning in its config is not supported")

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        tr = pipe.transformer.config
        return ltx_specs(text_dim=tr.caption_channels, inner_dim=tr.num_attention_heads * tr.attention_head_dim,
                         in_channels=tr.in_channels, out_channels=tr.out_channels,
                         latent_channels=pipe.vae.config.latent_channels, image_to_video=self.image_to_video)

    @property
    def image_to_video(self) -> bool:
        return "image-to-video" in self.family.capabilities.tasks

    def components(self, pipe) -> list[ExportableComponent]:
        specs = self.specs(pipe)
        tr = pipe.transformer.config
        # Batch 2 (batch 1 would be specialised), sizes unlike any fixed size in the model.
        batch, text_tokens, frames, lat_h, lat_w = 2, 7, 3, 6, 4
        tokens = frames * lat_h * lat_w
        gen = torch.Generator().manual_seed(0)
        device, dtype = pipe.transformer.device, pipe.transformer.dtype

        def randn(*shape):
            return torch.randn(*shape, generator=gen)

        mask = torch.ones(batch, text_tokens, dtype=torch.int64)
        mask[1, 4:] = 0
        coords = video_coords(frames, lat_h, lat_w, (1 / 25, 32, 32), 1, 1).expand(batch, -1, -1).contiguous()
        head_module = DenoiserHead(pipe.transformer).eval()
        timestep = torch.tensor([[700.0], [300.0]])
        if self.image_to_video:  # the first frame's tokens at 0
            timestep = timestep.repeat(1, tokens)
            timestep[:, :lat_h * lat_w] = 0
        head_inputs = {"hidden_states": randn(batch, tokens, tr.in_channels),
                       "encoder_hidden_states": randn(batch, text_tokens, tr.caption_channels),
                       "encoder_attention_mask": mask.float(), "timestep": timestep, "video_coords": coords}
        with torch.no_grad():
            image_hidden, text_hidden, temb, embedded_timestep, _ = (output.cpu().float() for output in head_module(
                **{name: value.to(device, dtype) for name, value in head_inputs.items()}))
        vae_spatial = pipe.vae_spatial_compression_ratio
        components = [
            ExportableComponent(specs["text_encoder"], TextEncoder(pipe.text_encoder).eval(),
                                {"input_ids": torch.randint(0, pipe.text_encoder.config.vocab_size,
                                                            (batch, text_tokens), generator=gen)}),
            ExportableComponent(specs["denoiser_head"], head_module, head_inputs),
            ExportableComponent(specs["denoiser_tail"], DenoiserTail(pipe.transformer).eval(),
                                {"image_hidden": image_hidden, "text_hidden": text_hidden, "temb": temb,
                                 "embedded_timestep": embedded_timestep, "encoder_attention_mask": mask.float(),
                                 "video_coords": coords}),
            ExportableComponent(specs["denoiser_reuse"], DenoiserReuse(pipe.transformer).eval(),
                                {"hidden_states": head_inputs["hidden_states"], "timestep": head_inputs["timestep"],
                                 "blocks_residual": randn(*image_hidden.shape)}),
            ExportableComponent(specs["vae_decoder"], VaeDecoder(pipe.vae).eval(),
                                {"latents": randn(batch, pipe.vae.config.latent_channels, frames, lat_h, lat_w)}),
            ExportableComponent(specs["postprocess"], Postprocess().eval(),
                                {"frames": randn(batch, 3, 5, lat_h * vae_spatial, lat_w * vae_spatial) * 0.8}),
        ]
        if self.image_to_video:  # drawn last: the other components' samples, and so their exports, are text-to-video's
            components.append(ExportableComponent(
                specs["vae_encoder"], VaeEncoder(pipe.vae).eval(),
                {"frames": randn(batch, 3, 1, lat_h * vae_spatial, lat_w * vae_spatial)}))
        return components

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # LTXPipeline.__call__'s defaults: 704x512, 161 frames at 25 fps, 50 steps, CFG 3.
        return ServedDefaults(height=512, width=704, num_inference_steps=50, guidance_scale=3.0, negative_prompt="",
                              max_sequence_length=128, max_height=1280, max_width=1280, num_frames=161,
                              max_frames=257, fps=25)

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
        spatial, temporal = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        return {
            "vae_spatial_ratio": spatial,
            "temporal_factor": temporal,
            # Height and width must be multiples of this: the VAE factor times the transformer's patch, and
            # of 32 (LTXPipeline.check_inputs).
            "size_multiple": math.lcm(spatial * patch, 32),
            "patch_size": patch,
            "patch_size_t": patch_t,
            "latent_channels": pipe.transformer.config.in_channels,
            "tokenizer_class": type(pipe.tokenizer).__name__,
            "max_sequence_length": defaults.max_sequence_length,
        }

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        spatial, multiple = settings["vae_spatial_ratio"], settings["size_multiple"]
        temporal = settings["temporal_factor"]
        height = AxisRange(multiple, defaults.height, defaults.max_height)
        width = AxisRange(multiple, defaults.width, defaults.max_width)
        frames = AxisRange(1, defaults.num_frames, defaults.max_frames)
        latent_frames = AxisRange(1, (defaults.num_frames - 1) // temporal + 1,
                                  (defaults.max_frames - 1) // temporal + 1)
        lat_h, lat_w = height.scaled(spatial), width.scaled(spatial)
        patch, patch_t = settings["patch_size"], settings["patch_size_t"]
        text = defaults.max_sequence_length
        return {
            "height": height, "width": width, "frames": frames, "latent_frames": latent_frames,
            "latent_height": lat_h, "latent_width": lat_w, "text_tokens": AxisRange(text, text, text),
            "video_tokens": latent_frames.scaled(patch_t).times(lat_h.scaled(patch)).times(lat_w.scaled(patch)),
        }
