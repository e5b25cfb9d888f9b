"""Wan (Wan 2.1 and Wan 2.2): diffusers' WanPipeline (text-to-video, with
Wan 2.2's two experts), WanImageToVideoPipeline without an image encoder
(``wan-i2v``: Wan 2.2 image-to-video) and WanVACEPipeline with reference
images (``wan-vace``).

Components, as Triton serves them:

- ``text_encoder``        UMT5, input ids and mask -> per-token embeddings,
  zero past the prompt's end (WanPipeline trims and pads them so)
- ``denoiser_head``       patch embedding, time and text embeddings and the
  first transformer block; also outputs that block's residual
- ``denoiser_tail``       the remaining blocks, output norm, projection and
  unpatchify; reads only the shape of the latents it is also given (rotary
  embedding, unpatchify)
- ``denoiser_reuse``      patch embedding plus a kept blocks residual, output
  norm, projection: the prediction of a step that skips the blocks
- ``denoiser_2_*``        the same three for Wan 2.2's low-noise expert
  (``transformer_2``), used below the boundary timestep
- ``vae_decoder_first``   the first latent frame -> the first video frame and
  the decoder's causal cache (flattened into one tensor per row)
- ``vae_decoder_next``    one more latent frame and the cache -> the next
  four frames and the updated cache
- ``vae_encoder_first``, ``vae_encoder_next``: the encoder, chunked the same
  way (image- and reference-to-video)
- ``postprocess``         frames in [-1, 1] -> uint8 [frames, H, W, 3]

The video is decoded latent frame by latent frame, each chunk turned into
uint8 frames at once, so memory stays that of one chunk whatever the length
(AutoencoderKLWan.decode walks the frames the same way, keeping the whole
float video). Concurrent requests of one size batch each decoder call.
"""

from __future__ import annotations

from machgen.contract.api import ApiTensor, FamilyInput
from machgen.contract.specs import Capabilities, ComponentSpec, TensorSpec
from machgen.contract.validation import InvalidArgument, guidance_scale_input
from machgen.families.registry import Family, register_family

# Wan 2.2's low-noise expert answers under this component prefix.
EXPERT_PREFIXES = ("denoiser", "denoiser_2")


def _second_expert_scale(field: str, value, settings) -> float:
    if settings["experts"] < 2:
        raise InvalidArgument(field, "this model has one denoiser, not two experts")
    return guidance_scale_input(field, value)


# Every Wan model takes it; one with a single denoiser refuses it.
GUIDANCE_SCALE_2 = FamilyInput(
    ApiTensor("guidance_scale_2", "FP32", (1,), "Wan 2.2 (two experts): the low-noise expert's classifier-free "
                                                "guidance scale; a one-denoiser model refuses it"),
    default=None, parse=_second_expert_scale, default_doc="`guidance_scale`")

WAN = register_family(Family(
    name="wan",
    diffusers_pipeline="WanPipeline",
    capabilities=Capabilities(tasks=("text-to-video",), guidance_is_cfg=True),
    runtime="machgen.families.wan.runtime:WanRuntime",
    export="machgen.families.wan.export:WanExport",
    tiny="machgen.families.wan.tiny:tiny_wan",
    inputs=(GUIDANCE_SCALE_2,),
    tiny_streaming="machgen.families.wan.tiny:tiny_wan_streaming",
))
WAN_I2V = register_family(Family(
    name="wan-i2v",
    diffusers_pipeline="WanImageToVideoPipeline",
    capabilities=Capabilities(tasks=("image-to-video",), guidance_is_cfg=True),
    runtime="machgen.families.wan.runtime:WanImageToVideoRuntime",
    export="machgen.families.wan.export:WanImageToVideoExport",
    tiny="machgen.families.wan.tiny:tiny_wan_i2v",
    inputs=(GUIDANCE_SCALE_2,),
))
WAN_VACE = register_family(Family(
    name="wan-vace",
    diffusers_pipeline="WanVACEPipeline",
    capabilities=Capabilities(tasks=("text-to-video", "reference-to-video"), guidance_is_cfg=True),
    runtime="machgen.families.wan.runtime:WanVaceRuntime",
    export="machgen.families.wan.export:WanVaceExport",
    tiny="machgen.families.wan.tiny:tiny_wan_vace",
    inputs=(GUIDANCE_SCALE_2,),
))

_SCALAR = ("batch", 1)


def denoiser_specs(prefix: str, *, in_channels: int, out_channels: int, text_dim: int, inner_dim: int,
                   control_channels: int | None) -> list[ComponentSpec]:
    video = ("latent_frames", "latent_height", "latent_width")
    # Image-to-video: the noisy latents, then the mask and the image's latents (in_channels > out_channels).
    latents = TensorSpec("hidden_states", "float32", ("batch", in_channels, *video))
    video_hidden = TensorSpec("image_hidden", "float32", ("batch", "video_tokens", inner_dim))
    text_hidden = TensorSpec("text_hidden", "float32", ("batch", "text_tokens", inner_dim))
    timestep_proj = TensorSpec("timestep_proj", "float32", ("batch", 6, inner_dim))
    temb = TensorSpec("temb", "float32", ("batch", inner_dim))
    timestep = TensorSpec("timestep", "float32", _SCALAR)
    noise_pred = TensorSpec("noise_pred", "float32", ("batch", out_channels, *video))
    residual = ("batch", "video_tokens", inner_dim)
    # VACE (reference-to-video): the control latents in, and the control stream after its first block between.
    control_in, control_between = ((), ()) if control_channels is None else (
        (TensorSpec("control_hidden_states", "float32", ("batch", control_channels, *video)),),
        (TensorSpec("control_hidden", "float32", residual),))
    return [
        ComponentSpec(
            f"{prefix}_head",
            inputs=(latents, timestep,
                    TensorSpec("encoder_hidden_states", "float32", ("batch", "text_tokens", text_dim)))
            + control_in,
            outputs=(video_hidden, text_hidden, timestep_proj, temb,
                     TensorSpec("first_block_residual", "float32", residual)) + control_between,
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            f"{prefix}_tail",
            inputs=(video_hidden, text_hidden, timestep_proj, temb, latents) + control_between,
            outputs=(noise_pred, TensorSpec("tail_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            f"{prefix}_reuse",
            inputs=(latents, timestep, TensorSpec("blocks_residual", "float32", residual)),
            outputs=(noise_pred,),
            tolerance=1e-4,
            per_step=True,
            in_sampler=True,
        ),
    ]


def chunk_specs(latent_channels: int, temporal_factor: int, coder: str) -> list[ComponentSpec]:
    """``vae_<coder>_first`` and ``vae_<coder>_next``: the VAE's decoder (or
    encoder) one chunk at a time, its causal cache a flat tensor per row."""
    latents = TensorSpec("latents", "float32", ("batch", latent_channels, 1, "latent_height", "latent_width"))

    def frames(count: int) -> TensorSpec:
        return TensorSpec("frames", "float32", ("batch", 3, count, "height", "width"))

    cache = TensorSpec(f"{coder}_cache", "float32", ("batch", f"{coder}_cache"))
    updated = TensorSpec("updated_cache", "float32", cache.shape)
    (first_in, first_out), (next_in, next_out) = (
        ((latents, frames(1)), (latents, frames(temporal_factor))) if coder == "decoder"
        else ((frames(1), latents), (frames(temporal_factor), latents)))
    return [
        ComponentSpec(f"vae_{coder}_first", inputs=(first_in,), outputs=(first_out, cache), tolerance=1e-3),
        # Called once per chunk, like a denoising step.
        ComponentSpec(f"vae_{coder}_next", inputs=(next_in, cache), outputs=(next_out, updated), tolerance=1e-3,
                      per_step=True),
    ]


def streaming_spec(*, in_channels: int, out_channels: int, text_dim: int, layers: int, heads: int, head_dim: int,
                   chunk_frames: int) -> ComponentSpec:
    """``streaming_denoiser``: one chunk of each row's realtime session after its cached keys and values
    (families/wan/streaming.py); run in the sampler's process, which holds the caches."""
    chunk = (chunk_frames, "latent_height", "latent_width")
    cache = ("batch", layers, "cache_tokens", heads, head_dim)
    own = ("batch", layers, "chunk_tokens", heads, head_dim)
    return ComponentSpec(
        "streaming_denoiser",
        inputs=(TensorSpec("hidden_states", "float32", ("batch", in_channels, *chunk)),
                TensorSpec("timestep", "float32", _SCALAR),
                TensorSpec("frame_offset", "int64", ("batch",)),
                TensorSpec("encoder_hidden_states", "float32", ("batch", "text_tokens", text_dim)),
                TensorSpec("past_keys", "float32", cache), TensorSpec("past_values", "float32", cache),
                TensorSpec("past_valid", "float32", ("batch", "cache_tokens"))),
        outputs=(TensorSpec("noise_pred", "float32", ("batch", out_channels, *chunk)),
                 TensorSpec("chunk_keys", "float32", own), TensorSpec("chunk_values", "float32", own)),
        tolerance=1e-4,
        per_step=True,
        in_sampler=True,
    )


def wan_specs(*, in_channels: int, out_channels: int, text_dim: int, inner_dim: int, experts: int,
              temporal_factor: int, vae_encoder: bool, control_channels: int | None) -> dict[str, ComponentSpec]:
    specs = [
        ComponentSpec(
            "text_encoder",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "text_tokens")),
                    TensorSpec("attention_mask", "int64", ("batch", "text_tokens"))),
            outputs=(TensorSpec("prompt_embeds", "float32", ("batch", "text_tokens", text_dim)),),
            tolerance=1e-4,
        ),
    ]
    for prefix in EXPERT_PREFIXES[:experts]:
        specs += denoiser_specs(prefix, in_channels=in_channels, out_channels=out_channels, text_dim=text_dim,
                                 inner_dim=inner_dim, control_channels=control_channels)
    specs += chunk_specs(out_channels, temporal_factor, "decoder")
    if vae_encoder:
        specs += chunk_specs(out_channels, temporal_factor, "encoder")
    specs.append(ComponentSpec(
        "postprocess",
        inputs=(TensorSpec("frames", "float32", ("batch", 3, "frames", "height", "width")),),
        outputs=(TensorSpec("images", "uint8", ("batch", "frames", "height", "width", 3)),),
        tolerance=1.0,  # one step of 255 where rounding lands on the other side of .5
        in_sampler=True,
    ))
    return {s.name: s for s in specs}
