"""Flux (FLUX.1 and Flux-architecture models): diffusers' FluxPipeline.

Components, as Triton serves them:

- ``text_encoder``   CLIP, input ids -> pooled embedding
- ``text_encoder_2`` T5, input ids -> per-token embeddings
- ``denoiser_head``  input embeddings, timestep/guidance embedding and the
  first double-stream block; also outputs that block's image residual,
  which First-Block Cache compares across steps
- ``denoiser_tail``  the remaining blocks, final norm and projection; also
  outputs the blocks' image residual, which cache reuse keeps
- ``denoiser_reuse`` input embedding plus a kept blocks residual, final norm
  and projection: the prediction of a step that skips the blocks
- ``vae_decoder``    latents -> image in [-1, 1]
- ``vae_encoder``    image in [-1, 1] -> mean and spread of its scaled latents
  (image-to-image: FluxImg2ImgPipeline samples its latents from them)
- ``postprocess``    image in [-1, 1] -> uint8 HWC, as diffusers' PIL output

Every per-request value (latents, timestep, guidance, embeddings, position
ids) is a batched input, so that Triton can group the step calls of
concurrent requests.
"""

from __future__ import annotations

import functools
import json
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

# Batched scalars travel as [batch, 1]: Triton needs one dimension past the batch.
_SCALAR = ("batch", 1)


def _flux_specs(*, clip_length: int, pooled_dim: int, t5_dim: int, joint_dim: int, inner_dim: int,
                in_channels: int, out_channels: int, latent_channels: int, guidance: bool) -> dict[str, ComponentSpec]:
    ids_img = TensorSpec("img_ids", "float32", ("batch", "image_tokens", 3))
    ids_txt = TensorSpec("txt_ids", "float32", ("batch", "text_tokens", 3))
    image_hidden = TensorSpec("image_hidden", "float32", ("batch", "image_tokens", inner_dim))
    text_hidden = TensorSpec("text_hidden", "float32", ("batch", "text_tokens", inner_dim))
    temb = TensorSpec("temb", "float32", ("batch", inner_dim))
    noise_pred = TensorSpec("noise_pred", "float32", ("batch", "image_tokens", out_channels))
    latents = TensorSpec("hidden_states", "float32", ("batch", "image_tokens", in_channels))
    pooled = TensorSpec("pooled_projections", "float32", ("batch", pooled_dim))
    timestep = TensorSpec("timestep", "float32", _SCALAR)
    # guidance-distilled models (FLUX.1-dev) embed the guidance scale
    guidance_input = (TensorSpec("guidance", "float32", _SCALAR),) if guidance else ()
    head_inputs = (latents, TensorSpec("encoder_hidden_states", "float32", ("batch", "text_tokens", joint_dim)),
                   pooled, timestep, ids_img, ids_txt) + guidance_input
    specs = [
        ComponentSpec(
            "text_encoder",
            inputs=(TensorSpec("input_ids", "int64", ("batch", clip_length)),),
            outputs=(TensorSpec("pooled_prompt_embeds", "float32", ("batch", pooled_dim)),),
            tolerance=1e-4,
        ),
        ComponentSpec(
            "text_encoder_2",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "text_tokens")),),
            outputs=(TensorSpec("prompt_embeds", "float32", ("batch", "text_tokens", t5_dim)),),
            tolerance=1e-4,
        ),
        ComponentSpec(
            "denoiser_head",
            inputs=head_inputs,
            outputs=(image_hidden, text_hidden, temb,
                     TensorSpec("first_block_residual", "float32", ("batch", "image_tokens", inner_dim))),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_tail",
            inputs=(image_hidden, text_hidden, temb, ids_img, ids_txt),
            outputs=(noise_pred, TensorSpec("tail_residual", "float32", ("batch", "image_tokens", inner_dim))),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_reuse",
            inputs=(latents, pooled, timestep) + guidance_input
            + (TensorSpec("blocks_residual", "float32", ("batch", "image_tokens", inner_dim)),),
            outputs=(noise_pred,),
            tolerance=1e-4,
            per_step=True,
            in_sampler=True,
        ),
        ComponentSpec(
            "vae_decoder",
            inputs=(TensorSpec("latents", "float32", ("batch", latent_channels, "latent_height", "latent_width")),),
            outputs=(TensorSpec("image", "float32", ("batch", 3, "height", "width")),),
            tolerance=1e-3,
        ),
        ComponentSpec(
            "vae_encoder",
            inputs=(TensorSpec("image", "float32", ("batch", 3, "height", "width")),),
            outputs=tuple(TensorSpec(name, "float32", ("batch", latent_channels, "latent_height", "latent_width"))
                          for name in ("latent_mean", "latent_std")),
            tolerance=1e-3,
        ),
        ComponentSpec(
            "postprocess",
            inputs=(TensorSpec("image", "float32", ("batch", 3, "height", "width")),),
            outputs=(TensorSpec("images", "uint8", ("batch", "height", "width", 3)),),
            # One step of 255 where float rounding lands on the other side of .5.
            tolerance=1.0,
            # Microseconds of work: a BLS round trip would cost more.
            in_sampler=True,
        ),
    ]
    return {s.name: s for s in specs}


def _modules():
    """The torch wrappers, defined lazily so that listing families stays light."""
    import torch

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

    return (TextEncoderPooled, TextEncoderSequence, DenoiserHead, DenoiserTail, DenoiserReuse, VaeDecoder, VaeEncoder,
            Postprocess)


def _vae_scale_factor(vae_config) -> int:
    return 2 ** (len(vae_config.block_out_channels) - 1)


@register_family
class Flux(Family):
    name = "flux"
    diffusers_pipeline = "FluxPipeline"
    capabilities = Capabilities(tasks=("text-to-image", "image-to-image"), true_cfg=True)
    sampler_assets = ("tokenizer", "tokenizer_2", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_flux",)

    # ------------------------------------------------------------------ build
    def specs(self, pipe) -> dict[str, ComponentSpec]:
        tr = pipe.transformer.config
        return _flux_specs(
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
        import torch

        pooled, sequence, head, tail, reuse, vae_decoder, vae_encoder, postprocess = _modules()
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

        head_module = head(pipe.transformer).eval()
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
        vae_scale = _vae_scale_factor(pipe.vae.config)
        return [
            ExportableComponent(specs["text_encoder"], pooled(pipe.text_encoder).eval(), {"input_ids": clip_ids}),
            ExportableComponent(
                specs["text_encoder_2"], sequence(pipe.text_encoder_2).eval(),
                {"input_ids": torch.randint(0, vocab, (batch, text_tokens), generator=gen)},
            ),
            ExportableComponent(specs["denoiser_head"], head_module, head_inputs),
            ExportableComponent(
                specs["denoiser_tail"], tail(pipe.transformer).eval(),
                {"image_hidden": image_hidden, "text_hidden": text_hidden, "temb": temb,
                 "img_ids": img_ids, "txt_ids": txt_ids},
            ),
            ExportableComponent(
                specs["denoiser_reuse"], reuse(pipe.transformer).eval(),
                {**{t.name: head_inputs[t.name] for t in specs["denoiser_reuse"].inputs if t.name in head_inputs},
                 "blocks_residual": randn(*image_hidden.shape)},
            ),
            ExportableComponent(
                specs["vae_decoder"], vae_decoder(pipe.vae).eval(),
                {"latents": randn(batch, latent_channels, lat_h, lat_w)},
            ),
            ExportableComponent(
                specs["vae_encoder"], vae_encoder(pipe.vae).eval(),
                {"image": randn(batch, 3, lat_h * vae_scale, lat_w * vae_scale).clamp(-1, 1)},
            ),
            ExportableComponent(
                specs["postprocess"], postprocess().eval(),
                {"image": randn(batch, 3, lat_h * vae_scale, lat_w * vae_scale) * 0.8},
            ),
        ]

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # FluxPipeline.__call__'s defaults; the size is default_sample_size (128) latents.
        size = 128 * _vae_scale_factor(pipe.vae.config)
        return ServedDefaults(height=size, width=size, num_inference_steps=28, guidance_scale=3.5,
                              max_sequence_length=512, max_height=2048, max_width=2048)

    def dense_attention_tokens(self, defaults: ServedDefaults) -> int:
        # Joint attention puts the T5 tokens, padded to max_sequence_length, before the image tokens.
        return defaults.max_sequence_length

    def tiny_defaults(self) -> ServedDefaults:
        return ServedDefaults(height=64, width=64, num_inference_steps=4, guidance_scale=3.5,
                              max_sequence_length=32, max_height=256, max_width=256)

    def tiny_pipeline(self):
        import diffusers
        import torch
        import transformers

        from machgen.builder.tiny import tiny_clip_tokenizer, tiny_t5_encoder, tiny_t5_tokenizer

        torch.manual_seed(0)
        clip_tok = tiny_clip_tokenizer()
        t5_tok = tiny_t5_tokenizer()
        clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, max_position_embeddings=clip_tok.model_max_length, projection_dim=32,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        ))
        t5 = tiny_t5_encoder(t5_tok)
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4, norm_num_groups=4, sample_size=64,
            use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
        )
        transformer = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            guidance_embeds=True, axes_dims_rope=(4, 6, 6),
        )
        for module in (clip, t5, vae, transformer):
            module.eval()
        return diffusers.FluxPipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                base_image_seq_len=256, max_image_seq_len=4096, shift=3.0,
            ),
            vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok,
            transformer=transformer,
        )

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
        vae_scale = _vae_scale_factor(pipe.vae.config)
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
        vae, multiple = settings["vae_scale_factor"], settings["size_multiple"]

        def pixels(default: int, largest: int) -> AxisRange:
            return AxisRange(multiple, default, largest)

        height, width = pixels(defaults.height, defaults.max_height), pixels(defaults.width, defaults.max_width)

        def scaled(size: AxisRange, factor: int) -> AxisRange:
            return AxisRange(size.min // factor, size.opt // factor, size.max // factor)

        patches_h, patches_w = scaled(height, multiple), scaled(width, multiple)
        # T5 input is always padded to max_sequence_length.
        text = defaults.max_sequence_length
        return {
            "height": height, "width": width,
            "latent_height": scaled(height, vae), "latent_width": scaled(width, vae),
            "image_tokens": AxisRange(patches_h.min * patches_w.min, patches_h.opt * patches_w.opt,
                                      patches_h.max * patches_w.max),
            "text_tokens": AxisRange(text, text, text),
        }

    # --------------------------------------------------------------- run time
    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return FluxConditioning(settings, assets_dir, run_component)


@functools.lru_cache(maxsize=16)
def _image_ids(lat_h: int, lat_w: int, rows: int, device: str):
    import torch

    ids = torch.zeros(lat_h // 2, lat_w // 2, 3)
    ids[..., 1] += torch.arange(lat_h // 2)[:, None]
    ids[..., 2] += torch.arange(lat_w // 2)[None, :]
    # Shared by every request of this size on this device: never written to.
    return ids.reshape(1, -1, 3).repeat(rows, 1, 1).to(device)


def _pack(latents):
    """FluxPipeline._pack_latents: [1, C, h, w] -> [1, h/2 * w/2, 4C] tokens of 2x2 patches."""
    _, channels, height, width = latents.shape
    latents = latents.view(1, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(1, (height // 2) * (width // 2), channels * 4)


class FluxConditioning:
    """The Flux-specific half of the sampler: prompts, latents, ids, timesteps.

    Mirrors FluxPipeline step for step (encode_prompt, prepare_latents,
    calculate_shift, _unpack_latents) so that a seed gives the same image.
    """

    def __init__(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler
        # Imported here, at model load, not at the first request: importing
        # the pipeline module pulls in transformers' processors (1.3 s).
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        self._calculate_shift = calculate_shift
        self.settings = settings
        self.run_component = run_component
        classes = settings["tokenizer_classes"]
        self.tokenizer = getattr(transformers, classes["tokenizer"]).from_pretrained(
            os.path.join(assets_dir, "tokenizer"))
        self.tokenizer_2 = getattr(transformers, classes["tokenizer_2"]).from_pretrained(
            os.path.join(assets_dir, "tokenizer_2"))
        with open(os.path.join(assets_dir, "scheduler", "scheduler_config.json")) as f:
            self.scheduler_config = json.load(f)
        self._scheduler_class = FlowMatchEulerDiscreteScheduler

    @property
    def size_multiple(self) -> int:
        return self.settings["size_multiple"]

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """FluxPipeline.encode_prompt for a list of prompts, one row each
        (torch tensors, where the text encoders left them)."""
        import numpy as np

        from machgen.ensembles.tensors import as_torch

        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.settings["clip_max_length"],
                                  truncation=True, return_tensors="np").input_ids.astype(np.int64)
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=self.settings["max_sequence_length"],
                                  truncation=True, return_tensors="np").input_ids.astype(np.int64)
        pooled = as_torch(self.run_component("text_encoder", {"input_ids": clip_ids})["pooled_prompt_embeds"])
        embeds = as_torch(self.run_component("text_encoder_2", {"input_ids": t5_ids})["prompt_embeds"])
        return {
            "encoder_hidden_states": embeds,
            "pooled_projections": pooled,
            "txt_ids": embeds.new_zeros((len(prompts), embeds.shape[1], 3)),
        }

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.settings["vae_scale_factor"]
        return 2 * (height // (factor * 2)), 2 * (width // (factor * 2))

    def initial_latents(self, seed: int, height: int, width: int, num_frames: int = 1):
        """Packed noise exactly as FluxPipeline.prepare_latents draws it (an image: one frame)."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        lat_h, lat_w = self.latent_size(height, width)
        channels = self.settings["latent_channels"]
        noise = randn_tensor((1, channels, lat_h, lat_w), generator=torch.Generator("cpu").manual_seed(seed),
                             dtype=torch.float32)
        return _pack(noise)

    def image_ids(self, height: int, width: int, rows: int = 1, device: str = "cpu"):
        """FluxPipeline's latent image ids, one copy per row; built once per
        size and device (read-only), not once per denoising step."""
        return _image_ids(*self.latent_size(height, width), rows, str(device))

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1):
        """A fresh scheduler with FluxPipeline's sigmas and resolution-dependent shift."""
        import numpy as np

        lat_h, lat_w = self.latent_size(height, width)
        image_tokens = (lat_h // 2) * (lat_w // 2)
        scheduler = self._scheduler_class.from_config(self.scheduler_config)
        cfg = scheduler.config
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if getattr(cfg, "use_flow_sigmas", False):
            sigmas = None
        mu = self._calculate_shift(image_tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        if sigmas is None:
            scheduler.set_timesteps(num_inference_steps, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def image_latents(self, image, first_step: int, seed: int, scheduler, num_frames: int = 1):
        """FluxImg2ImgPipeline's start: the schedule from ``first_step`` on,
        the image's latents sampled from the VAE encoder's distribution and
        noised to that step, drawing from one generator in the pipeline's
        order (the latent sample, then the noise)."""
        import numpy as np
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        from machgen.ensembles.tensors import as_torch

        timesteps = scheduler.timesteps[first_step:]
        scheduler.set_begin_index(first_step)
        # VaeImageProcessor.preprocess: [0, 255] -> [-1, 1], channels first.
        pixels = (image.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)[None]
        encoded = self.run_component("vae_encoder", {"image": np.ascontiguousarray(pixels)})
        mean, std = (as_torch(encoded[name]) for name in ("latent_mean", "latent_std"))
        # A CPU generator on any device, as diffusers draws it.
        generator = torch.Generator("cpu").manual_seed(seed)
        image_latents = mean + std * randn_tensor(mean.shape, generator=generator, device=mean.device,
                                                  dtype=torch.float32)
        noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        latents = scheduler.scale_noise(image_latents, timesteps[:1], noise)
        return _pack(latents), timesteps

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        """The denoiser_head inputs for one step, on the latents' device; rows follow ``conditioning``."""
        import torch

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
            inputs["guidance"] = torch.full((rows, 1), guidance_scale, device=device)
        inputs["img_ids"] = self.image_ids(height, width, rows, device)
        inputs["txt_ids"] = conditioning["txt_ids"]
        return inputs

    def decoder_latents(self, latents, height: int, width: int):
        """FluxPipeline._unpack_latents: packed tokens -> [1, C, h, w] for the VAE."""
        lat_h, lat_w = self.latent_size(height, width)
        batch, _, channels = latents.shape
        latents = latents.view(batch, lat_h // 2, lat_w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return latents.reshape(batch, channels // 4, lat_h, lat_w).contiguous()
