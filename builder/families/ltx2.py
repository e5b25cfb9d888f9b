"""LTX-2: diffusers' LTX2Pipeline (text-to-video with its sound track) and
LTX2ImageToVideoPipeline (``ltx2-i2v``: image-to-video, which adds
``vae_encoder`` and takes a timestep per video token).

One transformer denoises two streams together, the video's latent tokens
and the sound's (a latent mel spectrogram), which attend to each other in
every block. Components, as Triton serves them:

- ``text_encoder``    Gemma 3 (every layer's hidden states) and the text
  connectors in one graph: input ids and mask -> the video's and the
  sound's text embeddings and the connectors' mask
- ``denoiser_head``   both streams' input projections, the timestep,
  prompt and cross-modal modulations, the rotary embeddings and the first
  block; also outputs that block's residual
- ``denoiser_tail``   the remaining blocks and both output layers
- ``denoiser_reuse``  input projections plus a kept blocks residual, output
  layers: the prediction of a step that skips the blocks
- ``vae_decoder``     video latents -> every frame in [-1, 1], in one call
  (the decoder is not causal, as LTX-Video's)
- ``audio_decoder``   the sound's latents -> mel spectrogram (audio VAE) ->
  waveform (vocoder), [channels, samples]
- ``postprocess``     frames in [-1, 1] -> uint8 [frames, H, W, 3]

The sampler's latents are both streams' packed latents side by side in one
flat row per request, [1, video tokens x channels + sound tokens x
channels]: the pipeline steps its two schedulers with the same sigmas, and
FlowMatchEuler's step is elementwise, so one scheduler over the row is the
same. Predictions and the kept residuals are packed the same way.

Guidance, as LTX2Pipeline: classifier-free (a negative-prompt row),
spatio-temporal (a row whose self-attention in ``stg_blocks`` is replaced
by its values), modality isolation (a row without the audio-video
cross-attention), combined in x0 space with the guidance rescale, each
with the sound's own scales. The pipeline makes one to three transformer
calls per step; here every row it needs is one batch of one call: each row
carries its perturbation mask per block and its cross-modal mask (both
exact: a perturbed self-attention's lerp to its values, a cross-attention
output times 0).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

from machgen.builder.families.ltx import LtxConditioning, whole_video_decoder_specs
from machgen.builder.registry import (
    AxisRange,
    Capabilities,
    ComponentSpec,
    ExportableComponent,
    Family,
    ServedDefaults,
    TensorSpec,
    register_family,
)

# LTX2Pipeline.__call__'s guidance defaults (the LTX-2.3 recipe), by API input.
PIPELINE_GUIDANCE = {"stg_scale": 1.0, "stg_blocks": [28], "modality_scale": 3.0, "guidance_rescale": 0.7,
                     "audio_guidance_scale": 7.0, "audio_stg_scale": 1.0, "audio_modality_scale": 3.0,
                     "audio_guidance_rescale": 0.7}
# The rows a step runs, by what each pass is for; the first is always the prompt's.
CONDITIONAL, UNCONDITIONAL, PERTURBED, ISOLATED = "conditional", "unconditional", "perturbed", "isolated"
# The rotary position modules' settings the sampler rebuilds them from (they hold no weights).
_ROPE_FIELDS = ("dim", "patch_size", "patch_size_t", "base_num_frames", "base_height", "base_width",
                "sampling_rate", "hop_length", "scale_factors", "theta", "causal_offset", "modality",
                "double_precision", "rope_type", "num_attention_heads")


def _ltx2_specs(*, video_text_dim: int, audio_text_dim: int, inner_dim: int, audio_inner_dim: int,
                in_channels: int, audio_channels: int, layers: int, latent_channels: int,
                audio_latent_channels: int, sound_channels: int,
                image_to_video: bool) -> dict[str, ComponentSpec]:
    latents = TensorSpec("hidden_states", "float32", ("batch", "video_tokens", in_channels))
    audio_latents = TensorSpec("audio_hidden_states", "float32", ("batch", "audio_tokens", audio_channels))
    text = TensorSpec("encoder_hidden_states", "float32", ("batch", "text_tokens", video_text_dim))
    audio_text = TensorSpec("audio_encoder_hidden_states", "float32", ("batch", "text_tokens", audio_text_dim))
    mask = TensorSpec("encoder_attention_mask", "float32", ("batch", "text_tokens"))
    timestep = TensorSpec("timestep", "float32", ("batch", 1))
    video_coords = TensorSpec("video_coords", "float32", ("batch", 3, "video_tokens", 2))
    audio_coords = TensorSpec("audio_coords", "float32", ("batch", 1, "audio_tokens", 2))
    # 1: the block's self-attention as usual; 0: replaced by its values (spatio-temporal guidance).
    perturbation = TensorSpec("perturbation_mask", "float32", ("batch", layers))
    # 1: the audio-video cross-attention as usual; 0: left out (modality isolation guidance).
    cross_modal = TensorSpec("cross_modal_mask", "float32", ("batch", 1))
    video_hidden = TensorSpec("video_hidden", "float32", ("batch", "video_tokens", inner_dim))
    audio_hidden = TensorSpec("audio_hidden", "float32", ("batch", "audio_tokens", audio_inner_dim))
    residual = ("batch", "packed_hidden")
    noise_pred = TensorSpec("noise_pred", "float32", ("batch", "packed_latents"))
    step_inputs = (text, audio_text, mask, timestep, video_coords, audio_coords, perturbation, cross_modal)
    timesteps = (timestep,)
    if image_to_video:
        # A timestep per video token (0 on the first frame's, which hold the picture); the sound's, the
        # prompt modulation's and the cross-modal ones stay the step's.
        video_timestep = TensorSpec("video_timestep", "float32", ("batch", "video_tokens"))
        step_inputs, timesteps = step_inputs + (video_timestep,), timesteps + (video_timestep,)
    specs = [
        ComponentSpec(
            "text_encoder",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "text_tokens")), TensorSpec(
                "attention_mask", "int64", ("batch", "text_tokens"))),
            outputs=(text, audio_text, mask),
            tolerance=1e-4,
        ),
        ComponentSpec(
            "denoiser_head",
            inputs=(latents, audio_latents, *step_inputs),
            outputs=(video_hidden, audio_hidden, TensorSpec("first_block_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_tail",
            inputs=(video_hidden, audio_hidden, *step_inputs),
            outputs=(noise_pred, TensorSpec("tail_residual", "float32", residual)),
            tolerance=1e-4,
            per_step=True,
        ),
        ComponentSpec(
            "denoiser_reuse",
            inputs=(latents, audio_latents, *timesteps, TensorSpec("blocks_residual", "float32", residual)),
            outputs=(noise_pred,),
            tolerance=1e-4,
            per_step=True,
            in_sampler=True,
        ),
        ComponentSpec(
            "audio_decoder",
            inputs=(TensorSpec("audio_latents", "float32", ("batch", "audio_tokens", audio_latent_channels)),),
            outputs=(TensorSpec("waveform", "float32", ("batch", sound_channels, "samples")),),
            tolerance=1e-4,
        ),
        *whole_video_decoder_specs(latent_channels),
    ]
    if image_to_video:
        latent = ("batch", latent_channels, 1, "latent_height", "latent_width")
        specs.append(ComponentSpec(
            "vae_encoder",
            inputs=(TensorSpec("frames", "float32", ("batch", 3, 1, "height", "width")),),
            outputs=(TensorSpec("latents", "float32", latent),),
            tolerance=1e-3,
        ))
    return {s.name: s for s in specs}


def _modules():
    """The torch wrappers, defined lazily so that listing families stays light."""
    import torch

    from machgen.builder.families.ltx import _modules as ltx_modules

    # LTX-Video's: the same latent denormalisation and decode call (LTX2Pipeline's, at decode_timestep 0),
    # and the same frames to uint8.
    _, _, _, _, vae_decoder, postprocess, _ = ltx_modules()

    class TextEncoder(torch.nn.Module):
        """LTX2Pipeline._get_gemma_prompt_embeds then its connectors: every
        hidden state of the Gemma language model (its LM head is not needed)."""

        def __init__(self, text_encoder, connectors, padding_side: str):
            super().__init__()
            self.language_model = getattr(text_encoder, "model", text_encoder)
            self.connectors = connectors
            self.padding_side = padding_side

        def forward(self, input_ids, attention_mask):
            out = self.language_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)
            video, audio, mask = self.connectors(hidden, attention_mask, padding_side=self.padding_side)
            return video, audio, mask.to(video.dtype)

    def modulation(embed, values, batch: int, dtype):
        """An LTX2AdaLayerNormSingle on one value per row: [batch, 1, features] (and its embedding)."""
        params, embedded = embed(values, batch_size=batch, hidden_dtype=dtype)
        return params.reshape(batch, 1, params.size(-1)), embedded.reshape(batch, 1, embedded.size(-1))

    def video_modulation(tr, timestep, video_timestep, batch: int, dtype):
        """The video's time embedding: from its timestep per token when it has
        one (image-to-video), else from the step's [batch, 1 or tokens, features]."""
        if video_timestep is None:
            return modulation(tr.time_embed, timestep.reshape(-1), batch, dtype)
        params, embedded = tr.time_embed(video_timestep.reshape(-1), batch_size=batch, hidden_dtype=dtype)
        tokens = video_timestep.shape[1]
        return params.reshape(batch, tokens, params.size(-1)), embedded.reshape(batch, tokens, embedded.size(-1))

    def step_streams(tr, batch: int, encoder_hidden_states, audio_encoder_hidden_states, encoder_attention_mask,
                     timestep, video_coords, audio_coords, dtype, video_timestep=None) -> tuple[dict, Any, Any]:
        """LTX2VideoTransformer3DModel.forward before its blocks (one timestep per
        row: sigma, the sound's and the cross-modal ones; the video's too unless
        ``video_timestep`` gives one per token): the blocks' keyword arguments
        and both output layers' embedded timesteps."""
        bias = ((1 - encoder_attention_mask.to(dtype)) * -10000.0).unsqueeze(1)
        t = timestep.reshape(-1)
        temb, embedded = video_modulation(tr, timestep, video_timestep, batch, dtype)
        temb_audio, audio_embedded = modulation(tr.audio_time_embed, t, batch, dtype)
        temb_prompt = temb_prompt_audio = None
        if tr.prompt_modulation and tr.config.use_prompt_adaln_single:
            temb_prompt = modulation(tr.prompt_adaln, t, batch, dtype)[0]
            temb_prompt_audio = modulation(tr.audio_prompt_adaln, t, batch, dtype)[0]
        gate_factor = tr.config.cross_attn_timestep_scale_multiplier / tr.config.timestep_scale_multiplier
        if tr.config.use_prompt_embeddings:  # LTX-2.0; later versions project in the connectors
            encoder_hidden_states = tr.caption_projection(encoder_hidden_states)
            audio_encoder_hidden_states = tr.audio_caption_projection(audio_encoder_hidden_states)
        streams = {
            "encoder_hidden_states": encoder_hidden_states,
            "audio_encoder_hidden_states": audio_encoder_hidden_states,
            "temb": temb, "temb_audio": temb_audio,
            "temb_ca_scale_shift": modulation(tr.av_cross_attn_video_scale_shift, t, batch, dtype)[0],
            "temb_ca_audio_scale_shift": modulation(tr.av_cross_attn_audio_scale_shift, t, batch, dtype)[0],
            "temb_ca_gate": modulation(tr.av_cross_attn_video_a2v_gate, t * gate_factor, batch, dtype)[0],
            "temb_ca_audio_gate": modulation(tr.av_cross_attn_audio_v2a_gate, t * gate_factor, batch, dtype)[0],
            "temb_prompt": temb_prompt, "temb_prompt_audio": temb_prompt_audio,
            "video_rotary_emb": tr.rope(video_coords, device=video_coords.device),
            "audio_rotary_emb": tr.audio_rope(audio_coords, device=audio_coords.device),
            "ca_video_rotary_emb": tr.cross_attn_rope(video_coords[:, 0:1, :], device=video_coords.device),
            "ca_audio_rotary_emb": tr.cross_attn_audio_rope(audio_coords[:, 0:1, :], device=audio_coords.device),
            "encoder_attention_mask": bias, "audio_encoder_attention_mask": bias,
        }
        return streams, embedded, audio_embedded

    @contextlib.contextmanager
    def cross_modal_gated(block, gate):
        """Inside, the block's audio-to-video and video-to-audio attention
        outputs are multiplied by ``gate`` [batch, 1, 1]: a row at 0 adds
        nothing, as the pipeline's ``isolate_modalities`` pass."""
        handles = [module.register_forward_hook(lambda _module, _args, output: output * gate)
                   for module in (block.audio_to_video_attn, block.video_to_audio_attn)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def run_blocks(tr, blocks: range, video, audio, streams: dict, perturbation_mask, cross_modal_mask):
        gate = cross_modal_mask[:, :, None]
        for index in blocks:
            block = tr.transformer_blocks[index]
            with cross_modal_gated(block, gate):
                # all_perturbed False: every row computes its attention and lerps to the values where its
                # mask is 0, which is what a perturbed pass alone gives (lerp at 0 is its start, exactly).
                video, audio = block(hidden_states=video, audio_hidden_states=audio, **streams,
                                     perturbation_mask=perturbation_mask[:, index, None, None], all_perturbed=False)
        return video, audio

    def pack(video, audio):
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def outputs(tr, video, audio, embedded, audio_embedded):
        """Both output layers (norm, embedded-timestep scale and shift, projection), packed."""
        shift, scale = (tr.scale_shift_table[None, None] + embedded[:, :, None]).unbind(2)
        audio_shift, audio_scale = (tr.audio_scale_shift_table[None, None] + audio_embedded[:, :, None]).unbind(2)
        return pack(tr.proj_out(tr.norm_out(video) * (1 + scale) + shift),
                    tr.audio_proj_out(tr.audio_norm_out(audio) * (1 + audio_scale) + audio_shift))

    class DenoiserHead(torch.nn.Module):
        """LTX2VideoTransformer3DModel.forward up to and including the first block."""

        def __init__(self, transformer):
            super().__init__()
            self.transformer = transformer

        def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                    encoder_attention_mask, timestep, video_coords, audio_coords, perturbation_mask,
                    cross_modal_mask, video_timestep=None):
            tr = self.transformer
            video, audio = tr.proj_in(hidden_states), tr.audio_proj_in(audio_hidden_states)
            streams, _, _ = step_streams(tr, hidden_states.size(0), encoder_hidden_states, audio_encoder_hidden_states,
                                         encoder_attention_mask, timestep, video_coords, audio_coords, video.dtype,
                                         video_timestep)
            video_out, audio_out = run_blocks(tr, range(1), video, audio, streams, perturbation_mask,
                                              cross_modal_mask)
            return video_out, audio_out, pack(video_out - video, audio_out - audio)

    class DenoiserTail(torch.nn.Module):
        """The rest of LTX2VideoTransformer3DModel.forward after the first block
        (its modulations recomputed from the step's inputs: cheap next to the blocks)."""

        def __init__(self, transformer):
            super().__init__()
            self.transformer = transformer

        def forward(self, video_hidden, audio_hidden, encoder_hidden_states, audio_encoder_hidden_states,
                    encoder_attention_mask, timestep, video_coords, audio_coords, perturbation_mask,
                    cross_modal_mask, video_timestep=None):
            tr = self.transformer
            streams, embedded, audio_embedded = step_streams(
                tr, video_hidden.size(0), encoder_hidden_states, audio_encoder_hidden_states, encoder_attention_mask,
                timestep, video_coords, audio_coords, video_hidden.dtype, video_timestep)
            video, audio = run_blocks(tr, range(1, len(tr.transformer_blocks)), video_hidden, audio_hidden, streams,
                                      perturbation_mask, cross_modal_mask)
            return (outputs(tr, video, audio, embedded, audio_embedded),
                    pack(video - video_hidden, audio - audio_hidden))

    class DenoiserReuse(torch.nn.Module):
        """LTX2VideoTransformer3DModel.forward with every block replaced by a kept residual."""

        def __init__(self, transformer):
            super().__init__()
            self.transformer = transformer

        def forward(self, hidden_states, audio_hidden_states, timestep, blocks_residual, video_timestep=None):
            tr = self.transformer
            batch = hidden_states.size(0)
            video, audio = tr.proj_in(hidden_states), tr.audio_proj_in(audio_hidden_states)
            embedded = video_modulation(tr, timestep, video_timestep, batch, video.dtype)[1]
            audio_embedded = modulation(tr.audio_time_embed, timestep.reshape(-1), batch, video.dtype)[1]
            split = video.shape[1] * video.shape[2]
            video = video + blocks_residual[:, :split].reshape(video.shape)
            audio = audio + blocks_residual[:, split:].reshape(audio.shape)
            return outputs(tr, video, audio, embedded, audio_embedded)

    class AudioDecoder(torch.nn.Module):
        """LTX2Pipeline's sound from packed latents [batch, tokens, channels x mel
        bins]: denormalised, unpacked, AutoencoderKLLTX2Audio.decode, the vocoder."""

        def __init__(self, audio_vae, vocoder, latent_mel_bins: int):
            super().__init__()
            self.audio_vae = audio_vae
            self.vocoder = vocoder
            self.latent_mel_bins = latent_mel_bins

        def forward(self, audio_latents):
            latents = audio_latents * self.audio_vae.latents_std + self.audio_vae.latents_mean
            latents = latents.unflatten(2, (-1, self.latent_mel_bins)).transpose(1, 2)
            return self.vocoder(self.audio_vae.decode(latents, return_dict=False)[0])

    class VaeEncoder(torch.nn.Module):
        """LTX2ImageToVideoPipeline's picture latents: the mode of
        AutoencoderKLLTX2Video.encode, normalised (without the scaling factor, as the pipeline)."""

        def __init__(self, vae):
            super().__init__()
            self.vae = vae

        def forward(self, frames):
            mode = self.vae.encode(frames).latent_dist.mode()
            return (mode - self.vae.latents_mean.view(1, -1, 1, 1, 1)) / self.vae.latents_std.view(1, -1, 1, 1, 1)

    return TextEncoder, DenoiserHead, DenoiserTail, DenoiserReuse, vae_decoder, AudioDecoder, postprocess, VaeEncoder


@register_family
class Ltx2(Family):
    name = "ltx2"
    diffusers_pipeline = "LTX2Pipeline"
    capabilities = Capabilities(tasks=("text-to-video",), true_cfg=True, guidance_is_cfg=True, audio=True,
                                guidance_inputs=tuple(PIPELINE_GUIDANCE))
    sampler_assets = ("tokenizer", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_ltx2",)

    # ------------------------------------------------------------------ build
    def sparse_attention_layers(self, pipe) -> list:
        # The video self-attention only, the long one: the audio-video attention can have keys as long as its
        # queries, and the sound's own self-attention is short.
        return [block.attn1 for block in pipe.transformer.transformer_blocks]

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        tr = pipe.transformer.config
        inner, audio_inner = tr.num_attention_heads * tr.attention_head_dim, \
            tr.audio_num_attention_heads * tr.audio_attention_head_dim
        video_text, audio_text = (tr.caption_channels, tr.caption_channels) if tr.use_prompt_embeddings \
            else (inner, audio_inner)
        return _ltx2_specs(video_text_dim=video_text, audio_text_dim=audio_text, inner_dim=inner,
                           audio_inner_dim=audio_inner, in_channels=tr.in_channels,
                           audio_channels=tr.audio_in_channels, layers=tr.num_layers,
                           latent_channels=pipe.vae.config.latent_channels,
                           audio_latent_channels=self._audio_packed_channels(pipe),
                           sound_channels=pipe.vocoder.config.out_channels, image_to_video=self.image_to_video)

    @property
    def image_to_video(self) -> bool:
        return "image-to-video" in self.capabilities.tasks

    @staticmethod
    def _audio_packed_channels(pipe) -> int:
        return pipe.audio_vae.config.latent_channels * (pipe.audio_vae.config.mel_bins
                                                        // pipe.audio_vae_mel_compression_ratio)

    def components(self, pipe) -> list[ExportableComponent]:
        import torch

        text_encoder, head, tail, reuse, vae_decoder, audio_decoder, postprocess, vae_encoder = _modules()
        specs = self.specs(pipe)
        tr = pipe.transformer.config
        # Batch 2 (batch 1 would be specialised), sizes unlike any fixed size in the model.
        batch, text_tokens, frames, lat_h, lat_w, audio_frames = 2, 7, 3, 6, 4, 5
        tokens = frames * lat_h * lat_w
        gen = torch.Generator().manual_seed(0)
        device, dtype = pipe.transformer.device, pipe.transformer.dtype

        def randn(*shape):
            return torch.randn(*shape, generator=gen)

        ids = torch.randint(0, pipe.text_encoder.config.get_text_config().vocab_size, (batch, text_tokens),
                            generator=gen)
        text_mask = torch.ones(batch, text_tokens, dtype=torch.int64)
        text_mask[1, :3] = 0  # left padding, as the pipeline pads Gemma's prompts
        encoder = text_encoder(pipe.text_encoder, pipe.connectors, padding_side="left").eval()
        with torch.no_grad():
            video_text, audio_text, connector_mask = encoder(ids, text_mask)
        video_rope, audio_rope = pipe.transformer.rope, pipe.transformer.audio_rope
        perturbation = torch.ones(batch, tr.num_layers)
        perturbation[1, -1] = 0
        step = {"encoder_hidden_states": video_text, "audio_encoder_hidden_states": audio_text,
                "encoder_attention_mask": connector_mask, "timestep": torch.tensor([[700.0], [300.0]]),
                "video_coords": video_rope.prepare_video_coords(batch, frames, lat_h, lat_w, "cpu", fps=25.0),
                "audio_coords": audio_rope.prepare_audio_coords(batch, audio_frames, "cpu"),
                "perturbation_mask": perturbation, "cross_modal_mask": torch.tensor([[1.0], [0.0]])}
        if self.image_to_video:  # the first frame's tokens at 0
            step["video_timestep"] = step["timestep"].repeat(1, tokens)
            step["video_timestep"][:, :lat_h * lat_w] = 0
        timesteps = {name: step[name] for name in ("timestep", "video_timestep") if name in step}
        latents = {"hidden_states": randn(batch, tokens, tr.in_channels),
                   "audio_hidden_states": randn(batch, audio_frames, tr.audio_in_channels)}
        head_module = head(pipe.transformer).eval()
        with torch.no_grad():
            video_hidden, audio_hidden, residual = (output.cpu().float() for output in head_module(
                **{name: value.to(device, dtype) for name, value in {**latents, **step}.items()}))
        vae_spatial = pipe.vae_spatial_compression_ratio
        latent_mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        encoder_component = [ExportableComponent(
            specs["vae_encoder"], vae_encoder(pipe.vae).eval(),
            {"frames": randn(batch, 3, 1, lat_h * vae_spatial, lat_w * vae_spatial)})] if self.image_to_video else []
        return encoder_component + [
            ExportableComponent(specs["text_encoder"], encoder, {"input_ids": ids, "attention_mask": text_mask}),
            ExportableComponent(specs["denoiser_head"], head_module, {**latents, **step}),
            ExportableComponent(specs["denoiser_tail"], tail(pipe.transformer).eval(),
                                {"video_hidden": video_hidden, "audio_hidden": audio_hidden, **step}),
            ExportableComponent(specs["denoiser_reuse"], reuse(pipe.transformer).eval(),
                                {**latents, **timesteps, "blocks_residual": randn(*residual.shape)}),
            ExportableComponent(specs["vae_decoder"], vae_decoder(pipe.vae).eval(),
                                {"latents": randn(batch, pipe.vae.config.latent_channels, frames, lat_h, lat_w)}),
            ExportableComponent(specs["audio_decoder"],
                                audio_decoder(pipe.audio_vae, pipe.vocoder, latent_mel).eval(),
                                {"audio_latents": randn(batch, audio_frames, self._audio_packed_channels(pipe))}),
            ExportableComponent(specs["postprocess"], postprocess().eval(),
                                {"frames": randn(batch, 3, 5, lat_h * vae_spatial, lat_w * vae_spatial) * 0.8}),
        ]

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # LTX2Pipeline.__call__'s defaults: 768x512, 121 frames at 24 fps, 30 steps, the LTX-2.3 guidance.
        return ServedDefaults(height=512, width=768, num_inference_steps=30, guidance_scale=3.0, negative_prompt="",
                              max_sequence_length=1024, max_height=1280, max_width=1280, num_frames=121,
                              max_frames=257, fps=24, family_guidance=dict(PIPELINE_GUIDANCE))

    def tiny_defaults(self) -> ServedDefaults:
        # Spatio-temporal guidance on the tiny model's last block (the pipeline's block 28 is past its two).
        return ServedDefaults(height=32, width=32, num_inference_steps=4, guidance_scale=3.0, negative_prompt="",
                              max_sequence_length=16, max_height=64, max_width=64, num_frames=5, max_frames=9,
                              fps=25, family_guidance={**PIPELINE_GUIDANCE, "stg_blocks": [1]})

    def tiny_pipeline(self):
        """LTX-2.3's layout at toy size: gated attention, cross-attention and
        prompt modulation, perturbable self-attention (STG), per-modality
        connector projections; Gemma 3 of two layers."""
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
        return getattr(diffusers, self.diffusers_pipeline)(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
            text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, transformer=transformer,
            vocoder=vocoder)

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        window = getattr(pipe.text_encoder.config.get_text_config(), "sliding_window", None)
        if window is not None and defaults.max_sequence_length > window:
            # Gemma's mask code branches on the length against its window, and the export follows the
            # branch of the traced length: past the window the exported encoder would differ.
            raise ValueError(f"max_sequence_length {defaults.max_sequence_length} is over the text encoder's "
                             f"sliding window of {window} tokens, past which its export is not exact")
        spatial, temporal = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        audio_vae = pipe.audio_vae.config
        tr = pipe.transformer
        return {
            "vae_spatial_ratio": spatial,
            "temporal_factor": temporal,
            # Height and width: multiples of the VAE factor times the patch, and of 32 (LTX2Pipeline.check_inputs).
            "size_multiple": math.lcm(spatial * patch, 32),
            "patch_size": patch,
            "patch_size_t": patch_t,
            "latent_channels": tr.config.in_channels,
            "layers": tr.config.num_layers,
            "audio_latent_channels": audio_vae.latent_channels,
            "audio_latent_mel_bins": audio_vae.mel_bins // pipe.audio_vae_mel_compression_ratio,
            "audio_latents_per_second": pipe.audio_sampling_rate / pipe.audio_hop_length
            / float(pipe.audio_vae_temporal_compression_ratio),
            "sample_rate": int(getattr(pipe.vocoder.config, "output_sampling_rate", pipe.audio_sampling_rate)),
            "video_rope": {name: _plain(getattr(tr.rope, name)) for name in _ROPE_FIELDS},
            "audio_rope": {name: _plain(getattr(tr.audio_rope, name)) for name in _ROPE_FIELDS},
            "tokenizer_class": type(pipe.tokenizer).__name__,
            "max_sequence_length": defaults.max_sequence_length,
            # Image-to-video: the H.264 quality the picture is re-compressed at first (the model's training).
            "image_crf": resolve_default_image_crf(pipe.text_encoder),
        }

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        spatial, multiple = settings["vae_spatial_ratio"], settings["size_multiple"]
        temporal = settings["temporal_factor"]

        def scaled(size: AxisRange, factor: float) -> AxisRange:
            return AxisRange(int(size.min // factor), int(size.opt // factor), int(size.max // factor))

        height = AxisRange(multiple, defaults.height, defaults.max_height)
        width = AxisRange(multiple, defaults.width, defaults.max_width)
        frames = AxisRange(1, defaults.num_frames, defaults.max_frames)
        latent_frames = AxisRange(1, (defaults.num_frames - 1) // temporal + 1,
                                  (defaults.max_frames - 1) // temporal + 1)
        lat_h, lat_w = scaled(height, spatial), scaled(width, spatial)
        patch = settings["patch_size"]
        video_tokens = AxisRange(*(f * h * w for f, h, w in zip(
            (latent_frames.min, latent_frames.opt, latent_frames.max), (lat_h.min // patch, lat_h.opt // patch,
                                                                       lat_h.max // patch),
            (lat_w.min // patch, lat_w.opt // patch, lat_w.max // patch))))
        # The sound's length follows the clip's duration: frames at the slowest and fastest frame rates served.
        rate = settings["audio_latents_per_second"]
        audio_tokens = AxisRange(1, max(1, round(defaults.num_frames / defaults.fps * rate)),
                                 max(1, round(defaults.max_frames * rate)))
        channels = settings["latent_channels"]
        audio_channels = settings["audio_latent_channels"] * settings["audio_latent_mel_bins"]
        inner = settings["video_rope"]["dim"]
        audio_inner = settings["audio_rope"]["dim"]
        text = defaults.max_sequence_length

        def packed(video_width: int, audio_width: int) -> AxisRange:
            return AxisRange(*(v * video_width + a * audio_width for v, a in zip(
                (video_tokens.min, video_tokens.opt, video_tokens.max),
                (audio_tokens.min, audio_tokens.opt, audio_tokens.max))))

        samples = settings["sample_rate"]
        return {
            "height": height, "width": width, "frames": frames, "latent_frames": latent_frames,
            "latent_height": lat_h, "latent_width": lat_w, "text_tokens": AxisRange(text, text, text),
            "video_tokens": video_tokens, "audio_tokens": audio_tokens,
            "packed_latents": packed(channels, audio_channels), "packed_hidden": packed(inner, audio_inner),
            "samples": AxisRange(1, round(defaults.num_frames / defaults.fps * samples),
                                 round(defaults.max_frames * samples)),
        }

    # --------------------------------------------------------------- run time
    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return Ltx2Conditioning(settings, assets_dir, run_component)


def _plain(value):
    """A module attribute as JSON (tuples of scale factors as lists)."""
    return list(value) if isinstance(value, (tuple, list)) else value


def _ropes(settings: dict[str, Any]):
    """The video's and the sound's LTX2AudioVideoRotaryPosEmbed, rebuilt from
    their settings: what prepares the positions of a request's tokens."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    return tuple(LTX2AudioVideoRotaryPosEmbed(**{**settings[key], "scale_factors": tuple(
        settings[key]["scale_factors"])}) for key in ("video_rope", "audio_rope"))


class Ltx2Conditioning(LtxConditioning):
    """The LTX-2-specific half of the sampler: prompts, both streams' noise
    and positions, timesteps, the guidance rows and their combination, and
    the decode of picture and sound.

    LTX-Video's conditioning lends it the tokenizer and scheduler loading
    and the latent packing (LTX2Pipeline's _pack_latents is LTXPipeline's).
    Mirrors LTX2Pipeline step for step (_get_gemma_prompt_embeds with left
    padding, prepare_latents then prepare_audio_latents from one generator,
    calculate_shift on the video's token count, prepare_video_coords at the
    conditioning frame rate, prepare_audio_coords, convert_velocity_to_x0
    and back around the guidance, _unpack_latents, _unpack_audio_latents).
    """

    def __init__(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg

        super().__init__(settings, assets_dir, run_component)  # its tokenizer, scheduler; LTX's packing
        self._calculate_shift = calculate_shift
        self._rescale = rescale_noise_cfg
        # Gemma's prompts are padded on the left, with its end token when it has no pad token (the pipeline).
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.video_rope, self.audio_rope = _ropes(settings)

    @property
    def sample_rate(self) -> int:
        return self.settings["sample_rate"]

    def audio_frames(self, num_frames: int, fps: int) -> int:
        """The sound's latent length for a clip of ``num_frames`` at ``fps``."""
        return round(num_frames / fps * self.settings["audio_latents_per_second"])

    # --- requests
    def parse_guidance(self, get_input, defaults: dict[str, Any], request) -> dict[str, Any]:
        """The guidance inputs validated, absent ones the model's; the sound's
        fall back on the video's when absent or 0 (the pipeline's ``or``)."""
        import numpy as np

        from machgen.ensembles.api import fraction_input, guidance_scale_input, indices_input

        def value(name: str, parse):
            array = get_input(name)
            return defaults[name] if array is None else parse(name, np.asarray(array))

        guidance = {name: value(name, fraction_input if name.endswith("rescale") else guidance_scale_input)
                    for name in PIPELINE_GUIDANCE if name != "stg_blocks"}
        guidance["stg_blocks"] = value("stg_blocks", lambda f, v: indices_input(f, v, self.settings["layers"]))
        guidance["guidance_scale"] = request.guidance_scale
        for name in ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale"):
            guidance[f"audio_{name}"] = guidance[f"audio_{name}"] or guidance[name]
        guidance["stg_blocks"] = [int(block) for block in guidance["stg_blocks"]]
        return guidance

    def passes(self, guidance: dict[str, Any]) -> list[str]:
        """The rows a step runs, in order (LTX2Pipeline's do_* properties)."""
        rows = [CONDITIONAL]
        if guidance["guidance_scale"] > 1 or guidance["audio_guidance_scale"] > 1:
            rows.append(UNCONDITIONAL)
        if guidance["stg_scale"] > 0 or guidance["audio_stg_scale"] > 0:
            rows.append(PERTURBED)
        if guidance["modality_scale"] > 1 or guidance["audio_modality_scale"] > 1:
            rows.append(ISOLATED)
        return rows

    def uses_negative_prompt(self, request) -> bool:
        return UNCONDITIONAL in self.passes(request.guidance)

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """_get_gemma_prompt_embeds and the connectors, one row per prompt."""
        import numpy as np

        from machgen.ensembles.tensors import as_torch

        tokens = self.tokenizer([p.strip() for p in prompts], padding="max_length",
                                max_length=self.settings["max_sequence_length"], truncation=True,
                                add_special_tokens=True, return_tensors="np")
        encoded = self.run_component("text_encoder", {"input_ids": tokens.input_ids.astype(np.int64),
                                                      "attention_mask": tokens.attention_mask.astype(np.int64)})
        return {name: as_torch(encoded[name]) for name in
                ("encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask")}

    def request_latents(self, request):
        """Both streams' noise, as the pipeline draws it from one generator
        (the video's, then the sound's), packed side by side: [1, P]."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        generator = torch.Generator("cpu").manual_seed(request.seed)
        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        video = randn_tensor((1, self.settings["latent_channels"], frames, lat_h, lat_w), generator=generator,
                             dtype=torch.float32)
        audio = randn_tensor((1, self.settings["audio_latent_channels"],
                              self.audio_frames(request.num_frames, request.fps),
                              self.settings["audio_latent_mel_bins"]), generator=generator, dtype=torch.float32)
        return torch.cat([self.pack(video).flatten(1), audio.transpose(1, 2).flatten(2, 3).flatten(1)], dim=1)

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1):
        """A fresh scheduler with the pipeline's sigmas and shift for the video's token count."""
        import numpy as np

        scheduler = self._scheduler_class.from_config(self.scheduler_config)
        cfg = scheduler.config
        frames, lat_h, lat_w = self.latent_shape(height, width, num_frames)
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        tokens = (frames // patch_t) * (lat_h // patch) * (lat_w // patch)
        mu = self._calculate_shift(tokens, cfg.get("base_image_seq_len", 1024), cfg.get("max_image_seq_len", 4096),
                                   cfg.get("base_shift", 0.95), cfg.get("max_shift", 2.05))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps), mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def request_conditioning(self, request) -> dict[str, Any]:
        """This clip's positions (the video's at its frame rate, the sound's)
        and its guidance rows: which prompt each row takes and its masks."""
        import torch

        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        passes = self.passes(request.guidance)
        perturbation = torch.ones(len(passes), self.settings["layers"])
        if PERTURBED in passes:
            perturbation[passes.index(PERTURBED), request.guidance["stg_blocks"]] = 0
        return {
            "video_coords": self.video_rope.prepare_video_coords(1, frames, lat_h, lat_w, "cpu", fps=request.fps),
            "audio_coords": self.audio_rope.prepare_audio_coords(
                1, self.audio_frames(request.num_frames, request.fps), "cpu"),
            "passes": passes,
            "prompt_rows": [1 if name == UNCONDITIONAL else 0 for name in passes],
            "perturbation_mask": perturbation,
            "cross_modal_mask": torch.tensor([[0.0 if name == ISOLATED else 1.0] for name in passes]),
            "guidance": request.guidance,
        }

    def split(self, packed, conditioning: dict[str, Any]):
        """Packed rows [R, P] -> (video [R, tokens, C], sound [R, tokens, C'])."""
        video_tokens = conditioning["video_coords"].shape[2]
        audio_tokens = conditioning["audio_coords"].shape[2]
        split = video_tokens * self.settings["latent_channels"]
        return (packed[:, :split].reshape(len(packed), video_tokens, -1),
                packed[:, split:].reshape(len(packed), audio_tokens, -1))

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        import torch

        rows = len(conditioning["passes"])
        device = latents.device
        video, audio = self.split(latents, conditioning)
        return {
            "hidden_states": video.expand(rows, -1, -1).contiguous(),
            "audio_hidden_states": audio.expand(rows, -1, -1).contiguous(),
            "timestep": torch.full((rows, 1), float(timestep), device=device),
            **self._rows(conditioning, device),
        }

    @staticmethod
    def _rows(conditioning: dict[str, Any], device) -> dict[str, Any]:
        """What every step's rows share: each row's prompt embeddings, the
        positions, the masks; made at the first step and kept in the
        conditioning (a request's own dict), not rebuilt per step."""
        import torch

        if "step_rows" not in conditioning:
            rows = len(conditioning["passes"])
            prompt_rows = torch.tensor(conditioning["prompt_rows"])
            conditioning["step_rows"] = {
                **{name: conditioning[name][prompt_rows.to(conditioning[name].device)].to(device) for name in
                   ("encoder_hidden_states", "audio_encoder_hidden_states", "encoder_attention_mask")},
                **{name: conditioning[name].to(device).expand(rows, -1, -1, -1).contiguous()
                   for name in ("video_coords", "audio_coords")},
                **{name: conditioning[name].to(device) for name in ("perturbation_mask", "cross_modal_mask")},
            }
        return conditioning["step_rows"]

    def guide(self, prediction, latents, step: int, scheduler, conditioning: dict[str, Any]):
        """LTX2Pipeline's guidance of one step, per stream: every pass's
        velocity to x0, the deltas of the passes that ran, the rescale, back
        to a velocity; packed again."""
        import torch

        from machgen.ensembles.tensors import as_torch

        prediction = as_torch(prediction).float()
        sigma = scheduler.sigmas[step]
        passes, guidance = conditioning["passes"], conditioning["guidance"]
        guided = []
        for stream, prefix, sample in zip(self.split(prediction, conditioning), ("", "audio_"),
                                          self.split(latents.to(prediction.device), conditioning)):
            x0 = {name: sample - stream[index:index + 1] * sigma for index, name in enumerate(passes)}
            conditional = x0[CONDITIONAL]
            total = conditional
            if UNCONDITIONAL in x0:
                total = total + (guidance[f"{prefix}guidance_scale"] - 1) * (conditional - x0[UNCONDITIONAL])
            if PERTURBED in x0:
                total = total + guidance[f"{prefix}stg_scale"] * (conditional - x0[PERTURBED])
            if ISOLATED in x0:
                total = total + (guidance[f"{prefix}modality_scale"] - 1) * (conditional - x0[ISOLATED])
            rescale = guidance[f"{prefix}guidance_rescale"]
            if rescale > 0:
                total = self._rescale(total, conditional, guidance_rescale=rescale)
            guided.append(((sample - total) / sigma).flatten(1))
        return torch.cat(guided, dim=1)

    # --- decode
    def unpack(self, latents, request):
        """(video latents [1, C, frames, h, w] as _unpack_latents gives them,
        the sound's packed latents [1, tokens, C x mel bins]) of the final row."""
        patch, patch_t = self.settings["patch_size"], self.settings["patch_size_t"]
        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        frames, lat_h, lat_w = frames // patch_t, lat_h // patch, lat_w // patch
        split = frames * lat_h * lat_w * self.settings["latent_channels"]
        video = latents[:, :split].reshape(1, frames, lat_h, lat_w, -1, patch_t, patch, patch)
        video = video.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3).contiguous()
        audio_channels = self.settings["audio_latent_channels"] * self.settings["audio_latent_mel_bins"]
        return video, latents[:, split:].reshape(1, -1, audio_channels).contiguous()

    def decode(self, latents) -> Any:
        """uint8 frames [F, H, W, 3]: the whole video in one decoder call."""
        from machgen.ensembles.tensors import as_numpy

        video, _ = latents
        frames = self.run_component("vae_decoder", {"latents": video})["frames"]
        return as_numpy(self.run_component("postprocess", {"frames": frames})["images"])[0]

    def decode_audio(self, latents):
        """The sound track [channels, samples] (audio VAE, then the vocoder)."""
        _, audio = latents
        return self.run_component("audio_decoder", {"audio_latents": audio})["waveform"][0]


@register_family
class Ltx2ImageToVideo(Ltx2):
    """LTX-2 image-to-video (LTX2ImageToVideoPipeline): the picture, re-compressed
    as H.264 at the model's quality and encoded, is the first latent frame,
    kept as it is through the loop (its tokens at timestep 0); the sound is
    made as for text-to-video."""

    name = "ltx2-i2v"
    diffusers_pipeline = "LTX2ImageToVideoPipeline"
    capabilities = Capabilities(tasks=("image-to-video",), true_cfg=True, guidance_is_cfg=True, audio=True,
                                guidance_inputs=tuple(PIPELINE_GUIDANCE))

    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return Ltx2ImageToVideoConditioning(settings, assets_dir, run_component)


class Ltx2ImageToVideoConditioning(Ltx2Conditioning):
    """LTX2ImageToVideoPipeline.prepare_latents and its per-token video timesteps."""

    def frame_elements(self, height: int, width: int) -> int:
        """The first latent frame's share of the packed row (its tokens x channels)."""
        spatial, patch = self.settings["vae_spatial_ratio"], self.settings["patch_size"]
        return (height // spatial // patch) * (width // spatial // patch) * self.settings["latent_channels"]

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1):
        from machgen.builder.families.ltx import _KeepFirstFrame

        return _KeepFirstFrame(super().scheduler(num_inference_steps, height, width, num_frames),
                               self.frame_elements(height, width))

    def request_latents(self, request):
        """The picture's latents on the first frame and noise after it (the
        encoder's mode draws nothing), then the sound's noise, from one
        generator in the pipeline's order; packed."""
        import numpy as np
        import torch
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from diffusers.utils.torch_utils import randn_tensor

        from machgen.ensembles.tensors import as_torch

        picture = apply_image_conditioning_crf(request.image, self.settings["image_crf"])
        pixels = (picture.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)[None, :, None]
        encoded = as_torch(self.run_component("vae_encoder", {"frames": np.ascontiguousarray(pixels)})["latents"])
        generator = torch.Generator("cpu").manual_seed(request.seed)
        frames, lat_h, lat_w = self.latent_shape(request.height, request.width, request.num_frames)
        noise = randn_tensor((1, self.settings["latent_channels"], frames, lat_h, lat_w), generator=generator,
                             dtype=torch.float32)
        video = torch.cat([encoded.to(noise.device), noise[:, :, 1:]], dim=2)
        audio = randn_tensor((1, self.settings["audio_latent_channels"],
                              self.audio_frames(request.num_frames, request.fps),
                              self.settings["audio_latent_mel_bins"]), generator=generator, dtype=torch.float32)
        return torch.cat([self.pack(video).flatten(1), audio.transpose(1, 2).flatten(2, 3).flatten(1)], dim=1)

    def request_conditioning(self, request) -> dict[str, Any]:
        conditioning = super().request_conditioning(request)
        spatial, patch = self.settings["vae_spatial_ratio"], self.settings["patch_size"]
        conditioning["picture_tokens"] = (request.height // spatial // patch) * (request.width // spatial // patch)
        return conditioning

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        inputs = super().denoiser_inputs(latents, timestep, conditioning, guidance_scale, height, width)
        # t on every video token but the first frame's, which stay at 0 (the picture is clean).
        video_timestep = inputs["timestep"].expand(-1, inputs["hidden_states"].shape[1]).clone()
        video_timestep[:, :conditioning["picture_tokens"]] = 0
        return {**inputs, "video_timestep": video_timestep}
