"""Fine-tuning the moving-shapes video model into a steerable world model
(``models/shapes-world``): a shape steered chunk by chunk by actions, as a
realtime session of the streaming mode generates it (docs/realtime.md;
machgen/datasets/world_shapes.py for the data).

Starts from ``models/shapes-wan``. Two stages, each resumable from its checkpoint in ``OUT/checkpoints/``:

``world-decoder``: the VAE's decoder fine-tuned on long episodes, its encoder
frozen (so the transformer's latents do not change). The base VAE was
trained on 17-frame clips only and its causal caches are not stationary:
round trips of world episodes lost colour from the fourth chunk on (latent
frame 6; yellow decoded magenta, green cyan, 17-21 dB), so a streamed
session, decoded chunk after chunk without end, drifted in colour whatever
the transformer did.

``world-transformer``: the transformer and the text encoder fine-tuned
causally, as the streaming mode runs them:

- A sample is one target chunk after its context: the sink (the session's
  first chunk) and up to ``window_chunks`` chunks right before the target,
  at their absolute frame positions (the sink at 0), clean at timestep 0;
  the target chunk noisy at one of the card's step sigmas (75 %) or a
  shifted-uniform one (25 %). The loss is flow matching on the target only.
- Block-causal attention: every chunk attends to itself and the chunks
  before it in the sample (which are exactly the ones the streaming mode
  keeps), through the same weights StreamingChunkDenoiser streams with.
- Actions are prompt switches (LongLive's way): every token of a sample,
  context and target, is conditioned on the target chunk's caption, which is
  what the streaming mode's re-cache of the kept chunks under the new prompt
  computes.
- Positions: the sink at 0 and the rest at a random distance from it, up to
  the card's ``max_frames`` (RoPE is relative: the sink's distance is what
  changes over a long session).
- Drift: the sink anchors the subject; the context is noised a little
  (context noise augmentation: half of the rows, sigma up to 0.08, still at
  timestep 0) so that a slightly wrong chunk of the model's own does not
  throw the next one off; and in a share of the samples the window's chunks
  show the shape in a drifted colour (15-60 % of the way to another palette
  colour) while the target shows it right (colour drift augmentation): the
  first rollouts kept shape and motion but drifted in colour (blue to cyan,
  yellow to magenta) and then copied the wrong colour from the window.

Chunks of one latent frame (``chunked_settings``) keep the sink, window, episodes and checks as many latent
frames long as the default chunks of two. Episodes of ``episode_chunks`` chunks are encoded once by the frozen
VAE into a pool, a share of which is replaced by fresh episodes as training goes on. Resumable from
``OUT/checkpoints/world-transformer.pt``; the EMA of the weights is what is exported (``export_world_model``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from machgen.builder.training_loop import Checkpointer, EmaTraining
from machgen.builder.world_decoder import train_world_decoder
from machgen.datasets import moving_shapes, world_shapes

BASE_MODEL = Path("models/shapes-wan")
# The sink and the window in latent frames, whatever the chunk: the session's first 2 and the 6 before a chunk.
SINK_FRAMES, WINDOW_FRAMES = 2, 6


@dataclass
class WorldStreaming:
    """The streaming mode the model is trained for: recorded in its card's ``"streaming"`` section."""

    chunk_frames: int = world_shapes.CHUNK_FRAMES
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = 5.0
    sink_chunks: int = 1
    window_chunks: int = 3
    max_frames: int = 256
    fps: int = 8

    def card(self) -> dict:
        return {"chunk_frames": self.chunk_frames, "timesteps": list(self.timesteps), "shift": self.shift,
                "context_timestep": 0.0, "sink_frames": self.sink_chunks * self.chunk_frames,
                "window_frames": self.window_chunks * self.chunk_frames, "max_frames": self.max_frames,
                "actions": dict(world_shapes.ACTION_TEMPLATES), "fps": self.fps}

    def sigmas(self) -> list[float]:
        return [self.shift * (t / 1000) / (1 + (self.shift - 1) * (t / 1000)) for t in self.timesteps]

    @classmethod
    def chunked(cls, chunk_frames: int) -> "WorldStreaming":
        """Chunks of ``chunk_frames`` latent frames, the sink and the window as many latent frames as ever."""
        if chunk_frames < 1 or SINK_FRAMES % chunk_frames or WINDOW_FRAMES % chunk_frames:
            raise ValueError(f"chunk_frames: must divide the sink ({SINK_FRAMES}) and the window ({WINDOW_FRAMES} "
                             f"latent frames), not {chunk_frames}")
        return cls(chunk_frames, sink_chunks=SINK_FRAMES // chunk_frames, window_chunks=WINDOW_FRAMES // chunk_frames)


@dataclass
class WorldTrainingSettings:
    seed: int = 0
    steps: int = 40000
    minutes: float | None = None
    batch: int = 8
    lr: float = 3e-4
    warmup_steps: int = 100
    ema_decay: float = 0.999
    episode_chunks: int = 8
    pool_episodes: int = 768
    # Fresh episodes encoded into the pool (replacing random ones) every so many steps: encoding them together
    # costs a quarter of encoding each alone.
    refresh_episodes: int = 8
    refresh_every: int = 24
    # Share of samples at a session's start (the target within the first sink + window chunks, no gap).
    start_share: float = 0.35
    # Share of samples whose target sigma is one of the card's steps (the rest shifted-uniform).
    step_sigma_share: float = 0.75
    context_noise_share: float = 0.5
    context_noise_max: float = 0.08
    # Share of samples whose window chunks show a drifted colour (the sink and the target the true one).
    colour_drift_share: float = 0.3
    # Share of still chunks captioned with the bare subject (a session's starting prompt).
    bare_subject_share: float = 0.15
    # The decoder stage: steps, time budget, learning rate, shape pixels' extra loss weight, episode lengths.
    decoder_steps: int = 3000
    decoder_minutes: float | None = None
    decoder_lr: float = 5e-4
    decoder_shape_weight: float = 4.0
    decoder_chunks: tuple[int, ...] = (8, 15)  # alternately: 61 frames two at a time, 117 frames alone
    checkpoint_minutes: float = 5.0
    check_minutes: float | None = 20.0
    check_sessions: int = 6
    check_chunks: int = 12
    streaming: WorldStreaming = field(default_factory=WorldStreaming)


def chunked_settings(chunk_frames: int, **values) -> WorldTrainingSettings:
    """Settings for chunks of ``chunk_frames`` latent frames (``values``: other fields): episodes, the decoder's
    episodes and the checks' sessions as many latent, so video, frames long as with the default chunk."""
    default, streaming = WorldTrainingSettings(), WorldStreaming.chunked(chunk_frames)
    scale = default.streaming.chunk_frames // chunk_frames  # whole: chunked() lets only divisors of 2 through
    return WorldTrainingSettings(**{"episode_chunks": default.episode_chunks * scale,
                                    "decoder_chunks": tuple(chunks * scale for chunks in default.decoder_chunks),
                                    "check_chunks": default.check_chunks * scale, "streaming": streaming, **values})


# ------------------------------------------------------------ the forward
class BlockCausalForward:
    """The transformer over a whole sample at once: a timestep per frame, explicit frame positions, attention
    limited by a mask; the same arithmetic as families/wan/streaming.py's StreamingChunkDenoiser streams
    (its RoPE table up to ``max_frames``, its rotation), so a streamed chunk equals this forward's."""

    def __init__(self, transformer, max_frames: int):
        from machgen.families.wan.streaming import StreamingChunkDenoiser

        self.part = StreamingChunkDenoiser(transformer, max_frames)
        self.transformer = transformer

    def rotary(self, positions, pph: int, ppw: int):
        """(cos, sin) [B, tokens, 1, head_dim] of frames at ``positions`` [B, F]."""
        import torch

        rope = self.transformer.rope
        batch, frames = positions.shape
        parts = []
        for frame_table, table in ((self.part.frame_cos, rope.freqs_cos), (self.part.frame_sin, rope.freqs_sin)):
            _, height_table, width_table = table.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)
            grid = (frame_table[positions].reshape(batch, frames, 1, 1, -1).expand(batch, frames, pph, ppw, -1),
                    height_table[:pph].reshape(1, 1, pph, 1, -1).expand(batch, frames, pph, ppw, -1),
                    width_table[:ppw].reshape(1, 1, 1, ppw, -1).expand(batch, frames, pph, ppw, -1))
            parts.append(torch.cat(grid, dim=-1).reshape(batch, frames * pph * ppw, 1, rope.attention_head_dim))
        return parts[0], parts[1]

    def __call__(self, latents, frame_timesteps, positions, text, allowed):
        """Noise prediction [B, C, F, h, w] of ``latents`` [B, C, F, h, w] at ``frame_timesteps`` [B, F], frames
        at ``positions`` [B, F], under ``text`` [B, L, D]; token i sees token j where ``allowed`` [T, T]."""
        import torch

        from machgen.families.wan.denoiser_parts import patches

        tr = self.transformer
        batch, _, frames, height, width = latents.shape
        _, p_h, p_w = tr.config.patch_size
        pph, ppw = height // p_h, width // p_w
        per_frame = pph * ppw
        hidden = patches(tr.patch_embedding, latents)
        temb, projection = self.part.time_embedding(frame_timesteps.reshape(-1), hidden)
        temb = temb.reshape(batch, frames, 1, -1).expand(-1, -1, per_frame, -1).reshape(batch, frames * per_frame, -1)
        projection = projection.reshape(batch, frames, 1, 6, -1).expand(-1, -1, per_frame, -1, -1)
        projection = projection.reshape(batch, frames * per_frame, 6, -1)
        text_hidden = tr.condition_embedder.text_embedder(text)
        rotary = self.rotary(positions, pph, ppw)
        mask = allowed[None, None]
        for block in tr.blocks:
            hidden = self.block(block, hidden, text_hidden, projection, rotary, mask)
        shift, scale = (tr.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        hidden = (tr.norm_out(hidden.float()) * (1 + scale.squeeze(2)) + shift.squeeze(2)).type_as(hidden)
        hidden = tr.proj_out(hidden)
        p_t = tr.config.patch_size[0]
        hidden = hidden.reshape(batch, frames // p_t, pph, ppw, p_t, p_h, p_w, -1)
        return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @staticmethod
    def block(block, hidden, text_hidden, projection, rotary, mask):
        """WanTransformerBlock.forward with a timestep per token and a masked self-attention."""
        import torch.nn.functional as F

        from machgen.families.wan.streaming import rotate

        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = (
            block.scale_shift_table.unsqueeze(0) + projection.float()).unbind(2)
        normed = (block.norm1(hidden.float()) * (1 + scale_msa) + shift_msa).type_as(hidden)
        attn = block.attn1
        query = rotate(attn.norm_q(attn.to_q(normed)).unflatten(2, (attn.heads, -1)), *rotary)
        key = rotate(attn.norm_k(attn.to_k(normed)).unflatten(2, (attn.heads, -1)), *rotary)
        value = attn.to_v(normed).unflatten(2, (attn.heads, -1))
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=mask)
        attended = attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2, 3).type_as(query)))
        hidden = (hidden.float() + attended * gate_msa).type_as(hidden)
        hidden = hidden + block.attn2(block.norm2(hidden.float()).type_as(hidden), text_hidden, None, None)
        normed = (block.norm3(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
        return (hidden.float() + block.ffn(normed).float() * c_gate).type_as(hidden)


def block_causal_mask(chunks: int, tokens_per_chunk: int):
    """[T, T] bool: each chunk's tokens see their own chunk and every chunk before it in the sample."""
    import torch

    seen = torch.tril(torch.ones(chunks, chunks, dtype=torch.bool))
    return seen.repeat_interleave(tokens_per_chunk, 0).repeat_interleave(tokens_per_chunk, 1)


# ------------------------------------------------------------ the data
class EpisodePool:
    """Episodes' latents [N, C, chunks x chunk_frames, h, w] (the frozen VAE's, whole episodes encoded at
    once as the causal VAE streams them), with each chunk's action and the subject; refreshed as it goes."""

    def __init__(self, vae, settings: WorldTrainingSettings, rng: np.random.Generator,
                 log: Callable[[str], None] = print):
        import torch

        self.vae, self.settings, self.rng = vae, settings, rng
        start = time.monotonic()
        latents, drifted, self.subjects, self.actions = [], [], [], []
        for first in range(0, settings.pool_episodes, 16):
            encoded, encoded_drifted, subjects, actions = self._encode(min(16, settings.pool_episodes - first))
            latents.append(encoded)
            drifted.append(encoded_drifted)
            self.subjects += subjects
            self.actions += actions
        self.latents, self.drifted = torch.cat(latents), torch.cat(drifted)
        log(f"episode pool {tuple(self.latents.shape)} (and as many drifted in colour) built in "
            f"{time.monotonic() - start:.0f} s")

    def _encode(self, count: int):
        """``count`` fresh episodes: their latents, those of the same episodes in a drifted colour, subjects and
        actions."""
        from machgen.builder.vae_clips import encode_clips

        episodes = [world_shapes.sample(self.rng, self.settings.episode_chunks, self.settings.streaming.chunk_frames)
                    for _ in range(count)]
        latents = encode_clips(self.vae, np.stack([e.frames for e in episodes]))
        drifted = encode_clips(self.vae, np.stack([
            world_shapes.recolour(e, world_shapes.drifted_colour(self.rng, e.subject.colour)) for e in episodes]))
        return latents, drifted, [e.subject for e in episodes], [e.actions for e in episodes]

    def refresh(self, count: int) -> None:
        """Replaces ``count`` random episodes with fresh ones."""
        if count <= 0:
            return
        latents, drifted, subjects, actions = self._encode(count)
        for offset, index in enumerate(self.rng.choice(len(self.latents), count, replace=False)):
            self.latents[index], self.drifted[index] = latents[offset], drifted[offset]
            self.subjects[index], self.actions[index] = subjects[offset], actions[offset]


@dataclass
class Layout:
    """Which chunks of an episode a sample takes (context then target, by episode chunk index) and the
    absolute chunk index each sits at."""

    chunks: list[int]
    positions: list[int]


def draw_layout(rng: np.random.Generator, settings: WorldTrainingSettings) -> Layout:
    """A session's start (target chunk T <= sink + window: every chunk from 0 to T) or, later, the sink then
    ``window_chunks`` chunks and the target, at a random distance from the sink (small ones more often)."""
    streaming = settings.streaming
    kept = streaming.sink_chunks + streaming.window_chunks
    if rng.random() < settings.start_share:
        target = int(rng.integers(0, kept + 1))
        return Layout(list(range(target + 1)), list(range(target + 1)))
    target = int(rng.integers(streaming.window_chunks + streaming.sink_chunks, settings.episode_chunks))
    max_chunks = streaming.max_frames // streaming.chunk_frames
    at = kept + int(rng.random() ** 2 * (max_chunks - kept))
    at = max(at, target)  # never nearer the sink than the episode itself has it
    window = list(range(target - streaming.window_chunks, target + 1))
    sink = list(range(streaming.sink_chunks))
    return Layout(sink + window, sink + [at - (target - c) for c in window])


class PromptIds:
    """Every world caption's UMT5 ids, embedded as WanPipeline embeds them."""

    def __init__(self, tokenizer, max_sequence_length: int):
        from machgen.builder.video_training import PromptTable

        self.captions = world_shapes.all_captions()
        self.index = {caption: i for i, caption in enumerate(self.captions)}
        self.table = PromptTable(self.captions, tokenizer, max_sequence_length)

    def embed(self, text_encoder, captions: list[str]):
        import torch

        return self.table.embed(text_encoder, torch.tensor([self.index[c] for c in captions]))


def world_loss(forward: BlockCausalForward, text_encoder, prompts: PromptIds, pool: EpisodePool,
               settings: WorldTrainingSettings, rng: np.random.Generator):
    """One batch's flow-matching loss on its target chunks (every row the same layout)."""
    import torch

    streaming = settings.streaming
    frames = streaming.chunk_frames
    layout = draw_layout(rng, settings)
    rows = rng.integers(0, len(pool.latents), settings.batch)
    frame_index = torch.tensor([c * frames + f for c in layout.chunks for f in range(frames)])
    x0 = pool.latents[torch.from_numpy(rows)][:, :, frame_index]
    batch, channels, total, height, width = x0.shape
    # Colour drift: the window's chunks (after the sink, before the target) from the drifted copies.
    window = [i * frames + f for i, c in enumerate(layout.chunks[:-1]) if c >= streaming.sink_chunks
              for f in range(frames)]
    drift_rows = np.flatnonzero(rng.random(batch) < settings.colour_drift_share)
    if window:
        for row in drift_rows:
            x0[row, :, window] = pool.drifted[rows[row]][:, frame_index[window]]
    positions = torch.tensor([p * frames + f for p in layout.positions for f in range(frames)]).expand(batch, -1)

    captions = []
    for row in rows:
        subject, action = pool.subjects[row], pool.actions[row][layout.chunks[-1]]
        bare = action == "stop" and rng.random() < settings.bare_subject_share
        captions.append(subject.phrase if bare else world_shapes.chunk_caption(subject, action))

    sigmas = streaming.sigmas()
    u = torch.from_numpy(rng.random(batch)).float()
    shifted = streaming.shift * u / (1 + (streaming.shift - 1) * u)
    on_steps = torch.from_numpy(rng.random(batch) < settings.step_sigma_share)
    sigma = torch.where(on_steps, torch.tensor(sigmas)[torch.from_numpy(rng.integers(0, len(sigmas), batch))],
                        shifted).view(batch, 1, 1, 1, 1)
    target = x0[:, :, -frames:]
    noise = torch.randn_like(target)
    noisy = (1 - sigma) * target + sigma * noise
    context = x0[:, :, :-frames]
    if context.shape[2]:
        context_sigma = torch.from_numpy(rng.random(batch) * settings.context_noise_max).float()
        context_sigma *= torch.from_numpy(rng.random(batch) < settings.context_noise_share)
        context_sigma = context_sigma.view(batch, 1, 1, 1, 1)
        context = (1 - context_sigma) * context + context_sigma * torch.randn_like(context)
    latents = torch.cat([context, noisy], dim=2)
    timesteps = torch.zeros(batch, total)
    timesteps[:, -frames:] = sigma.view(batch, 1) * 1000
    tokens_per_chunk = frames * (height // 2) * (width // 2)
    mask = block_causal_mask(len(layout.chunks), tokens_per_chunk)
    prediction = forward(latents, timesteps, positions, prompts.embed(text_encoder, captions), mask)
    return ((prediction[:, :, -frames:].float() - (noise - target)) ** 2).mean()


# ------------------------------------------------------------ the base model
def load_base(base: Path, tokenizer_dir: Path, log: Callable[[str], None] = print):
    """(vae, transformer, text_encoder, tokenizer) of the base video model, its tokenizer widened to the world
    captions' words (the text encoder's embedding rows carried over by piece; new words start from the mean
    of their letters' rows)."""
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from machgen.builder.caption_tokenizers import caption_word_tokenizer

    vae = AutoencoderKLWan.from_pretrained(base / "vae").eval().requires_grad_(False)
    transformer = WanTransformer3DModel.from_pretrained(base / "transformer")
    old_tokenizer = transformers.AutoTokenizer.from_pretrained(base / "tokenizer")
    old_encoder = transformers.UMT5EncoderModel.from_pretrained(base / "text_encoder")
    saved = (tokenizer_dir / "tokenizer.json").is_file()
    if saved:
        tokenizer = transformers.T5TokenizerFast.from_pretrained(tokenizer_dir)
    else:
        tokenizer = caption_word_tokenizer(moving_shapes.all_captions() + world_shapes.all_captions())
    covered = tokenizer.get_vocab().keys() <= old_tokenizer.get_vocab().keys()
    if not saved:
        (old_tokenizer if covered else tokenizer).save_pretrained(tokenizer_dir)
    if covered:
        # A base that reads every world caption's word already (a world model): its own tokenizer and text
        # encoder, as they are, so that a fine-tune of it starts from exactly it.
        log(f"tokenizer: the base's own, {len(old_tokenizer)} pieces (every world caption's word in it)")
        return vae, transformer, old_encoder, old_tokenizer
    config = old_encoder.config
    config.vocab_size = len(tokenizer)
    encoder = transformers.UMT5EncoderModel(config)
    state = {k: v for k, v in old_encoder.state_dict().items() if "embed_tokens" not in k and k != "shared.weight"}
    encoder.load_state_dict(state, strict=False)
    old_rows, old_vocab = old_encoder.get_input_embeddings().weight.detach(), old_tokenizer.get_vocab()
    new_rows = encoder.get_input_embeddings().weight.detach().clone()
    fresh = []
    for piece, index in tokenizer.get_vocab().items():
        if piece in old_vocab:
            new_rows[index] = old_rows[old_vocab[piece]]
        else:
            letters = [old_vocab[c] for c in piece.lstrip("\u2581") if c in old_vocab]
            new_rows[index] = old_rows[letters].mean(0) if letters else old_rows.mean(0)
            fresh.append(piece)
    with torch.no_grad():
        encoder.get_input_embeddings().weight.copy_(new_rows)
    log(f"tokenizer: {len(tokenizer)} pieces ({len(fresh)} new: {', '.join(sorted(fresh))})")
    return vae, transformer, encoder, tokenizer


# ------------------------------------------------------------ training
def train_world_model(out: Path, settings: WorldTrainingSettings, base: Path = BASE_MODEL, resume: bool = True,
                      log: Callable[[str], None] = print) -> dict:
    """Fine-tune (resumable), then export the EMA weights to ``out/model``."""
    import torch

    torch.manual_seed(settings.seed)
    started = time.time()
    checkpoints = out / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / "settings.json").write_text(json.dumps({"base": str(base), **asdict(settings)}, indent=2) + "\n")
    vae, transformer, text_encoder, tokenizer = load_base(base, checkpoints / "tokenizer", log)
    decoder_metrics = train_world_decoder(out, settings, vae, resume, log)
    stage = EmaTraining("world-transformer", [transformer, text_encoder], settings.lr, settings.warmup_steps,
                        settings.ema_decay, Checkpointer(checkpoints / "world-transformer.pt",
                                                         settings.checkpoint_minutes),
                        np.random.default_rng(settings.seed + 11))
    if resume:
        stage.resume(log)
    if not stage.finished(settings.steps, settings.minutes):
        # A resumed run draws a new pool (from its step), not the one it started with: the data is endless.
        pool = EpisodePool(vae, settings, np.random.default_rng([settings.seed, stage.step]), log)
        forward = BlockCausalForward(transformer, settings.streaming.max_frames)
        prompts = PromptIds(tokenizer, 32)

        def batch_loss(rng: np.random.Generator):
            if stage.step % settings.refresh_every == 0:
                pool.refresh(settings.refresh_episodes)
            return world_loss(forward, text_encoder, prompts, pool, settings, rng)

        stage.run(settings.steps, settings.minutes, batch_loss,
                  check=rollout_check(out, settings, vae, stage.ema, tokenizer, log),
                  check_minutes=settings.check_minutes)
    metrics = stage.metrics()
    log(f"world-transformer: {json.dumps(metrics)}")
    export_world_model(out / "model", base, vae, stage.ema, tokenizer, settings)
    record = {"settings": asdict(settings), "base": str(base), **decoder_metrics, **metrics,
              "wall_minutes_this_run": round((time.time() - started) / 60, 1)}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"saved {out / 'model'}")
    return record


def base_chunk_frames(base: Path) -> int:
    """The chunk a base world model streams (its card's), else the default: what a fine-tune keeps unless told."""
    from machgen.builder.model_folder import SERVING_FILE

    card = base / SERVING_FILE
    streaming = json.loads(card.read_text()).get("streaming", {}) if card.is_file() else {}
    return int(streaming.get("chunk_frames", WorldStreaming.chunk_frames))


# ------------------------------------------------------------ rollouts and export
def rollout(forward: BlockCausalForward, text_encoder, prompts: PromptIds, streaming: WorldStreaming,
            subject: world_shapes.Subject, actions: list[str], seed: int, latent_size: tuple[int, int, int]):
    """The clean latents [1, C, chunks x chunk_frames, h, w] of a session steered by ``actions`` (one a chunk),
    each chunk denoised as the streaming mode does it (the step sigmas, fresh noise between steps), by one
    forward over its kept context re-cached under its caption (equal to the streamed chunk on every switch)."""
    import torch

    frames, sigmas = streaming.chunk_frames, streaming.sigmas()
    channels, height, width = latent_size
    generator = torch.Generator().manual_seed(seed)
    done = []
    with torch.no_grad():
        for chunk, action in enumerate(actions):
            text = prompts.embed(text_encoder, [world_shapes.chunk_caption(subject, action)])
            kept = [c for c in range(chunk) if c < streaming.sink_chunks or c >= chunk - streaming.window_chunks]
            positions = torch.tensor([[c * frames + f for c in kept + [chunk] for f in range(frames)]])
            context = [done[c] for c in kept]
            latents = torch.randn(1, channels, frames, height, width, generator=generator)
            mask = block_causal_mask(len(kept) + 1, frames * height * width // 4)
            for step, sigma in enumerate(sigmas):
                timesteps = torch.zeros(1, (len(kept) + 1) * frames)
                timesteps[:, -frames:] = sigma * 1000
                prediction = forward(torch.cat(context + [latents], dim=2), timesteps, positions, text, mask)
                clean = latents - sigma * prediction[:, :, -frames:]
                if step + 1 < len(sigmas):
                    noise = torch.randn(latents.shape, generator=generator)
                    latents = (1 - sigmas[step + 1]) * clean + sigmas[step + 1] * noise
            done.append(clean)
    return torch.cat(done, dim=2)


def check_actions(rng: np.random.Generator, chunks: int) -> list[str]:
    """Actions that keep a shape near its start wherever it starts: a move and then its way back, or a stop."""
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    actions: list[str] = ["stop"]
    while len(actions) < chunks:
        direction = world_shapes.ACTIONS[rng.integers(5)]
        actions += ["stop"] if direction == "stop" else [direction, opposite[direction]]
    return actions[:chunks]


def rollout_check(out: Path, settings: WorldTrainingSettings, vae, ema_modules, tokenizer,
                  log: Callable[[str], None]) -> Callable[[int], None]:
    """The stage's periodic measurement: a few steered rollouts of the EMA model read back by the detector
    (checkpoints/world-checks.jsonl)."""
    from machgen.builder.vae_clips import decode_latents

    record = out / "checkpoints" / "world-checks.jsonl"
    latent_size = (vae.config.z_dim, *(2 * [world_shapes.SIZE // vae.config.scale_factor_spatial]))

    def check(step: int) -> None:
        start = time.monotonic()
        transformer, text_encoder = ema_modules
        forward = BlockCausalForward(transformer, settings.streaming.max_frames)
        prompts = PromptIds(tokenizer, 32)
        rng = np.random.default_rng(777)
        subjects = world_shapes.all_subjects()
        steered = kept = total = 0
        for session in range(settings.check_sessions):
            subject = subjects[rng.integers(len(subjects))]
            actions = check_actions(rng, settings.check_chunks)
            latents = rollout(forward, text_encoder, prompts, settings.streaming, subject, actions, session,
                              latent_size)
            frames = decode_latents(vae, latents)[0]
            readings = world_shapes.detect_episode(frames, len(actions), settings.streaming.chunk_frames)
            for action, reading in zip(actions, readings):
                total += 1
                steered += reading is not None and reading.action == action
                kept += reading is not None and (reading.colour, reading.shape) == (subject.colour, subject.shape)
        line = {"step": step, "steered": round(steered / total, 3), "subject_kept": round(kept / total, 3),
                "chunks": total, "seconds": round(time.monotonic() - start, 1)}
        log(f"world check: {json.dumps(line)}")
        with record.open("a") as file:
            file.write(json.dumps(line) + "\n")

    return check


def export_world_model(model_dir: Path, base: Path, vae, ema_modules, tokenizer,
                       settings: WorldTrainingSettings) -> Path:
    """The diffusers folder the streaming build loads: a WanPipeline (Wan 2.1's layout: one transformer, a
    timestep per call) with the base's VAE and scheduler, and the card's serving and streaming sections."""
    import copy

    from diffusers import UniPCMultistepScheduler, WanPipeline

    from machgen.builder.model_folder import SERVING_FILE

    transformer, text_encoder = ema_modules
    # The base VAE's patch size 1 is no patching at all (diffusers' patchify returns its input): saved as none,
    # the folder is Wan 2.1's layout, which the 'wan' family's streaming mode serves.
    vae = copy.deepcopy(vae)
    vae.register_to_config(patch_size=None)
    scheduler = UniPCMultistepScheduler.from_pretrained(base / "scheduler")
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       transformer=transformer.eval(), scheduler=scheduler, transformer_2=None, boundary_ratio=None,
                       expand_timesteps=False)
    pipe.save_pretrained(model_dir, safe_serialization=True)
    card = json.loads((base / SERVING_FILE).read_text())
    serving = dict(card["serving"], fps=settings.streaming.fps)
    (model_dir / SERVING_FILE).write_text(json.dumps({"serving": serving, "streaming": settings.streaming.card()},
                                                     indent=2) + "\n")
    return model_dir


def export_checkpoint(out: Path, model_dir: Path | None = None, base: Path = BASE_MODEL) -> Path:
    """The model folder of a run's latest checkpoint (its EMA weights), e.g. to evaluate it while it trains."""
    import torch

    checkpoints = out / "checkpoints"
    saved = json.loads((checkpoints / "settings.json").read_text())
    base = Path(saved.pop("base", base))
    streaming = saved.pop("streaming")
    settings = WorldTrainingSettings(**saved, streaming=WorldStreaming(**{**streaming,
                                                                          "timesteps": tuple(streaming["timesteps"])}))
    vae, transformer, text_encoder, tokenizer = load_base(base, checkpoints / "tokenizer", log=lambda _: None)
    decoder = checkpoints / "world-decoder.pt"
    if decoder.is_file():
        vae.load_state_dict(torch.load(decoder, weights_only=False)["vae"])
    state = torch.load(checkpoints / "world-transformer.pt", weights_only=False)
    for module, saved_state in zip((transformer, text_encoder), state["ema"]):
        module.load_state_dict(saved_state)
    target = model_dir or out / f"model-step{state['step']}"
    export_world_model(target, base, vae, (transformer, text_encoder), tokenizer, settings)
    return target
