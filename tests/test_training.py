"""Training smoke test: a few steps on a tiny configuration (full training never runs in CI)."""

import json

import numpy as np
import pytest
import torch

from machgen.builder.caption_tokenizers import train_t5_tokenizer
from machgen.builder.tiny import tiny_clip_tokenizer
from machgen.builder.training import (ShapesModelConfig, TrainingSettings, assemble_pipeline, refine_vae_decoder,
                                      train_transformer, train_vae)
from machgen.datasets import shapes

TINY = ShapesModelConfig(vae_channels=(8, 16, 16), latent_channels=4, transformer_heads=2, head_dim=16,
                         double_blocks=1, single_blocks=1, text_dim=32)


@pytest.fixture(scope="module")
def tokenizers():
    return tiny_clip_tokenizer(), train_t5_tokenizer(shapes.all_captions())


def settings(**overrides):
    values = dict(config=TINY, vae_steps=6, vae_batch=4, steps=60, batch=16, lr=2e-3, warmup_steps=5,
                  latent_pool=256, checkpoint_minutes=60.0)
    values.update(overrides)
    return TrainingSettings(**values)


def test_t5_tokenizer_is_trained_on_the_captions_and_knows_every_letter(tokenizers):
    _, t5 = tokenizers
    for caption in ("a magenta triangle at the bottom right", "an orange hexagon"):
        ids = t5(caption).input_ids
        assert t5.unk_token_id not in ids and ids[-1] == t5.eos_token_id
    longest = max(len(t5(c).input_ids) for c in shapes.all_captions() + shapes.all_captions(colours=("orange",)))
    assert longest <= ShapesModelConfig.max_sequence_length  # no caption is ever truncated


def test_few_steps_lower_the_loss_and_checkpoints_resume(tmp_path, tokenizers):
    torch.manual_seed(0)
    clip_tok, t5_tok = tokenizers
    vae, vae_metrics = train_vae(tmp_path, settings(), log=lambda line: None)
    assert vae_metrics["vae_steps"] == 6
    assert vae.config.scaling_factor > 0 and np.isfinite(vae.config.shift_factor)

    logs = []
    ema, losses, metrics = train_transformer(tmp_path, settings(), vae, clip_tok, t5_tok, log=logs.append)
    assert metrics["transformer_steps"] == 60 and len(losses) == 60
    assert np.mean(losses[-15:]) < 0.85 * np.mean(losses[:15])

    saved = torch.load(tmp_path / "checkpoints" / "transformer.pt", weights_only=False)
    assert saved["step"] == 60
    resumed_logs = []
    ema2, losses2, metrics2 = train_transformer(tmp_path, settings(steps=65), vae, clip_tok, t5_tok,
                                                log=resumed_logs.append)
    assert "transformer: resumed at step 60" in resumed_logs
    assert metrics2["transformer_steps"] == 65 and len(losses2) == 65 and losses2[:60] == losses

    # the EMA weights make a FluxPipeline that saves and loads back unchanged
    pipe = assemble_pipeline(vae, ema2, clip_tok, t5_tok)
    pipe.save_pretrained(tmp_path / "model")
    from diffusers import FluxPipeline

    again = FluxPipeline.from_pretrained(tmp_path / "model", local_files_only=True)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        a, b = getattr(pipe, name).state_dict(), getattr(again, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    image = again("a red circle at the top left", height=64, width=64, num_inference_steps=2,
                  max_sequence_length=TINY.max_sequence_length, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()


def test_vae_checkpoint_resumes_finished_stage(tmp_path):
    train_vae(tmp_path, settings(), log=lambda line: None)
    logs = []
    _, metrics = train_vae(tmp_path, settings(), log=logs.append)
    assert "vae: resumed at step 6" in logs and metrics["vae_steps"] == 6
    assert json.loads(json.dumps(metrics))  # JSON-able for the model card


def test_decoder_stage_trains_the_decoder_alone(tmp_path):
    """The transformer learned the encoder's latents: the last stage must not move them."""
    vae, _ = train_vae(tmp_path, settings(), log=lambda line: None)
    before = {name: value.clone() for name, value in vae.state_dict().items()}
    scaling, shift = vae.config.scaling_factor, vae.config.shift_factor
    metrics = refine_vae_decoder(tmp_path, settings(decoder_steps=4), vae, log=lambda line: None)
    changed = {name for name, value in vae.state_dict().items() if not torch.equal(before[name], value)}
    assert changed and all(name.startswith(("decoder.", "post_quant_conv.")) for name in changed)
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (scaling, shift)
    assert metrics["vae_decoder_steps"] == 4 and 0 <= metrics["vae_decoder_reconstructions_read_correctly"] <= 1
    logs = []
    refine_vae_decoder(tmp_path, settings(decoder_steps=4), vae, log=logs.append)
    assert "vae decoder: resumed at step 4" in logs
