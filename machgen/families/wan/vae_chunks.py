"""AutoencoderKLWan's encoder and decoder exported a chunk of frames at a time: the first chunk, then each next
one with the causal cache the last left (as one flat tensor a row), and the decoder's chunks split by rows over
a parallel layout's ranks."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d, WanResample

from machgen.builder.family_export import ExportableComponent
from machgen.families.wan.spec import chunk_specs
from machgen.parallel.rows import attention_by_rows, by_rows, halo_rows, split_by_rows


def two_frames(entry):
    # A one-frame entry zero-padded in front: the causal convolutions read
    # the zeros as their own padding, the time downsamplers read only the last frame.
    return torch.cat([torch.zeros_like(entry), entry], dim=2) if entry.shape[2] == 1 else entry


class CausalChunk(torch.nn.Module):
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


class FirstChunk(CausalChunk):
    def forward(self, chunk):
        output, entries = self.first_chunk(chunk)
        return output, torch.cat([entry.flatten(1) for _, entry in entries], dim=1)


class NextChunk(CausalChunk):
    def forward(self, chunk, cache):
        batch = chunk.shape[0]
        height, width = self.latent_size(chunk)
        entries = [None] * self.vae._cached_conv_counts[self.coder]
        sizes = [channels * 2 * height * scale * width * scale for channels, scale in self.layout]
        for slot, part, (channels, scale) in zip(self.slots, torch.split(cache, sizes, dim=1), self.layout):
            entries[slot] = part.reshape(batch, channels, 2, height * scale, width * scale)
        output = self.run(chunk, entries, first=False)
        return output, torch.cat([two_frames(entries[slot]).flatten(1) for slot in self.slots], dim=1)


class VaeDecoderFirst(FirstChunk):
    def forward(self, latents):
        return super().forward(latents)


class VaeDecoderNext(NextChunk):
    def forward(self, latents, decoder_cache):
        return super().forward(latents, decoder_cache)


def causal_conv_by_rows(conv: WanCausalConv3d):
    """WanCausalConv3d.forward with its height padding read from the neighbouring ranks' rows (after the
    cached frames are put in front: the neighbours lend theirs too)."""
    if conv.stride[1] != 1:
        raise ValueError(f"{conv}: a convolution with a stride along the rows is not split by rows")

    def forward(x, cache_x=None):
        left, right, top, bottom, front, back = conv._padding
        if cache_x is not None and front > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            front -= cache_x.shape[2]
        x = F.pad(halo_rows(x, 3, top, bottom, "zeros"), (left, right, 0, 0, front, back))
        return torch.nn.Conv3d.forward(conv, x)

    return forward


def decoder_by_rows(module: torch.nn.Module):
    """What AutoencoderKLWan's decoder runs split by rows (parallel/rows.py) besides its mid-block's
    attention (split_decoder): its convolutions that pad the rows (causal ones, and the upsamplers' 2-D ones);
    its norms are over channels, its upsampling (nearest, or channels to space) maps each row to its own rows."""
    if isinstance(module, WanCausalConv3d):  # pads itself, its own padding zero
        return causal_conv_by_rows(module) if module._padding[2] or module._padding[3] else None
    return by_rows(module)


@contextlib.contextmanager
def split_decoder(decoder: torch.nn.Module):
    """Inside, ``decoder`` (AutoencoderKLWan's) runs split by rows over the ranks."""
    blocks = [module for module in decoder.modules() if isinstance(module, WanAttentionBlock)]
    with split_by_rows(decoder, decoder_by_rows), attention_by_rows(WanAttentionBlock.__module__, blocks):
        yield


class SplitVaeDecoderFirst(VaeDecoderFirst):
    """VaeDecoderFirst with its decoder split by rows over the ranks (split_decoder)."""

    def forward(self, latents):
        with split_decoder(self.vae.decoder):
            return super().forward(latents)


class SplitVaeDecoderNext(VaeDecoderNext):
    """VaeDecoderNext with its decoder split by rows over the ranks; each rank's flat cache is its rows'."""

    def forward(self, latents, decoder_cache):
        with split_decoder(self.vae.decoder):
            return super().forward(latents, decoder_cache)


class VaeEncoderFirst(FirstChunk):
    coder = "encoder"

    def forward(self, frames):
        return super().forward(frames)


class VaeEncoderNext(NextChunk):
    coder = "encoder"

    def forward(self, frames, encoder_cache):
        return super().forward(frames, encoder_cache)


def sample_chunk(vae, coder: str, frames: int, lat_h: int, lat_w: int, batch: int, gen=None):
    """A chunk a coder takes: latent frames for the decoder, pixel frames for the encoder."""
    if coder == "decoder":
        return torch.randn(batch, vae.config.z_dim, frames, lat_h, lat_w, generator=gen)
    factor = vae.config.scale_factor_spatial
    return torch.randn(batch, 3, frames, lat_h * factor, lat_w * factor, generator=gen).clamp(-1, 1)


# The (first chunk, next chunk) modules of each coder.
CHUNK_CLASSES = {"decoder": (VaeDecoderFirst, VaeDecoderNext), "encoder": (VaeEncoderFirst, VaeEncoderNext)}


def chunk_layout(vae, coder: str, classes=CHUNK_CLASSES) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(slots, layout) of the coder's flat cache (CausalChunk), from a small
    first chunk in eager mode (a trace would fix the sizes it reads)."""
    with torch.no_grad():
        _, entries = classes[coder][0](vae).eval().first_chunk(
            sample_chunk(vae, coder, 1, 2, 2, 1).to(vae.device, vae.dtype))
    return (tuple(slot for slot, _ in entries),
            tuple((int(entry.shape[1]), int(entry.shape[3]) // 2) for _, entry in entries))


def cache_per_latent_pixel(vae, coder: str, classes=CHUNK_CLASSES) -> int:
    """Elements of a row's flat cache per latent pixel (of height x width)."""
    return sum(2 * channels * scale * scale for channels, scale in chunk_layout(vae, coder, classes)[1])


def vae_chunk_components(vae, coder: str, temporal_factor: int, classes=CHUNK_CLASSES) -> list[ExportableComponent]:
    """``vae_<coder>_first`` and ``vae_<coder>_next`` of an AutoencoderKLWan
    (coder: "decoder" or "encoder"), with sample inputs (batch 2, 6x4
    latents) on the CPU in float32."""
    first_class, next_class = classes[coder]
    first_spec, next_spec = chunk_specs(vae.config.z_dim, temporal_factor, coder)
    gen = torch.Generator().manual_seed(1)
    first = first_class(vae).eval()
    first_chunk = sample_chunk(vae, coder, 1, 6, 4, 2, gen)
    with torch.no_grad():
        _, cache = first(first_chunk.to(vae.device, vae.dtype))
    next_chunk = sample_chunk(vae, coder, next_spec.inputs[0].shape[2], 6, 4, 2, gen)
    return [ExportableComponent(first_spec, first, {first_spec.inputs[0].name: first_chunk}),
            ExportableComponent(next_spec, next_class(vae, *chunk_layout(vae, coder, classes)).eval(),
                                {next_spec.inputs[0].name: next_chunk, next_spec.inputs[1].name: cache.cpu().float()},
                                # The flat cache holds every slot at the chunk's height x width.
                                axis_growth={f"{coder}_cache": 4})]
