"""LTX-2's build-time half: the torch wrappers each component exports, and
``Ltx2Export`` (text-to-video and image-to-video, with the sound)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoResnetBlock3d
from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

from machgen.builder.family_export import ExportableComponent, FamilyExport, OnRanks
from machgen.contract.specs import AxisRange, ComponentSpec, ServedDefaults, TensorSpec
# LTX-Video's: the same latent denormalisation and decode call (LTX2Pipeline's, at decode_timestep 0),
# and the same frames to uint8.
from machgen.families.ltx.export import Postprocess, VaeDecoder
from machgen.families.ltx2.spec import ltx2_specs
from machgen.parallel.layout import SEQUENCE_MARKER, ParallelSupport
from machgen.parallel.op import (
    sequence_attention_swapped,
    sequence_gather,
    sequence_keys_attention_swapped,
    sequence_shard,
)
from machgen.parallel.rows import by_rows, split_by_rows

# The rotary position modules' settings the sampler rebuilds them from (they hold no weights).
_ROPE_FIELDS = ("dim", "patch_size", "patch_size_t", "base_num_frames", "base_height", "base_width",
                "sampling_rate", "hop_length", "scale_factors", "theta", "causal_offset", "modality",
                "double_precision", "rope_type", "num_attention_heads")


def _plain(value):
    """A module attribute as JSON (tuples of scale factors as lists)."""
    return list(value) if isinstance(value, (tuple, list)) else value


class TextEncoder(torch.nn.Module):
    """LTX2Pipeline._get_gemma_prompt_embeds then its connectors: every
    hidden state of the Gemma language model (its LM head is not needed)."""

    def __init__(self, text_encoder, connectors, padding_side: str):
        super().__init__()
        self.language_model = getattr(text_encoder, "model", text_encoder)
        self.connectors = connectors
        self.padding_side = padding_side

    def forward(self, input_ids, attention_mask):
        # No key-value cache: nothing reads it, and the TorchScript exporter would keep its lengths as constants.
        out = self.language_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                  use_cache=False)
        hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)
        video, audio, mask = self.connectors(hidden, attention_mask, padding_side=self.padding_side)
        return video, audio, mask.to(video.dtype)


def _split_rotary_out_of_place(x, freqs):
    """diffusers' transformer_ltx2.apply_split_rotary_emb with its two in-place ``addcmul_`` into halves of the
    product as ``torch.addcmul`` of the same halves, joined: the same kernels on the same values, bit for bit. The
    TorchScript exporter mistranslates the writes into views (its file differed from torch by 0.5)."""
    cos, sin = freqs
    x_dtype = x.dtype
    needs_reshape = False
    if x.ndim != 4 and cos.ndim == 4:
        b, h, t, _ = cos.shape
        x = x.reshape(b, t, h, -1).swapaxes(1, 2)
        needs_reshape = True
    last = x.shape[-1]
    if last % 2 != 0:
        raise ValueError(f"Expected x.shape[-1] to be even for split rotary, got {last}.")
    split_x = x.reshape(*x.shape[:-1], 2, last // 2).float()
    first_x, second_x = split_x[..., :1, :], split_x[..., 1:, :]
    cos_u, sin_u = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = split_x * cos_u
    out = torch.cat([torch.addcmul(out[..., :1, :], -sin_u, second_x), torch.addcmul(out[..., 1:, :], sin_u, first_x)],
                    dim=-2)
    out = out.reshape(*out.shape[:-2], last)
    if needs_reshape:
        out = out.swapaxes(1, 2).reshape(b, t, -1)
    return out.to(dtype=x_dtype)


@contextlib.contextmanager
def rotary_out_of_place():
    """diffusers' LTX-2 attention (the transformer's and the text connectors') calling _split_rotary_out_of_place:
    what the TorchScript exporter traces (ExportableComponent.torchscript_context)."""
    from diffusers.models.transformers import transformer_ltx2

    kept = transformer_ltx2.apply_split_rotary_emb
    transformer_ltx2.apply_split_rotary_emb = _split_rotary_out_of_place
    try:
        yield
    finally:
        transformer_ltx2.apply_split_rotary_emb = kept


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


def video_shards(sequence_marker, hidden, video_coords, video_timestep):
    """This rank's chunk of the video's tokens, of their coordinates and per-token timesteps (every
    per-token stream the blocks see derives from these); the sound stays whole on every rank."""
    return (sequence_shard(hidden, 1, sequence_marker), sequence_shard(video_coords, 2, sequence_marker),
            None if video_timestep is None else sequence_shard(video_timestep, 1, sequence_marker))


class ShardedDenoiserHead(DenoiserHead):
    """DenoiserHead with the video's tokens split over the sequence ranks of a
    parallel layout (machgen::sequence_shard), joined again after the block.
    The sound is whole on every rank, and the same there: its attention over
    the split video merges every rank's part (machgen::sequence_keys_attention)."""

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                encoder_attention_mask, timestep, video_coords, audio_coords, perturbation_mask,
                cross_modal_mask, sequence_marker, video_timestep=None):
        tr = self.transformer
        whole_video, audio = tr.proj_in(hidden_states), tr.audio_proj_in(audio_hidden_states)
        video, video_coords, video_timestep = video_shards(sequence_marker, whole_video, video_coords,
                                                           video_timestep)
        streams, _, _ = step_streams(tr, hidden_states.size(0), encoder_hidden_states, audio_encoder_hidden_states,
                                     encoder_attention_mask, timestep, video_coords, audio_coords, video.dtype,
                                     video_timestep)
        video_out, audio_out = run_blocks(tr, range(1), video, audio, streams, perturbation_mask,
                                          cross_modal_mask)
        video_out = sequence_gather(video_out, 1, whole_video)
        return video_out, audio_out, pack(video_out - whole_video, audio_out - audio)


class ShardedDenoiserTail(DenoiserTail):
    """DenoiserTail with the video's tokens split as ShardedDenoiserHead's."""

    def forward(self, video_hidden, audio_hidden, encoder_hidden_states, audio_encoder_hidden_states,
                encoder_attention_mask, timestep, video_coords, audio_coords, perturbation_mask,
                cross_modal_mask, sequence_marker, video_timestep=None):
        tr = self.transformer
        batch, dtype = video_hidden.size(0), video_hidden.dtype
        # The output layer runs on the whole video: its embedded timesteps (per token for image-to-video) too.
        embedded = video_modulation(tr, timestep, video_timestep, batch, dtype)[1]
        video, video_coords, video_timestep = video_shards(sequence_marker, video_hidden, video_coords,
                                                           video_timestep)
        streams, _, audio_embedded = step_streams(
            tr, batch, encoder_hidden_states, audio_encoder_hidden_states, encoder_attention_mask,
            timestep, video_coords, audio_coords, dtype, video_timestep)
        video, audio = run_blocks(tr, range(1, len(tr.transformer_blocks)), video, audio_hidden, streams,
                                  perturbation_mask, cross_modal_mask)
        video = sequence_gather(video, 1, video_hidden)
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


def decoder_by_rows(module: torch.nn.Module):
    """What AutoencoderKLLTX2Video's decoder runs split by rows (parallel/rows.py): its convolutions that pad
    the rows (reflected at the picture's edges, as LTX-2's decoder pads); its norms are per pixel, its
    upsamplers move channels to space within each row's own rows, and it has no attention."""
    if isinstance(module, LTX2VideoResnetBlock3d) and (module.per_channel_scale1 is not None
                                                       or module.per_channel_scale2 is not None):
        raise ValueError("a decoder that injects noise drawn for the whole picture is not split by rows")
    return by_rows(module)


class SplitVaeDecoder(VaeDecoder):
    """VaeDecoder with its decoder split by rows over the ranks (decoder_by_rows)."""

    def forward(self, latents):
        with split_by_rows(self.vae.decoder, decoder_by_rows):
            return super().forward(latents)


class Ltx2Export(FamilyExport):
    sampler_assets = ("tokenizer", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_ltx2",)
    sequence_axes = ("video_tokens",)

    def sparse_attention_layers(self, pipe) -> list:
        # The video self-attention only, the long one: the audio-video attention can have keys as long as its
        # queries, and the sound's own self-attention is short.
        return [block.attn1 for block in pipe.transformer.transformer_blocks]

    def parallel_support(self, pipe, ranges: dict[str, AxisRange]) -> ParallelSupport:
        # Guidance rows: CFG's, the spatio-temporal guidance's perturbed and the modality guidance's isolated
        # rows, all in each step's one call. The sequence split is the video's (Ulysses over its heads); the
        # sound, short, stays whole on every rank.
        return ParallelSupport(heads=pipe.transformer.config.num_attention_heads, guidance_rows=True)

    def sequence_parallel(self, component: ExportableComponent) -> ExportableComponent | None:
        # Head and tail split the video themselves: its positions and per-token timesteps come whole.
        sharded = {"denoiser_head": ShardedDenoiserHead, "denoiser_tail": ShardedDenoiserTail}.get(
            component.spec.name)
        if sharded is None:
            return None
        marker = TensorSpec(SEQUENCE_MARKER, "int64", ("sequence_degree",))
        # Two chunks in the sample: a length of one would be fixed by the trace.
        return ExportableComponent(dataclasses.replace(component.spec, inputs=component.spec.inputs + (marker,)),
                                   sharded(component.module.transformer).eval(),
                                   {**component.sample_inputs, SEQUENCE_MARKER: torch.zeros(2, dtype=torch.int64)})

    def decoder_split_by_rows(self, component: ExportableComponent) -> OnRanks | None:
        if component.spec.name != "vae_decoder":
            return None
        # Its convolutions pad by reflection: the picture's edge bands mirror their second row.
        return OnRanks(dataclasses.replace(component, module=SplitVaeDecoder(component.module.vae).eval()),
                       ("latent_height", "height"), ranks="all", min_rows=2)

    @contextlib.contextmanager
    def sequence_attention_swap(self, pipe):
        # The video's self-attention across the ranks; the sound's attention over the video (video-to-audio)
        # merges every rank's keys; the sound's own attention and the video's over the sound stay as they are
        # (whole sound keys on every rank), whatever the lengths.
        blocks = pipe.transformer.transformer_blocks
        with sequence_attention_swapped(self.attention_modules, [block.attn1 for block in blocks]), \
                sequence_keys_attention_swapped(self.attention_modules,
                                                [block.video_to_audio_attn for block in blocks]):
            yield

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        tr = pipe.transformer.config
        inner, audio_inner = tr.num_attention_heads * tr.attention_head_dim, \
            tr.audio_num_attention_heads * tr.audio_attention_head_dim
        video_text, audio_text = (tr.caption_channels, tr.caption_channels) if tr.use_prompt_embeddings \
            else (inner, audio_inner)
        return ltx2_specs(video_text_dim=video_text, audio_text_dim=audio_text, inner_dim=inner,
                           audio_inner_dim=audio_inner, in_channels=tr.in_channels,
                           audio_channels=tr.audio_in_channels, layers=tr.num_layers,
                           latent_channels=pipe.vae.config.latent_channels,
                           audio_latent_channels=self._audio_packed_channels(pipe),
                           sound_channels=pipe.vocoder.config.out_channels, image_to_video=self.image_to_video)

    @property
    def image_to_video(self) -> bool:
        return "image-to-video" in self.family.capabilities.tasks

    @staticmethod
    def _audio_packed_channels(pipe) -> int:
        return pipe.audio_vae.config.latent_channels * (pipe.audio_vae.config.mel_bins
                                                        // pipe.audio_vae_mel_compression_ratio)

    def components(self, pipe) -> list[ExportableComponent]:
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
        encoder = TextEncoder(pipe.text_encoder, pipe.connectors, padding_side="left").eval()
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
        head_module = DenoiserHead(pipe.transformer).eval()
        with torch.no_grad():
            video_hidden, audio_hidden, residual = (output.cpu().float() for output in head_module(
                **{name: value.to(device, dtype) for name, value in {**latents, **step}.items()}))
        vae_spatial = pipe.vae_spatial_compression_ratio
        latent_mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        components = [
            ExportableComponent(specs["text_encoder"], encoder, {"input_ids": ids, "attention_mask": text_mask},
                                torchscript_context=rotary_out_of_place),
            ExportableComponent(specs["denoiser_head"], head_module, {**latents, **step},
                                torchscript_context=rotary_out_of_place),
            ExportableComponent(specs["denoiser_tail"], DenoiserTail(pipe.transformer).eval(),
                                {"video_hidden": video_hidden, "audio_hidden": audio_hidden, **step},
                                torchscript_context=rotary_out_of_place),
            ExportableComponent(specs["denoiser_reuse"], DenoiserReuse(pipe.transformer).eval(),
                                {**latents, **timesteps, "blocks_residual": randn(*residual.shape)}),
            ExportableComponent(specs["vae_decoder"], VaeDecoder(pipe.vae).eval(),
                                {"latents": randn(batch, pipe.vae.config.latent_channels, frames, lat_h, lat_w)}),
            ExportableComponent(specs["audio_decoder"],
                                AudioDecoder(pipe.audio_vae, pipe.vocoder, latent_mel).eval(),
                                {"audio_latents": randn(batch, audio_frames, self._audio_packed_channels(pipe))}),
            ExportableComponent(specs["postprocess"], Postprocess().eval(),
                                {"frames": randn(batch, 3, 5, lat_h * vae_spatial, lat_w * vae_spatial) * 0.8}),
        ]
        if self.image_to_video:  # drawn last: the other components' samples, and so their exports, are text-to-video's
            components.append(ExportableComponent(
                specs["vae_encoder"], VaeEncoder(pipe.vae).eval(),
                {"frames": randn(batch, 3, 1, lat_h * vae_spatial, lat_w * vae_spatial)}))
        return components

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # LTX2Pipeline.__call__'s defaults: 768x512, 121 frames at 24 fps, 30 steps, the LTX-2.3 guidance.
        return ServedDefaults(height=512, width=768, num_inference_steps=30, guidance_scale=3.0, negative_prompt="",
                              max_sequence_length=1024, max_height=1280, max_width=1280, num_frames=121,
                              max_frames=257, fps=24)

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
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
