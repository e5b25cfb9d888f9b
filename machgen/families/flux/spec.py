"""Flux (FLUX.1 and Flux-architecture models): diffusers' FluxPipeline and
FluxImg2ImgPipeline, served as one family (text-to-image and image-to-image).

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

from machgen.contract.specs import Capabilities, ComponentSpec, TensorSpec
from machgen.families.registry import Family, register_family

FLUX = register_family(Family(
    name="flux",
    diffusers_pipeline="FluxPipeline",
    capabilities=Capabilities(tasks=("text-to-image", "image-to-image")),
    runtime="machgen.families.flux.runtime:FluxRuntime",
    export="machgen.families.flux.export:FluxExport",
    tiny="machgen.families.flux.tiny:tiny_flux",
))

# Batched scalars travel as [batch, 1]: Triton needs one dimension past the batch.
_SCALAR = ("batch", 1)


def flux_specs(*, clip_length: int, pooled_dim: int, t5_dim: int, joint_dim: int, inner_dim: int,
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
