"""The client alone: `pip install machgen[client]` into a fresh virtual
environment (no torch, no diffusers, no server) generates an image from a
running server with `machgen generate`."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import PIPELINE_NAME

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client_environment(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("client-venv")
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"{ROOT}[client]"], check=True,
                   capture_output=True, timeout=600)
    return folder


def test_the_client_extra_generates_from_a_server_without_torch(client_environment, triton_server, tmp_path):
    python, cli = client_environment / "bin" / "python", client_environment / "bin" / "machgen"
    absent = subprocess.run([str(python), "-c", "import importlib.util as u; print([m for m in ('torch', 'diffusers', "
                                                "'transformers', 'onnxruntime', 'pytriton') if u.find_spec(m)])"],
                            capture_output=True, text=True, check=True)
    assert absent.stdout.strip() == "[]"
    out = tmp_path / "cat.png"
    done = subprocess.run([str(cli), "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
                           "--prompt", "a red cat", "--seed", "3", "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    from machgen.client import MachgenClient

    with MachgenClient(triton_server.grpc_url) as client:
        expected = client.generate(PIPELINE_NAME, "a red cat", seed=3, num_inference_steps=2)[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), expected)
    # The model's own inputs are the flags it publishes: another family's (LTX-2's) is refused by name here.
    refused = subprocess.run([str(cli), "generate", "--url", triton_server.grpc_url, "--model", PIPELINE_NAME,
                              "--prompt", "x", "--stg-scale", "1.0", "--out", str(tmp_path / "no.png")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--stg-scale" in refused.stderr and "publishes" in refused.stderr, \
        refused.stderr
