"""World-model training (machgen/builder/world_training.py) on a tiny base: a world model fine-tuned further for
streaming chunks of one latent frame (``machgen-build train OUT --world --chunk-frames 1``), its base's
tokenizer and decoder kept as they are; the full runs never run here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from machgen.builder.cli import app
from machgen.builder.model_folder import SERVING_FILE
from machgen.builder.video_training import VideoModelConfig
from machgen.builder.world_training import chunked_settings, export_checkpoint, train_world_model

TINY = VideoModelConfig(vae_base_dim=8, latent_channels=8, heads=2, head_dim=16, layers=1, ffn_dim=32, text_dim=32)


def tiny_settings(chunk_frames: int, **values):
    return chunked_settings(chunk_frames, **{
        "steps": 3, "batch": 2, "pool_episodes": 4, "refresh_episodes": 1, "refresh_every": 2, "decoder_steps": 0,
        "check_sessions": 1, "check_chunks": 4, "check_minutes": None, "checkpoint_minutes": 60.0, **values})


def write_tiny_video_base(folder):
    """A random-weight moving-shapes video model laid out as models/shapes-wan (the world model's base)."""
    from machgen.builder.caption_tokenizers import caption_word_tokenizer
    from machgen.builder.video_training import (assemble_video_pipeline, build_text_encoder, build_video_transformer,
                                                build_video_vae, video_served_defaults)
    from machgen.datasets import moving_shapes

    torch.manual_seed(0)
    tokenizer = caption_word_tokenizer(moving_shapes.all_captions())
    pipe = assemble_video_pipeline(build_video_vae(TINY), (build_video_transformer(TINY),
                                                           build_text_encoder(TINY, tokenizer)), tokenizer, TINY)
    pipe.save_pretrained(folder, safe_serialization=True)
    (folder / SERVING_FILE).write_text(json.dumps({"serving": video_served_defaults().to_json()}))
    return folder


@pytest.fixture(scope="module")
def world_base(tmp_path_factory):
    """A world model of the default chunks of two latent frames, made from the tiny video base (no steps)."""
    out = tmp_path_factory.mktemp("world")
    logs = []
    video_base = write_tiny_video_base(tmp_path_factory.mktemp("video-base"))
    train_world_model(out, tiny_settings(2, steps=0), base=video_base, log=logs.append)
    return out / "model", logs


@pytest.fixture(scope="module")
def fine_tuned(world_base, tmp_path_factory):
    out = tmp_path_factory.mktemp("world1")
    logs = []
    record = train_world_model(out, tiny_settings(1), base=world_base[0], log=logs.append)
    return out, record, logs


def card_streaming(model_dir) -> dict:
    return json.loads((model_dir / SERVING_FILE).read_text())["streaming"]


def test_the_video_base_s_tokenizer_is_widened_by_the_world_captions_words(world_base):
    import transformers

    model, logs = world_base
    assert any(line.startswith("tokenizer:") and "2 new: \u2581stays, \u2581still" in line for line in logs), logs
    vocab = transformers.AutoTokenizer.from_pretrained(model / "tokenizer").get_vocab()
    assert {"\u2581stays", "\u2581still"} <= vocab.keys()
    streaming = card_streaming(model)
    assert (streaming["chunk_frames"], streaming["sink_frames"], streaming["window_frames"]) == (2, 2, 6)


def test_a_world_base_fine_tuned_for_one_frame_chunks_keeps_its_tokenizer_and_decoder(world_base, fine_tuned):
    import transformers
    from diffusers import AutoencoderKLWan

    base = world_base[0]
    out, record, logs = fine_tuned
    assert any(line.startswith("tokenizer: the base's own") for line in logs), logs
    assert "world-decoder: skipped (0 steps): the base's VAE decoder as it is" in logs
    assert not (out / "checkpoints" / "world-decoder.pt").exists()
    assert record["transformer_steps"] == 3 and record["decoder_steps"] == 0
    tokenizers = [transformers.AutoTokenizer.from_pretrained(m / "tokenizer") for m in (base, out / "model")]
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    vaes = [AutoencoderKLWan.from_pretrained(m / "vae").state_dict() for m in (base, out / "model")]
    assert all(torch.equal(vaes[0][name], vaes[1][name]) for name in vaes[0])


def test_one_frame_chunks_keep_the_sink_window_and_episodes_in_latent_frames(fine_tuned):
    from machgen.contract.streaming import StreamingSettings

    out, _, _ = fine_tuned
    streaming = card_streaming(out / "model")
    assert (streaming["chunk_frames"], streaming["sink_frames"], streaming["window_frames"]) == (1, 2, 6)
    assert StreamingSettings.from_json(streaming).chunk_frames == 1  # what the build reads
    settings = json.loads((out / "training.json").read_text())["settings"]
    assert settings["streaming"]["chunk_frames"] == 1
    assert (settings["streaming"]["sink_chunks"], settings["streaming"]["window_chunks"]) == (2, 6)
    assert settings["episode_chunks"] == 16 and settings["decoder_chunks"] == [16, 30]  # 61 and 117 frames
    checks = [json.loads(line) for line in (out / "checkpoints" / "world-checks.jsonl").read_text().splitlines()]
    assert checks[-1]["step"] == 3 and checks[-1]["chunks"] == 4


def test_a_checkpoint_exports_with_its_one_frame_chunks(fine_tuned, tmp_path):
    out, _, _ = fine_tuned
    model = export_checkpoint(out, tmp_path / "model")
    assert card_streaming(model) == card_streaming(out / "model")


def test_train_world_takes_the_chunk_and_learning_rate_and_skips_the_decoder(world_base, fine_tuned, tmp_path):
    base = world_base[0]
    result = CliRunner().invoke(app, ["train", str(tmp_path / "a"), "--world", "--base", str(base), "--chunk-frames",
                                      "1", "--lr", "1e-4", "--steps", "0", "--decoder-steps", "0", "--batch", "2"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "a" / "training.json").read_text())
    assert record["settings"]["lr"] == 1e-4 and record["settings"]["batch"] == 2
    assert record["settings"]["streaming"]["chunk_frames"] == 1 and record["settings"]["check_chunks"] == 24
    assert card_streaming(tmp_path / "a" / "model")["chunk_frames"] == 1
    # Without --chunk-frames: the base card's chunk (a one-frame world model's, here), and the stage's own rate.
    result = CliRunner().invoke(app, ["train", str(tmp_path / "b"), "--world", "--base", str(fine_tuned[0] / "model"),
                                      "--steps", "0", "--decoder-steps", "0"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "b" / "training.json").read_text())
    assert record["settings"]["streaming"]["chunk_frames"] == 1 and record["settings"]["lr"] == 3e-4


@pytest.mark.parametrize("option, value, words", [("--chunk-frames", "3", "must divide"),
                                                  ("--lr", "0", "must be positive")])
def test_train_world_refuses_a_chunk_or_rate_it_cannot_train_naming_the_option(world_base, tmp_path, option, value,
                                                                                words):
    result = CliRunner().invoke(app, ["train", str(tmp_path / "c"), "--world", "--base", str(world_base[0]),
                                      "--steps", "0", "--decoder-steps", "0", option, value])
    assert result.exit_code == 2 and option in result.output and words in result.output, result.output
    assert not (tmp_path / "c" / "model").exists()


@pytest.mark.parametrize("args, option", [(["--chunk-frames", "1"], "--chunk-frames"),
                                          (["--video", "--lr", "0.001"], "--lr")])
def test_train_refuses_a_world_option_without_world_naming_it(tmp_path, args, option):
    result = CliRunner().invoke(app, ["train", str(tmp_path / "d"), "--steps", "0", *args])
    assert result.exit_code == 2 and option in result.output, result.output
    assert not (tmp_path / "d").exists()


@pytest.mark.export
def test_world_eval_plays_one_frame_chunks_of_a_card_overridden_by_streaming(world_base, tmp_path):
    """world_eval --model M --streaming '{"chunk_frames": 1}': the card's sink and window kept, sessions of a
    one-frame first chunk, then four frames a chunk, the first chunk steered still."""
    from argparse import Namespace

    from machgen.builder.world_eval import _repository, run_sessions
    from machgen.datasets import world_shapes
    from machgen.runtime.local import LocalPipeline

    args = Namespace(repository=None, model=str(world_base[0]), checkpoint=None, name="world1",
                     work=str(tmp_path), streaming='{"chunk_frames": 1}')
    repository, name = _repository(args, log=lambda line: None)
    with LocalPipeline(repository, name) as local:
        engine = local.streaming(max_sessions=2, max_rows=2)
        settings = engine.settings
        assert (settings.chunk_frames, settings.sink_frames, settings.window_frames) == (1, 2, 6)
        records = run_sessions(engine, world_shapes.evaluation_sessions(2), 3, 2, keep_frames=True,
                               log=lambda line: None)
    for record in records:
        assert [len(frames) for frames in record.frames] == [1, 4, 4]
        assert record.actions[0] == "stop" and len(record.readings) == 3
        assert all(np.asarray(frames).shape[1:] == (64, 64, 3) for frames in record.frames)
