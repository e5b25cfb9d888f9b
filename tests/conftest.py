"""Shared fixtures: one tiny Flux folder, one built repository, one server per session.

The tiny model is written and loaded back through the same code a user's
model takes (save_pretrained / from_pretrained, machgen-build build).
"""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the sparse-attention kernel runs under Triton's interpreter. Triton reads this when it is
# first imported, which other tests' imports (torch's exporter) do before test_triton_kernel.py runs.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

PIPELINE_NAME = "flux"


def component_onnx(repository: Path, component: str, pipeline: str = PIPELINE_NAME) -> Path:
    """A built component's ONNX file: in its Triton model, or under the sampler when it runs there."""
    import json

    from machgen.builder.repository import pipeline_dir

    public_dir = pipeline_dir(repository, pipeline)
    entry = json.loads((public_dir / "pipeline.json").read_text())["components"][component]
    return public_dir / entry["file"] if "file" in entry else repository / entry["model"] / "1" / "model.onnx"


def write_tiny(tmp_path_factory, family: str) -> Path:
    """A tiny random-weight model folder of ``family``, as `machgen-build tiny` writes it."""
    from machgen.builder.build import write_tiny_model
    from machgen.builder.registry import get_family

    return write_tiny_model(get_family(family), tmp_path_factory.mktemp("models") / f"tiny-{family}")


def load_diffusers(model_dir: Path):
    """The diffusers pipeline the folder's model_index.json names, loaded from it, quiet."""
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_repository(tmp_path_factory, model_dir: Path, name: str, sampler_instances: int = 2,
                          **options) -> Path:
    """A model repository of ``model_dir`` served as ``name`` (one instance per
    component; ``options``: other ServingOptions)."""
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    out = tmp_path_factory.mktemp(f"{name}-repository")
    build_repository(model_dir, name, out, options=ServingOptions(sampler_instances=sampler_instances,
                                                                  component_instances=1, **options),
                     log=lambda line: None)
    return out


def levels(pixels):
    """Pixels in [0, 1] (diffusers' "np" output) as uint8 levels, int16 to take differences."""
    import numpy as np

    return (np.asarray(pixels) * 255).round().astype(np.int16)


def picture(height: int, width: int, seed: int):
    """A uint8 [H, W, 3] test picture: smooth gradients plus noise."""
    import numpy as np

    rows, cols = np.mgrid[0:height, 0:width] / max(height, width)
    noise = np.random.default_rng(seed).integers(0, 60, (height, width, 3))
    return (np.stack([rows, cols, rows * cols], axis=-1) * 190 + noise).clip(0, 255).astype(np.uint8)


def run_tensorrt_form(model, feeds: dict) -> list:
    """A graph lowered for TensorRT (plugins/tensorrt_plugin.py) run on the CPU:
    standard ops by ONNX's reference evaluator, each plugin node by its Triton
    kernel (under the interpreter) launched as TensorRT launches it."""
    import numpy as np
    import torch
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    from machgen.plugins import tensorrt_plugin, triton_kernel
    from machgen.plugins.schema import DOMAIN

    torch_types = {name: dtype for dtype, name in triton_kernel.TRITON_TYPES.items()}
    fp8 = torch.float8_e4m3fn

    class GatherElements(OpRun):  # onnx 1.23's reference implementation mishandles a negative axis
        def _run(self, data, indices, axis=None):
            return (np.take_along_axis(data, indices, axis=axis),)

    class PluginOp(OpRun):
        op_domain = DOMAIN

        def _run(self, *arrays, **attributes):
            plugin = tensorrt_plugin.PLUGINS[type(self).__name__]
            fields = {f.name: getattr(self, f.name) for f in plugin.fields}
            fields = {name: value.decode() if isinstance(value, bytes) else value for name, value in fields.items()}
            # numpy has no float8: float8 tensors travel between the nodes as their bytes (uint8)
            tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
            tensors = [t.view(fp8) if t.dtype == torch.uint8 else t for t in tensors]
            outputs, _ = tensorrt_plugin.launch_plan(plugin, [t.shape for t in tensors],
                                                     [triton_kernel.TRITON_TYPES[t.dtype] for t in tensors], fields)
            results = [torch.empty(shape, dtype=torch_types[kind]) for shape, kind in outputs]
            tensorrt_plugin.launch_kernel(plugin, tensors, results, fields)
            return tuple((r.view(torch.uint8) if r.dtype == fp8 else r).numpy() for r in results)

    plugins = [type(name, (PluginOp,), {}) for name in tensorrt_plugin.PLUGINS]
    return ReferenceEvaluator(model, new_ops=[GatherElements, *plugins]).run(None, feeds)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def session_export_cache(tmp_path_factory):
    """One export cache for every build of the session (builder/export_cache.py): the tiny Wan
    models share their VAE and text encoder, the LoRA and sparse-attention builds of the tiny
    Flux its text encoders and VAE. Never the developer's own cache."""
    from machgen.builder.export_cache import CACHE_ENV

    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("export-cache"))
    yield
    if previous is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = previous


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> Path:
    from machgen.builder.build import write_tiny_model
    from machgen.builder.registry import get_family

    return write_tiny_model(get_family("flux"), tmp_path_factory.mktemp("models") / "tiny-flux")


@pytest.fixture(scope="session")
def tiny_flux_pipeline(tiny_flux_dir):
    import diffusers

    return diffusers.FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)


@pytest.fixture(scope="session")
def built_repository(tiny_flux_dir, tmp_path_factory):
    """(repository path, per-component parity results) of the tiny Flux."""
    from machgen.builder.build import build_repository

    out = tmp_path_factory.mktemp("repository")
    results = build_repository(tiny_flux_dir, PIPELINE_NAME, out, log=lambda line: None)
    return out, results


@pytest.fixture(scope="session")
def triton_server(built_repository):
    from machgen.server import Ports, TritonServer

    repository, _ = built_repository
    server = TritonServer(repository, Ports(free_port(), free_port(), free_port()))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def conditioning_factory(built_repository):
    """Flux's run-time conditioning over any run_component (a fake, for example)."""
    import json

    repository, _ = built_repository
    from machgen.builder.registry import get_family
    from machgen.builder.repository import pipeline_dir

    public_dir = pipeline_dir(repository, PIPELINE_NAME)
    settings = json.loads((public_dir / "pipeline.json").read_text())["family_settings"]
    return lambda run: get_family("flux").make_sampler(settings, str(public_dir), run)
