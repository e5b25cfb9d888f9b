"""Wan's streaming denoiser: one chunk of latent frames of a realtime session
through WanTransformer3DModel, attending to its own tokens and to the keys and
values its session cached for earlier chunks (Self-Forcing's and LongLive's
block-causal generation), and returning its own keys and values for the cache.

The cache holds each layer's self-attention keys after RoPE at absolute frame
positions (as Self-Forcing stores them) and its values. Absolute positions
keep a streamed chunk exactly what one forward over the whole sequence with a
block-causal mask computes (the exactness the tests check); LongLive's
window-relative positions would re-rotate every cached key each chunk and have
no such reference. A session is bounded by the positions the build tabled
(``max_frames``), not by the model's ``rope_max_seq_len``: the table extends
diffusers' own formula, equal to it where both are defined.

Rows are sessions: each row's cache is padded to the longest in the call and
``past_valid`` marks its real entries, so chunks of sessions with different
cache lengths, at different steps, run in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_1d_rotary_pos_embed

from machgen.families.wan.denoiser_parts import WanDenoiserPart, patches


def rotate(hidden, freqs_cos, freqs_sin):
    """WanAttnProcessor's apply_rotary_emb: hidden [B, tokens, heads, dim], freqs [B or 1, tokens, 1, dim]."""
    x1, x2 = hidden.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.type_as(hidden)


class StreamingChunkDenoiser(WanDenoiserPart):
    """noise_pred and the chunk's keys and values [B, layers, tokens, heads, head_dim] of
    ``hidden_states`` [B, C, chunk frames, h, w] at ``timestep`` [B, 1], its first latent frame at
    ``frame_offset`` [B] (int64), under ``encoder_hidden_states`` [B, text tokens, text dim], after the cached
    ``past_keys``/``past_values`` [B, layers, entries, heads, head_dim] where ``past_valid`` [B, entries] is 1."""

    def __init__(self, transformer, max_frames: int):
        super().__init__(transformer)
        rope = transformer.rope
        cos, sin = get_1d_rotary_pos_embed(rope.t_dim, max_frames, 10000.0, use_real=True,
                                           repeat_interleave_real=True, freqs_dtype=torch.float64)
        self.register_buffer("frame_cos", cos.float(), persistent=False)
        self.register_buffer("frame_sin", sin.float(), persistent=False)

    def rotary(self, latents, frame_offset):
        """(cos, sin) [B, tokens, 1, head_dim]: the frame part at each row's absolute positions, the height and
        width parts as WanRotaryPosEmbed makes them."""
        rope = self.transformer.rope
        batch, _, frames, height, width = latents.shape
        p_t, p_h, p_w = rope.patch_size
        ppf, pph, ppw = frames // p_t, height // p_h, width // p_w
        positions = frame_offset.reshape(-1, 1) + torch.arange(ppf, device=latents.device).reshape(1, -1)
        parts = []
        for frame_table, table in ((self.frame_cos, rope.freqs_cos), (self.frame_sin, rope.freqs_sin)):
            _, height_table, width_table = table.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)
            per_frame = frame_table[positions].reshape(-1, ppf, 1, 1, rope.t_dim).expand(-1, ppf, pph, ppw, -1)
            per_row = height_table[:pph].reshape(1, 1, pph, 1, -1).expand(per_frame.shape[0], ppf, pph, ppw, -1)
            per_column = width_table[:ppw].reshape(1, 1, 1, ppw, -1).expand(per_frame.shape[0], ppf, pph, ppw, -1)
            parts.append(torch.cat([per_frame, per_row, per_column], dim=-1).reshape(-1, ppf * pph * ppw, 1,
                                                                                     rope.attention_head_dim))
        return parts[0], parts[1]

    @staticmethod
    def self_attention(attn, hidden, rotary, past_keys, past_values, allowed):
        """WanAttnProcessor's self-attention over the cache and the chunk; also the chunk's keys and values."""
        query = attn.norm_q(attn.to_q(hidden)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden).unflatten(2, (attn.heads, -1))
        query, key = rotate(query, *rotary), rotate(key, *rotary)
        keys = torch.cat([past_keys, key], dim=1)
        values = torch.cat([past_values, value], dim=1)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=allowed)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out)), key, value

    def block(self, block, hidden, text_hidden, timestep_proj, rotary, past_keys, past_values, allowed):
        """WanTransformerBlock.forward with the cached self-attention."""
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            block.scale_shift_table + timestep_proj.float()).chunk(6, dim=1)
        normed = (block.norm1(hidden.float()) * (1 + scale_msa) + shift_msa).type_as(hidden)
        attended, key, value = self.self_attention(block.attn1, normed, rotary, past_keys, past_values, allowed)
        hidden = (hidden.float() + attended * gate_msa).type_as(hidden)
        hidden = hidden + block.attn2(block.norm2(hidden.float()).type_as(hidden), text_hidden, None, None)
        normed = (block.norm3(hidden.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden)
        hidden = (hidden.float() + block.ffn(normed).float() * c_gate_msa).type_as(hidden)
        return hidden, key, value

    def forward(self, hidden_states, timestep, frame_offset, encoder_hidden_states, past_keys, past_values,
                past_valid):
        tr = self.transformer
        hidden = patches(tr.patch_embedding, hidden_states)
        temb, timestep_proj = self.time_embedding(timestep, encoder_hidden_states)
        text_hidden = tr.condition_embedder.text_embedder(encoder_hidden_states)
        rotary = self.rotary(hidden_states, frame_offset)
        own = torch.ones(hidden.shape[0], hidden.shape[1], dtype=torch.bool, device=hidden.device)
        allowed = torch.cat([past_valid > 0, own], dim=1)[:, None, None, :]
        keys, values = [], []
        for layer, block in enumerate(tr.blocks):
            hidden, key, value = self.block(block, hidden, text_hidden, timestep_proj, rotary, past_keys[:, layer],
                                            past_values[:, layer], allowed)
            keys.append(key)
            values.append(value)
        return self.output(hidden, temb, hidden_states), torch.stack(keys, dim=1), torch.stack(values, dim=1)
