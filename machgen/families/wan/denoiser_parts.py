"""What the exported parts of WanTransformer3DModel.forward share (the denoiser's head, tail and reuse in
export.py, the streaming denoiser in streaming.py): the patch embedding's tokens, the time embedding and the
output layer."""

from __future__ import annotations

import torch


def patches(embedding, latents):
    """A patch embedding's tokens [batch, tokens, inner] of latents [batch, C, frames, h, w]."""
    return embedding(latents).flatten(2).transpose(1, 2).contiguous()


class WanDenoiserPart(torch.nn.Module):
    """What the parts of WanTransformer3DModel.forward share: the time
    embedding and the output layer (a subclass may take the timestep
    another way, one per token)."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def time_embedding(self, timestep, like):
        """WanTimeTextImageEmbedding's time half: (temb, timestep_proj [batch, 6, inner])."""
        embedder = self.transformer.condition_embedder
        projected = embedder.timesteps_proj(timestep.reshape(-1))
        projected = projected.to(next(iter(embedder.time_embedder.parameters())).dtype)
        temb = embedder.time_embedder(projected).type_as(like)
        return temb, embedder.time_proj(embedder.act_fn(temb)).unflatten(1, (6, -1))

    def modulation(self, temb):
        """The output norm's (shift, scale) from ``temb``."""
        return (self.transformer.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)

    def output(self, hidden, temb, latents):
        """WanTransformer3DModel.forward's output norm, projection and unpatchify."""
        tr = self.transformer
        batch, _, frames, height, width = latents.shape
        p_t, p_h, p_w = tr.config.patch_size
        shift, scale = self.modulation(temb)
        hidden = (tr.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = tr.proj_out(hidden)
        hidden = hidden.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
