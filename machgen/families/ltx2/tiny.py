"""Tiny random-weight LTX-2 pipelines for tests: LTX-2.3's layout at toy
size (gated attention, cross-attention and prompt modulation, perturbable
self-attention for STG, per-modality connector projections; Gemma 3 of two
layers)."""

from __future__ import annotations

from typing import Any

from machgen.contract.specs import ServedDefaults


def _tiny(pipeline_class: str) -> tuple[Any, ServedDefaults]:
    import diffusers
    import torch
    import transformers
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from machgen.builder.tiny import tiny_gemma_tokenizer

    torch.manual_seed(0)
    tokenizer = tiny_gemma_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
                sliding_window=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=16, patch_size=8)
    text_encoder = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    transformer = diffusers.LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=16, rope_double_precision=False,
        rope_type="split", gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
        audio_cross_attn_mod=True, perturbed_attn=True, use_prompt_embeddings=False)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, per_modality_projections=True, video_hidden_dim=16,
        audio_hidden_dim=8, video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None, video_gated_attn=True,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, audio_gated_attn=True, connector_rope_base_seq_len=32,
        rope_double_precision=False, rope_type="split")
    vae = diffusers.AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False)
    audio_vae = diffusers.AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    vocoder = LTX2Vocoder(in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    for module in (text_encoder, transformer, connectors, vae, audio_vae, vocoder):
        module.eval()
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
        vocoder=vocoder)
    # Spatio-temporal guidance on the tiny model's last block (the pipeline's block 28 is past its two).
    return pipe, ServedDefaults(height=32, width=32, num_inference_steps=4, guidance_scale=3.0, negative_prompt="",
                                max_sequence_length=16, max_height=64, max_width=64, num_frames=5, max_frames=9,
                                fps=25, family_inputs={"stg_blocks": [1]})


def tiny_ltx2() -> tuple[Any, ServedDefaults]:
    return _tiny("LTX2Pipeline")


def tiny_ltx2_i2v() -> tuple[Any, ServedDefaults]:
    return _tiny("LTX2ImageToVideoPipeline")
