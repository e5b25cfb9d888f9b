"""LTX-Video: diffusers' LTXPipeline (text-to-video) and LTXImageToVideoPipeline
(``ltx-i2v``: image-to-video, which adds ``vae_encoder`` and takes a timestep per token).

Components, as Triton serves them:

- ``text_encoder``    T5, input ids -> per-token embeddings (the mask goes to the transformer)
- ``denoiser_head``   input projection, time and caption embeddings and the
  first transformer block; also outputs that block's residual
- ``denoiser_tail``   the remaining blocks, output norm and projection
- ``denoiser_reuse``  input projection plus a kept blocks residual, output
  norm and projection: the prediction of a step that skips the blocks
- ``vae_decoder``     latents -> every frame in [-1, 1], in one call (LTX's
  decoder is not causal: diffusers decodes the whole video at once, and a
  decode split along time would change the frames)
- ``postprocess``     frames in [-1, 1] -> uint8 [frames, H, W, 3]

The rotary embedding's positions (frame, row, column of each latent token,
scaled by the frame rate as LTXPipeline's ``rope_interpolation_scale``)
are a per-request input, ``video_coords``: the request's ``fps`` reaches the
model through them.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

from machgen.builder.registry import (
    AxisRange,
    Capabilities,
    ComponentSpec,
    ExportableComponent,
    Family,
    ServedDefaults,
    TensorSpec,
    register_family,
)

_SCALAR = ("batch", 1)


def whole_video_decoder_specs(latent_channels: int) -> list[ComponentSpec]:
    """``vae_decoder`` (latents -> every frame in [-1, 1], one call) and ``postprocess`` (-> uint8)."""
    frames = ("batch", 3, "frames", "height", "width")
    return [
        ComponentSpec(
            "vae_decoder",
            inputs=(TensorSpec("latents", "float32",
                               ("batch", latent_channels, "latent_frames", "latent_height", "latent_width")),),
            outputs=(TensorSpec("frames", "float32", frames),),
            tolerance=1e-3,
        ),
        ComponentSpec(
            "postprocess",
            inputs=(TensorSpec("frames", "float32", frames),),
            outputs=(TensorSpec("images", "uint8", ("batch", "frames", "height", "width", 3)),),
            tolerance=1.0,  # one step of 255 where rounding lands on the other side of .5
            in_sampler=True,
        ),
    ]


def _ltx_specs(*, text_dim: int, inner_dim: int, in_channels: int, out_channels: int, latent_channels: int,
               image_to_video: bool) -> dict[str, ComponentSpec]:
    latents = TensorSpec("hidden_states", "float32", ("batch", "video_tokens", in_channels))
    text = TensorSpec("encoder_hidden_states", "float32", ("batch", "text_tokens", text_dim))
    mask = TensorSpec("encoder_attention_mask", "float32", ("batch", "text_tokens"))
    # Image-to-video: a timestep per token (0 on the first frame's, which hold the picture).
    timesteps = "video_tokens" if image_to_video else 1
    timestep = TensorSpec("timestep", "float32", ("batch", timesteps))
    coords = TensorSpec("video_coords", "float32", ("batch", 3, "video_tokens"))
    video_hidden = TensorSpec("image_hidden", "float32", ("batch", "video_tokens", inner_dim))
    text_hidden = TensorSpec("text_hidden", "float32", ("batch", "text_tokens", inner_dim))
    temb = TensorSpec("temb", "float32", ("batch", timesteps, 6 * inner_dim))
    embedded_timestep = TensorSpec("embedded_timestep", "float32", ("batch", timesteps, inner_dim))
    noise_pred = TensorSpec("noise_pred", "float32", ("batch", "video_tokens", out_channels))
    residual = ("batch", "video_tokens", inner_dim)
    specs = [
        ComponentSpec(
            "text_encoder",
            # LTXPipeline runs T5 without the mask; the transformer's cross-attention takes it.
            inputs=(TensorSpec("input_ids", "int64", ("batch", "text_tokens")),),
            outputs=(TensorSpec("prompt_embeds", "float32", ("batch", "text_tokens", text_dim)),),
            tolerance=1e-4,
        ),
        ComponentSpec(
            "denoiser_head",
            inputs=(latents, text, mask, timestep, coords),
            outputs=(video_hidden, text_hidden, temb, embedded_timestep,
                     TensorSpec("first_block_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_tail",
            inputs=(video_hidden, text_hidden, temb, embedded_timestep, mask, coords),
            outputs=(noise_pred, TensorSpec("tail_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_reuse",
            inputs=(latents, timestep, TensorSpec("blocks_residual", "float32", residual)),
            outputs=(noise_pred,),
            tolerance=1e-4,
            per_step=True,
            in_sampler=True,
        ),
        *whole_video_decoder_specs(latent_channels),
    ]
    if image_to_video:
        latent = ("batch", latent_channels, 1, "latent_height", "latent_width")
        specs.append(ComponentSpec(
            "vae_encoder",
            inputs=(TensorSpec("frames", "float32", ("batch", 3, 1, "height", "width")),),
            outputs=(TensorSpec("latent_mean", "float32", latent), TensorSpec("latent_std", "float32", latent)),
            tolerance=1e-3,
        ))
    return {s.name: s for s in specs}


def _modules():
    """The torch wrappers, defined lazily so that listing families stays light."""
    import torch

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

    return TextEncoder, DenoiserHead, DenoiserTail, DenoiserReuse, VaeDecoder, Postprocess, VaeEncoder


@register_family
class Ltx(Family):
    name = "ltx"
    diffusers_pipeline = "LTXPipeline"
    capabilities = Capabilities(tasks=("text-to-video",), true_cfg=True, guidance_is_cfg=True)
    sampler_assets = ("tokenizer", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_ltx",)

    # ------------------------------------------------------------------ build
    def specs(self, pipe) -> dict[str, ComponentSpec]:
        tr = pipe.transformer.config
        return _ltx_specs(text_dim=tr.caption_channels, inner_dim=tr.num_attention_heads * tr.attention_head_dim,
                          in_channels=tr.in_channels, out_channels=tr.out_channels,
                          latent_channels=pipe.vae.config.latent_channels, image_to_video=self.image_to_video)

    @property
    def image_to_video(self) -> bool:
        return "image-to-video" in self.capabilities.tasks

    def components(self, pipe) -> list[ExportableComponent]:
        import torch

        text_encoder, head, tail, reuse, vae_decoder, postprocess, vae_encoder = _modules()
        if pipe.vae.config.timestep_conditioning is None:
            raise ValueError("an LTX VAE without timestep_conditioning in its config is not supported")
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
        coords = _video_coords(frames, lat_h, lat_w, (1 / 25, 32, 32), 1, 1).expand(batch, -1, -1).contiguous()
        head_module = head(pipe.transformer).eval()
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
        encoder = [ExportableComponent(specs["vae_encoder"], vae_encoder(pipe.vae).eval(),
                                       {"frames": randn(batch, 3, 1, lat_h * vae_spatial, lat_w * vae_spatial)})
                   ] if self.image_to_video else []
        return encoder + [
            ExportableComponent(specs["text_encoder"], text_encoder(pipe.text_encoder).eval(),
                                {"input_ids": torch.randint(0, pipe.text_encoder.config.vocab_size,
                                                            (batch, text_tokens), generator=gen)}),
            ExportableComponent(specs["denoiser_head"], head_module, head_inputs),
            ExportableComponent(specs["denoiser_tail"], tail(pipe.transformer).eval(),
                                {"image_hidden": image_hidden, "text_hidden": text_hidden, "temb": temb,
                                 "embedded_timestep": embedded_timestep, "encoder_attention_mask": mask.float(),
                                 "video_coords": coords}),
            ExportableComponent(specs["denoiser_reuse"], reuse(pipe.transformer).eval(),
                                {"hidden_states": head_inputs["hidden_states"], "timestep": head_inputs["timestep"],
                                 "blocks_residual": randn(*image_hidden.shape)}),
            ExportableComponent(specs["vae_decoder"], vae_decoder(pipe.vae).eval(),
                                {"latents": randn(batch, pipe.vae.config.latent_channels, frames, lat_h, lat_w)}),
            ExportableComponent(specs["postprocess"], postprocess().eval(),
                                {"frames": randn(batch, 3, 5, lat_h * vae_spatial, lat_w * vae_spatial) * 0.8}),
        ]

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # LTXPipeline.__call__'s defaults: 704x512, 161 frames at 25 fps, 50 steps, CFG 3.
        return ServedDefaults(height=512, width=704, num_inference_steps=50, guidance_scale=3.0, negative_prompt="",
                              max_sequence_length=128, max_height=1280, max_width=1280, num_frames=161,
                              max_frames=257, fps=25)

    def tiny_defaults(self) -> ServedDefaults:
        return ServedDefaults(height=32, width=64, num_inference_steps=4, guidance_scale=3.0, negative_prompt="",
                              max_sequence_length=16, max_height=128, max_width=128, num_frames=9, max_frames=17,
                              fps=25)

    def tiny_pipeline(self):
        import diffusers
        import torch

        from machgen.builder.tiny import tiny_t5_encoder, tiny_t5_tokenizer

        torch.manual_seed(0)
        tokenizer = tiny_t5_tokenizer()
        text_encoder = tiny_t5_encoder(tokenizer)
        transformer = diffusers.LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
            attention_head_dim=8, cross_attention_dim=32, num_layers=2, caption_channels=32,
        )
        vae = diffusers.AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
            encoder_causal=True, decoder_causal=False,
        )
        for module in (text_encoder, transformer, vae):
            module.eval()
        return getattr(diffusers, self.diffusers_pipeline)(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
            tokenizer=tokenizer, transformer=transformer,
        )

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
        spatial, multiple, temporal = settings["vae_spatial_ratio"], settings["size_multiple"], settings["temporal_factor"]

        def scaled(size: AxisRange, factor: int) -> AxisRange:
            return AxisRange(size.min // factor, size.opt // factor, size.max // factor)

        height = AxisRange(multiple, defaults.height, defaults.max_height)
        width = AxisRange(multiple, defaults.width, defaults.max_width)
        frames = AxisRange(1, defaults.num_frames, defaults.max_frames)
        latent_frames = AxisRange(1, (defaults.num_frames - 1) // temporal + 1, (defaults.max_frames - 1) // temporal + 1)
        lat_h, lat_w = scaled(height, spatial), scaled(width, spatial)
        tokens = [scaled(latent_frames, settings["patch_size_t"]), scaled(lat_h, settings["patch_size"]),
                  scaled(lat_w, settings["patch_size"])]
        text = defaults.max_sequence_length
        return {
            "height": height, "width": width, "frames": frames, "latent_frames": latent_frames,
            "latent_height": lat_h, "latent_width": lat_w, "text_tokens": AxisRange(text, text, text),
            "video_tokens": AxisRange(tokens[0].min * tokens[1].min * tokens[2].min,
                                      tokens[0].opt * tokens[1].opt * tokens[2].opt,
                                      tokens[0].max * tokens[1].max * tokens[2].max),
        }

    # --------------------------------------------------------------- run time
    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return LtxConditioning(settings, assets_dir, run_component)


def _video_coords(frames: int, height: int, width: int, scale: tuple[float, float, float], patch: int,
                  patch_t: int):
    """LTXVideoRotaryPosEmbed's positions of the latent tokens before its
    division by the base sizes: [1, 3, tokens] (frame, row, column), each
    times its rope_interpolation_scale and patch, as _prepare_video_coords."""
    import torch

    grid = torch.stack(torch.meshgrid(torch.arange(frames, dtype=torch.float32),
                                      torch.arange(height, dtype=torch.float32),
                                      torch.arange(width, dtype=torch.float32), indexing="ij"), dim=0)[None]
    grid[:, 0:1] = grid[:, 0:1] * scale[0] * patch_t
    grid[:, 1:2] = grid[:, 1:2] * scale[1] * patch
    grid[:, 2:3] = grid[:, 2:3] * scale[2] * patch
    return grid.flatten(2, 4)


class LtxConditioning:
    """The LTX-specific half of the sampler: prompts, noise, timesteps, positions.

    Mirrors LTXPipeline step for step (_get_t5_prompt_embeds, prepare_latents
    and _pack_latents, calculate_shift on the video's token count,
    rope_interpolation_scale from the frame rate, _unpack_latents).
    """

    def __init__(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

        self._calculate_shift = calculate_shift
        self.settings = settings
        self.run_component = run_component
        self.tokenizer = getattr(transformers, settings["tokenizer_class"]).from_pretrained(
            os.path.join(assets_dir, "tokenizer"))
        with open(os.path.join(assets_dir, "scheduler", "scheduler_config.json")) as f:
            self.scheduler_config = json.load(f)
        self._scheduler_class = FlowMatchEulerDiscreteScheduler

    @property
    def size_multiple(self) -> int:
        return self.settings["size_multiple"]

    @property
    def frame_multiple(self) -> int:
        return self.settings["temporal_factor"]

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        spatial = self.settings["vae_spatial_ratio"]
        return (num_frames - 1) // self.frame_multiple + 1, height // spatial, width // spatial

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """LTXPipeline._get_t5_prompt_embeds for a list of prompts, one row each, with their masks."""
        import numpy as np

        from machgen.ensembles.tensors import as_torch

        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.settings["max_sequence_length"],
                                truncation=True, add_special_tokens=True, return_tensors="np")
        mask = tokens.attention_mask.astype(np.int64)
        embeds = as_torch(self.run_component("text_encoder", {"input_ids": tokens.input_ids.astype(np.int64)})[
            "prompt_embeds"])
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": as_torch(mask.astype(np.float32))}

    def initial_latents(self, seed: int, height: int, width: int, num_frames: int = 1):
        """Packed noise exactly as LTXPipeline.prepare_latents draws it: [1, tokens, C]."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        shape = (1, self.settings["latent_channels"], *self.latent_shape(height, width, num_frames))
        return self.pack(randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32))

    def pack(self, latents):
        """LTXPipeline._pack_latents: [1, C, F, h, w] -> [1, tokens, C x patches]."""
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        _, channels, frames, lat_h, lat_w = latents.shape
        latents = latents.reshape(1, channels, frames // patch_t, patch_t, lat_h // patch, patch, lat_w // patch,
                                  patch)
        return latents.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1):
        """A fresh scheduler with LTXPipeline's sigmas and shift for the video's token count."""
        import numpy as np

        scheduler = self._scheduler_class.from_config(self.scheduler_config)
        cfg = scheduler.config
        frames, lat_h, lat_w = self.latent_shape(height, width, num_frames)
        mu = self._calculate_shift(frames * lat_h * lat_w, cfg.get("base_image_seq_len", 256),
                                   cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                   cfg.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps), mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def request_conditioning(self, request) -> dict[str, Any]:
        """The rotary positions of this video's tokens at its frame rate."""
        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        spatial = self.settings["vae_spatial_ratio"]
        scale = (self.frame_multiple / request.fps, spatial, spatial)
        return {"video_coords": _video_coords(frames // patch_t, lat_h // patch, lat_w // patch, scale, patch,
                                              patch_t)}

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        import torch

        rows = conditioning["encoder_hidden_states"].shape[0]
        device = latents.device
        return {
            "hidden_states": latents.expand(rows, -1, -1).contiguous(),
            "encoder_hidden_states": conditioning["encoder_hidden_states"],
            "encoder_attention_mask": conditioning["encoder_attention_mask"],
            "timestep": torch.full((rows, 1), float(timestep), device=device),
            "video_coords": conditioning["video_coords"].to(device).expand(rows, -1, -1).contiguous(),
        }

    def decoder_latents(self, latents, height: int, width: int):
        """LTXPipeline._unpack_latents: [1, tokens, C] -> [1, C, frames, h, w]."""
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        spatial = self.settings["vae_spatial_ratio"]
        lat_h, lat_w = height // spatial // patch, width // spatial // patch
        frames = latents.shape[1] // (lat_h * lat_w)
        latents = latents.reshape(1, frames, lat_h, lat_w, -1, patch_t, patch, patch)
        return latents.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3).contiguous()

    def decode(self, latents) -> Any:
        """uint8 frames [F, H, W, 3]: the whole video in one decoder call."""
        from machgen.ensembles.tensors import as_numpy

        frames = self.run_component("vae_decoder", {"latents": latents})["frames"]
        return as_numpy(self.run_component("postprocess", {"frames": frames})["images"])[0]


@register_family
class LtxImageToVideo(Ltx):
    """LTX-Video image-to-video (LTXImageToVideoPipeline): the picture's
    latents are the first latent frame, kept as they are through the loop
    (its tokens denoised at timestep 0), the other frames start from noise."""

    name = "ltx-i2v"
    diffusers_pipeline = "LTXImageToVideoPipeline"
    capabilities = Capabilities(tasks=("image-to-video",), true_cfg=True, guidance_is_cfg=True)

    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return LtxImageToVideoConditioning(settings, assets_dir, run_component)


class _KeepFirstFrame:
    """A scheduler whose step leaves the first latent frame's tokens as they
    are: LTXImageToVideoPipeline steps only the others (FlowMatchEuler's step
    is elementwise, so this is the same)."""

    def __init__(self, scheduler, frame_tokens: int):
        self.scheduler = scheduler
        self.frame_tokens = frame_tokens
        self.timesteps = scheduler.timesteps
        self.sigmas = scheduler.sigmas

    def step(self, model_output, timestep, sample, return_dict: bool = False):
        stepped = self.scheduler.step(model_output, timestep, sample, return_dict=False)[0]
        stepped[:, :self.frame_tokens] = sample[:, :self.frame_tokens]
        return (stepped,)


class LtxImageToVideoConditioning(LtxConditioning):
    """LTXImageToVideoPipeline.prepare_latents and its per-token timesteps."""

    def frame_tokens(self, height: int, width: int) -> int:
        spatial, patch = self.settings["vae_spatial_ratio"], self.settings["patch_size"]
        return (height // spatial // patch) * (width // spatial // patch)

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1):
        return _KeepFirstFrame(super().scheduler(num_inference_steps, height, width, num_frames),
                               self.frame_tokens(height, width))

    def image_latents(self, image, first_step: int, seed: int, scheduler, num_frames: int = 1):
        """The picture's latents (sampled from the VAE encoder's distribution)
        as the first latent frame, noise after it, drawn from one generator in
        the pipeline's order (the sample, then the noise); packed."""
        import numpy as np
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        from machgen.ensembles.tensors import as_torch

        pixels = (image.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)[None, :, None]
        encoded = self.run_component("vae_encoder", {"frames": np.ascontiguousarray(pixels)})
        mean, std = (as_torch(encoded[name]) for name in ("latent_mean", "latent_std"))
        generator = torch.Generator("cpu").manual_seed(seed)
        picture = mean + std * randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        shape = (1, self.settings["latent_channels"], *self.latent_shape(*image.shape[:2], num_frames))
        noise = randn_tensor(shape, generator=generator, device=mean.device, dtype=torch.float32)
        latents = torch.cat([picture, noise[:, :, 1:]], dim=2)
        return self.pack(latents), scheduler.timesteps

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        inputs = super().denoiser_inputs(latents, timestep, conditioning, guidance_scale, height, width)
        # t on every token but the first frame's, which stay at 0 (the picture is clean).
        inputs["timestep"] = inputs["timestep"].expand(-1, latents.shape[1]).clone()
        inputs["timestep"][:, :self.frame_tokens(height, width)] = 0
        return inputs
