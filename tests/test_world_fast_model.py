"""The committed low-latency world model (models/shapes-world-fast): shapes-world fine-tuned for chunks of one
latent frame (half a second at 8 fps), so that a key shows sooner. Its folder is small safetensors with the
streaming mode it was trained for in its card; played in process through machgen's streaming engine, held-out
sessions steered by a random walk follow their keys and keep their subject (the card's figures are on 64
sessions of 48 chunks; here fewer, for the suite's time)."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "shapes-world-fast"
BASE_DIR = ROOT / "models" / "shapes-world"


def test_folder_is_small_safetensors_with_one_frame_chunks_and_the_base_s_sink_and_window():
    files = [p for p in MODEL_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 10 * 2**20
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth")]
    streaming = json.loads((MODEL_DIR / "machgen.json").read_text())["streaming"]
    base = json.loads((BASE_DIR / "machgen.json").read_text())["streaming"]
    assert (streaming["chunk_frames"], base["chunk_frames"]) == (1, 2)
    # The same context in latent frames as the model it was fine-tuned from, and the same actions.
    for field in ("sink_frames", "window_frames", "max_frames", "timesteps", "shift", "actions", "fps"):
        assert streaming[field] == base[field], field
    card = (MODEL_DIR / "README.md").read_text()
    assert "--chunk-frames 1" in card and "--session-lead-s" in card


@pytest.mark.export
def test_held_out_sessions_follow_their_keys_and_keep_their_subject(tmp_path):
    from machgen.builder.world_eval import main

    figures = main(["--model", str(MODEL_DIR), "--name", "shapes-world-fast", "--work", str(tmp_path),
                    "--sessions", "4", "--chunks", "16", "--rows", "4"])
    assert figures["all"]["chunks"] == 64
    assert figures["all"]["steered"] >= 0.9, figures["all"]
    assert figures["all"]["subject_kept"] >= 0.9, figures["all"]
