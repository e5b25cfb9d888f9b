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

Sizes: HiDreamImagePipeline keeps only the aspect ratio of the requested
size; it renders ``(default_sample_size x VAE factor)^2`` pixels (1024 x 1024
for HiDream-I1). The served model does the same, so the image can come back
at another size than asked. Non-square images are padded to the
transformer's ``max_seq`` tokens with a mask over the padding's keys, as
diffusers does; the patches are made by the sampler, so every input of the
components is a plain tensor whose rows share one size.
"""

from __future__ import annotations

from machgen.contract.specs import Capabilities, ComponentSpec, TensorSpec
from machgen.families.registry import Family, register_family

HIDREAM = register_family(Family(
    name="hidream",
    diffusers_pipeline="HiDreamImagePipeline",
    capabilities=Capabilities(tasks=("text-to-image",), guidance_is_cfg=True),
    runtime="machgen.families.hidream.runtime:HiDreamRuntime",
    export="machgen.families.hidream.export:HiDreamExport",
    tiny="machgen.families.hidream.tiny:tiny_hidream",
))
_SCALAR = ("batch", 1)


def hidream_specs(*, pooled_dim: int, t5_dim: int, llama_layers: int, llama_dim: int,
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


def used_llama_layers(transformer_config) -> list[int]:
    """The Llama layers the transformer reads, each once, in order: what text_encoder_4 outputs."""
    return sorted(set(transformer_config.llama_layers))
