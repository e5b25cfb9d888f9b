"""A tiny random-weight HiDream-I1 for tests."""

from __future__ import annotations

from typing import Any

from machgen.contract.specs import ServedDefaults


def tiny_hidream() -> tuple[Any, ServedDefaults]:
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
    pipe = diffusers.HiDreamImagePipeline(
        # HiDream-I1-Full's scheduler.
        scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                    flow_shift=3.0),
        vae=vae, text_encoder=encoders[0], tokenizer=clip_tokenizer, text_encoder_2=encoders[1],
        tokenizer_2=clip_tokenizer_2, text_encoder_3=encoders[2], tokenizer_3=t5_tokenizer,
        text_encoder_4=encoders[3], tokenizer_4=llama_tokenizer, transformer=transformer,
    )
    # The tiny VAE's factor is 2: the pipeline renders 256 x 256 pixels (4096 tokens).
    return pipe, ServedDefaults(height=256, width=256, num_inference_steps=4, guidance_scale=5.0, negative_prompt="",
                                max_sequence_length=16, max_height=512, max_width=512)
