"""Video training smoke test: a few steps of both stages on a tiny configuration (the full run never runs in CI);
the result is a Wan 2.2 TI2V-layout folder that diffusers' pipelines load and machgen serves as wan-ti2v."""

import json

import numpy as np
import pytest
import torch

from machgen.builder.vae_clips import clips_to_tensor
from machgen.builder.video_training import VideoModelConfig, VideoTrainingSettings, train_video_model
from machgen.datasets import moving_shapes

TINY = VideoModelConfig(vae_base_dim=8, latent_channels=8, heads=2, head_dim=16, layers=1, ffn_dim=32, text_dim=32)


def settings(**overrides):
    values = dict(config=TINY, vae_steps=3, vae_batch=2, steps=40, batch=8, lr=2e-3, warmup_steps=5,
                  latent_pool=32, vae_check_clips=4, checkpoint_minutes=60.0, check_pairs=2)
    values.update(overrides)
    return VideoTrainingSettings(**values)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("video-training")
    torch.manual_seed(0)
    logs = []
    record = train_video_model(out, settings(), log=logs.append)
    return out, record, logs


def test_both_stages_train_and_the_loss_falls(trained):
    out, record, _ = trained
    assert record["vae_steps"] == 3 and record["transformer_steps"] == 40
    losses = torch.load(out / "checkpoints" / "video-transformer.pt", weights_only=False)["losses"]
    assert len(losses) == 40 and np.mean(losses[-10:]) < 0.85 * np.mean(losses[:10])
    assert json.loads((out / "training.json").read_text())["transformer_steps"] == 40
    serving = json.loads((out / "model" / "machgen.json").read_text())["serving"]
    assert (serving["num_frames"], serving["height"], serving["width"]) == (moving_shapes.FRAMES, 64, 64)


def test_a_rerun_resumes_both_stages_from_their_checkpoints(trained):
    out, record, _ = trained
    logs = []
    again = train_video_model(out, settings(steps=42), log=logs.append)
    assert "video-vae: resumed at step 3" in logs and "video-transformer: resumed at step 40" in logs
    assert again["transformer_steps"] == 42 and again["vae_steps"] == 3
    losses = torch.load(out / "checkpoints" / "video-transformer.pt", weights_only=False)["losses"]
    assert len(losses) == 42


def test_the_folder_is_wan_ti2v_for_diffusers_and_for_machgen(trained):
    import diffusers

    from machgen.builder.model_folder import detect_family

    out, _, _ = trained
    model = out / "model"
    assert detect_family(model).name == "wan-ti2v"
    pipe = diffusers.WanPipeline.from_pretrained(model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.expand_timesteps and pipe.vae.config.patch_size == 1
    clip = pipe("a red circle moves to the right", height=64, width=64, num_frames=moving_shapes.FRAMES,
                num_inference_steps=2, max_sequence_length=TINY.max_sequence_length, output_type="np",
                generator=torch.Generator().manual_seed(0)).frames
    assert clip.shape == (1, moving_shapes.FRAMES, 64, 64, 3) and np.isfinite(clip).all()


def test_image_to_video_starts_from_the_pictures_own_latent_frame(trained):
    """The VAE is causal: a clip's first latent frame is its first frame's own, which is what image-to-video
    puts there (and what the transformer learned to keep at timestep 0)."""
    import diffusers

    out, _, _ = trained
    vae = diffusers.AutoencoderKLWan.from_pretrained(out / "model" / "vae")
    clip = moving_shapes.batch(1, seed=3)[0].frames[None]
    with torch.no_grad():
        whole = vae.encode(clips_to_tensor(clip)).latent_dist.mean
        first = vae.encode(clips_to_tensor(clip[:, :1])).latent_dist.mean
    assert whole.shape[2] == 5 and torch.equal(whole[:, :, :1], first)


@pytest.mark.parametrize("task", ["text-to-video", "image-to-video"])
def test_eval_scores_a_video_model_on_motion_in_diffusers(trained, task, tmp_path):
    """machgen-build eval on a video folder: colour, shape and direction read from diffusers' clips (an untrained
    model moves nothing, so none is read); image-to-video also checks that the first frame is the picture's VAE
    round trip, which holds whatever the transformer learned."""
    from typer.testing import CliRunner

    from machgen.builder.cli import app

    out, _, _ = trained
    result = CliRunner().invoke(app, ["eval", str(out / "model"), "--count", "2", "--grid", str(tmp_path / "g.png"),
                                      *(["--task", task] if task == "image-to-video" else [])])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.output[result.output.rindex("{"):])  # after the loaders' progress (stderr)
    assert scores["count"] == 2 and 0 <= scores["all_three"] <= 1
    if task == "image-to-video":
        assert scores["first_frame_psnr"] > 40
    else:
        assert scores["first_frame_psnr"] is None
    assert (tmp_path / "g.png").is_file()


def test_every_caption_reaches_the_text_encoder_whole_a_token_a_word():
    """The captions tokenized as WanPipeline tokenizes them at the model's max_sequence_length keep every word,
    each one token (cut, the direction -- the caption's last words -- never reached the model); a word the
    captions lack still tokenizes, a letter at a time, without <unk>."""
    from machgen.builder.caption_tokenizers import caption_word_tokenizer

    tokenizer = caption_word_tokenizer(moving_shapes.all_captions())
    for caption in moving_shapes.all_captions():
        ids = tokenizer(caption).input_ids
        assert len(ids) == len(caption.split()) + 1 <= VideoModelConfig.max_sequence_length, caption
        assert tokenizer.decode(ids, skip_special_tokens=True) == caption
    unseen = tokenizer("a Purple hexagon moves 2 ways").input_ids
    assert tokenizer.unk_token_id not in unseen
    assert tokenizer.decode(unseen, skip_special_tokens=True) == "a Purple hexagon moves 2 ways"


def test_the_transformer_stage_measures_text_to_video_as_it_trains(trained):
    out, _, logs = trained
    checks = [json.loads(line) for line in (out / "checkpoints" / "video-transformer-checks.jsonl").read_text().splitlines()]
    assert checks[0]["step"] == 40 and checks[0]["text_to_video"]["count"] == 2
    assert any(line.startswith("video-transformer check: ") for line in logs)
