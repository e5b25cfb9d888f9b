"""A tiny random-weight Flux for tests: written with save_pretrained and
loaded back through the code a user's model takes."""

from __future__ import annotations

from typing import Any

from machgen.contract.specs import ServedDefaults


def tiny_flux() -> tuple[Any, ServedDefaults]:
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
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096, shift=3.0,
        ),
        vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok,
        transformer=transformer,
    )
    return pipe, ServedDefaults(height=64, width=64, num_inference_steps=4, guidance_scale=3.5,
                                max_sequence_length=32, max_height=256, max_width=256)
