"""Training a FluxPipeline-compatible model on the `shapes` dataset (CPU or GPU).

Stages, each resumable from its checkpoint in ``OUT/checkpoints/``:

1. ``vae``: a small AutoencoderKL, trained on the dataset's images; its
   latent statistics become the VAE's shift and scaling factors.
2. ``transformer``: FluxTransformer2DModel plus tiny CLIP and T5 encoders,
   trained jointly with flow matching (x_t = (1 - s) x0 + s e, target e - x0)
   under Flux's resolution-dependent timestep shift, with caption dropout so
   that classifier-free guidance works, and an EMA of the weights.

The result is saved with ``save_pretrained`` (safetensors) and loads with
``FluxPipeline.from_pretrained``; ``machgen.json`` beside it holds the served
defaults the model card recommends.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from machgen.builder.caption_tokenizers import clip_tokenizer_from_open_clip, train_t5_tokenizer
from machgen.builder.training_loop import (Checkpointer, EmaTraining, budget_left, progress_bar, resume_vae_stage,
                                           set_cosine_lr)
from machgen.datasets import shapes


@dataclass
class ShapesModelConfig:
    """Sizes of the shapes model (about 3 M parameters in the transformer)."""

    vae_channels: tuple[int, ...] = (32, 64, 64)  # three levels: 64x64 images -> 16x16 latents
    latent_channels: int = 8
    transformer_heads: int = 4
    head_dim: int = 32
    double_blocks: int = 2
    single_blocks: int = 4
    text_dim: int = 64
    # T5 tokens; the longest caption takes 24 with the trained tokenizer (new words need room too).
    max_sequence_length: int = 32


@dataclass
class TrainingSettings:
    """One training run; recorded in the model card."""

    seed: int = 0
    vae_steps: int = 6000
    vae_minutes: float | None = None  # a time budget ends the stage early
    vae_batch: int = 16
    vae_lr: float = 1.5e-3
    # Share of VAE images drawn with a random shape colour, so that the latent
    # space also holds colours the dataset lacks (what a LoRA may teach later).
    vae_unseen_colours: float = 0.5
    # A last stage retrains the VAE decoder alone, the encoder (and with it the
    # latents the transformer learned) frozen: its colours were still off by
    # tens of RGB units after the joint stage (magenta read as white, blue as cyan).
    decoder_steps: int = 3000
    decoder_minutes: float | None = None
    decoder_lr: float = 1e-3
    # Extra loss weight on the shape's pixels, whose colour the prompt names but
    # which cover only 5-15 % of an image.
    decoder_shape_weight: float = 4.0
    steps: int = 20000
    minutes: float | None = None
    batch: int = 32
    lr: float = 7e-4
    warmup_steps: int = 200
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    latent_pool: int = 16384
    bf16: bool = False  # autocast; slower than fp32 on the 2-core CPU trial
    checkpoint_minutes: float = 5.0
    config: ShapesModelConfig = field(default_factory=ShapesModelConfig)


# ----------------------------------------------------------------- utilities
def images_to_tensor(images: np.ndarray):
    """uint8 [N, H, W, 3] -> float [N, 3, H, W] in [-1, 1]."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 127.5 - 1


# ----------------------------------------------------------------- VAE stage
def build_vae(config: ShapesModelConfig):
    from diffusers import AutoencoderKL

    levels = len(config.vae_channels)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=config.vae_channels,
        layers_per_block=1, latent_channels=config.latent_channels, norm_num_groups=8, sample_size=shapes.SIZE,
        mid_block_add_attention=False, use_quant_conv=False, use_post_quant_conv=False,
    )


def _vae_training_sample(rng: np.random.Generator, unseen_colour_share: float) -> shapes.Sample:
    if rng.random() >= unseen_colour_share:
        return shapes.sample(rng)
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    return shapes.sample(rng, colours=("unseen",), palette={"unseen": colour})


def train_vae(out: Path, settings: TrainingSettings, resume: bool = True, log: Callable[[str], None] = print):
    """Near-deterministic autoencoder training (posterior mean plus a little
    noise; MSE + 0.5 L1 + 1e-4 KL; cosine learning rate), then the latent
    statistics set shift_factor and scaling_factor."""
    import torch

    vae = build_vae(settings.config).train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.vae_lr, weight_decay=0.0)
    checkpoint = Checkpointer(out / "checkpoints" / "vae.pt", settings.checkpoint_minutes)
    rng = np.random.default_rng(settings.seed + 1)
    step, elapsed = resume_vae_stage(checkpoint if resume else None, vae, optimizer, rng, "vae", log)
    start = time.monotonic()
    latent_size = shapes.SIZE // 2 ** (len(settings.config.vae_channels) - 1)
    latent_elements = settings.config.latent_channels * latent_size**2

    def snapshot() -> dict:
        return {"vae": vae.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed + time.monotonic() - start, "rng": rng.bit_generator.state}

    with progress_bar(settings.vae_steps, step, "vae") as bar:
        while step < settings.vae_steps and budget_left(start, elapsed, settings.vae_minutes):
            set_cosine_lr(optimizer, settings.vae_lr, 1e-4, step, settings.vae_steps,
                          elapsed + time.monotonic() - start, settings.vae_minutes)
            images = np.stack([_vae_training_sample(rng, settings.vae_unseen_colours).image
                               for _ in range(settings.vae_batch)])
            x = images_to_tensor(images)
            posterior = vae.encode(x).latent_dist
            z = posterior.mean + 0.02 * torch.randn_like(posterior.mean)
            reconstruction = vae.decode(z).sample
            mse = ((reconstruction - x) ** 2).mean()
            loss = mse + 0.5 * (reconstruction - x).abs().mean() + 1e-4 * posterior.kl().mean() / latent_elements
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            bar.update(1)
            bar.set_postfix(mse=f"{mse.item():.5f}")
            checkpoint.maybe_save(snapshot)
    checkpoint.maybe_save(snapshot, force=True)
    vae.eval()
    with torch.no_grad():
        latents = vae.encode(images_to_tensor(np.stack([s.image for s in _vae_check_samples()]))).latent_dist.mean
    mean, std = latents.mean().item(), latents.std().item()
    vae.register_to_config(shift_factor=mean, scaling_factor=1.0 / std)
    metrics = {"vae_steps": step, **vae_metrics(vae, "vae")}
    log(f"vae: {json.dumps(metrics)}")
    return vae, metrics


def _vae_check_samples() -> list[shapes.Sample]:
    return shapes.batch(256, seed=12345)


def vae_metrics(vae, prefix: str) -> dict:
    """Reconstruction PSNR, share of reconstructions the detector reads
    correctly, and the colour error on unseen colours."""
    import torch

    samples = _vae_check_samples()
    images = np.stack([s.image for s in samples])
    with torch.no_grad():
        reconstructed = tensor_to_images(vae.decode(vae.encode(images_to_tensor(images)).latent_dist.mean).sample)
    readable = np.mean([shapes.detect(r) == s.label for r, s in zip(reconstructed, samples)])
    mse = np.mean((reconstructed.astype(np.float64) - images) ** 2)
    return {f"{prefix}_reconstruction_psnr_db": round(float(10 * np.log10(255**2 / mse)), 2),
            f"{prefix}_reconstructions_read_correctly": round(float(readable), 4),
            f"{prefix}_unseen_colour_error": round(unseen_colour_error(vae), 1)}


def refine_vae_decoder(out: Path, settings: TrainingSettings, vae, resume: bool = True,
                       log: Callable[[str], None] = print) -> dict:
    """Train the decoder alone on what the frozen encoder gives (so the
    transformer's latents keep their meaning), with the shape's pixels
    weighted up; cosine learning rate. Updates ``vae`` in place."""
    import torch

    decoder_parts = [vae.decoder] + ([vae.post_quant_conv] if vae.post_quant_conv is not None else [])
    params = [p for part in decoder_parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=settings.decoder_lr, weight_decay=0.0)
    checkpoint = Checkpointer(out / "checkpoints" / "vae_decoder.pt", settings.checkpoint_minutes)
    rng = np.random.default_rng(settings.seed + 3)
    step, elapsed = resume_vae_stage(checkpoint if resume else None, vae, optimizer, rng, "vae decoder", log)
    start = time.monotonic()

    def snapshot() -> dict:
        return {"vae": vae.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed + time.monotonic() - start, "rng": rng.bit_generator.state}

    vae.requires_grad_(False)
    for part in decoder_parts:
        part.requires_grad_(True).train()
    with progress_bar(settings.decoder_steps, step, "vae decoder") as bar:
        while step < settings.decoder_steps and budget_left(start, elapsed, settings.decoder_minutes):
            set_cosine_lr(optimizer, settings.decoder_lr, 5e-5, step, settings.decoder_steps,
                          elapsed + time.monotonic() - start, settings.decoder_minutes)
            samples = [_vae_training_sample(rng, settings.vae_unseen_colours) for _ in range(settings.vae_batch)]
            x = images_to_tensor(np.stack([s.image for s in samples]))
            weight = 1.0 + settings.decoder_shape_weight * torch.from_numpy(
                np.stack([_shape_pixels(s.image, 0.5) for s in samples]).astype(np.float32))[:, None]
            with torch.no_grad():
                z = vae.encode(x).latent_dist.mean
            reconstruction = vae.decode(z + 0.02 * torch.randn_like(z)).sample
            error = reconstruction - x
            mse = (weight * error**2).mean()
            loss = mse + 0.5 * (weight * error.abs()).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            bar.update(1)
            bar.set_postfix(mse=f"{mse.item():.5f}")
            checkpoint.maybe_save(snapshot)
    checkpoint.maybe_save(snapshot, force=True)
    vae.eval().requires_grad_(False)
    metrics = {"vae_decoder_steps": step, **vae_metrics(vae, "vae_decoder")}
    log(f"vae decoder: {json.dumps(metrics)}")
    return metrics


def unseen_colour_error(vae, count: int = 128, seed: int = 54321) -> float:
    """Mean RGB distance between a random-colour shape and its reconstruction's shape colour."""
    import torch

    rng = np.random.default_rng(seed)
    samples = [_vae_training_sample(rng, 1.0) for _ in range(count)]
    images = np.stack([s.image for s in samples])
    with torch.no_grad():
        x = images_to_tensor(images)
        reconstructed = tensor_to_images(vae.decode(vae.encode(x).latent_dist.mean).sample)
    errors = []
    for original, decoded in zip(images.astype(np.float64), reconstructed.astype(np.float64)):
        shape_pixels = _shape_pixels(original, 0.8)
        errors.append(np.linalg.norm(np.median(decoded[shape_pixels], axis=0)
                                     - np.median(original[shape_pixels], axis=0)))
    return float(np.mean(errors))


def _shape_pixels(image: np.ndarray, fraction: float) -> np.ndarray:
    """Where an image is farther than ``fraction`` of its largest distance from
    its own border colour: the shape (the background is flat plus mild noise)."""
    image = image.astype(np.float64)
    border = np.median(np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]]), axis=0)
    distance = np.linalg.norm(image - border, axis=2)
    return distance > fraction * distance.max()


def tensor_to_images(tensor) -> np.ndarray:
    """float [N, 3, H, W] in [-1, 1] -> uint8 [N, H, W, 3], rounded as diffusers does."""
    return ((tensor.clamp(-1, 1) / 2 + 0.5) * 255).round().byte().permute(0, 2, 3, 1).numpy()


# --------------------------------------------------------- transformer stage
def build_text_encoders(config: ShapesModelConfig, clip_tokenizer, t5_tokenizer):
    import transformers

    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=config.text_dim, intermediate_size=4 * config.text_dim,
        num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=clip_tokenizer.model_max_length,
        projection_dim=config.text_dim, bos_token_id=clip_tokenizer.bos_token_id,
        eos_token_id=clip_tokenizer.eos_token_id, pad_token_id=clip_tokenizer.pad_token_id,
    ))
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(t5_tokenizer), d_model=config.text_dim, d_kv=16, d_ff=4 * config.text_dim, num_layers=2,
        num_heads=4, feed_forward_proj="gated-gelu", relative_attention_num_buckets=16,
        pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id,
        decoder_start_token_id=t5_tokenizer.pad_token_id,
    ))
    return clip, t5


def build_transformer(config: ShapesModelConfig):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=4 * config.latent_channels, num_layers=config.double_blocks,
        num_single_layers=config.single_blocks, attention_head_dim=config.head_dim,
        num_attention_heads=config.transformer_heads, joint_attention_dim=config.text_dim,
        pooled_projection_dim=config.text_dim, guidance_embeds=False,
        # Flux's split of the head dimension over (index, row, column): (16, 56, 56) of 128.
        axes_dims_rope=(config.head_dim // 4, 3 * config.head_dim // 8, 3 * config.head_dim // 8),
    )


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1's scheduler settings: the shift depends on the image token count.
    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def flux_sigma_shift(image_tokens: int, scheduler_config) -> float:
    """exp(mu) of FluxPipeline's calculate_shift: sigma -> s*sigma / (1 + (s-1)*sigma)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = scheduler_config
    return math.exp(calculate_shift(image_tokens, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift,
                                    cfg.max_shift))


class LatentPool:
    """Dataset images encoded once by the frozen VAE (posterior mean, scaled and
    packed as FluxPipeline packs latents), with their caption indices."""

    def __init__(self, vae, size: int, seed: int, captions: list[str], sample_fn=None,
                 log: Callable[[str], None] = print):
        import torch
        from diffusers import FluxPipeline

        sample_fn = sample_fn or shapes.sample
        index = {caption: i for i, caption in enumerate(captions)}
        rng = np.random.default_rng(seed)
        latents, caption_ids = [], []
        start = time.monotonic()
        with torch.no_grad():
            for _ in range(0, size, 256):
                samples = [sample_fn(rng) for _ in range(256)]
                mean = vae.encode(images_to_tensor(np.stack([s.image for s in samples]))).latent_dist.mean
                latents.append((mean - vae.config.shift_factor) * vae.config.scaling_factor)
                caption_ids += [index[s.caption] for s in samples]
        latents = torch.cat(latents)[:size]
        batch, channels, height, width = latents.shape
        self.latents = FluxPipeline._pack_latents(latents, batch, channels, height, width)
        self.caption_ids = torch.tensor(caption_ids[:size])
        self.latent_size = (height, width)
        log(f"latent pool {tuple(self.latents.shape)} built in {time.monotonic() - start:.0f} s")


@dataclass
class TextBatch:
    """Every caption pre-tokenized exactly as FluxPipeline tokenizes prompts."""

    captions: list[str]
    clip_ids: object
    t5_ids: object

    @classmethod
    def build(cls, captions: list[str], clip_tokenizer, t5_tokenizer, max_sequence_length: int) -> "TextBatch":
        clip_ids = clip_tokenizer(captions, padding="max_length", max_length=clip_tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        t5_ids = t5_tokenizer(captions, padding="max_length", max_length=max_sequence_length, truncation=True,
                              return_tensors="pt").input_ids
        return cls(captions, clip_ids, t5_ids)


def flow_matching_loss(transformer, clip, t5, text: TextBatch, x0, caption_ids, img_ids, txt_ids, shift: float,
                       bf16: bool = False, guidance_scale: float = 3.5):
    """Flow-matching loss of one batch: sigma 70 % logit-normal, 30 % uniform,
    shifted as Flux shifts its sampling schedule; target eps - x0.

    Guidance-distilled transformers (FLUX.1-dev) get ``guidance_scale``
    embedded, as diffusers' Flux LoRA training does."""
    import torch

    batch = x0.shape[0]
    unique, inverse = torch.unique(caption_ids, return_inverse=True)
    u = torch.where(torch.rand(batch) < 0.3, torch.rand(batch), torch.sigmoid(torch.randn(batch)))
    sigma = shift * u / (1 + (shift - 1) * u)
    noise = torch.randn_like(x0)
    s = sigma[:, None, None]
    noisy = (1 - s) * x0 + s * noise
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        pooled = clip(text.clip_ids[unique]).pooler_output[inverse]
        embeds = t5(text.t5_ids[unique])[0][inverse]
        guidance = torch.full((batch,), guidance_scale) if transformer.config.guidance_embeds else None
        prediction = transformer(hidden_states=noisy, timestep=sigma, pooled_projections=pooled,
                                 encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids,
                                 guidance=guidance, return_dict=False)[0]
    return ((prediction.float() - (noise - x0)) ** 2).mean()


def train_transformer(out: Path, settings: TrainingSettings, vae, clip_tokenizer, t5_tokenizer, resume: bool = True,
                      log: Callable[[str], None] = print):
    """Jointly train the transformer and both text encoders; returns the EMA modules."""
    import torch
    from diffusers import FluxPipeline

    config = settings.config
    transformer = build_transformer(config)
    clip, t5 = build_text_encoders(config, clip_tokenizer, t5_tokenizer)
    stage = EmaTraining("transformer", [transformer, clip, t5], settings.lr, settings.warmup_steps,
                        settings.ema_decay, Checkpointer(out / "checkpoints" / "transformer.pt",
                                                         settings.checkpoint_minutes),
                        np.random.default_rng(settings.seed + 7))
    captions = [""] + shapes.all_captions()
    text = TextBatch.build(captions, clip_tokenizer, t5_tokenizer, config.max_sequence_length)
    pool = LatentPool(vae, settings.latent_pool, settings.seed + 1234, captions, log=log)
    height, width = pool.latent_size
    img_ids = FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(config.max_sequence_length, 3)
    shift = flux_sigma_shift(img_ids.shape[0], build_scheduler().config)
    if resume:
        stage.resume(log)

    def batch_loss(rng: np.random.Generator):
        index = torch.from_numpy(rng.integers(0, len(pool.latents), settings.batch))
        caption_ids = pool.caption_ids[index].clone()
        caption_ids[torch.from_numpy(rng.random(settings.batch) < settings.caption_dropout)] = 0  # ""
        return flow_matching_loss(transformer, clip, t5, text, pool.latents[index], caption_ids, img_ids, txt_ids,
                                  shift, settings.bf16)

    metrics = stage.run(settings.steps, settings.minutes, batch_loss)
    log(f"transformer: {json.dumps(metrics)}")
    return stage.ema, stage.losses, metrics


def shapes_served_defaults():
    """What the model card recommends: its training size and sequence length,
    true CFG 4 against an empty negative prompt."""
    from machgen.contract.specs import ServedDefaults

    return ServedDefaults(height=64, width=64, num_inference_steps=20, guidance_scale=3.5, true_cfg_scale=4.0,
                          negative_prompt="", max_sequence_length=ShapesModelConfig.max_sequence_length,
                          max_height=128, max_width=128)


def assemble_pipeline(vae, ema_modules, clip_tokenizer, t5_tokenizer):
    from diffusers import FluxPipeline

    transformer, clip, t5 = ema_modules
    return FluxPipeline(scheduler=build_scheduler(), vae=vae.eval(), text_encoder=clip.eval(),
                        tokenizer=clip_tokenizer, text_encoder_2=t5.eval(), tokenizer_2=t5_tokenizer,
                        transformer=transformer.eval())


def train_shapes_model(out: Path, settings: TrainingSettings, clip_vocab: Path, resume: bool = True,
                       log: Callable[[str], None] = print) -> dict:
    """Both stages, then the pipeline folder and served defaults in ``out/model``."""
    import torch

    from machgen.builder.model_folder import SERVING_FILE

    torch.manual_seed(settings.seed)
    started = time.time()
    clip_tokenizer = clip_tokenizer_from_open_clip(clip_vocab, out / "clip-tokenizer")
    t5_tokenizer = train_t5_tokenizer(shapes.all_captions())
    vae, vae_record = train_vae(out, settings, resume=resume, log=log)
    vae.requires_grad_(False)
    ema, _, transformer_metrics = train_transformer(out, settings, vae, clip_tokenizer, t5_tokenizer,
                                                    resume=resume, log=log)
    decoder_metrics = refine_vae_decoder(out, settings, vae, resume=resume, log=log)
    pipe = assemble_pipeline(vae, ema, clip_tokenizer, t5_tokenizer)
    model_dir = out / "model"
    pipe.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / SERVING_FILE).write_text(json.dumps({"serving": shapes_served_defaults().to_json()}, indent=2)
                                          + "\n")
    record = {"settings": asdict(settings), **vae_record, **transformer_metrics, **decoder_metrics,
              "wall_minutes_this_run": round((time.time() - started) / 60, 1)}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"saved {model_dir}")
    return record


