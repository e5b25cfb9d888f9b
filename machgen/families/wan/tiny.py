"""Tiny random-weight Wan pipelines for tests: Wan 2.2's layout (two experts)
for text- and image-to-video, Wan2.1-VACE's (one transformer) for VACE."""

from __future__ import annotations

from typing import Any

from machgen.contract.specs import ServedDefaults

TINY_DEFAULTS = ServedDefaults(height=48, width=32, num_inference_steps=4, guidance_scale=5.0, negative_prompt="",
                               max_sequence_length=16, max_height=96, max_width=96, num_frames=9, max_frames=17,
                               fps=16)


def tiny_transformer(in_channels: int = 16):
    import diffusers

    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )


def tiny_vace_transformer():
    import diffusers
    import torch

    # Control latents: the empty video's twice (16 + 16 channels) and the 8 x 8 mask of each latent pixel.
    transformer = diffusers.WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=96,
    )
    # At their initial scale the control branch's hints move the frames by a level or two: louder, so that
    # the parity tests see every reference's latents.
    with torch.no_grad():
        transformer.vace_patch_embedding.weight.mul_(10)
        for block in transformer.vace_blocks:
            block.proj_out.weight.mul_(4)
    return transformer


def tiny_text_encoder_and_vae():
    """(tokenizer, UMT5 encoder, Wan 2.1's VAE) at toy size."""
    import diffusers

    from machgen.builder.tiny import tiny_t5_encoder, tiny_t5_tokenizer

    tokenizer = tiny_t5_tokenizer()
    text_encoder = tiny_t5_encoder(tokenizer, "UMT5EncoderModel")
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
    return tokenizer, text_encoder, vae


def _pipeline(pipeline_class: str, make_transformer, boundary_ratio: float | None) -> tuple[Any, ServedDefaults]:
    """``boundary_ratio``: the share of the schedule at which Wan 2.2's
    low-noise expert takes over (None: one transformer, as Wan 2.1)."""
    import diffusers
    import torch

    torch.manual_seed(0)
    tokenizer, text_encoder, vae = tiny_text_encoder_and_vae()
    high_noise = make_transformer()
    low_noise = None if boundary_ratio is None else make_transformer()
    for module in (text_encoder, vae, high_noise, low_noise):
        if module is not None:
            module.eval()
    pipe = getattr(diffusers, pipeline_class)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
        scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                    flow_shift=3.0),
        transformer=high_noise, transformer_2=low_noise, boundary_ratio=boundary_ratio,
    )
    return pipe, TINY_DEFAULTS


def tiny_wan() -> tuple[Any, ServedDefaults]:
    return _pipeline("WanPipeline", tiny_transformer, 0.875)


def tiny_wan_i2v() -> tuple[Any, ServedDefaults]:
    # The noisy latents, then the first-frame mask (4 channels) and the picture's latents.
    return _pipeline("WanImageToVideoPipeline", lambda: tiny_transformer(in_channels=36), 0.9)


def tiny_wan_vace() -> tuple[Any, ServedDefaults]:
    return _pipeline("WanVACEPipeline", tiny_vace_transformer, None)


# Its streaming mode: chunks of 2 latent frames in 3 steps, a sink of one chunk and a window of two, two actions.
TINY_STREAMING = {"chunk_frames": 2, "timesteps": [1000, 750, 500], "sink_frames": 2, "window_frames": 4,
                  "max_frames": 64, "actions": {"left": "a red circle moves to the left",
                                                "right": "a red circle moves to the right"}}


def tiny_wan_streaming() -> tuple[Any, ServedDefaults, dict]:
    """Wan 2.1's layout (one transformer), as Self-Forcing's, with a streaming mode (realtime sessions)."""
    return (*_pipeline("WanPipeline", tiny_transformer, None), TINY_STREAMING)
