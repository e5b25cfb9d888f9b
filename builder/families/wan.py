"""Wan (Wan 2.1 and Wan 2.2 text-to-video): diffusers' WanPipeline.

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
- ``postprocess``         frames in [-1, 1] -> uint8 [frames, H, W, 3]

The video is decoded latent frame by latent frame, each chunk turned into
uint8 frames at once, so memory stays that of one chunk whatever the length
(AutoencoderKLWan.decode walks the frames the same way, keeping the whole
float video). Concurrent requests of one size batch each decoder call.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

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

_SCALAR = ("batch", 1)
# Wan 2.2's low-noise expert answers under this component prefix.
EXPERT_PREFIXES = ("denoiser", "denoiser_2")


def _denoiser_specs(prefix: str, *, in_channels: int, out_channels: int, text_dim: int, inner_dim: int,
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
            inputs=(latents, timestep, TensorSpec("encoder_hidden_states", "float32", ("batch", "text_tokens", text_dim)))
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


def _chunk_specs(latent_channels: int, temporal_factor: int, coder: str) -> list[ComponentSpec]:
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


def _wan_specs(*, in_channels: int, out_channels: int, text_dim: int, inner_dim: int, experts: int,
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
        specs += _denoiser_specs(prefix, in_channels=in_channels, out_channels=out_channels, text_dim=text_dim,
                                 inner_dim=inner_dim, control_channels=control_channels)
    specs += _chunk_specs(out_channels, temporal_factor, "decoder")
    if vae_encoder:
        specs += _chunk_specs(out_channels, temporal_factor, "encoder")
    specs.append(ComponentSpec(
        "postprocess",
        inputs=(TensorSpec("frames", "float32", ("batch", 3, "frames", "height", "width")),),
        outputs=(TensorSpec("images", "uint8", ("batch", "frames", "height", "width", 3)),),
        tolerance=1.0,  # one step of 255 where rounding lands on the other side of .5
        in_sampler=True,
    ))
    return {s.name: s for s in specs}


def _modules():
    """The torch wrappers, defined lazily so that listing families stays light."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    class TextEncoder(torch.nn.Module):
        def __init__(self, umt5):
            super().__init__()
            self.umt5 = umt5

        def forward(self, input_ids, attention_mask):
            hidden = self.umt5(input_ids, attention_mask).last_hidden_state
            # WanPipeline keeps each prompt's own tokens and pads with zeros: the mask is a prefix of ones.
            return hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)

    def time_embedding(tr, timestep, like):
        """WanTimeTextImageEmbedding's time half: (temb, timestep_proj [batch, 6, inner])."""
        embedder = tr.condition_embedder
        projected = embedder.timesteps_proj(timestep.reshape(-1))
        projected = projected.to(next(iter(embedder.time_embedder.parameters())).dtype)
        temb = embedder.time_embedder(projected).type_as(like)
        return temb, embedder.time_proj(embedder.act_fn(temb)).unflatten(1, (6, -1))

    def patches(embedding, latents):
        """A patch embedding's tokens [batch, tokens, inner] of latents [batch, C, frames, h, w]."""
        return embedding(latents).flatten(2).transpose(1, 2).contiguous()

    def output(tr, hidden, temb, latents):
        """WanTransformer3DModel.forward's output norm, projection and unpatchify."""
        batch, _, frames, height, width = latents.shape
        p_t, p_h, p_w = tr.config.patch_size
        shift, scale = (tr.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (tr.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = tr.proj_out(hidden)
        hidden = hidden.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    class DenoiserHead(torch.nn.Module):
        """WanTransformer3DModel.forward up to and including the first block."""

        def __init__(self, transformer):
            super().__init__()
            self.transformer = transformer

        def forward(self, hidden_states, timestep, encoder_hidden_states):
            tr = self.transformer
            embedded = patches(tr.patch_embedding, hidden_states)
            temb, timestep_proj = time_embedding(tr, timestep, encoder_hidden_states)
            text_hidden = tr.condition_embedder.text_embedder(encoder_hidden_states)
            hidden = tr.blocks[0](embedded, text_hidden, timestep_proj, tr.rope(hidden_states))
            return hidden, text_hidden, timestep_proj, temb, hidden - embedded

    class DenoiserTail(torch.nn.Module):
        """The rest of WanTransformer3DModel.forward after the first block."""

        def __init__(self, transformer):
            super().__init__()
            self.transformer = transformer

        def forward(self, image_hidden, text_hidden, timestep_proj, temb, hidden_states):
            tr = self.transformer
            rotary = tr.rope(hidden_states)
            hidden = image_hidden
            for block in tr.blocks[1:]:
                hidden = block(hidden, text_hidden, timestep_proj, rotary)
            return output(tr, hidden, temb, hidden_states), hidden - image_hidden

    class DenoiserReuse(torch.nn.Module):
        """WanTransformer3DModel.forward with every block replaced by a kept residual."""

        def __init__(self, transformer):
            super().__init__()
            self.transformer = transformer

        def forward(self, hidden_states, timestep, blocks_residual):
            tr = self.transformer
            temb, _ = time_embedding(tr, timestep, blocks_residual)
            return output(tr, patches(tr.patch_embedding, hidden_states) + blocks_residual, temb, hidden_states)

    def two_frames(entry):
        # A one-frame entry zero-padded in front: the causal convolutions read
        # the zeros as their own padding, the time downsamplers read only the last frame.
        return torch.cat([torch.zeros_like(entry), entry], dim=2) if entry.shape[2] == 1 else entry

    class _CausalChunk(torch.nn.Module):
        """One chunk of frames through AutoencoderKLWan's encoder or decoder
        with its causal cache (the list ``_encode`` and ``_decode`` keep
        across chunks) as one flat tensor per row: the slots in use, each two
        frames long, in ``layout`` order ((channels, spatial scale against
        the latent frame) per slot). The first chunk starts from an empty
        cache and differs in structure (no time up- or downsampling), so it
        is its own module."""

        coder = "decoder"

        def __init__(self, vae, slots: tuple[int, ...] = (), layout: tuple[tuple[int, int], ...] = ()):
            super().__init__()
            self.vae = vae
            self.slots, self.layout = slots, layout
            config = vae.config
            self.spatial_factor = config.scale_factor_spatial
            self.register_buffer("latents_mean", torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1),
                                 persistent=False)
            self.register_buffer("latents_std", torch.tensor(config.latents_std).view(1, -1, 1, 1, 1),
                                 persistent=False)

        def run(self, chunk, cache, first: bool):
            """The coder on ``chunk`` with ``cache``: decoded frames in [-1, 1], or normalised latent means."""
            if self.coder == "decoder":
                # WanPipeline's latent normalisation undone first.
                chunk = self.vae.post_quant_conv(chunk * self.latents_std + self.latents_mean)
                return self.vae.decoder(chunk, feat_cache=cache, feat_idx=[0], first_chunk=first).clamp(-1, 1)
            moments = self.vae.quant_conv(self.vae.encoder(chunk, feat_cache=cache, feat_idx=[0]))
            # The distribution's mode (WanImageToVideoPipeline's argmax), normalised as the pipeline does.
            return (moments[:, :self.vae.config.z_dim] - self.latents_mean) / self.latents_std

        def latent_size(self, chunk) -> tuple[Any, Any]:
            if self.coder == "decoder":
                return chunk.shape[3], chunk.shape[4]
            return chunk.shape[3] // self.spatial_factor, chunk.shape[4] // self.spatial_factor

        def first_chunk(self, chunk):
            """(output, [(slot, two-frame cache entry)]) of the first chunk."""
            cache = [None] * self.vae._cached_conv_counts[self.coder]
            # A time-upsampling layer marks its slot "Rep" on the first chunk (it
            # reads zeros next time): its input's shape gives those zeros.
            upsampler_inputs: dict[int, Any] = {}

            def keep_input(module, args, kwargs):
                upsampler_inputs[kwargs["feat_idx"][0]] = args[0]

            hooks = [m.register_forward_pre_hook(keep_input, with_kwargs=True)
                     for m in getattr(self.vae, self.coder).modules()
                     if isinstance(m, WanResample) and m.mode == "upsample3d"]
            try:
                output = self.run(chunk, cache, first=True)
            finally:
                for hook in hooks:
                    hook.remove()
            entries = [(slot, two_frames(torch.zeros_like(upsampler_inputs[slot]) if isinstance(entry, str)
                                         else entry))
                       for slot, entry in enumerate(cache) if entry is not None]
            return output, entries

    class _FirstChunk(_CausalChunk):
        def forward(self, chunk):
            output, entries = self.first_chunk(chunk)
            return output, torch.cat([entry.flatten(1) for _, entry in entries], dim=1)

    class _NextChunk(_CausalChunk):
        def forward(self, chunk, cache):
            batch = chunk.shape[0]
            height, width = self.latent_size(chunk)
            entries = [None] * self.vae._cached_conv_counts[self.coder]
            sizes = [channels * 2 * height * scale * width * scale for channels, scale in self.layout]
            for slot, part, (channels, scale) in zip(self.slots, torch.split(cache, sizes, dim=1), self.layout):
                entries[slot] = part.reshape(batch, channels, 2, height * scale, width * scale)
            output = self.run(chunk, entries, first=False)
            return output, torch.cat([two_frames(entries[slot]).flatten(1) for slot in self.slots], dim=1)

    class VaeDecoderFirst(_FirstChunk):
        def forward(self, latents):
            return super().forward(latents)

    class VaeDecoderNext(_NextChunk):
        def forward(self, latents, decoder_cache):
            return super().forward(latents, decoder_cache)

    class VaeEncoderFirst(_FirstChunk):
        coder = "encoder"

        def forward(self, frames):
            return super().forward(frames)

    class VaeEncoderNext(_NextChunk):
        coder = "encoder"

        def forward(self, frames, encoder_cache):
            return super().forward(frames, encoder_cache)

    class _Vace:
        """WanVACETransformer3DModel's control branch: its block j (run in
        order) makes the hint added after the j-th main block of vace_layers.
        diffusers runs every control block before the main blocks; a control
        block reads only the control stream, the text and the timestep
        (the first also the embedded latents), so running each where its hint
        is needed computes the same."""

        def hint_after(self, block: int) -> int | None:
            """The control block whose hint follows main block ``block``, or None."""
            layers = sorted(self.transformer.config.vace_layers)
            return layers.index(block) if block in layers else None

    class VaceDenoiserHead(DenoiserHead, _Vace):
        def forward(self, hidden_states, timestep, encoder_hidden_states, control_hidden_states):
            tr = self.transformer
            embedded = patches(tr.patch_embedding, hidden_states)
            temb, timestep_proj = time_embedding(tr, timestep, encoder_hidden_states)
            text_hidden = tr.condition_embedder.text_embedder(encoder_hidden_states)
            rotary = tr.rope(hidden_states)
            # The control latents cover every latent frame (references included): no padding to add.
            control = patches(tr.vace_patch_embedding, control_hidden_states)
            hint, control = tr.vace_blocks[0](embedded, text_hidden, control, timestep_proj, rotary)
            hidden = tr.blocks[0](embedded, text_hidden, timestep_proj, rotary) + hint  # layer 0 is always a VACE layer
            return hidden, text_hidden, timestep_proj, temb, hidden - embedded, control

    class VaceDenoiserTail(DenoiserTail, _Vace):
        def forward(self, image_hidden, text_hidden, timestep_proj, temb, hidden_states, control_hidden):
            tr = self.transformer
            rotary = tr.rope(hidden_states)
            hidden, control = image_hidden, control_hidden
            for index, block in enumerate(tr.blocks[1:], start=1):
                hidden = block(hidden, text_hidden, timestep_proj, rotary)
                if self.hint_after(index) is not None:
                    hint, control = tr.vace_blocks[self.hint_after(index)](hidden, text_hidden, control,
                                                                           timestep_proj, rotary)
                    hidden = hidden + hint
            return output(tr, hidden, temb, hidden_states), hidden - image_hidden

    class Postprocess(torch.nn.Module):
        """VideoProcessor.postprocess_video(output_type="np") as uint8, frames last-but-channels."""

        def forward(self, frames):
            frames = (frames / 2 + 0.5).clamp(0, 1)
            return (frames.permute(0, 2, 3, 4, 1) * 255).round().to(torch.uint8)

    return (TextEncoder, DenoiserHead, DenoiserTail, DenoiserReuse, VaeDecoderFirst, VaeDecoderNext, VaeEncoderFirst,
            VaeEncoderNext, VaceDenoiserHead, VaceDenoiserTail, Postprocess)


def _sample_chunk(vae, coder: str, frames: int, lat_h: int, lat_w: int, batch: int, gen=None):
    """A chunk a coder takes: latent frames for the decoder, pixel frames for the encoder."""
    import torch

    if coder == "decoder":
        return torch.randn(batch, vae.config.z_dim, frames, lat_h, lat_w, generator=gen)
    factor = vae.config.scale_factor_spatial
    return torch.randn(batch, 3, frames, lat_h * factor, lat_w * factor, generator=gen).clamp(-1, 1)


def _chunk_classes(coder: str):
    decoder_first, decoder_next, encoder_first, encoder_next = _modules()[4:8]
    return (decoder_first, decoder_next) if coder == "decoder" else (encoder_first, encoder_next)


def _chunk_layout(vae, coder: str) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(slots, layout) of the coder's flat cache (_CausalChunk), from a small
    first chunk in eager mode (a trace would fix the sizes it reads)."""
    import torch

    with torch.no_grad():
        _, entries = _chunk_classes(coder)[0](vae).eval().first_chunk(
            _sample_chunk(vae, coder, 1, 2, 2, 1).to(vae.device, vae.dtype))
    return (tuple(slot for slot, _ in entries),
            tuple((int(entry.shape[1]), int(entry.shape[3]) // 2) for _, entry in entries))


def cache_per_latent_pixel(vae, coder: str) -> int:
    """Elements of a row's flat cache per latent pixel (of height x width)."""
    return sum(2 * channels * scale * scale for channels, scale in _chunk_layout(vae, coder)[1])


def vae_chunk_components(vae, coder: str, temporal_factor: int) -> list[ExportableComponent]:
    """``vae_<coder>_first`` and ``vae_<coder>_next`` of an AutoencoderKLWan
    (coder: "decoder" or "encoder"), with sample inputs (batch 2, 6x4
    latents) on the CPU in float32."""
    import torch

    first_class, next_class = _chunk_classes(coder)
    first_spec, next_spec = _chunk_specs(vae.config.z_dim, temporal_factor, coder)
    gen = torch.Generator().manual_seed(1)
    first = first_class(vae).eval()
    first_chunk = _sample_chunk(vae, coder, 1, 6, 4, 2, gen)
    with torch.no_grad():
        _, cache = first(first_chunk.to(vae.device, vae.dtype))
    next_chunk = _sample_chunk(vae, coder, next_spec.inputs[0].shape[2], 6, 4, 2, gen)
    return [ExportableComponent(first_spec, first, {first_spec.inputs[0].name: first_chunk}),
            ExportableComponent(next_spec, next_class(vae, *_chunk_layout(vae, coder)).eval(),
                                {next_spec.inputs[0].name: next_chunk, next_spec.inputs[1].name: cache.cpu().float()})]


@register_family
class Wan(Family):
    name = "wan"
    diffusers_pipeline = "WanPipeline"
    capabilities = Capabilities(tasks=("text-to-video",), true_cfg=True, guidance_is_cfg=True)
    sampler_assets = ("tokenizer", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_wan",)

    # ------------------------------------------------------------------ build
    @staticmethod
    def experts(pipe) -> int:
        """1, or 2 for Wan 2.2's high- and low-noise experts; refuses what is not supported."""
        if getattr(pipe.config, "expand_timesteps", False) or pipe.vae.config.patch_size is not None:
            raise ValueError("Wan 2.2 TI2V-5B (a timestep per token, a patchified VAE) is not supported yet")
        if pipe.transformer is None:
            raise ValueError("a Wan pipeline without its high-noise transformer is not supported")
        return 2 if pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None else 1

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        tr = pipe.transformer.config
        return _wan_specs(in_channels=tr.in_channels, out_channels=tr.out_channels, text_dim=tr.text_dim,
                          vae_encoder=self.encodes_pictures, control_channels=self.control_channels(pipe),
                          inner_dim=tr.num_attention_heads * tr.attention_head_dim, experts=self.experts(pipe),
                          temporal_factor=pipe.vae_scale_factor_temporal)

    @property
    def encodes_pictures(self) -> bool:
        """Whether requests bring pictures for the VAE encoder (image- and reference-to-video)."""
        return bool({"image-to-video", "reference-to-video"} & set(self.capabilities.tasks))

    def control_channels(self, pipe) -> int | None:
        """The channels of VACE's control latents (reference-to-video), None without a control branch."""
        return None

    def denoiser_modules(self):
        """(head, tail, reuse) module classes."""
        modules = _modules()
        return modules[1:4]

    def components(self, pipe) -> list[ExportableComponent]:
        import torch

        text_encoder, *_, postprocess = _modules()
        head, tail, reuse = self.denoiser_modules()
        specs = self.specs(pipe)
        control_channels = self.control_channels(pipe)
        tr = pipe.transformer.config
        # Batch 2 (batch 1 would be specialised), sizes unlike any fixed size in the model.
        batch, text_tokens, frames, lat_h, lat_w = 2, 7, 3, 6, 4
        gen = torch.Generator().manual_seed(0)
        device, dtype = pipe.transformer.device, pipe.transformer.dtype

        def randn(*shape):
            return torch.randn(*shape, generator=gen)

        mask = torch.ones(batch, text_tokens, dtype=torch.int64)
        mask[1, 4:] = 0
        exportable = [ExportableComponent(
            specs["text_encoder"], text_encoder(pipe.text_encoder).eval(),
            {"input_ids": torch.randint(0, pipe.text_encoder.config.vocab_size, (batch, text_tokens), generator=gen),
             "attention_mask": mask})]
        latents = randn(batch, tr.in_channels, frames, lat_h, lat_w)
        for prefix, transformer in zip(EXPERT_PREFIXES, (pipe.transformer, pipe.transformer_2)):
            if f"{prefix}_head" not in specs:
                break
            head_module = head(transformer).eval()
            head_inputs = {"hidden_states": latents, "timestep": torch.tensor([[700.0], [300.0]]),
                           "encoder_hidden_states": randn(batch, text_tokens, tr.text_dim)}
            if control_channels is not None:
                head_inputs["control_hidden_states"] = randn(batch, control_channels, frames, lat_h, lat_w)
            with torch.no_grad():
                image_hidden, text_hidden, timestep_proj, temb, _, *control = (
                    output.cpu().float() for output in head_module(
                        **{name: value.to(device, dtype) for name, value in head_inputs.items()}))
            exportable += [
                ExportableComponent(specs[f"{prefix}_head"], head_module, head_inputs),
                ExportableComponent(specs[f"{prefix}_tail"], tail(transformer).eval(),
                                    {"image_hidden": image_hidden, "text_hidden": text_hidden,
                                     "timestep_proj": timestep_proj, "temb": temb, "hidden_states": latents,
                                     **({"control_hidden": control[0]} if control else {})}),
                ExportableComponent(specs[f"{prefix}_reuse"], reuse(transformer).eval(),
                                    {"hidden_states": latents, "timestep": head_inputs["timestep"],
                                     "blocks_residual": randn(*image_hidden.shape)}),
            ]
        vae_scale = pipe.vae_scale_factor_spatial
        exportable += vae_chunk_components(pipe.vae, "decoder", pipe.vae_scale_factor_temporal)
        if "vae_encoder_first" in specs:
            exportable += vae_chunk_components(pipe.vae, "encoder", pipe.vae_scale_factor_temporal)
        exportable.append(ExportableComponent(
            specs["postprocess"], postprocess().eval(),
            {"frames": randn(batch, 3, 2, lat_h * vae_scale, lat_w * vae_scale) * 0.8}))
        return exportable

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # WanPipeline.__call__'s defaults (480x832, 81 frames at Wan's 16 fps, 50 steps, CFG 5).
        return ServedDefaults(height=480, width=832, num_inference_steps=50, guidance_scale=5.0,
                              negative_prompt="", max_sequence_length=512, max_height=1280, max_width=1280,
                              num_frames=81, max_frames=81, fps=16)

    def tiny_defaults(self) -> ServedDefaults:
        return ServedDefaults(height=48, width=32, num_inference_steps=4, guidance_scale=5.0, negative_prompt="",
                              max_sequence_length=16, max_height=96, max_width=96, num_frames=9, max_frames=17,
                              fps=16)

    def dense_attention_tokens(self, defaults: ServedDefaults) -> int:
        return 0  # self-attention over video tokens only; the text enters by cross-attention

    def tiny_pipeline(self):
        import diffusers
        import torch

        from machgen.builder.tiny import tiny_t5_encoder, tiny_t5_tokenizer

        torch.manual_seed(0)
        tokenizer = tiny_t5_tokenizer()
        text_encoder = tiny_t5_encoder(tokenizer, "UMT5EncoderModel")
        vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[False, True, True])

        high_noise = self.tiny_transformer()
        low_noise = None if self.tiny_boundary_ratio is None else self.tiny_transformer()
        for module in (text_encoder, vae, high_noise, low_noise):
            if module is not None:
                module.eval()
        pipeline_class = getattr(diffusers, self.diffusers_pipeline)
        return pipeline_class(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
            scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                        flow_shift=3.0),
            transformer=high_noise, transformer_2=low_noise, boundary_ratio=self.tiny_boundary_ratio,
        )

    # The tiny model has Wan 2.2's layout: a high-noise and a low-noise expert, switched at this share of the
    # schedule (None: one transformer, as Wan 2.1).
    tiny_boundary_ratio: float | None = 0.875

    def tiny_transformer(self, in_channels: int = 16):
        import diffusers

        return diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        )

    def sampler_settings(self, pipe, defaults: ServedDefaults) -> dict[str, Any]:
        spatial = pipe.vae_scale_factor_spatial
        patch = pipe.transformer.config.patch_size
        return {
            "vae_scale_factor": spatial,
            "temporal_factor": pipe.vae_scale_factor_temporal,
            # Height and width must be multiples of this: the VAE factor times the transformer's patch.
            "size_multiple": spatial * max(patch[1], patch[2]),
            "patch_size": list(patch),
            "latent_channels": pipe.vae.config.z_dim,
            "experts": self.experts(pipe),
            "boundary_timestep": None if pipe.config.boundary_ratio is None
            else pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps,
            "tokenizer_class": type(pipe.tokenizer).__name__,
            "max_sequence_length": defaults.max_sequence_length,
            "scheduler_class": type(pipe.scheduler).__name__,
            "decoder_cache_per_latent_pixel": cache_per_latent_pixel(pipe.vae, "decoder"),
            **({"encoder_cache_per_latent_pixel": cache_per_latent_pixel(pipe.vae, "encoder")}
               if self.encodes_pictures else {}),
        }

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        vae, multiple, temporal = settings["vae_scale_factor"], settings["size_multiple"], settings["temporal_factor"]
        _, patch_h, patch_w = settings["patch_size"]

        def scaled(size: AxisRange, factor: int) -> AxisRange:
            return AxisRange(size.min // factor, size.opt // factor, size.max // factor)

        height = AxisRange(multiple, defaults.height, defaults.max_height)
        width = AxisRange(multiple, defaults.width, defaults.max_width)
        lat_h, lat_w = scaled(height, vae), scaled(width, vae)
        frames = AxisRange(1, (defaults.num_frames - 1) // temporal + 1, (defaults.max_frames - 1) // temporal + 1)

        def product(*ranges: AxisRange, factor: int = 1) -> AxisRange:
            low, opt, high = factor, factor, factor
            for r in ranges:
                low, opt, high = low * r.min, opt * r.opt, high * r.max
            return AxisRange(low, opt, high)

        text = defaults.max_sequence_length
        return {
            "height": height, "width": width, "latent_height": lat_h, "latent_width": lat_w,
            "latent_frames": frames, "frames": AxisRange(1, temporal, temporal),
            "video_tokens": product(frames, scaled(lat_h, patch_h), scaled(lat_w, patch_w)),
            "text_tokens": AxisRange(text, text, text),
            **{f"{coder}_cache": product(lat_h, lat_w, factor=settings[f"{coder}_cache_per_latent_pixel"])
               for coder in ("decoder", "encoder") if f"{coder}_cache_per_latent_pixel" in settings},
        }

    # --------------------------------------------------------------- run time
    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return WanConditioning(settings, assets_dir, run_component)


class WanConditioning:
    """The Wan-specific half of the sampler: prompts, noise, timesteps, experts, decode.

    Mirrors WanPipeline step for step (_get_t5_prompt_embeds, prepare_latents,
    the expert switch at the boundary timestep, the VAE's frame-by-frame
    decode) so that a seed gives the same video.
    """

    def __init__(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        import diffusers
        import transformers
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        self._prompt_clean = prompt_clean
        self.settings = settings
        self.run_component = run_component
        self.tokenizer = getattr(transformers, settings["tokenizer_class"]).from_pretrained(
            os.path.join(assets_dir, "tokenizer"))
        with open(os.path.join(assets_dir, "scheduler", "scheduler_config.json")) as f:
            self.scheduler_config = json.load(f)
        self._scheduler_class = getattr(diffusers, settings["scheduler_class"])

    @property
    def size_multiple(self) -> int:
        return self.settings["size_multiple"]

    @property
    def frame_multiple(self) -> int:
        return self.settings["temporal_factor"]

    @property
    def experts(self) -> int:
        return self.settings["experts"]

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """WanPipeline._get_t5_prompt_embeds for a list of prompts, one row each."""
        import numpy as np

        from machgen.ensembles.tensors import as_torch

        tokens = self.tokenizer([self._prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=self.settings["max_sequence_length"], truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="np")
        outputs = self.run_component("text_encoder", {"input_ids": tokens.input_ids.astype(np.int64),
                                                      "attention_mask": tokens.attention_mask.astype(np.int64)})
        return {"encoder_hidden_states": as_torch(outputs["prompt_embeds"])}

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.settings["vae_scale_factor"]
        return height // factor, width // factor

    def initial_latents(self, seed: int, height: int, width: int, num_frames: int = 1):
        """Noise exactly as WanPipeline.prepare_latents draws it: [1, C, latent frames, h, w]."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        shape = (1, self.settings["latent_channels"], (num_frames - 1) // self.frame_multiple + 1,
                 *self.latent_size(height, width))
        return randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1):
        scheduler = self._scheduler_class.from_config(self.scheduler_config)
        scheduler.set_timesteps(num_inference_steps)
        scheduler.set_begin_index(0)
        return scheduler

    def expert(self, timestep) -> str:
        """The component prefix of the denoiser for ``timestep``: Wan 2.2's
        high-noise expert from the start down to the boundary, the low-noise one after."""
        boundary = self.settings["boundary_timestep"]
        return EXPERT_PREFIXES[0] if boundary is None or float(timestep) >= boundary else EXPERT_PREFIXES[1]

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        import torch

        rows = conditioning["encoder_hidden_states"].shape[0]
        return {
            "hidden_states": latents.expand(rows, -1, -1, -1, -1).contiguous(),
            "timestep": torch.full((rows, 1), float(timestep), device=latents.device),
            "encoder_hidden_states": conditioning["encoder_hidden_states"],
        }

    def decoder_latents(self, latents, height: int, width: int):
        return latents

    def decode(self, latents) -> Any:
        return decode_video(latents, self.run_component)

    def encode_frames(self, first, black_chunks: int) -> Any:
        """The normalised latent means [1, C, 1 + black_chunks, h, w] of a
        video: the frame ``first`` ([1, 3, 1, H, W] in [-1, 1]) followed by
        ``black_chunks`` x frame_multiple black frames, encoded chunk by chunk
        (the chunked VAE encoder; AutoencoderKLWan.encode walks them the same way)."""
        import numpy as np
        import torch

        from machgen.ensembles.tensors import as_torch

        outputs = self.run_component("vae_encoder_first", {"frames": first})
        latents, cache = [as_torch(outputs["latents"])], outputs["encoder_cache"]
        black = np.zeros((1, 3, self.frame_multiple, *first.shape[3:]), np.float32)
        for _ in range(black_chunks):
            outputs = self.run_component("vae_encoder_next", {"frames": black, "encoder_cache": cache})
            latents.append(as_torch(outputs["latents"]).to(latents[0].device))
            cache = outputs["updated_cache"]
        return torch.cat(latents, dim=2)


@register_family
class WanImageToVideo(Wan):
    """Wan 2.2 image-to-video (WanImageToVideoPipeline without an image
    encoder, as Wan2.2-I2V-A14B): every step's transformer input carries, after
    the noisy latents, a first-frame mask and the latents of the picture
    followed by empty frames (the VAE encoder, chunked like the decoder)."""

    name = "wan-i2v"
    diffusers_pipeline = "WanImageToVideoPipeline"
    capabilities = Capabilities(tasks=("image-to-video",), true_cfg=True, guidance_is_cfg=True)

    tiny_boundary_ratio = 0.9

    def tiny_transformer(self, in_channels: int = 36):
        # The noisy latents, then the first-frame mask (4 channels) and the picture's latents.
        return super().tiny_transformer(in_channels)

    @staticmethod
    def experts(pipe) -> int:
        if getattr(pipe, "image_encoder", None) is not None or pipe.transformer.config.image_dim is not None:
            raise ValueError("Wan 2.1 image-to-video (CLIP image embeddings in the transformer) is not supported "
                             "yet; Wan 2.2's (no image encoder) is")
        return Wan.experts(pipe)

    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return WanImageToVideoConditioning(settings, assets_dir, run_component)


class WanImageToVideoConditioning(WanConditioning):
    """WanImageToVideoPipeline.prepare_latents' condition, and the transformer
    input it makes with the latents."""

    def request_conditioning(self, request) -> dict[str, Any]:
        """The mask (first latent frame 1, the others 0) and the normalised
        latent means of the picture followed by num_frames - 1 black frames."""
        import torch

        latent_condition = self.encode_frames(_pixels(request.image), (request.num_frames - 1) // self.frame_multiple)
        mask = torch.zeros_like(latent_condition[:, :self.frame_multiple])
        mask[:, :, 0] = 1
        return {"image_condition": torch.cat([mask, latent_condition], dim=1)}

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        import torch

        condition = conditioning["image_condition"].to(latents.device)
        return super().denoiser_inputs(torch.cat([latents, condition], dim=1), timestep, conditioning,
                                       guidance_scale, height, width)


@register_family
class WanVace(Wan):
    """Wan VACE (WanVACEPipeline: Wan2.1-VACE, Wan 2.2 VACE-Fun's two experts)
    with reference images and no control video or mask: reference-to-video,
    or text-to-video without references. A control branch (``vace_blocks``)
    reads latents of an empty video, of each reference image and a mask, and
    adds a hint after each of its ``vace_layers``; each reference also adds a
    latent frame in front of the video, denoised and then dropped."""

    name = "wan-vace"
    diffusers_pipeline = "WanVACEPipeline"
    capabilities = Capabilities(tasks=("text-to-video", "reference-to-video"), true_cfg=True, guidance_is_cfg=True)
    # The tiny model has Wan2.1-VACE's layout: one transformer.
    tiny_boundary_ratio = None

    def tiny_transformer(self, in_channels: int = 16):
        import diffusers
        import torch

        # Control latents: the empty video's twice (16 + 16 channels) and the 8 x 8 mask of each latent pixel.
        transformer = diffusers.WanVACETransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
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

    def control_channels(self, pipe) -> int | None:
        return pipe.transformer.config.vace_in_channels

    def denoiser_modules(self):
        modules = _modules()
        return modules[8], modules[9], modules[3]

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        from machgen.ensembles.api import MAX_REFERENCE_IMAGES

        ranges = super().axis_ranges(defaults, settings)
        frames, tokens = ranges["latent_frames"], ranges["video_tokens"]
        # Each reference image adds a latent frame in front of the video.
        ranges["latent_frames"] = AxisRange(frames.min, frames.opt, frames.max + MAX_REFERENCE_IMAGES)
        ranges["video_tokens"] = AxisRange(tokens.min, tokens.opt,
                                           tokens.max // frames.max * (frames.max + MAX_REFERENCE_IMAGES))
        return ranges

    def make_sampler(self, settings: dict[str, Any], assets_dir: str, run_component: Callable):
        return WanVaceConditioning(settings, assets_dir, run_component)


class WanVaceConditioning(WanConditioning):
    """WanVACEPipeline's control latents (preprocess_conditions,
    prepare_video_latents, prepare_masks without video or mask) and the
    reference frames in front of the video."""

    def reference_frames(self, request) -> int:
        return 0 if request.reference_images is None else len(request.reference_images)

    def request_conditioning(self, request) -> dict[str, Any]:
        """[1, control channels, references + latent frames, h, w]: the empty
        video's latents twice (its inactive and reactive parts are both
        empty), each reference's latents beside zeros in front of them (the
        last reference first, as the pipeline prepends them), then the mask:
        0 on the references' frames, 1 on the video's."""
        import numpy as np
        import torch

        empty_first = np.zeros((1, 3, 1, request.height, request.width), np.float32)
        empty = self.encode_frames(empty_first, (request.num_frames - 1) // self.frame_multiple)
        control = torch.cat([empty, empty], dim=1)
        for picture in request.reference_images if request.reference_images is not None else ():
            latent = self.encode_frames(_pixels(picture), 0)
            control = torch.cat([torch.cat([latent, torch.zeros_like(latent)], dim=1), control], dim=2)
        spatial = self.settings["vae_scale_factor"]
        mask = control.new_ones(1, spatial * spatial, *control.shape[2:])
        mask[:, :, :self.reference_frames(request)] = 0
        return {"control_hidden_states": torch.cat([control, mask], dim=1)}

    def denoiser_inputs(self, latents, timestep, conditioning: dict[str, Any], guidance_scale: float,
                        height: int, width: int) -> dict[str, Any]:
        inputs = super().denoiser_inputs(latents, timestep, conditioning, guidance_scale, height, width)
        control = conditioning["control_hidden_states"].to(latents.device)
        inputs["control_hidden_states"] = control.expand(len(inputs["hidden_states"]), -1, -1, -1, -1).contiguous()
        return inputs


def _pixels(picture) -> Any:
    """VideoProcessor.preprocess of a uint8 [H, W, 3] picture: [1, 3, 1, H, W] float32 in [-1, 1]."""
    import numpy as np

    return np.ascontiguousarray((picture.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(2, 0, 1)[None, :, None])


def decode_video(latents, run_component: Callable) -> Any:
    """uint8 frames [F, H, W, 3] (numpy) of latents [1, C, latent frames, h,
    w]: the decoder components run latent frame by latent frame, each chunk
    made uint8 by ``postprocess`` before the next is decoded."""
    import numpy as np

    from machgen.ensembles.tensors import as_numpy, as_torch

    latents = as_torch(latents)
    chunks = []
    cache = None
    for index in range(latents.shape[2]):
        frame = latents[:, :, index:index + 1].contiguous()
        if index == 0:
            outputs = run_component("vae_decoder_first", {"latents": frame})
            cache = outputs["decoder_cache"]
        else:
            outputs = run_component("vae_decoder_next", {"latents": frame, "decoder_cache": cache})
            cache = outputs["updated_cache"]
        chunks.append(as_numpy(run_component("postprocess", {"frames": outputs["frames"]})["images"]))
    return np.concatenate(chunks, axis=1)[0]
