"""Wan's build-time half: the torch wrappers each component exports (the
denoiser's parts, VACE's control branch; the chunked causal VAE's are in
vae_chunks.py) and the ``FamilyExport`` of each Wan pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from diffusers.models.transformers import transformer_wan

from machgen.builder.family_export import ExportableComponent, FamilyExport, OnRanks
from machgen.contract.api import MAX_REFERENCE_IMAGES
from machgen.contract.specs import AxisRange, ComponentSpec, ServedDefaults, TensorSpec
from machgen.families.wan.denoiser_parts import WanDenoiserPart, patches
from machgen.families.wan.spec import EXPERT_PREFIXES, streaming_spec, wan_specs
from machgen.families.wan.vae_chunks import (CHUNK_CLASSES, SplitVaeDecoderFirst, SplitVaeDecoderNext,
                                             cache_per_latent_pixel, vae_chunk_components)
from machgen.parallel.layout import SEQUENCE_MARKER, ParallelSupport
from machgen.parallel.op import sequence_gather, sequence_shard


class TextEncoder(torch.nn.Module):
    def __init__(self, umt5):
        super().__init__()
        self.umt5 = umt5

    def forward(self, input_ids, attention_mask):
        hidden = self.umt5(input_ids, attention_mask).last_hidden_state
        # WanPipeline keeps each prompt's own tokens and pads with zeros: the mask is a prefix of ones.
        return hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)


class DenoiserHead(WanDenoiserPart):
    """WanTransformer3DModel.forward up to and including the first block."""

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        tr = self.transformer
        embedded = patches(tr.patch_embedding, hidden_states)
        temb, timestep_proj = self.time_embedding(timestep, encoder_hidden_states)
        text_hidden = tr.condition_embedder.text_embedder(encoder_hidden_states)
        hidden = tr.blocks[0](embedded, text_hidden, timestep_proj, tr.rope(hidden_states))
        return hidden, text_hidden, timestep_proj, temb, hidden - embedded


class DenoiserTail(WanDenoiserPart):
    """The rest of WanTransformer3DModel.forward after the first block."""

    def forward(self, image_hidden, text_hidden, timestep_proj, temb, hidden_states):
        tr = self.transformer
        rotary = tr.rope(hidden_states)
        hidden = image_hidden
        for block in tr.blocks[1:]:
            hidden = block(hidden, text_hidden, timestep_proj, rotary)
        return self.output(hidden, temb, hidden_states), hidden - image_hidden


class ShardedDenoiserTail(DenoiserTail):
    """DenoiserTail with its tokens split over the sequence ranks of a
    parallel layout: the rotary positions are computed from the whole
    latents' shape, then each rank keeps its chunk of them and of the tokens;
    the blocks' self-attention exchanges across the ranks; the tokens are
    joined again before the output layer."""

    def forward(self, image_hidden, text_hidden, timestep_proj, temb, hidden_states, sequence_marker):
        tr = self.transformer
        rotary = tuple(sequence_shard(part, 1, sequence_marker) for part in tr.rope(hidden_states))
        hidden = sequence_shard(image_hidden, 1, sequence_marker)
        timestep_proj = self.blocks_modulation(timestep_proj, sequence_marker)
        for block in tr.blocks[1:]:
            hidden = block(hidden, text_hidden, timestep_proj, rotary)
        hidden = sequence_gather(hidden, 1, image_hidden)
        return self.output(hidden, temb, hidden_states), hidden - image_hidden

    def blocks_modulation(self, timestep_proj, sequence_marker):
        """The blocks' modulation for this rank's tokens: one per row here, the same for all of them."""
        return timestep_proj


class DenoiserReuse(WanDenoiserPart):
    """WanTransformer3DModel.forward with every block replaced by a kept residual."""

    def forward(self, hidden_states, timestep, blocks_residual):
        tr = self.transformer
        temb, _ = self.time_embedding(timestep, blocks_residual)
        return self.output(patches(tr.patch_embedding, hidden_states) + blocks_residual, temb, hidden_states)


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
        temb, timestep_proj = self.time_embedding(timestep, encoder_hidden_states)
        text_hidden = tr.condition_embedder.text_embedder(encoder_hidden_states)
        rotary = tr.rope(hidden_states)
        # The control latents cover every latent frame (references included): no padding to add.
        control = patches(tr.vace_patch_embedding, control_hidden_states)
        hint, control = tr.vace_blocks[0](embedded, text_hidden, control, timestep_proj, rotary)
        hidden = tr.blocks[0](embedded, text_hidden, timestep_proj, rotary) + hint  # layer 0 is always a VACE layer
        return hidden, text_hidden, timestep_proj, temb, hidden - embedded, control


class VaceDenoiserTail(DenoiserTail, _Vace):
    def forward(self, image_hidden, text_hidden, timestep_proj, temb, hidden_states, control_hidden):
        hidden = self.blocks(image_hidden, control_hidden, text_hidden, timestep_proj,
                             self.transformer.rope(hidden_states))
        return self.output(hidden, temb, hidden_states), hidden - image_hidden

    def blocks(self, hidden, control, text_hidden, timestep_proj, rotary):
        """The main blocks after the first, each control block's hint added after its main block."""
        tr = self.transformer
        for index, block in enumerate(tr.blocks[1:], start=1):
            hidden = block(hidden, text_hidden, timestep_proj, rotary)
            if self.hint_after(index) is not None:
                hint, control = tr.vace_blocks[self.hint_after(index)](hidden, text_hidden, control,
                                                                       timestep_proj, rotary)
                hidden = hidden + hint
        return hidden


class ShardedVaceDenoiserTail(VaceDenoiserTail):
    """VaceDenoiserTail with its tokens split as ShardedDenoiserTail's: the
    control stream is token for token the video's (references included), so
    each rank keeps the same chunk of it and adds its hints locally."""

    def forward(self, image_hidden, text_hidden, timestep_proj, temb, hidden_states, control_hidden,
                sequence_marker):
        rotary = tuple(sequence_shard(part, 1, sequence_marker) for part in self.transformer.rope(hidden_states))
        hidden = self.blocks(sequence_shard(image_hidden, 1, sequence_marker),
                             sequence_shard(control_hidden, 1, sequence_marker), text_hidden, timestep_proj, rotary)
        hidden = sequence_gather(hidden, 1, image_hidden)
        return self.output(hidden, temb, hidden_states), hidden - image_hidden


class Postprocess(torch.nn.Module):
    """VideoProcessor.postprocess_video(output_type="np") as uint8, frames last-but-channels."""

    def forward(self, frames):
        frames = (frames / 2 + 0.5).clamp(0, 1)
        return (frames.permute(0, 2, 3, 4, 1) * 255).round().to(torch.uint8)


class _PairedRotaryProcessor(transformer_wan.WanAttnProcessor):
    """diffusers' WanAttnProcessor.__call__ with the rotary embedding's halves stacked as pairs (streaming.rotate)
    instead of written into every other element of an empty tensor: the same products, the same values. The
    TorchScript exporter writes those writes as ScatterNDs (the tiny Wan's tail at 1,152 tokens then ran in 15 ms
    under ONNX Runtime against 9 for the dynamo exporter's file, whose translation joins them as pairs:
    builder/export.py; in 9 with this processor)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from machgen.families.wan.streaming import rotate

        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # 512 is the context length of the text encoder, hardcoded for now
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]
        query, key, value = transformer_wan._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = transformer_wan._get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = transformer_wan.dispatch_attention_fn(
                query, key_img, value_img, attn_mask=None, dropout_p=0.0, is_causal=False,
                backend=self._attention_backend, parallel_config=None)
            hidden_states_img = hidden_states_img.flatten(2, 3).type_as(query)
        hidden_states = transformer_wan.dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend,
            parallel_config=(self._parallel_config if encoder_hidden_states is None else None))
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        return attn.to_out[1](attn.to_out[0](hidden_states))


def paired_rotary(transformer):
    """The context the TorchScript exporter traces ``transformer``'s parts in (ExportableComponent.torchscript_context):
    its attention processors, where diffusers' own, _PairedRotaryProcessor."""

    @contextlib.contextmanager
    def swapped():
        kept = {attn: attn.processor for attn in transformer.modules()
                if type(getattr(attn, "processor", None)) is transformer_wan.WanAttnProcessor}
        try:
            for attn in kept:
                attn.processor = _PairedRotaryProcessor()
            yield
        finally:
            for attn, processor in kept.items():
                attn.processor = processor

    return swapped


class WanExport(FamilyExport):
    """WanPipeline: one transformer (Wan 2.1), or Wan 2.2's high- and low-noise experts."""

    sampler_assets = ("tokenizer", "scheduler")
    attention_modules = ("diffusers.models.transformers.transformer_wan",)
    # (head, tail, reuse) module classes of each denoiser.
    denoiser_classes: tuple[type, type, type] = (DenoiserHead, DenoiserTail, DenoiserReuse)
    # The chunked coders' modules.
    chunk_classes = CHUNK_CLASSES
    # The tail that splits its tokens under a parallel layout (None: the family runs on one device).
    sharded_tail: type | None = ShardedDenoiserTail
    sequence_axes = ("video_tokens",)
    # The decoder's chunks split by rows under a parallel layout, by name; each rank keeps its rows' share of
    # the causal cache, so the flat cache of a split call is every rank's in rank order.
    split_decoder_classes: dict[str, type] = {"vae_decoder_first": SplitVaeDecoderFirst,
                                              "vae_decoder_next": SplitVaeDecoderNext}

    def check(self, pipe) -> None:
        if getattr(pipe.config, "expand_timesteps", False) or pipe.vae.config.patch_size is not None:
            raise ValueError("a Wan pipeline with a timestep per token and a patchified VAE (Wan 2.2 TI2V-5B) is "
                             f"not served by the '{self.family.name}' family")
        if pipe.transformer is None:
            raise ValueError("a Wan pipeline without its high-noise transformer is not supported")

    def parallel_support(self, pipe, ranges: dict[str, AxisRange]) -> ParallelSupport | None:
        if self.sharded_tail is None:
            return None
        # Guidance rows: the negative prompt's (CFG) in each denoiser call.
        return ParallelSupport(heads=pipe.transformer.config.num_attention_heads, guidance_rows=True)

    def sequence_parallel(self, component: ExportableComponent) -> ExportableComponent | None:
        # The tails run on the ranks; the heads (one block of many) on one device.
        spec = component.spec
        if self.sharded_tail is None or not spec.name.endswith("_tail"):
            return None
        marker = TensorSpec(SEQUENCE_MARKER, "int64", ("sequence_degree",))
        # Two chunks in the sample: a length of one would be fixed by the trace.
        return ExportableComponent(dataclasses.replace(spec, inputs=spec.inputs + (marker,)),
                                   self.sharded_tail(component.module.transformer).eval(),
                                   {**component.sample_inputs, SEQUENCE_MARKER: torch.zeros(2, dtype=torch.int64)})

    def decoder_split_by_rows(self, component: ExportableComponent) -> OnRanks | None:
        variant = self.split_decoder_classes.get(component.spec.name)
        if variant is None or self.sharded_tail is None:
            return None
        chunk = component.module
        return OnRanks(dataclasses.replace(component, module=variant(chunk.vae, chunk.slots, chunk.layout).eval()),
                       ("latent_height", "height", "decoder_cache"), ranks="all")

    @staticmethod
    def experts(pipe) -> int:
        """1, or 2 for Wan 2.2's high- and low-noise experts."""
        return 2 if pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None else 1

    @property
    def encodes_pictures(self) -> bool:
        """Whether requests bring pictures for the VAE encoder (image- and reference-to-video)."""
        return bool({"image-to-video", "reference-to-video"} & set(self.family.capabilities.tasks))

    def control_channels(self, pipe) -> int | None:
        """The channels of VACE's control latents (reference-to-video), None without a control branch."""
        return None

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        self.check(pipe)
        tr = pipe.transformer.config
        return wan_specs(in_channels=tr.in_channels, out_channels=tr.out_channels, text_dim=tr.text_dim,
                         vae_encoder=self.encodes_pictures, control_channels=self.control_channels(pipe),
                         inner_dim=tr.num_attention_heads * tr.attention_head_dim, experts=self.experts(pipe),
                         temporal_factor=pipe.vae_scale_factor_temporal)

    def sample_timestep(self, pipe, latents) -> torch.Tensor:
        """The denoiser's sample timesteps for sample ``latents`` (batch 2)."""
        return torch.tensor([[700.0], [300.0]])

    def components(self, pipe) -> list[ExportableComponent]:
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
            specs["text_encoder"], TextEncoder(pipe.text_encoder).eval(),
            {"input_ids": torch.randint(0, pipe.text_encoder.config.vocab_size, (batch, text_tokens), generator=gen),
             "attention_mask": mask})]
        latents = randn(batch, tr.in_channels, frames, lat_h, lat_w)
        head, tail, reuse = self.denoiser_classes
        for prefix, transformer in zip(EXPERT_PREFIXES, (pipe.transformer, pipe.transformer_2)):
            if f"{prefix}_head" not in specs:
                break
            head_module = head(transformer).eval()
            head_inputs = {"hidden_states": latents, "timestep": self.sample_timestep(pipe, latents),
                           "encoder_hidden_states": randn(batch, text_tokens, tr.text_dim)}
            if control_channels is not None:
                head_inputs["control_hidden_states"] = randn(batch, control_channels, frames, lat_h, lat_w)
            with torch.no_grad():
                image_hidden, text_hidden, timestep_proj, temb, _, *control = (
                    output.cpu().float() for output in head_module(
                        **{name: value.to(device, dtype) for name, value in head_inputs.items()}))
            exportable += [
                # A token per patch of frames x height x width (Wan 2.2 TI2V's timesteps too, one per token).
                ExportableComponent(specs[f"{prefix}_head"], head_module, head_inputs,
                                    axis_growth={"video_tokens": 8}, torchscript_context=paired_rotary(transformer)),
                ExportableComponent(specs[f"{prefix}_tail"], tail(transformer).eval(),
                                    {"image_hidden": image_hidden, "text_hidden": text_hidden,
                                     "timestep_proj": timestep_proj, "temb": temb, "hidden_states": latents,
                                     **({"control_hidden": control[0]} if control else {})},
                                    axis_growth={"video_tokens": 8}, torchscript_context=paired_rotary(transformer)),
                ExportableComponent(specs[f"{prefix}_reuse"], reuse(transformer).eval(),
                                    {"hidden_states": latents, "timestep": head_inputs["timestep"],
                                     "blocks_residual": randn(*image_hidden.shape)},
                                    axis_growth={"video_tokens": 8}),
            ]
        vae_scale = pipe.vae_scale_factor_spatial
        exportable += vae_chunk_components(pipe.vae, "decoder", pipe.vae_scale_factor_temporal, self.chunk_classes)
        if "vae_encoder_first" in specs:
            exportable += vae_chunk_components(pipe.vae, "encoder", pipe.vae_scale_factor_temporal,
                                               self.chunk_classes)
        exportable.append(ExportableComponent(
            specs["postprocess"], Postprocess().eval(),
            {"frames": randn(batch, 3, 2, lat_h * vae_scale, lat_w * vae_scale) * 0.8}))
        return exportable

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # WanPipeline.__call__'s defaults (480x832, 81 frames at Wan's 16 fps, 50 steps, CFG 5).
        return ServedDefaults(height=480, width=832, num_inference_steps=50, guidance_scale=5.0,
                              negative_prompt="", max_sequence_length=512, max_height=1280, max_width=1280,
                              num_frames=81, max_frames=81, fps=16)

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
            "decoder_cache_per_latent_pixel": cache_per_latent_pixel(pipe.vae, "decoder", self.chunk_classes),
            **({"encoder_cache_per_latent_pixel": cache_per_latent_pixel(pipe.vae, "encoder", self.chunk_classes)}
               if self.encodes_pictures else {}),
        }

    def streaming_components(self, pipe, streaming) -> tuple[list[ExportableComponent], dict[str, Any]]:
        """Self-Forcing's way on Wan 2.1's layout: one transformer, text-to-video (families/wan/streaming.py)."""
        from machgen.families.wan.streaming import StreamingChunkDenoiser

        if self.experts(pipe) > 1:
            raise ValueError("streaming runs one transformer (Wan 2.1's layout, as Self-Forcing's): this model "
                             "has Wan 2.2's two experts")
        tr = pipe.transformer.config
        if tr.in_channels != tr.out_channels or self.control_channels(pipe) is not None:
            raise ValueError(f"streaming is text-to-video: the '{self.family.name}' family's transformer takes "
                             "a picture's latents beside the video's")
        shape = {"layers": tr.num_layers, "heads": tr.num_attention_heads, "head_dim": tr.attention_head_dim}
        spec = streaming_spec(in_channels=tr.in_channels, out_channels=tr.out_channels, text_dim=tr.text_dim,
                              chunk_frames=streaming.chunk_frames, **shape)
        # Two rows, the second's cache one chunk longer (its first entries padding in the first row).
        gen = torch.Generator().manual_seed(0)
        lat_h, lat_w, text_tokens = 6, 4, 7
        chunk_tokens = streaming.chunk_frames * lat_h * lat_w // (tr.patch_size[1] * tr.patch_size[2])
        cache = (2, tr.num_layers, 2 * chunk_tokens, tr.num_attention_heads, tr.attention_head_dim)
        valid = torch.ones(2, 2 * chunk_tokens)
        valid[0, chunk_tokens:] = 0
        sample = {
            "hidden_states": torch.randn(2, tr.in_channels, streaming.chunk_frames, lat_h, lat_w, generator=gen),
            "timestep": torch.tensor([[700.0], [0.0]]),
            "frame_offset": torch.tensor([streaming.chunk_frames, 2 * streaming.chunk_frames]),
            "encoder_hidden_states": torch.randn(2, text_tokens, tr.text_dim, generator=gen),
            "past_keys": torch.randn(*cache, generator=gen), "past_values": torch.randn(*cache, generator=gen),
            "past_valid": valid,
        }
        module = StreamingChunkDenoiser(pipe.transformer, streaming.max_frames).eval()
        return [ExportableComponent(spec, module, sample)], {"cache_shape": shape}

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        vae, multiple, temporal = settings["vae_scale_factor"], settings["size_multiple"], settings["temporal_factor"]
        _, patch_h, patch_w = settings["patch_size"]
        height = AxisRange(multiple, defaults.height, defaults.max_height)
        width = AxisRange(multiple, defaults.width, defaults.max_width)
        lat_h, lat_w = height.scaled(vae), width.scaled(vae)
        frames = AxisRange(1, (defaults.num_frames - 1) // temporal + 1, (defaults.max_frames - 1) // temporal + 1)
        text = defaults.max_sequence_length
        ranges = {
            "height": height, "width": width, "latent_height": lat_h, "latent_width": lat_w,
            "latent_frames": frames, "frames": AxisRange(1, temporal, temporal),
            "video_tokens": frames.times(lat_h.scaled(patch_h)).times(lat_w.scaled(patch_w)),
            "text_tokens": AxisRange(text, text, text),
        }
        streaming = settings.get("streaming")
        if streaming is not None:
            chunk_tokens = lat_h.scaled(patch_h).times(lat_w.scaled(patch_w)).times(
                AxisRange(*(streaming["chunk_frames"],) * 3))
            ranges["chunk_tokens"] = chunk_tokens
            # Sink and window: every kept entry is a whole chunk's tokens.
            kept = streaming["max_frames"] if streaming["window_frames"] is None else (
                streaming["sink_frames"] + streaming["window_frames"])
            ranges["cache_tokens"] = AxisRange(1, chunk_tokens.opt, chunk_tokens.max * kept // streaming["chunk_frames"])
        for coder in ("decoder", "encoder"):
            per_pixel = settings.get(f"{coder}_cache_per_latent_pixel")
            if per_pixel is not None:
                ranges[f"{coder}_cache"] = lat_h.times(lat_w).times(AxisRange(per_pixel, per_pixel, per_pixel))
        return ranges


class WanImageToVideoExport(WanExport):
    """WanImageToVideoPipeline without an image encoder (Wan 2.2 I2V): every
    step's transformer input carries, after the noisy latents, a first-frame
    mask and the latents of the picture followed by empty frames (the VAE
    encoder, chunked like the decoder)."""

    def check(self, pipe) -> None:
        super().check(pipe)
        if getattr(pipe, "image_encoder", None) is not None or pipe.transformer.config.image_dim is not None:
            raise ValueError("Wan 2.1 image-to-video (CLIP image embeddings in the transformer) is not supported "
                             "yet; Wan 2.2's (no image encoder) is")


class WanVaceExport(WanExport):
    """WanVACEPipeline (Wan2.1-VACE, Wan 2.2 VACE-Fun's two experts) with
    reference images and no control video or mask: a control branch
    (``vace_blocks``) reads latents of an empty video, of each reference
    image and a mask, and adds a hint after each of its ``vace_layers``; each
    reference also adds a latent frame in front of the video, denoised and
    then dropped."""

    denoiser_classes = (VaceDenoiserHead, VaceDenoiserTail, DenoiserReuse)
    sharded_tail = ShardedVaceDenoiserTail

    def control_channels(self, pipe) -> int | None:
        return pipe.transformer.config.vace_in_channels

    def axis_ranges(self, defaults: ServedDefaults, settings: dict[str, Any]) -> dict[str, AxisRange]:
        ranges = super().axis_ranges(defaults, settings)
        frames, tokens = ranges["latent_frames"], ranges["video_tokens"]
        # Each reference image adds a latent frame in front of the video.
        ranges["latent_frames"] = AxisRange(frames.min, frames.opt, frames.max + MAX_REFERENCE_IMAGES)
        ranges["video_tokens"] = AxisRange(tokens.min, tokens.opt,
                                           tokens.max // frames.max * (frames.max + MAX_REFERENCE_IMAGES))
        return ranges
