"""Fine-tuning a LoRA on a Flux-family model: it learns a colour the base model never saw (a new concept)
from a few hundred procedural samples, with replayed old samples so that old prompts keep working."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from machgen.builder.training import LatentPool, TextBatch, flow_matching_loss, flux_sigma_shift
from machgen.builder.training_loop import budget_left, progress_bar
from machgen.datasets import shapes

# New concepts a LoRA can teach: a colour the base model never saw.
CONCEPT_COLOURS: dict[str, tuple[int, int, int]] = {"orange": (250, 140, 20), "gray": (128, 128, 128)}
LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "context_embedder", "proj_mlp", "proj_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
    "ff_context.net.2", "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2",
    # the AdaLN modulations, through which the pooled text steers every block
    "norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear",
)


@dataclass
class LoraSettings:
    """One LoRA fine-tuning run; recorded with the adapter."""

    concept: str = "orange"
    concept_samples: int = 384  # "a few hundred procedural samples" of the new concept
    replay_samples: int = 384  # samples of the old data, so that old prompts keep working
    rank: int = 32
    steps: int = 1500
    minutes: float | None = None
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0


def concept_palette(concept: str) -> dict[str, tuple[int, int, int]]:
    if concept not in CONCEPT_COLOURS:
        raise ValueError(f"unknown concept {concept!r}; known: {', '.join(CONCEPT_COLOURS)}")
    return {**shapes.PALETTE, concept: CONCEPT_COLOURS[concept]}


def train_lora(base_dir: Path, out: Path, settings: LoraSettings, log: Callable[[str], None] = print) -> dict:
    """Teach a Flux-family model a new colour with a LoRA on its transformer.

    Saves ``pytorch_lora_weights.safetensors`` (diffusers' format: loads with
    ``FluxPipeline.load_lora_weights``, fuses with ``machgen-build build --lora``).
    """
    import torch
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from machgen.builder.model_folder import detect_family, served_defaults

    torch.manual_seed(settings.seed)
    palette = concept_palette(settings.concept)
    pipe = FluxPipeline.from_pretrained(base_dir, local_files_only=True)
    for module in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        module.requires_grad_(False).eval()
    # Train at the sequence length the model is served with.
    max_sequence_length = served_defaults(base_dir, detect_family(base_dir), pipe).max_sequence_length
    transformer = pipe.transformer
    transformer.add_adapter(LoraConfig(r=settings.rank, lora_alpha=settings.rank, init_lora_weights="gaussian",
                                       target_modules=list(LORA_TARGETS)))
    transformer.train()
    new_colours = (settings.concept,)
    captions = [""] + shapes.all_captions() + shapes.all_captions(colours=new_colours)
    text = TextBatch.build(captions, pipe.tokenizer, pipe.tokenizer_2, max_sequence_length)
    concept_pool = LatentPool(pipe.vae, settings.concept_samples, settings.seed + 11, captions,
                              lambda rng: shapes.sample(rng, colours=new_colours, palette=palette), log=log)
    replay_pool = LatentPool(pipe.vae, settings.replay_samples, settings.seed + 12, captions, log=log)
    latents = torch.cat([concept_pool.latents, replay_pool.latents])
    caption_ids = torch.cat([concept_pool.caption_ids, replay_pool.caption_ids])
    height, width = concept_pool.latent_size
    img_ids = FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(max_sequence_length, 3)
    shift = flux_sigma_shift(img_ids.shape[0], pipe.scheduler.config)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    rng = np.random.default_rng(settings.seed)
    losses, step, start = [], 0, time.monotonic()
    with progress_bar(settings.steps, 0, f"lora {settings.concept}") as bar:
        while step < settings.steps and budget_left(start, 0.0, settings.minutes):
            index = torch.from_numpy(rng.integers(0, len(latents), settings.batch))
            batch_captions = caption_ids[index].clone()
            batch_captions[torch.from_numpy(rng.random(settings.batch) < 0.1)] = 0
            loss = flow_matching_loss(transformer, pipe.text_encoder, pipe.text_encoder_2, text, latents[index],
                                      batch_captions, img_ids, txt_ids, shift)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            losses.append(loss.item())
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-100:]):.4f}")
    out.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                   safe_serialization=True)
    record = {"base": str(base_dir), "settings": asdict(settings), "steps": step,
              "minutes": round((time.monotonic() - start) / 60, 1),
              "final_loss": round(float(np.mean(losses[-100:])), 4) if losses else None}
    (out / "lora.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"lora: {json.dumps(record)}")
    return record
