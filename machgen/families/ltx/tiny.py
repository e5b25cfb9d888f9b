"""Tiny random-weight LTX-Video pipelines for tests."""

from __future__ import annotations

from typing import Any

from machgen.contract.specs import ServedDefaults


def _tiny(pipeline_class: str) -> tuple[Any, ServedDefaults]:
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
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, transformer=transformer,
    )
    return pipe, ServedDefaults(height=32, width=64, num_inference_steps=4, guidance_scale=3.0, negative_prompt="",
                                max_sequence_length=16, max_height=128, max_width=128, num_frames=9, max_frames=17,
                                fps=25)


def tiny_ltx() -> tuple[Any, ServedDefaults]:
    return _tiny("LTXPipeline")


def tiny_ltx_i2v() -> tuple[Any, ServedDefaults]:
    return _tiny("LTXImageToVideoPipeline")
