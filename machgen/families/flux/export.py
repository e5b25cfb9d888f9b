"""Flux's build-time half: the torch wrappers each component exports, and
``FluxExport`` (machgen/builder/family_export.py)."""

from __future__ import annotations

from typing import Any

import torch

from machgen.builder.family_export import ExportableComponent, FamilyExport
from machgen.contract.specs import AxisRange, ComponentSpec, ServedDefaults
from machgen.families.flux.spec import flux_specs
from machgen.parallel.layout import ParallelSupport


class TextEncoderPooled(torch.nn.Module):
    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, input_ids):
        return self.clip(input_ids, output_hidden_states=False).pooler_output


class TextEncoderSequence(torch.nn.Module):
    def __init__(self, t5):
        super().__init__()
        self.t5 = t5

    def forward(self, input_ids):
        return self.t5(input_ids, output_hidden_states=False)[0]


def rotary(transformer, img_ids, txt_ids):
    # All rows of a batch share one shape bucket, so one set of ids holds.
    return transformer.pos_embed(torch.cat((txt_ids[0], img_ids[0]), dim=0))


def time_embedding(transformer, timestep, pooled_projections, guidance):
    timestep = timestep.reshape(-1).to(pooled_projections.dtype) * 1000
    if guidance is None:
        return transformer.time_text_embed(timestep, pooled_projections)
    guidance = guidance.reshape(-1).to(pooled_projections.dtype) * 1000
    return transformer.time_text_embed(timestep, guidance, pooled_projections)


class DenoiserHead(torch.nn.Module):
    """FluxTransformer2DModel.forward up to and including the first double block."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                guidance=None):
        tr = self.transformer
        embedded = tr.x_embedder(hidden_states)
        temb = time_embedding(tr, timestep, pooled_projections, guidance)
        encoder_hidden_states = tr.context_embedder(encoder_hidden_states)
        encoder_hidden_states, hidden_states = tr.transformer_blocks[0](
            hidden_states=embedded,
            encoder_hidden_states=encoder_hidden_states,
            temb=temb,
            image_rotary_emb=rotary(tr, img_ids, txt_ids),
        )
        return hidden_states, encoder_hidden_states, temb, hidden_states - embedded


class DenoiserTail(torch.nn.Module):
    """The rest of FluxTransformer2DModel.forward after the first double block."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, image_hidden, text_hidden, temb, img_ids, txt_ids):
        tr = self.transformer
        image_rotary_emb = rotary(tr, img_ids, txt_ids)
        blocks = list(tr.transformer_blocks)[1:] + list(tr.single_transformer_blocks)
        image_final = image_hidden
        for block in blocks:
            text_hidden, image_final = block(
                hidden_states=image_final,
                encoder_hidden_states=text_hidden,
                temb=temb,
                image_rotary_emb=image_rotary_emb,
            )
        return tr.proj_out(tr.norm_out(image_final, temb)), image_final - image_hidden


class DenoiserReuse(torch.nn.Module):
    """FluxTransformer2DModel.forward with every block replaced by a kept residual."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, pooled_projections, timestep, blocks_residual, guidance=None):
        tr = self.transformer
        image_final = tr.x_embedder(hidden_states) + blocks_residual
        return tr.proj_out(tr.norm_out(image_final, time_embedding(tr, timestep, pooled_projections, guidance)))


class ScaledVae(torch.nn.Module):
    """The VAE with the pipelines' latent scale: latents = (vae latents - shift) * scale."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        self.scaling_factor = float(vae.config.scaling_factor)
        self.shift_factor = float(vae.config.shift_factor or 0.0)


class VaeDecoder(ScaledVae):
    """FluxPipeline's latent scaling followed by AutoencoderKL.decode."""

    def forward(self, latents):
        latents = latents / self.scaling_factor + self.shift_factor
        return self.vae.decode(latents, return_dict=False)[0]


class VaeEncoder(ScaledVae):
    """AutoencoderKL.encode's latent distribution in FluxImg2ImgPipeline's
    latent scale: (sample - shift) * scale = mean + std * noise, with both
    returned already shifted and scaled."""

    def forward(self, image):
        distribution = self.vae.encode(image).latent_dist
        return (distribution.mean - self.shift_factor) * self.scaling_factor, distribution.std * self.scaling_factor


class Postprocess(torch.nn.Module):
    """VaeImageProcessor.postprocess(output_type="pil") as tensor ops."""

    def forward(self, image):
        image = (image / 2 + 0.5).clamp(0, 1)
        return (image.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)


def image_axis_ranges(defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
    """The served sizes of a Flux-layout image model's axes: pixels, latents, 2x2 patches, T5 tokens."""
    vae, multiple = settings["vae_scale_factor"], settings["size_multiple"]
    height = AxisRange(multiple, defaults.height, defaults.max_height)
    width = AxisRange(multiple, defaults.width, defaults.max_width)
    # T5 input is always padded to max_sequence_length.
    text = defaults.max_sequence_length
    return {
        "height": height, "width": width,
        "latent_height": height.scaled(vae), "latent_width": width.scaled(vae),
        "image_tokens": height.scaled(multiple).times(width.scaled(multiple)),
        "text_tokens": AxisRange(text, text, text),
    }


def vae_scale_factor(vae_config) -> int:
    return 2 ** (len(vae_config.block_out_channels) - 1)


class FluxExport(FamilyExport):
    sampler_assets = ("tokenizer", "tokenizer_2", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_flux",)
    # Joint attention over the text and image tokens: each rank holds a chunk of both.
    sequence_axes = ("image_tokens", "text_tokens")

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        tr = pipe.transformer.config
        return flux_specs(
            clip_length=pipe.tokenizer.model_max_length,
            pooled_dim=pipe.text_encoder.config.projection_dim
            if hasattr(pipe.text_encoder, "text_projection") else pipe.text_encoder.config.hidden_size,
            t5_dim=pipe.text_encoder_2.config.d_model,
            joint_dim=tr.joint_attention_dim,
            inner_dim=tr.num_attention_heads * tr.attention_head_dim,
            in_channels=tr.in_channels,
            out_channels=tr.out_channels or tr.in_channels,
            latent_channels=pipe.vae.config.latent_channels,
            guidance=bool(tr.guidance_embeds),
        )

    def components(self, pipe) -> list[ExportableComponent]:
        specs = self.specs(pipe)
        tr = pipe.transformer.config
        # Sample sizes: batch 2 (batch 1 would be specialised by the exporter),
        # and token counts that differ from every fixed size in the model.
        batch, text_tokens, lat_h, lat_w = 2, 7, 6, 4
        image_tokens = (lat_h // 2) * (lat_w // 2)
        gen = torch.Generator().manual_seed(0)
        # The head runs once here to give the tail its sample inputs: on the transformer's device and dtype.
        device, dtype = pipe.transformer.device, pipe.transformer.dtype

        def randn(*shape):
            return torch.randn(*shape, generator=gen)

        img_ids = torch.zeros(lat_h // 2, lat_w // 2, 3)
        img_ids[..., 1] += torch.arange(lat_h // 2)[:, None]
        img_ids[..., 2] += torch.arange(lat_w // 2)[None, :]
        img_ids = img_ids.reshape(1, image_tokens, 3).expand(batch, -1, -1).contiguous()
        txt_ids = torch.zeros(batch, text_tokens, 3)
        vocab = min(pipe.text_encoder.config.vocab_size, pipe.text_encoder_2.config.vocab_size)

        head_module = DenoiserHead(pipe.transformer).eval()
        head_inputs: dict[str, Any] = {
            "hidden_states": randn(batch, image_tokens, tr.in_channels),
            "encoder_hidden_states": randn(batch, text_tokens, tr.joint_attention_dim),
            "pooled_projections": randn(batch, specs["denoiser_head"].inputs[2].shape[1]),
            "timestep": torch.tensor([[0.7], [0.3]]),
        }
        head_inputs.update(img_ids=img_ids, txt_ids=txt_ids)
        if tr.guidance_embeds:
            head_inputs["guidance"] = torch.tensor([[3.5], [1.0]])
        with torch.no_grad():
            image_hidden, text_hidden, temb, _ = (output.cpu().float() for output in head_module(
                **{name: value.to(device, dtype) for name, value in head_inputs.items()}))
        clip_ids = torch.randint(0, vocab, (batch, specs["text_encoder"].inputs[0].shape[1]), generator=gen)
        latent_channels = pipe.vae.config.latent_channels
        vae_scale = vae_scale_factor(pipe.vae.config)
        return [
            ExportableComponent(specs["text_encoder"], TextEncoderPooled(pipe.text_encoder).eval(),
                                {"input_ids": clip_ids}),
            ExportableComponent(
                specs["text_encoder_2"], TextEncoderSequence(pipe.text_encoder_2).eval(),
                {"input_ids": torch.randint(0, vocab, (batch, text_tokens), generator=gen)},
            ),
            ExportableComponent(specs["denoiser_head"], head_module, head_inputs),
            ExportableComponent(
                specs["denoiser_tail"], DenoiserTail(pipe.transformer).eval(),
                {"image_hidden": image_hidden, "text_hidden": text_hidden, "temb": temb,
                 "img_ids": img_ids, "txt_ids": txt_ids},
            ),
            ExportableComponent(
                specs["denoiser_reuse"], DenoiserReuse(pipe.transformer).eval(),
                {**{t.name: head_inputs[t.name] for t in specs["denoiser_reuse"].inputs if t.name in head_inputs},
                 "blocks_residual": randn(*image_hidden.shape)},
            ),
            ExportableComponent(
                specs["vae_decoder"], VaeDecoder(pipe.vae).eval(),
                {"latents": randn(batch, latent_channels, lat_h, lat_w)},
            ),
            ExportableComponent(
                specs["vae_encoder"], VaeEncoder(pipe.vae).eval(),
                {"image": randn(batch, 3, lat_h * vae_scale, lat_w * vae_scale).clamp(-1, 1)},
            ),
            ExportableComponent(
                specs["postprocess"], Postprocess().eval(),
                {"image": randn(batch, 3, lat_h * vae_scale, lat_w * vae_scale) * 0.8},
            ),
        ]

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # FluxPipeline.__call__'s defaults; the size is default_sample_size (128) latents.
        size = 128 * vae_scale_factor(pipe.vae.config)
        return ServedDefaults(height=size, width=size, num_inference_steps=28, guidance_scale=3.5,
                              max_sequence_length=512, max_height=2048, max_width=2048)

    def adapted_model(self, pipe):
        return pipe.transformer

    def adapter_state_dict(self, weights_file):
        from pathlib import Path

        from diffusers import FluxPipeline

        weights_file = Path(weights_file)
        state, alphas, metadata = FluxPipeline.lora_state_dict(
            weights_file.parent, weight_name=weights_file.name, return_alphas=True, return_lora_metadata=True)
        if metadata:  # the saved LoRA config, kept per model under its prefix
            metadata = {key[len(self.adapted_prefix):]: value for key, value in metadata.items()
                        if key.startswith(self.adapted_prefix)}
        return state, alphas, metadata

    def parallel_support(self, pipe, ranges: dict[str, AxisRange]) -> ParallelSupport:
        # Guidance rows: true CFG's negative-prompt rows (FluxPipeline's true_cfg_scale > 1).
        return ParallelSupport(heads=pipe.transformer.config.num_attention_heads, guidance_rows=True)

    def dense_attention_tokens(self, defaults: ServedDefaults) -> int:
        # Joint attention puts the T5 tokens, padded to max_sequence_length, before the image tokens.
        return defaults.max_sequence_length

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
        vae_scale = vae_scale_factor(pipe.vae.config)
        return {
            "vae_scale_factor": vae_scale,
            # Height and width must be multiples of this: the VAE factor times Flux's 2x2 packing.
            "size_multiple": vae_scale * 2,
            "latent_channels": pipe.transformer.config.in_channels // 4,
            "guidance_embeds": bool(pipe.transformer.config.guidance_embeds),
            "tokenizer_classes": {
                "tokenizer": type(pipe.tokenizer).__name__,
                "tokenizer_2": type(pipe.tokenizer_2).__name__,
            },
            "clip_max_length": pipe.tokenizer.model_max_length,
            "max_sequence_length": defaults.max_sequence_length,
        }

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        return image_axis_ranges(defaults, settings)
