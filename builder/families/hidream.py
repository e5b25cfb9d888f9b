"""HiDream-I1: diffusers' HiDreamImagePipeline (text-to-image).

Components, as Triton serves them:

- ``text_encoder``    CLIP with projection, input ids -> projected pooled embedding
- ``text_encoder_2``  the second CLIP with projection, the same way
- ``text_encoder_3``  T5, input ids and mask -> per-token embeddings
- ``text_encoder_4``  Llama 3.1, input ids and mask -> the hidden states of
  the layers the transformer reads (``llama_layers``, each once), batch first
- ``denoiser_head``   patch, time and pooled embeddings, the caption
  projections it needs and the first double-stream block; also outputs
  that block's image residual
- ``denoiser_tail``   the remaining double- and single-stream blocks (each
  with its Llama layer's projection) and the output layer; the prediction
  comes out negated, as HiDreamImagePipeline negates it
- ``denoiser_reuse``  patch embedding plus a kept blocks residual and the
  output layer: the prediction of a step that skips the blocks
- ``vae_decoder``, ``postprocess``: Flux's (an AutoencoderKL with shift and scale)

The transformer's mixture-of-experts layers do not export as diffusers runs
them (``moe_infer`` counts tokens per expert with ``bincount().cpu()`` and
loops over the counts). During export each is replaced by ``DenseMixture``:
every routed expert on every token, weighted by the gate's top-k weights
(zero for the experts a token does not use) and summed in expert order,
which adds exactly the same terms in the same order as moe_infer. It costs
experts / active times the routed feed-forward FLOPs (2x for HiDream-I1).

Sizes: HiDreamImagePipeline keeps only the aspect ratio of the requested
size; it renders ``(default_sample_size x VAE factor)^2`` pixels (1024 x 1024
for HiDream-I1). The served model does the same, so the image can come back
at another size than asked. Non-square images are padded to the
transformer's ``max_seq`` tokens with a mask over the padding's keys, as
diffusers does; the patches are made by the sampler, so every input of the
components is a plain tensor whose rows share one size.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Callable

from machgen.builder.families.flux import _vae_scale_factor
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
# _get_clip_prompt_embeds pads CLIP input to min(max_sequence_length, this).
_CLIP_MAX_TOKENS = 218


def _hidream_specs(*, pooled_dim: int, t5_dim: int, llama_layers: int, llama_dim: int,
                   inner_dim: int, patch_features: int, out_features: int,
                   latent_channels: int) -> dict[str, ComponentSpec]:
    latents = TensorSpec("hidden_states", "float32", ("batch", "image_tokens", patch_features))
    # 1 on the image's tokens, 0 on the padding of a non-square image.
    image_mask = TensorSpec("image_mask", "float32", ("batch", "image_tokens"))
    img_ids = TensorSpec("img_ids", "float32", ("batch", "image_tokens", 3))
    pooled = TensorSpec("pooled_embeds", "float32", ("batch", pooled_dim))
    t5 = TensorSpec("t5_embeds", "float32", ("batch", "t5_tokens", t5_dim))
    llama = TensorSpec("llama_embeds", "float32", ("batch", llama_layers, "llama_tokens", llama_dim))
    timestep = TensorSpec("timestep", "float32", _SCALAR)
    image_hidden = TensorSpec("image_hidden", "float32", ("batch", "image_tokens", inner_dim))
    # The double-stream blocks' text stream: the T5 tokens, then the last block's Llama tokens.
    text_hidden = TensorSpec("text_hidden", "float32", ("batch", "text_tokens", inner_dim))
    temb = TensorSpec("temb", "float32", ("batch", inner_dim))
    noise_pred = TensorSpec("noise_pred", "float32", ("batch", "image_tokens", out_features))
    residual = ("batch", "image_tokens", inner_dim)
    image = TensorSpec("image", "float32", ("batch", 3, "height", "width"))
    specs = [
        *(ComponentSpec(
            name,
            inputs=(TensorSpec("input_ids", "int64", ("batch", "clip_tokens")),),
            outputs=(TensorSpec("text_embeds", "float32", ("batch", pooled_dim // 2)),),
            tolerance=1e-4,
        ) for name in ("text_encoder", "text_encoder_2")),
        ComponentSpec(
            "text_encoder_3",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "t5_tokens")),
                    TensorSpec("attention_mask", "int64", ("batch", "t5_tokens"))),
            outputs=(t5,),
            tolerance=1e-4,
        ),
        ComponentSpec(
            "text_encoder_4",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "llama_tokens")),
                    TensorSpec("attention_mask", "int64", ("batch", "llama_tokens"))),
            outputs=(llama,),
            tolerance=1e-4,
        ),
        ComponentSpec(
            "denoiser_head",
            inputs=(latents, image_mask, img_ids, timestep, pooled, t5, llama),
            outputs=(image_hidden, text_hidden, temb, TensorSpec("first_block_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_tail",
            inputs=(image_hidden, text_hidden, temb, image_mask, img_ids, llama),
            outputs=(noise_pred, TensorSpec("tail_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_reuse",
            inputs=(latents, timestep, pooled, TensorSpec("blocks_residual", "float32", residual)),
            outputs=(noise_pred,),
            tolerance=1e-4,
            per_step=True,
            in_sampler=True,
        ),
        ComponentSpec(
            "vae_decoder",
            inputs=(TensorSpec("latents", "float32", ("batch", latent_channels, "latent_height", "latent_width")),),
            outputs=(image,),
            tolerance=1e-3,
        ),
        ComponentSpec(
            "postprocess",
            inputs=(image,),
            outputs=(TensorSpec("images", "uint8", ("batch", "height", "width", 3)),),
            tolerance=1.0,  # one level where float rounding lands on the other side of .5
            in_sampler=True,
        ),
    ]
    return {s.name: s for s in specs}


def _used_llama_layers(transformer_config) -> list[int]:
    """The Llama layers the transformer reads, each once, in order: what text_encoder_4 outputs."""
    return sorted(set(transformer_config.llama_layers))


def _modules():
    """The torch wrappers, defined lazily so that listing families stays light."""
    import torch

    class ProjectedPooled(torch.nn.Module):
        def __init__(self, clip):
            super().__init__()
            self.clip = clip

        def forward(self, input_ids):
            return self.clip(input_ids).text_embeds

    class MaskedT5(torch.nn.Module):
        def __init__(self, t5):
            super().__init__()
            self.t5 = t5

        def forward(self, input_ids, attention_mask):
            return self.t5(input_ids, attention_mask=attention_mask)[0]

    class LlamaLayers(torch.nn.Module):
        """_get_llama3_prompt_embeds' hidden states, only the layers used,
        batch first ([batch, layers, tokens, dim]; diffusers stacks all
        layers in front of the batch)."""

        def __init__(self, llama, layers: list[int]):
            super().__init__()
            # The decoder without the language-model head, whose logits nobody reads.
            self.decoder = llama.model
            self.layers = layers

        def forward(self, input_ids, attention_mask):
            hidden = self.decoder(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
            # hidden_states[0] is the embedding; diffusers indexes hidden_states[1:].
            return torch.stack([hidden[layer + 1] for layer in self.layers], dim=1)

    class DenseMixture(torch.nn.Module):
        """MOEFeedForwardSwiGLU at inference, in a form that exports (see the module docstring)."""

        def __init__(self, mixture):
            super().__init__()
            self.gate = mixture.gate
            self.experts = mixture.experts
            self.shared_experts = mixture.shared_experts

        def forward(self, x):
            topk_idx, topk_weight, _ = self.gate(x)
            tokens = x.reshape(-1, x.shape[-1])
            weights = torch.zeros(tokens.shape[0], len(self.experts), dtype=topk_weight.dtype, device=x.device)
            weights = weights.scatter(1, topk_idx, topk_weight)
            routed = torch.zeros_like(tokens)
            for index, expert in enumerate(self.experts):
                routed = routed + expert(tokens) * weights[:, index:index + 1]
            return routed.reshape(x.shape) + self.shared_experts(x)

    def dense_mixtures(transformer):
        """The transformer with every mixture-of-experts layer as DenseMixture
        (in place, sharing the weights; idempotent)."""
        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

        for wrapper in list(transformer.double_stream_blocks) + list(transformer.single_stream_blocks):
            if isinstance(wrapper.block.ff_i, MOEFeedForwardSwiGLU):
                wrapper.block.ff_i = DenseMixture(wrapper.block.ff_i)
        return transformer

    class _Denoiser(torch.nn.Module):
        def __init__(self, transformer):
            super().__init__()
            self.transformer = dense_mixtures(transformer)
            self.slot = {layer: slot for slot, layer in enumerate(_used_llama_layers(transformer.config))}
            self.blocks = list(transformer.double_stream_blocks) + list(transformer.single_stream_blocks)

        def llama(self, llama_embeds, block: int):
            """Block ``block``'s caption: its Llama layer through its projection."""
            tr = self.transformer
            return tr.caption_projection[block](llama_embeds[:, self.slot[tr.config.llama_layers[block]]])

        def rotary(self, img_ids, text_tokens: int):
            # Text positions are zero; the ids of all rows are equal (one shape bucket per batch).
            ids = torch.cat((img_ids, img_ids.new_zeros(img_ids.shape[0], text_tokens, 3)), dim=1)
            # rope() multiplies the positions by float64 frequencies; eager torch promotes the float32 positions,
            # an exported Einsum needs both in one type.
            return self.transformer.pe_embedder(ids.to(torch.float64))

        def time_embedding(self, timestep, pooled_embeds, dtype):
            tr = self.transformer
            return tr.t_embedder(timestep.reshape(-1), dtype) + tr.p_embedder(pooled_embeds)

        def double_block(self, block: int, image, text, mask, temb, rotary, llama_embeds):
            """One double-stream block; the text stream keeps its length (the block's Llama tokens are dropped)."""
            joint = torch.cat((text, self.llama(llama_embeds, block)), dim=1)
            image, joint = self.blocks[block](hidden_states=image, hidden_states_masks=mask,
                                              encoder_hidden_states=joint, temb=temb, image_rotary_emb=rotary)
            return image, joint[:, :text.shape[1]]

        def output(self, image, temb):
            # HiDreamImagePipeline negates the transformer's output.
            return -self.transformer.final_layer(image, temb)

    class DenoiserHead(_Denoiser):
        """HiDreamImageTransformer2DModel.forward up to and including the first double-stream block."""

        def forward(self, hidden_states, image_mask, img_ids, timestep, pooled_embeds, t5_embeds, llama_embeds):
            tr = self.transformer
            embedded = tr.x_embedder(hidden_states)
            temb = self.time_embedding(timestep, pooled_embeds, hidden_states.dtype)
            # The text stream: T5's tokens, then those of the last block's Llama layer.
            text = torch.cat((tr.caption_projection[-1](t5_embeds), self.llama(llama_embeds, len(self.blocks) - 1)),
                             dim=1)
            rotary = self.rotary(img_ids, text.shape[1] + llama_embeds.shape[2])
            image, text = self.double_block(0, embedded, text, image_mask, temb, rotary, llama_embeds)
            return image, text, temb, image - embedded

    class DenoiserTail(_Denoiser):
        """The rest of HiDreamImageTransformer2DModel.forward, its output negated."""

        def forward(self, image_hidden, text_hidden, temb, image_mask, img_ids, llama_embeds):
            tr = self.transformer
            rotary = self.rotary(img_ids, text_hidden.shape[1] + llama_embeds.shape[2])
            image, text = image_hidden, text_hidden
            doubles = len(tr.double_stream_blocks)
            for block in range(1, doubles):
                image, text = self.double_block(block, image, text, image_mask, temb, rotary, llama_embeds)
            image_tokens = image.shape[1]
            hidden = torch.cat((image, text), dim=1)
            joint_tokens = hidden.shape[1]
            mask = torch.cat((image_mask, image_mask.new_ones(image_mask.shape[0],
                                                              text.shape[1] + llama_embeds.shape[2])), dim=1)
            for block in range(doubles, len(self.blocks)):
                hidden = torch.cat((hidden, self.llama(llama_embeds, block)), dim=1)
                hidden = self.blocks[block](hidden_states=hidden, hidden_states_masks=mask,
                                            encoder_hidden_states=None, temb=temb, image_rotary_emb=rotary)
                hidden = hidden[:, :joint_tokens]
            image = hidden[:, :image_tokens]
            return self.output(image, temb), image - image_hidden

    class DenoiserReuse(_Denoiser):
        """HiDreamImageTransformer2DModel.forward with every block replaced by a kept residual."""

        def forward(self, hidden_states, timestep, pooled_embeds, blocks_residual):
            image = self.transformer.x_embedder(hidden_states) + blocks_residual
            return self.output(image, self.time_embedding(timestep, pooled_embeds, hidden_states.dtype))

    return ProjectedPooled, MaskedT5, LlamaLayers, DenoiserHead, DenoiserTail, DenoiserReuse, DenseMixture


@register_family
class HiDream(Family):
    name = "hidream"
    diffusers_pipeline = "HiDreamImagePipeline"
    capabilities = Capabilities(tasks=("text-to-image",), true_cfg=True, guidance_is_cfg=True)
    sampler_assets = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4", "scheduler")
    # Its attention calls F.scaled_dot_product_attention directly: no sparse-attention swap yet.
    attention_modules = ()

    # ------------------------------------------------------------------ build
    @staticmethod
    def _check(pipe) -> None:
        tr = pipe.transformer.config
        if tr.num_layers < 1:
            raise ValueError("a HiDream transformer without double-stream blocks is not supported")
        if pipe.text_encoder_4 is None or pipe.tokenizer_4 is None:
            raise ValueError("HiDreamImagePipeline needs its Llama text encoder and tokenizer (text_encoder_4, "
                             "tokenizer_4) in the model folder")

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        self._check(pipe)
        tr = pipe.transformer.config
        patch_area = tr.patch_size * tr.patch_size
        return _hidream_specs(
            pooled_dim=tr.text_emb_dim, t5_dim=pipe.text_encoder_3.config.d_model,
            llama_layers=len(_used_llama_layers(tr)), llama_dim=pipe.text_encoder_4.config.hidden_size,
            inner_dim=tr.num_attention_heads * tr.attention_head_dim, patch_features=tr.in_channels * patch_area,
            out_features=(tr.out_channels or tr.in_channels) * patch_area,
            latent_channels=pipe.vae.config.latent_channels,
        )

    def components(self, pipe) -> list[ExportableComponent]:
        import torch

        from machgen.builder.families.flux import _modules as flux_modules

        pooled, t5, llama, head, tail, reuse, _ = _modules()
        *_, vae_decoder, _, postprocess = flux_modules()
        specs = self.specs(pipe)
        tr = pipe.transformer.config
        # Batch 2 (batch 1 would be specialised), sizes unlike any fixed size in the model.
        batch, clip_tokens, image_tokens, t5_tokens, llama_tokens, lat_h, lat_w = 2, 9, 10, 7, 5, 6, 4
        gen = torch.Generator().manual_seed(0)
        device, dtype = pipe.transformer.device, pipe.transformer.dtype

        def randn(*shape):
            return torch.randn(*shape, generator=gen)

        def text_inputs(encoder, tokens: int) -> dict[str, torch.Tensor]:
            mask = torch.ones(batch, tokens, dtype=torch.int64)
            mask[1, tokens // 2:] = 0
            return {"input_ids": torch.randint(0, encoder.config.vocab_size, (batch, tokens), generator=gen),
                    "attention_mask": mask}

        image_mask = torch.ones(batch, image_tokens)
        image_mask[:, image_tokens - 3:] = 0  # a padded, non-square image
        img_ids = torch.zeros(batch, image_tokens, 3)
        img_ids[:, :image_tokens - 3, 1] = torch.arange(image_tokens - 3) // 2
        img_ids[:, :image_tokens - 3, 2] = torch.arange(image_tokens - 3) % 2
        head_module = head(pipe.transformer).eval()
        llama_dims = specs["text_encoder_4"].outputs[0].shape
        head_inputs = {
            "hidden_states": randn(batch, image_tokens, specs["denoiser_head"].inputs[0].shape[2]),
            "image_mask": image_mask, "img_ids": img_ids, "timestep": torch.tensor([[700.0], [300.0]]),
            "pooled_embeds": randn(batch, tr.text_emb_dim),
            "t5_embeds": randn(batch, t5_tokens, pipe.text_encoder_3.config.d_model),
            "llama_embeds": randn(batch, llama_dims[1], llama_tokens, llama_dims[3]),
        }
        with torch.no_grad():
            image_hidden, text_hidden, temb, _ = (output.cpu().float() for output in head_module(
                **{name: value.to(device, dtype) for name, value in head_inputs.items()}))
        vae_scale = _vae_scale_factor(pipe.vae.config)
        return [
            *(ExportableComponent(specs[name], pooled(encoder).eval(), {"input_ids": torch.randint(
                0, encoder.config.vocab_size, (batch, clip_tokens), generator=gen)})
              for name, encoder in (("text_encoder", pipe.text_encoder), ("text_encoder_2", pipe.text_encoder_2))),
            ExportableComponent(specs["text_encoder_3"], t5(pipe.text_encoder_3).eval(),
                                text_inputs(pipe.text_encoder_3, t5_tokens)),
            ExportableComponent(specs["text_encoder_4"], llama(pipe.text_encoder_4, _used_llama_layers(tr)).eval(),
                                text_inputs(pipe.text_encoder_4, llama_tokens)),
            ExportableComponent(specs["denoiser_head"], head_module, head_inputs),
            ExportableComponent(
                specs["denoiser_tail"], tail(pipe.transformer).eval(),
                {"image_hidden": image_hidden, "text_hidden": text_hidden, "temb": temb, "image_mask": image_mask,
                 "img_ids": img_ids, "llama_embeds": head_inputs["llama_embeds"]},
            ),
            ExportableComponent(
                specs["denoiser_reuse"], reuse(pipe.transformer).eval(),
                {"hidden_states": head_inputs["hidden_states"], "timestep": head_inputs["timestep"],
                 "pooled_embeds": head_inputs["pooled_embeds"], "blocks_residual": randn(*image_hidden.shape)},
            ),
            ExportableComponent(specs["vae_decoder"], vae_decoder(pipe.vae).eval(),
                                {"latents": randn(batch, pipe.vae.config.latent_channels, lat_h, lat_w)}),
            ExportableComponent(specs["postprocess"], postprocess().eval(),
                                {"image": randn(batch, 3, lat_h * vae_scale, lat_w * vae_scale) * 0.8}),
        ]

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # HiDreamImagePipeline.__call__'s defaults: 1024 x 1024 (HiDream-I1), 50 steps, CFG 5, 128 tokens.
        size = pipe.default_sample_size * _vae_scale_factor(pipe.vae.config)
        return ServedDefaults(height=size, width=size, num_inference_steps=50, guidance_scale=5.0,
                              negative_prompt="", max_sequence_length=128, max_height=2 * size, max_width=2 * size)

    def tiny_defaults(self) -> ServedDefaults:
        # The tiny VAE's factor is 2: the pipeline renders 256 x 256 pixels (4096 tokens).
        return ServedDefaults(height=256, width=256, num_inference_steps=4, guidance_scale=5.0, negative_prompt="",
                              max_sequence_length=16, max_height=512, max_width=512)

    def tiny_pipeline(self):
        import diffusers
        import torch
        import transformers

        from machgen.builder.tiny import (
            tiny_clip_tokenizer,
            tiny_llama_tokenizer,
            tiny_t5_encoder,
            tiny_t5_tokenizer,
        )

        torch.manual_seed(0)

        def clip(tokenizer):
            return transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=128, projection_dim=16,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            ))

        clip_tokenizer, clip_tokenizer_2, t5_tokenizer = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
        llama_tokenizer = tiny_llama_tokenizer()
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(llama_tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=llama_tokenizer.bos_token_id, eos_token_id=llama_tokenizer.eos_token_id,
        ))
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4, norm_num_groups=4, sample_size=64,
            use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
        )
        # Two double- and two single-stream blocks, four experts of which two are active (as HiDream-I1);
        # the blocks read Llama layers 2, 0, 1, 2 (one twice, as the real model's list repeats layers).
        transformer = diffusers.HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=32, num_routed_experts=4,
            num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(128, 128),
            llama_layers=[2, 0, 1, 2],
        )
        encoders = (clip(clip_tokenizer), clip(clip_tokenizer_2), tiny_t5_encoder(t5_tokenizer), llama)
        for module in (*encoders, vae, transformer):
            module.eval()
        return diffusers.HiDreamImagePipeline(
            # HiDream-I1-Full's scheduler.
            scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                        flow_shift=3.0),
            vae=vae, text_encoder=encoders[0], tokenizer=clip_tokenizer, text_encoder_2=encoders[1],
            tokenizer_2=clip_tokenizer_2, text_encoder_3=encoders[2], tokenizer_3=t5_tokenizer,
            text_encoder_4=encoders[3], tokenizer_4=llama_tokenizer, transformer=transformer,
        )

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
        vae_scale = _vae_scale_factor(pipe.vae.config)
        tr = pipe.transformer.config
        msl = defaults.max_sequence_length
        return {
            "vae_scale_factor": vae_scale,
            # HiDreamImagePipeline rounds its sizes to multiples of twice the VAE factor.
            "size_multiple": vae_scale * 2,
            # It renders this many pixels squared whatever the requested size (only the aspect ratio is kept).
            "sample_pixels": pipe.default_sample_size * vae_scale,
            "patch_size": tr.patch_size,
            "latent_channels": tr.in_channels,
            "max_image_tokens": pipe.transformer.max_seq,
            "tokenizer_classes": {name: type(getattr(pipe, name)).__name__
                                  for name in ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")},
            "clip_tokens": min(msl, _CLIP_MAX_TOKENS),
            "t5_tokens": min(msl, pipe.tokenizer_3.model_max_length),
            "llama_tokens": min(msl, pipe.tokenizer_4.model_max_length),
            "scheduler_class": type(pipe.scheduler).__name__,
        }

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        vae, multiple, patch = settings["vae_scale_factor"], settings["size_multiple"], settings["patch_size"]
        height = AxisRange(multiple, defaults.height, defaults.max_height)
        width = AxisRange(multiple, defaults.width, defaults.max_width)

        def scaled(size: AxisRange) -> AxisRange:
            return AxisRange(size.min // vae, size.opt // vae, size.max // vae)

        tokens = settings["max_image_tokens"]
        clip, t5, llama = settings["clip_tokens"], settings["t5_tokens"], settings["llama_tokens"]
        return {
            "height": height, "width": width, "latent_height": scaled(height), "latent_width": scaled(width),
            # A square image has (side / patch)^2 tokens, at most max_seq; any other is padded to max_seq.
            "image_tokens": AxisRange((multiple // vae // patch) ** 2, tokens, tokens),
            "clip_tokens": AxisRange(clip, clip, clip), "t5_tokens": AxisRange(t5, t5, t5), "llama_tokens": AxisRange(llama, llama, llama),
            "text_tokens": AxisRange(t5 + llama, t5 + llama, t5 + llama),
        }

    # --------------------------------------------------------------- run time
    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return HiDreamConditioning(settings, assets_dir, run_component)


@functools.lru_cache(maxsize=16)
def _image_layout(patches_h: int, patches_w: int, tokens: int, rows: int, device: str):
    """(mask, ids) of an image of patches_h x patches_w patches in ``tokens``
    tokens (zero past the image), one copy per row; shared, never written to."""
    import torch

    mask = torch.zeros(rows, tokens)
    mask[:, :patches_h * patches_w] = 1.0
    ids = torch.zeros(patches_h, patches_w, 3)
    ids[..., 1] += torch.arange(patches_h)[:, None]
    ids[..., 2] += torch.arange(patches_w)[None, :]
    padded = torch.zeros(rows, tokens, 3)
    padded[:, :patches_h * patches_w] = ids.reshape(1, -1, 3)
    return mask.to(device), padded.to(device)


class HiDreamConditioning:
    """The HiDream-specific half of the sampler: size, prompts, patches, timesteps.

    Mirrors HiDreamImagePipeline step for step (the size it renders,
    encode_prompt with its four encoders, prepare_latents, the transformer's
    patchify and unpatchify, retrieve_timesteps) so that a seed gives the
    same image.
    """

    def __init__(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        import diffusers
        import transformers
        # Imported at model load, not at the first request.
        from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift, retrieve_timesteps

        self._calculate_shift = calculate_shift
        self._retrieve_timesteps = retrieve_timesteps
        self.settings = settings
        self.run_component = run_component
        self.tokenizers = {
            name: getattr(transformers, class_name).from_pretrained(os.path.join(assets_dir, name))
            for name, class_name in settings["tokenizer_classes"].items()
        }
        # HiDreamImagePipeline.__init__ pads Llama's input with its end-of-text token.
        self.tokenizers["tokenizer_4"].pad_token = self.tokenizers["tokenizer_4"].eos_token
        with open(os.path.join(assets_dir, "scheduler", "scheduler_config.json")) as f:
            self.scheduler_config = json.load(f)
        self._scheduler_class = getattr(diffusers, settings["scheduler_class"])
        self._unipc = diffusers.UniPCMultistepScheduler

    @property
    def size_multiple(self) -> int:
        return self.settings["size_multiple"]

    def rendered_size(self, height: int, width: int) -> tuple[int, int]:
        """The size HiDreamImagePipeline renders for a requested one: the
        aspect ratio kept, the area that of its default size, rounded down to
        its multiple (the same float arithmetic as the pipeline)."""
        division = self.settings["size_multiple"]
        scale = math.sqrt(self.settings["sample_pixels"] ** 2 / (width * height))
        return int(height * scale // division * division), int(width * scale // division * division)

    def _tokens(self, name: str, prompts: list[str], length: int) -> dict[str, Any]:
        import numpy as np

        encoded = self.tokenizers[name](prompts, padding="max_length", max_length=length, truncation=True,
                                        add_special_tokens=True, return_tensors="np")
        return {"input_ids": encoded.input_ids.astype(np.int64),
                "attention_mask": encoded.attention_mask.astype(np.int64)}

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """HiDreamImagePipeline.encode_prompt for a list of prompts, one row each."""
        import torch

        from machgen.ensembles.tensors import as_torch

        settings = self.settings
        pooled = [as_torch(self.run_component(encoder, {"input_ids": self._tokens(
            tokenizer, prompts, settings["clip_tokens"])["input_ids"]})["text_embeds"])
            for encoder, tokenizer in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))]
        t5 = self.run_component("text_encoder_3", self._tokens("tokenizer_3", prompts, settings["t5_tokens"]))
        llama = self.run_component("text_encoder_4", self._tokens("tokenizer_4", prompts, settings["llama_tokens"]))
        return {"pooled_embeds": torch.cat(pooled, dim=-1), "t5_embeds": as_torch(t5["t5_embeds"]),
                "llama_embeds": as_torch(llama["llama_embeds"])}

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

    def initial_latents(self, seed: int, height: int, width: int, num_frames: int = 1):
        """Noise exactly as HiDreamImagePipeline.prepare_latents draws it, in
        the transformer's patches: [1, tokens, patch x patch x C]."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        lat_h, lat_w = self.latent_size(height, width)
        rows, columns, tokens = self._patches(height, width)
        patch, channels = self.settings["patch_size"], self.settings["latent_channels"]
        noise = randn_tensor((1, channels, lat_h, lat_w), generator=torch.Generator("cpu").manual_seed(seed),
                             dtype=torch.float32)
        # HiDreamImageTransformer2DModel.patchify's layout: (patch row, patch column, channel) per token.
        patches = noise.reshape(1, channels, rows, patch, columns, patch).permute(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(1, rows * columns, patch * patch * channels)
        return torch.nn.functional.pad(patches, (0, 0, 0, tokens - rows * columns))

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1):
        """A fresh scheduler set as HiDreamImagePipeline sets it (UniPC: plain; otherwise the shift of max_seq)."""
        scheduler = self._scheduler_class.from_config(self.scheduler_config)
        if isinstance(scheduler, self._unipc):
            scheduler.set_timesteps(num_inference_steps)
        else:
            self._retrieve_timesteps(scheduler, num_inference_steps, "cpu",
                                     mu=self._calculate_shift(self.settings["max_image_tokens"]))
        scheduler.set_begin_index(0)
        return scheduler

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        import torch

        rows = conditioning["t5_embeds"].shape[0]
        device = latents.device
        patch_rows, patch_columns, tokens = self._patches(height, width)
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

    def decoder_latents(self, latents, height: int, width: int):
        """HiDreamImageTransformer2DModel.unpatchify of the image's tokens: [1, C, h, w] for the VAE."""
        rows, columns, _ = self._patches(height, width)
        patch = self.settings["patch_size"]
        channels = latents.shape[-1] // (patch * patch)
        image = latents[:, :rows * columns].reshape(1, rows, columns, patch, patch, channels)
        return image.permute(0, 5, 1, 3, 2, 4).reshape(1, channels, rows * patch, columns * patch).contiguous()
