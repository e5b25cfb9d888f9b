"""Wan 2.2 TI2V-5B's build-time half: Wan's denoiser parts with a timestep
per token, Wan's chunked VAE coders through the Wan 2.2 VAE's patchified
layout, and ``WanTi2vExport``."""

from __future__ import annotations

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

from machgen.builder.family_export import ExportableComponent
from machgen.contract.specs import ComponentSpec, ServedDefaults
from machgen.families.wan import export as wan
from machgen.families.wan import vae_chunks
from machgen.families.wan_ti2v.spec import per_token_timestep_specs
from machgen.parallel.op import sequence_shard


class PerTokenTimestep(wan.WanDenoiserPart):
    """WanTransformer3DModel.forward's time embedding and output modulation
    for a timestep per token ([batch, tokens]; Wan 2.2 TI2V)."""

    def time_embedding(self, timestep, like):
        """(temb [batch, tokens, inner], timestep_proj [batch, tokens, 6, inner])."""
        embedder = self.transformer.condition_embedder
        batch, tokens = timestep.shape
        projected = embedder.timesteps_proj(timestep.reshape(-1)).reshape(batch, tokens, -1)
        projected = projected.to(next(iter(embedder.time_embedder.parameters())).dtype)
        temb = embedder.time_embedder(projected).type_as(like)
        return temb, embedder.time_proj(embedder.act_fn(temb)).unflatten(2, (6, -1))

    def modulation(self, temb):
        shift, scale = (self.transformer.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        return shift.squeeze(2), scale.squeeze(2)


class DenoiserHead(PerTokenTimestep, wan.DenoiserHead):
    pass


class DenoiserTail(PerTokenTimestep, wan.DenoiserTail):
    pass


class DenoiserReuse(PerTokenTimestep, wan.DenoiserReuse):
    pass


class ShardedDenoiserTail(PerTokenTimestep, wan.ShardedDenoiserTail):
    """Wan's sharded tail with a modulation per token: each rank keeps its
    tokens' share of it, as of the tokens and their positions."""

    def blocks_modulation(self, timestep_proj, sequence_marker):
        return sequence_shard(timestep_proj, 1, sequence_marker)


class Patchified(vae_chunks.CausalChunk):
    """A coder of the Wan 2.2 VAE: its frames through ``patchify`` before the
    encoder and ``unpatchify`` after the decoder (AutoencoderKLWan._encode,
    _decode), the rest as Wan's."""

    def run(self, chunk, cache, first: bool):
        patch = self.vae.config.patch_size
        if self.coder == "decoder":
            return unpatchify(super().run(chunk, cache, first), patch)
        return super().run(patchify(chunk, patch), cache, first)


class VaeDecoderFirst(Patchified, vae_chunks.VaeDecoderFirst):
    pass


class VaeDecoderNext(Patchified, vae_chunks.VaeDecoderNext):
    pass


class SplitVaeDecoderFirst(Patchified, vae_chunks.SplitVaeDecoderFirst):
    pass


class SplitVaeDecoderNext(Patchified, vae_chunks.SplitVaeDecoderNext):
    pass


class VaeEncoderFirst(Patchified, vae_chunks.VaeEncoderFirst):
    pass


class VaeEncoderNext(Patchified, vae_chunks.VaeEncoderNext):
    pass


CHUNK_CLASSES = {"decoder": (VaeDecoderFirst, VaeDecoderNext), "encoder": (VaeEncoderFirst, VaeEncoderNext)}


class WanTi2vExport(wan.WanExport):
    denoiser_classes = (DenoiserHead, DenoiserTail, DenoiserReuse)
    sharded_tail = ShardedDenoiserTail
    chunk_classes = CHUNK_CLASSES
    split_decoder_classes = {"vae_decoder_first": SplitVaeDecoderFirst, "vae_decoder_next": SplitVaeDecoderNext}

    def check(self, pipe) -> None:
        if not getattr(pipe.config, "expand_timesteps", False) or pipe.vae.config.patch_size is None:
            raise ValueError("the 'wan-ti2v' family serves Wan 2.2 TI2V-5B: a WanPipeline with expand_timesteps "
                             "and a patchified VAE")
        if pipe.transformer is None or pipe.transformer_2 is not None:
            raise ValueError("Wan 2.2 TI2V-5B has one transformer")

    def specs(self, pipe) -> dict[str, ComponentSpec]:
        # The picture is one frame: the encoder's first chunk is all image-to-video needs.
        return {name: spec for name, spec in per_token_timestep_specs(super().specs(pipe)).items()
                if name != "vae_encoder_next"}

    def sample_timestep(self, pipe, latents) -> torch.Tensor:
        # A timestep per token; the second row's first latent frame at 0, as image-to-video sends it.
        _, _, frames, height, width = latents.shape
        _, patch_h, patch_w = pipe.transformer.config.patch_size
        tokens_per_frame = (height // patch_h) * (width // patch_w)
        timestep = torch.tensor([[700.0], [300.0]]).repeat(1, frames * tokens_per_frame)
        timestep[1, :tokens_per_frame] = 0
        return timestep

    def components(self, pipe) -> list[ExportableComponent]:
        specs = self.specs(pipe)
        return [component for component in super().components(pipe) if component.spec.name in specs]

    def pipeline_defaults(self, pipe) -> ServedDefaults:
        # The model card's: 704 x 1280 (720p), 121 frames at 24 fps, 50 steps, CFG 5.
        return ServedDefaults(height=704, width=1280, num_inference_steps=50, guidance_scale=5.0,
                              negative_prompt="", max_sequence_length=512, max_height=1280, max_width=1280,
                              num_frames=121, max_frames=121, fps=24)
