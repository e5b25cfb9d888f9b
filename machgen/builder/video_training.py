"""Training a Wan 2.2 TI2V-layout video model on the `moving shapes` dataset
(machgen/datasets/moving_shapes.py), on the CPU or a GPU.

One model does text-to-video and image-to-video as Wan2.2-TI2V-5B does: a
WanPipeline with ``expand_timesteps`` (a timestep per token), whose
image-to-video (WanImageToVideoPipeline on the same folder) puts the
picture's latents in the first latent frame with timestep 0.

Stages, each resumable from its checkpoint in ``OUT/checkpoints/``:

1. ``video-vae``: a small AutoencoderKLWan of the Wan 2.2 kind (residual
   blocks, causal in time: 4x in time, 4x4 in space), trained on short clips
   (its first frame alone, then chunks of four, as it encodes), the shape's
   pixels weighted up; its per-channel latent statistics become the VAE's
   ``latents_mean`` and ``latents_std``.
2. ``video-transformer``: WanTransformer3DModel and a small UMT5 encoder,
   trained jointly with flow matching on the frozen VAE's latents of whole
   clips; in a share of the batch the first latent frame is the clean
   picture at timestep 0, outside the loss (image-to-video); caption dropout
   for classifier-free guidance; an EMA of the weights is what is saved.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from machgen.builder.caption_tokenizers import caption_word_tokenizer
from machgen.builder.training_loop import (Checkpointer, EmaTraining, budget_left, progress_bar, resume_vae_stage,
                                           set_cosine_lr)
from machgen.builder.vae_clips import clips_to_tensor, decode_latents, encode_clips
from machgen.datasets import moving_shapes


@dataclass
class VideoModelConfig:
    """Sizes of the moving-shapes model: 64x64x17 clips -> 16x16x5 latents
    -> 320 tokens a step (patches of 2x2)."""

    vae_base_dim: int = 16
    vae_dim_mult: tuple[int, ...] = (1, 2, 2)  # two levels down: 4x4 in space, 4x in time
    latent_channels: int = 16
    heads: int = 4
    head_dim: int = 32
    layers: int = 4
    ffn_dim: int = 384
    text_dim: int = 64
    # UMT5 tokens: a caption takes 7 or 8 (one a word, caption_tokenizers.caption_word_tokenizer); the room
    # beyond is for prompts with words the captions lack, which take a token a letter.
    max_sequence_length: int = 32
    # The sampling schedule's shift (UniPC's flow_shift), which training's timestep draw follows too.
    flow_shift: float = 3.0


@dataclass
class VideoTrainingSettings:
    """One training run; recorded in the model card."""

    seed: int = 0
    vae_steps: int = 4000
    vae_minutes: float | None = None
    vae_batch: int = 4
    # Clip length in VAE training: whole clips (the first frame alone, then four chunks of four). Its causal
    # caches are not stationary over chunks: trained on 5 frames, frames 5-16 decoded 6-9 dB worse than the
    # first ones; on 9 frames (3,500 steps), frames 0-8 at 27-28 dB and 9-16 at 20-25 dB.
    vae_frames: int = moving_shapes.FRAMES
    vae_lr: float = 1.5e-3
    # Extra loss weight on the shape's pixels, whose colour the prompt names
    # but which cover only 5-12 % of a frame.
    vae_shape_weight: float = 4.0
    steps: int = 20000
    minutes: float | None = None
    batch: int = 16
    lr: float = 7e-4
    warmup_steps: int = 200
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    # Share of each batch trained as image-to-video (first latent frame given).
    image_to_video_share: float = 0.5
    latent_pool: int = 3072
    # Held-out clips that set the latent statistics and measure the VAE.
    vae_check_clips: int = 32
    checkpoint_minutes: float = 5.0
    # Text-to-video on the first held-out evaluation pairs (20 steps, CFG 5) every so many minutes of the
    # transformer stage and at its end, logged and kept in checkpoints/video-transformer-checks.jsonl: the
    # loss alone does not say whether the text steers the motion.
    check_minutes: float | None = 15.0
    check_pairs: int = 16
    config: VideoModelConfig = field(default_factory=VideoModelConfig)


def build_video_vae(config: VideoModelConfig):
    from diffusers import AutoencoderKLWan

    levels = len(config.vae_dim_mult) - 1
    return AutoencoderKLWan(
        base_dim=config.vae_base_dim, decoder_base_dim=config.vae_base_dim, z_dim=config.latent_channels,
        dim_mult=list(config.vae_dim_mult), num_res_blocks=1, temperal_downsample=[True] * levels,
        is_residual=True, in_channels=3, out_channels=3, patch_size=1,
        scale_factor_spatial=2 ** levels, scale_factor_temporal=2 ** levels,
        latents_mean=[0.0] * config.latent_channels, latents_std=[1.0] * config.latent_channels)


def build_video_transformer(config: VideoModelConfig):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=config.heads, attention_head_dim=config.head_dim,
        in_channels=config.latent_channels, out_channels=config.latent_channels, text_dim=config.text_dim,
        freq_dim=256, ffn_dim=config.ffn_dim, num_layers=config.layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)


def build_text_encoder(config: VideoModelConfig, tokenizer):
    import transformers

    return transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(tokenizer), d_model=config.text_dim, d_kv=16, d_ff=4 * config.text_dim, num_layers=2,
        num_heads=4, feed_forward_proj="gated-gelu", relative_attention_num_buckets=16,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id))


def build_video_scheduler(config: VideoModelConfig):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   flow_shift=config.flow_shift)


# ----------------------------------------------------------------- VAE stage
def train_video_vae(out: Path, settings: VideoTrainingSettings, resume: bool = True,
                    log: Callable[[str], None] = print):
    """Near-deterministic autoencoder training (posterior mean plus a little
    noise; shape-weighted MSE + 0.5 L1 + 1e-4 KL; cosine learning rate),
    then the per-channel latent statistics."""
    import torch

    vae = build_video_vae(settings.config).train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.vae_lr, weight_decay=0.0)
    checkpoint = Checkpointer(out / "checkpoints" / "video-vae.pt", settings.checkpoint_minutes)
    rng = np.random.default_rng(settings.seed + 1)
    step, elapsed = resume_vae_stage(checkpoint if resume else None, vae, optimizer, rng, "video-vae", log)
    start = time.monotonic()

    def snapshot() -> dict:
        return {"vae": vae.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed + time.monotonic() - start, "rng": rng.bit_generator.state}

    with progress_bar(settings.vae_steps, step, "video-vae") as bar:
        while step < settings.vae_steps and budget_left(start, elapsed, settings.vae_minutes):
            set_cosine_lr(optimizer, settings.vae_lr, 1e-4, step, settings.vae_steps,
                          elapsed + time.monotonic() - start, settings.vae_minutes)
            clips = [moving_shapes.sample(rng, frames=settings.vae_frames) for _ in range(settings.vae_batch)]
            x = clips_to_tensor(np.stack([clip.frames for clip in clips]))
            weight = 1 + settings.vae_shape_weight * torch.from_numpy(np.stack([clip.masks for clip in clips]))[:, None]
            posterior = vae.encode(x).latent_dist
            z = posterior.mean + 0.02 * torch.randn_like(posterior.mean)
            reconstruction = vae.decode(z).sample
            error = reconstruction - x
            mse = (weight * error**2).mean() / weight.mean()
            loss = mse + 0.5 * (weight * error.abs()).mean() / weight.mean() + 1e-4 * posterior.kl().mean() / z[0].numel()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            optimizer.step()
            step += 1
            bar.update(1)
            bar.set_postfix(mse=f"{(error**2).mean().item():.5f}")
            checkpoint.maybe_save(snapshot)
    checkpoint.maybe_save(snapshot, force=True)
    vae.eval()
    check = moving_shapes.batch(settings.vae_check_clips, seed=12345)
    set_latent_statistics(vae, check)
    metrics = {"vae_steps": step, "vae_minutes": round((elapsed + time.monotonic() - start) / 60, 1),
               **video_vae_metrics(vae, check)}
    log(f"video-vae: {json.dumps(metrics)}")
    return vae, metrics


def set_latent_statistics(vae, clips: list[moving_shapes.Clip]) -> None:
    """latents_mean and latents_std per channel, over whole held-out clips."""
    vae.register_to_config(latents_mean=[0.0] * vae.config.z_dim, latents_std=[1.0] * vae.config.z_dim)
    latents = encode_clips(vae, np.stack([clip.frames for clip in clips]))
    vae.register_to_config(latents_mean=[round(v, 6) for v in latents.mean(dim=(0, 2, 3, 4)).tolist()],
                           latents_std=[round(v, 6) for v in latents.std(dim=(0, 2, 3, 4)).tolist()])


def video_vae_metrics(vae, clips: list[moving_shapes.Clip]) -> dict:
    """Round-trip PSNR over whole held-out clips, and how often the detector
    reads the reconstruction as the original's motion."""
    frames = np.stack([clip.frames for clip in clips])
    decoded = decode_latents(vae, encode_clips(vae, frames))
    mse = ((decoded.astype(np.float64) - frames) ** 2).mean()
    readable = np.mean([moving_shapes.detect(video) == clip.motion for video, clip in zip(decoded, clips)])
    return {"vae_psnr": round(float(10 * np.log10(255**2 / max(mse, 1e-12))), 2),
            "vae_motion_read": round(float(readable), 4)}


# --------------------------------------------------------- transformer stage
class ClipLatentPool:
    """Whole dataset clips encoded once by the frozen VAE, with caption indices."""

    def __init__(self, vae, size: int, seed: int, captions: list[str], log: Callable[[str], None] = print):
        import torch

        index = {caption: i for i, caption in enumerate(captions)}
        rng = np.random.default_rng(seed)
        latents, caption_ids = [], []
        start = time.monotonic()
        for first in range(0, size, 32):
            clips = [moving_shapes.sample(rng) for _ in range(min(32, size - first))]
            latents.append(encode_clips(vae, np.stack([clip.frames for clip in clips])))
            caption_ids += [index[clip.caption] for clip in clips]
        self.latents = torch.cat(latents)
        self.caption_ids = torch.tensor(caption_ids)
        log(f"clip latent pool {tuple(self.latents.shape)} built in {time.monotonic() - start:.0f} s")


class PromptTable:
    """Every caption's UMT5 ids and mask, tokenized as WanPipeline tokenizes."""

    def __init__(self, captions: list[str], tokenizer, max_sequence_length: int):
        tokens = tokenizer(captions, padding="max_length", max_length=max_sequence_length, truncation=True,
                           add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        self.ids, self.mask = tokens.input_ids, tokens.attention_mask

    def embed(self, text_encoder, caption_ids):
        """WanPipeline's prompt embeddings: the encoder's states up to each
        prompt's length, zeros after."""
        import torch

        unique, inverse = torch.unique(caption_ids, return_inverse=True)
        mask = self.mask[unique]
        states = text_encoder(self.ids[unique], mask).last_hidden_state
        return (states * mask[..., None].to(states.dtype))[inverse]


def video_flow_matching_loss(transformer, text_encoder, prompts: PromptTable, x0, caption_ids, given_first,
                             shift: float):
    """Flow-matching loss of one batch: sigma 70 % logit-normal, 30 %
    uniform, shifted as the sampling schedule is; target noise - x0; a
    timestep per token (1000 sigma), 0 and clean for the first latent frame
    of the ``given_first`` rows, whose first frame is outside the loss."""
    import torch

    batch, _, frames, height, width = x0.shape
    u = torch.where(torch.rand(batch) < 0.3, torch.rand(batch), torch.sigmoid(torch.randn(batch)))
    sigma = shift * u / (1 + (shift - 1) * u)
    noise = torch.randn_like(x0)
    s = sigma.view(batch, 1, 1, 1, 1)
    noisy = (1 - s) * x0 + s * noise
    keep = torch.ones(batch, 1, frames, 1, 1)
    keep[given_first, :, 0] = 0
    noisy = keep * noisy + (1 - keep) * x0
    tokens_per_frame = (height // 2) * (width // 2)
    timestep = (sigma * 1000).view(batch, 1, 1).expand(batch, frames, tokens_per_frame).clone()
    timestep[given_first, 0] = 0
    embeds = prompts.embed(text_encoder, caption_ids)
    prediction = transformer(hidden_states=noisy, timestep=timestep.reshape(batch, -1),
                             encoder_hidden_states=embeds, return_dict=False)[0]
    error = (prediction.float() - (noise - x0)) ** 2
    return (keep * error).sum() / (keep.sum() * error.shape[1] * height * width)


def train_video_transformer(out: Path, settings: VideoTrainingSettings, vae, tokenizer, resume: bool = True,
                            log: Callable[[str], None] = print):
    """Jointly train the transformer and the text encoder; returns the EMA modules and the metrics."""
    import torch

    config = settings.config
    transformer = build_video_transformer(config)
    text_encoder = build_text_encoder(config, tokenizer)
    stage = EmaTraining("video-transformer", [transformer, text_encoder], settings.lr, settings.warmup_steps,
                        settings.ema_decay, Checkpointer(out / "checkpoints" / "video-transformer.pt",
                                                         settings.checkpoint_minutes),
                        np.random.default_rng(settings.seed + 7))
    captions = [""] + moving_shapes.all_captions()
    prompts = PromptTable(captions, tokenizer, config.max_sequence_length)
    if resume:
        stage.resume(log)
    if not stage.finished(settings.steps, settings.minutes):
        pool = ClipLatentPool(vae, settings.latent_pool, settings.seed + 1234, captions, log=log)

        def batch_loss(rng: np.random.Generator):
            index = torch.from_numpy(rng.integers(0, len(pool.latents), settings.batch))
            caption_ids = pool.caption_ids[index].clone()
            caption_ids[torch.from_numpy(rng.random(settings.batch) < settings.caption_dropout)] = 0  # ""
            given_first = torch.from_numpy(rng.random(settings.batch) < settings.image_to_video_share)
            return video_flow_matching_loss(transformer, text_encoder, prompts, pool.latents[index], caption_ids,
                                            given_first, config.flow_shift)

        stage.run(settings.steps, settings.minutes, batch_loss,
                  check=text_to_video_check(out, settings, vae, stage.ema, tokenizer, log), check_minutes=settings.check_minutes)
    metrics = stage.metrics()
    log(f"video-transformer: {json.dumps(metrics)}")
    return stage.ema, metrics


def text_to_video_check(out: Path, settings: VideoTrainingSettings, vae, ema_modules, tokenizer,
                        log: Callable[[str], None]) -> Callable[[int], None]:
    """The transformer stage's periodic measurement: the EMA model's text-to-video accuracy on the first
    ``check_pairs`` held-out evaluation pairs at the served defaults."""
    from machgen.builder.evaluate import sample_videos, score_motion

    pairs = moving_shapes.evaluation_prompts(settings.check_pairs)
    record = out / "checkpoints" / "video-transformer-checks.jsonl"

    def check(step: int) -> None:
        start = time.monotonic()
        pipe = assemble_video_pipeline(vae, ema_modules, tokenizer, settings.config)
        clips = sample_videos(pipe, video_served_defaults(), pairs, chunk=8)
        accuracy = score_motion(clips, [m for _, _, m in pairs])
        line = {"step": step, "text_to_video": asdict(accuracy), "seconds": round(time.monotonic() - start, 1)}
        log(f"video-transformer check: {json.dumps(line)}")
        with record.open("a") as file:
            file.write(json.dumps(line) + "\n")

    return check


# ------------------------------------------------------------------ assembly
def video_served_defaults():
    """What the model card recommends: the training size and length, CFG 5
    against an empty negative prompt."""
    from machgen.contract.specs import ServedDefaults

    return ServedDefaults(height=64, width=64, num_inference_steps=20, guidance_scale=5.0, negative_prompt="",
                          max_sequence_length=VideoModelConfig.max_sequence_length, max_height=128, max_width=128,
                          num_frames=moving_shapes.FRAMES, max_frames=33, fps=8)


def assemble_video_pipeline(vae, ema_modules, tokenizer, config: VideoModelConfig):
    from diffusers import WanPipeline

    transformer, text_encoder = ema_modules
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       transformer=transformer.eval(), transformer_2=None, scheduler=build_video_scheduler(config),
                       boundary_ratio=None, expand_timesteps=True)


def _tokenizer(folder: Path):
    """The UMT5 tokenizer of the captions' words, made once and kept with
    the checkpoints (a resumed run's text encoder needs the same ids)."""
    import transformers

    if (folder / "tokenizer.json").is_file():
        return transformers.T5TokenizerFast.from_pretrained(folder)
    tokenizer = caption_word_tokenizer(moving_shapes.all_captions())
    tokenizer.save_pretrained(folder)
    return tokenizer


def train_video_model(out: Path, settings: VideoTrainingSettings, resume: bool = True,
                      log: Callable[[str], None] = print) -> dict:
    """Both stages, then the pipeline folder and served defaults in ``out/model``."""
    import torch

    from machgen.builder.model_folder import SERVING_FILE

    torch.manual_seed(settings.seed)
    started = time.time()
    tokenizer = _tokenizer(out / "checkpoints" / "tokenizer")
    vae, vae_record = train_video_vae(out, settings, resume=resume, log=log)
    vae.requires_grad_(False)
    ema, transformer_metrics = train_video_transformer(out, settings, vae, tokenizer, resume=resume, log=log)
    pipe = assemble_video_pipeline(vae, ema, tokenizer, settings.config)
    model_dir = out / "model"
    pipe.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / SERVING_FILE).write_text(json.dumps({"serving": video_served_defaults().to_json()}, indent=2)
                                          + "\n")
    record = {"settings": asdict(settings), **vae_record, **transformer_metrics,
              "wall_minutes_this_run": round((time.time() - started) / 60, 1)}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"saved {model_dir}")
    return record
