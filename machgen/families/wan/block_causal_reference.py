"""The uncached reference of streamed chunks on diffusers' own blocks: one
forward of SkyReelsV2Transformer3DModel's blocks over a whole sequence (the
clean chunks before a chunk at the context timestep, then the chunk), its
tokens attending by a dense mask to what the streaming mode lets them see,
with explicit frame positions.

diffusers' SkyReels-V2 forward computes block-causal attention itself, but
only for blocks of more than one frame (``num_frame_per_block > 1``; with
one-frame blocks it attends to every frame, the future included), and only
over every earlier frame (no sink and window, no re-cached frames). The
tests (tests/test_streaming.py) check ``dense_forward`` equal to diffusers'
own forward where both apply; the window, prompt-switch and one-frame-chunk
references stand on it, as does perf/bench_realtime.py's recompute baseline
for one-frame chunks.
"""

from __future__ import annotations

import torch

from machgen.contract.streaming import StreamingSettings


def allowed_mask(first_frames: list[int], chunk_frames: int, settings: StreamingSettings, patch_tokens: int):
    """[tokens, tokens] bool: a token of the chunk starting at a frame sees its own chunk and the earlier
    chunks its settings keep (the sink, the window before it)."""
    chunks = len(first_frames)
    seen = torch.zeros(chunks, chunks, dtype=torch.bool)
    for query, query_first in enumerate(first_frames):
        for key, key_first in enumerate(first_frames):
            seen[query, key] = key == query or (key < query and settings.kept(key_first, query_first))
    per_chunk = chunk_frames * patch_tokens
    return seen.repeat_interleave(per_chunk, 0).repeat_interleave(per_chunk, 1)


def dense_forward(sky, latents, timesteps, text, positions, allowed):
    """noise prediction [1, C, F, h, w] of ``latents`` [1, C, F, h, w] at a timestep per frame, its frames at
    absolute ``positions`` [F], attention limited to ``allowed`` [tokens, tokens] (SkyReels-V2's blocks)."""
    _, _, frames, height, width = latents.shape
    p_t, p_h, p_w = sky.config.patch_size
    pph, ppw = height // p_h, width // p_w
    rope = sky.rope
    tables = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t_part, h_part, w_part = table.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)
        grid = torch.cat([t_part[positions].view(frames, 1, 1, -1).expand(frames, pph, ppw, -1),
                          h_part[:pph].view(1, pph, 1, -1).expand(frames, pph, ppw, -1),
                          w_part[:ppw].view(1, 1, ppw, -1).expand(frames, pph, ppw, -1)], dim=-1)
        tables.append(grid.reshape(1, frames * pph * ppw, 1, -1))
    hidden = sky.patch_embedding(latents).flatten(2).transpose(1, 2)
    temb, timestep_proj, text_hidden, _ = sky.condition_embedder(timesteps.reshape(1, -1), text)
    timestep_proj = timestep_proj.unflatten(-1, (6, -1))
    temb = temb.view(1, frames, 1, 1, -1).repeat(1, 1, pph, ppw, 1).flatten(1, 3)
    timestep_proj = timestep_proj.view(1, frames, 1, 1, 6, -1).repeat(1, 1, pph, ppw, 1, 1).flatten(1, 3)
    timestep_proj = timestep_proj.transpose(1, 2).contiguous()
    mask = allowed[None, None]
    for block in sky.blocks:
        hidden = block(hidden, text_hidden, timestep_proj, tuple(tables), mask)
    shift, scale = (sky.scale_shift_table.unsqueeze(2) + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden = (sky.norm_out(hidden.float()) * (1 + scale.squeeze(1)) + shift.squeeze(1)).type_as(hidden)
    hidden = sky.proj_out(hidden).reshape(1, frames, pph, ppw, p_t, p_h, p_w, -1)
    return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
