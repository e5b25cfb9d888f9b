import hashlib
import json

import numpy as np
import torch
from typer.testing import CliRunner

from machgen.builder.cli import app


def _digest(folder):
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_cli_writes_a_deterministic_folder_that_diffusers_loads(tmp_path, tiny_flux_dir, tiny_flux_pipeline):
    result = CliRunner().invoke(app, ["tiny", "flux", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    assert _digest(tmp_path / "again") == _digest(tiny_flux_dir)
    assert json.loads((tiny_flux_dir / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert any(p.suffix == ".safetensors" for p in tiny_flux_dir.rglob("*"))
    image = tiny_flux_pipeline("a red cat", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                               generator=torch.Generator("cpu").manual_seed(0), output_type="np").images
    assert image.shape == (1, 32, 32, 3) and np.isfinite(image).all() and image.std() > 0.01


def test_unknown_family_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["tiny", "sd15", str(tmp_path / "x")])
    assert result.exit_code != 0
    assert "sd15" in result.output
