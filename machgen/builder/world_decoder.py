"""The world model's decoder stage (machgen/builder/world_training.py): the base VAE's decoder fine-tuned on
long world-shapes episodes, its encoder frozen, so that a session decoded chunk after chunk keeps its
colours; and the round trip that measures it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from machgen.builder.training_loop import Checkpointer, budget_left, progress_bar, resume_vae_stage, set_cosine_lr
from machgen.datasets import world_shapes


def train_world_decoder(out: Path, settings, vae, resume: bool = True,
                        log: Callable[[str], None] = print) -> dict:
    """Fine-tunes ``vae``'s decoder (and post-quant conv) in place on whole long episodes: shape-weighted MSE +
    0.5 L1 on the decode of the frozen encoder's posterior means; a cosine learning rate. ``settings``: the
    run's WorldTrainingSettings (its decoder_* fields); none at all at 0 steps."""
    import torch

    if settings.decoder_steps == 0:
        # A base whose decoder is fine-tuned for long episodes already (a world model fine-tuned further): kept
        # as it is, with no checkpoint and no round trip.
        log("world-decoder: skipped (0 steps): the base's VAE decoder as it is")
        return {"decoder_steps": 0}

    from machgen.builder.vae_clips import clips_to_tensor

    trained = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    optimizer = torch.optim.AdamW(trained, lr=settings.decoder_lr, weight_decay=0.0)
    checkpoint = Checkpointer(out / "checkpoints" / "world-decoder.pt", settings.checkpoint_minutes)
    rng = np.random.default_rng(settings.seed + 3)
    step, elapsed = resume_vae_stage(checkpoint if resume else None, vae, optimizer, rng, "world-decoder", log)
    start = time.monotonic()

    def snapshot() -> dict:
        return {"vae": vae.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed + time.monotonic() - start, "rng": rng.bit_generator.state}

    vae.requires_grad_(False)
    for parameter in trained:
        parameter.requires_grad_(True)
    with progress_bar(settings.decoder_steps, step, "world-decoder") as bar:
        while step < settings.decoder_steps and budget_left(start, elapsed, settings.decoder_minutes):
            set_cosine_lr(optimizer, settings.decoder_lr, settings.decoder_lr / 10, step, settings.decoder_steps,
                          elapsed + time.monotonic() - start, settings.decoder_minutes)
            chunks = settings.decoder_chunks[step % len(settings.decoder_chunks)]
            episodes = [world_shapes.sample(rng, chunks, settings.streaming.chunk_frames)
                        for _ in range(max(1, 16 // chunks))]
            x = clips_to_tensor(np.stack([e.frames for e in episodes]))
            weight = 1 + settings.decoder_shape_weight * torch.from_numpy(np.stack([e.masks for e in episodes]))[:, None]
            with torch.no_grad():
                z = vae.encode(x).latent_dist.mean
            error = vae.decode(z).sample - x
            loss = ((weight * error**2).mean() + 0.5 * (weight * error.abs()).mean()) / weight.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            step += 1
            bar.update(1)
            bar.set_postfix(mse=f"{(error**2).mean().item():.5f}")
            checkpoint.maybe_save(snapshot)
    checkpoint.maybe_save(snapshot, force=True)
    vae.eval().requires_grad_(False)
    metrics = {"decoder_steps": step, "decoder_minutes": round((elapsed + time.monotonic() - start) / 60, 1),
               **episode_round_trip(vae, settings)}
    log(f"world-decoder: {json.dumps(metrics)}")
    return metrics


def episode_round_trip(vae, settings, count: int = 8, chunks: int = 24) -> dict:
    """Held-out wall-free episodes of ``chunks`` chunks through the VAE: PSNR at chunks 1-8 and 17-24, and the
    share of chunks whose colour, shape and action the detector reads right after the round trip."""
    from machgen.builder.vae_clips import decode_latents, encode_clips

    rng = np.random.default_rng(31337)
    episodes = [world_shapes.sample(rng, chunks, settings.streaming.chunk_frames, walk=True) for _ in range(count)]
    frames = np.stack([e.frames for e in episodes])
    decoded = np.concatenate([decode_latents(vae, encode_clips(vae, frames[i:i + 1])) for i in range(count)])
    starts = world_shapes.chunk_starts(chunks, settings.streaming.chunk_frames)
    split = starts[8], starts[16]

    def psnr(a, b) -> float:
        return round(float(10 * np.log10(255**2 / max(((a.astype(np.float64) - b) ** 2).mean(), 1e-12))), 2)

    read = [reading == world_shapes.ChunkReading(e.subject.colour, e.subject.shape, action,
                                                 reading.speed if reading else 0.0)
            for video, e in zip(decoded, episodes)
            for action, reading in zip(e.actions, world_shapes.detect_episode(video, chunks,
                                                                              settings.streaming.chunk_frames))]
    return {"round_trip_psnr_chunks_1_8": psnr(decoded[:, :split[0]], frames[:, :split[0]]),
            "round_trip_psnr_chunks_17_24": psnr(decoded[:, split[1]:], frames[:, split[1]:]),
            "round_trip_read": round(float(np.mean(read)), 4)}
