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

from machgen.contract.specs import Capabilities, ComponentSpec, TensorSpec
from machgen.families.registry import Family, register_family

LTX = register_family(Family(
    name="ltx",
    diffusers_pipeline="LTXPipeline",
    capabilities=Capabilities(tasks=("text-to-video",), guidance_is_cfg=True),
    runtime="machgen.families.ltx.runtime:LtxRuntime",
    export="machgen.families.ltx.export:LtxExport",
    tiny="machgen.families.ltx.tiny:tiny_ltx",
))
LTX_I2V = register_family(Family(
    name="ltx-i2v",
    diffusers_pipeline="LTXImageToVideoPipeline",
    capabilities=Capabilities(tasks=("image-to-video",), guidance_is_cfg=True),
    runtime="machgen.families.ltx.runtime:LtxImageToVideoRuntime",
    export="machgen.families.ltx.export:LtxExport",
    tiny="machgen.families.ltx.tiny:tiny_ltx_i2v",
))

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


def ltx_specs(*, text_dim: int, inner_dim: int, in_channels: int, out_channels: int, latent_channels: int,
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
