"""A tiny random-weight Wan 2.2 TI2V-5B for tests: its layout (one
transformer of 48 latent channels, a timestep per token; the Wan 2.2 VAE
with residual blocks and a 2x2 patchified layout) at toy size."""

from __future__ import annotations

from typing import Any

from machgen.contract.specs import ServedDefaults


def tiny_wan_ti2v() -> tuple[Any, ServedDefaults]:
    import diffusers
    import torch

    from machgen.builder.tiny import tiny_t5_encoder, tiny_t5_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_t5_tokenizer()
    text_encoder = tiny_t5_encoder(tokenizer, "UMT5EncoderModel")
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, decoder_base_dim=12, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[0.05 * (i % 5 - 2) for i in range(48)], latents_std=[1.0 + 0.1 * (i % 7) for i in range(48)])
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    for module in (text_encoder, vae, transformer):
        module.eval()
    pipe = diffusers.WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, transformer_2=None,
        scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                    flow_shift=5.0),
        boundary_ratio=None, expand_timesteps=True)
    return pipe, ServedDefaults(height=64, width=64, num_inference_steps=4, guidance_scale=5.0, negative_prompt="",
                                max_sequence_length=16, max_height=128, max_width=128, num_frames=9, max_frames=17,
                                fps=24)
