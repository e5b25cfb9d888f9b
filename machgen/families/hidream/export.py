"""HiDream's build-time half: the torch wrappers each component exports, and
``HiDreamExport``.

The transformer's mixture-of-experts layers do not export as diffusers runs
them (``moe_infer`` counts tokens per expert with ``bincount().cpu()`` and
loops over the counts). During export each is replaced by ``DenseMixture``:
every routed expert on every token, weighted by the gate's top-k weights
(zero for the experts a token does not use) and summed in expert order,
which adds exactly the same terms in the same order as moe_infer. It costs
experts / active times the routed feed-forward FLOPs (2x for HiDream-I1).
"""

from __future__ import annotations

from typing import Any

import torch

from machgen.builder.family_export import ExportableComponent, FamilyExport
from machgen.contract.specs import AxisRange, ComponentSpec, ServedDefaults
from machgen.families.flux.export import Postprocess, VaeDecoder, vae_scale_factor
from machgen.families.hidream.spec import hidream_specs, used_llama_layers
from machgen.parallel.layout import ParallelSupport

# _get_clip_prompt_embeds pads CLIP input to min(max_sequence_length, this).
CLIP_MAX_TOKENS = 218


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
        # No key-value cache: nothing reads it, and the TorchScript exporter would keep its lengths as constants.
        hidden = self.decoder(input_ids, attention_mask=attention_mask, output_hidden_states=True,
                              use_cache=False).hidden_states
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
        self.slot = {layer: slot for slot, layer in enumerate(used_llama_layers(transformer.config))}
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


class HiDreamExport(FamilyExport):
    sampler_assets = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4", "scheduler")
    # Its attention calls F.scaled_dot_product_attention directly: no sparse-attention swap yet.
    attention_modules = ()
    # Under a parallel layout its attention is split (plugins/ops.dispatch_swapped reaches its SDPA calls).
    # Each rank's joint sequence is its chunk of the image tokens, of the T5 tokens and of every block's Llama
    # tokens: a reordering of the whole one, which attention does not see (each image token keeps its
    # position; text tokens all have position 0), and every block mixes tokens only in its attention.
    sequence_attention_modules = ("diffusers.models.transformers.transformer_hidream_image",)
    sequence_axes = ("image_tokens", "text_tokens", "t5_tokens", "llama_tokens")

    def check(self, pipe) -> None:
        tr = pipe.transformer.config
        if tr.num_layers < 1:
            raise ValueError("a HiDream transformer without double-stream blocks is not supported")
        if pipe.text_encoder_4 is None or pipe.tokenizer_4 is None:
            raise ValueError("HiDreamImagePipeline needs its Llama text encoder and tokenizer (text_encoder_4, "
                             "tokenizer_4) in the model folder")

    def parallel_support(self, pipe, ranges: dict[str, AxisRange]) -> ParallelSupport:
        # Guidance rows: the negative prompt's (CFG) in each denoiser call.
        return ParallelSupport(heads=pipe.transformer.config.num_attention_heads, guidance_rows=True,
                               sparse_sequence_reason="HiDream's joint attention joins each rank's image tokens, "
                                                      "then its T5 and Llama tokens, so the whole sequence after "
                                                      "the exchange is in another order than one rank's and its "
                                                      "block mask would differ (use cfg=2)")

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        self.check(pipe)
        tr = pipe.transformer.config
        patch_area = tr.patch_size * tr.patch_size
        return hidream_specs(
            pooled_dim=tr.text_emb_dim, t5_dim=pipe.text_encoder_3.config.d_model,
            llama_layers=len(used_llama_layers(tr)), llama_dim=pipe.text_encoder_4.config.hidden_size,
            inner_dim=tr.num_attention_heads * tr.attention_head_dim, patch_features=tr.in_channels * patch_area,
            out_features=(tr.out_channels or tr.in_channels) * patch_area,
            latent_channels=pipe.vae.config.latent_channels,
        )

    def components(self, pipe) -> list[ExportableComponent]:
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
        head_module = DenoiserHead(pipe.transformer).eval()
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
        vae_scale = vae_scale_factor(pipe.vae.config)
        return [
            *(ExportableComponent(specs[name], ProjectedPooled(encoder).eval(), {"input_ids": torch.randint(
                0, encoder.config.vocab_size, (batch, clip_tokens), generator=gen)})
              for name, encoder in (("text_encoder", pipe.text_encoder), ("text_encoder_2", pipe.text_encoder_2))),
            ExportableComponent(specs["text_encoder_3"], MaskedT5(pipe.text_encoder_3).eval(),
                                text_inputs(pipe.text_encoder_3, t5_tokens)),
            ExportableComponent(specs["text_encoder_4"], LlamaLayers(pipe.text_encoder_4, used_llama_layers(tr)).eval(),
                                text_inputs(pipe.text_encoder_4, llama_tokens)),
            ExportableComponent(specs["denoiser_head"], head_module, head_inputs),
            ExportableComponent(
                specs["denoiser_tail"], DenoiserTail(pipe.transformer).eval(),
                {"image_hidden": image_hidden, "text_hidden": text_hidden, "temb": temb, "image_mask": image_mask,
                 "img_ids": img_ids, "llama_embeds": head_inputs["llama_embeds"]},
            ),
            ExportableComponent(
                specs["denoiser_reuse"], DenoiserReuse(pipe.transformer).eval(),
                {"hidden_states": head_inputs["hidden_states"], "timestep": head_inputs["timestep"],
                 "pooled_embeds": head_inputs["pooled_embeds"], "blocks_residual": randn(*image_hidden.shape)},
            ),
            ExportableComponent(specs["vae_decoder"], VaeDecoder(pipe.vae).eval(),
                                {"latents": randn(batch, pipe.vae.config.latent_channels, lat_h, lat_w)}),
            ExportableComponent(specs["postprocess"], Postprocess().eval(),
                                {"image": randn(batch, 3, lat_h * vae_scale, lat_w * vae_scale) * 0.8}),
        ]

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # HiDreamImagePipeline.__call__'s defaults: 1024 x 1024 (HiDream-I1), 50 steps, CFG 5, 128 tokens.
        size = pipe.default_sample_size * vae_scale_factor(pipe.vae.config)
        return ServedDefaults(height=size, width=size, num_inference_steps=50, guidance_scale=5.0,
                              negative_prompt="", max_sequence_length=128, max_height=2 * size, max_width=2 * size)

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
        vae_scale = vae_scale_factor(pipe.vae.config)
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
            "clip_tokens": min(msl, CLIP_MAX_TOKENS),
            "t5_tokens": min(msl, pipe.tokenizer_3.model_max_length),
            "llama_tokens": min(msl, pipe.tokenizer_4.model_max_length),
            "scheduler_class": type(pipe.scheduler).__name__,
        }

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        vae, multiple, patch = settings["vae_scale_factor"], settings["size_multiple"], settings["patch_size"]
        height = AxisRange(multiple, defaults.height, defaults.max_height)
        width = AxisRange(multiple, defaults.width, defaults.max_width)

        tokens = settings["max_image_tokens"]
        clip, t5, llama = settings["clip_tokens"], settings["t5_tokens"], settings["llama_tokens"]
        return {
            "height": height, "width": width, "latent_height": height.scaled(vae), "latent_width": width.scaled(vae),
            # A square image has (side / patch)^2 tokens, at most max_seq; any other is padded to max_seq.
            "image_tokens": AxisRange((multiple // vae // patch) ** 2, tokens, tokens),
            "clip_tokens": AxisRange(clip, clip, clip), "t5_tokens": AxisRange(t5, t5, t5),
            "llama_tokens": AxisRange(llama, llama, llama),
            "text_tokens": AxisRange(t5 + llama, t5 + llama, t5 + llama),
        }
