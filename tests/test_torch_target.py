"""The torch target (torch.export programs run by PyTorch in the Python
backend) on the CPU: built, served by Triton with tensors passed by DLPack,
and compared with diffusers. CUDA graphs and bf16 need a GPU (perf/gpu_check.sh)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from machgen.contract.manifest import pipeline_dir

from conftest import ADAPTER_RANK, PIPELINE_NAME, serving
from test_image_to_image import PROMPT, _diffusers_img2img, _image
from test_integration import MAX_PIXEL_DIFF, diffusers_image


@pytest.fixture(scope="module")
def torch_repository(tiny_flux_dir, tmp_path_factory):
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    out = tmp_path_factory.mktemp("torch-repository")
    # One process per model: what is checked here is the path of a tensor, not concurrency (test_batching).
    build_repository(tiny_flux_dir, PIPELINE_NAME, out, target="torch", log=lambda line: None, preview=False,
                     options=ServingOptions(in_flight=1, component_instances=1, max_lora_rank=ADAPTER_RANK))
    return out


@pytest.fixture(scope="module")
def local_torch(torch_repository):
    from machgen.runtime.local import LocalPipeline

    return LocalPipeline(torch_repository, PIPELINE_NAME)


def test_torch_repository_holds_programs_and_their_configs(torch_repository):
    pipeline = json.loads((pipeline_dir(torch_repository, PIPELINE_NAME) / "pipeline.json").read_text())
    assert pipeline["target"] == "torch"
    assert pipeline["components"]["denoiser_reuse"]["file"] == "components/denoiser_reuse/model.pt2"
    tail = torch_repository / f"{PIPELINE_NAME}_denoiser_tail"
    info = json.loads((tail / "1" / "component.json").read_text())
    assert info["dtype"] == "float32" and info["device"] == "cpu" and info["weight_bytes"] > 0
    config = (tail / "config.pbtxt").read_text()
    assert 'key: "FORCE_CPU_ONLY_INPUT_TENSORS"' in config and "kind: KIND_CPU" in config
    assert "TorchComponentModel" in (tail / "1" / "model.py").read_text()


def test_in_process_torch_target_equals_diffusers(local_torch, tiny_flux_pipeline):
    defaults = local_torch.manifest.defaults.to_json()
    settings = dict(prompt="a red cat", negative_prompt="a blue dog", true_cfg_scale=4.0, seed=7)
    expected = diffusers_image(tiny_flux_pipeline, defaults, **settings)
    images, stats = local_torch.generate(**settings, cache_policy="none")
    assert np.abs(images[0].astype(int) - expected.astype(int)).max() <= MAX_PIXEL_DIFF
    assert stats.denoiser_tail_passes == 2 * defaults["num_inference_steps"]


@pytest.fixture(scope="module")
def torch_server(torch_repository):
    with serving(torch_repository) as server:
        yield server


def test_served_torch_target_equals_diffusers(torch_repository, torch_server, tiny_flux_pipeline):
    """Through Triton: the sampler sends torch tensors by DLPack, the
    components take them and answer by DLPack (CPU tensors here)."""
    from machgen.client import MachgenClient

    defaults = json.loads((pipeline_dir(torch_repository, PIPELINE_NAME) / "pipeline.json").read_text())["defaults"]
    image = _image(defaults["height"], defaults["width"] * 2, seed=4)
    with MachgenClient(torch_server.grpc_url) as client:
        text_to_image = client.generate(PIPELINE_NAME, "a green circle", seed=3)
        image_to_image = client.generate(PIPELINE_NAME, PROMPT, image=image, strength=0.75, seed=5,
                                         cache_policy="none")
    expected = diffusers_image(tiny_flux_pipeline, defaults, "a green circle", 3)
    assert np.abs(text_to_image[0].astype(int) - expected.astype(int)).max() <= MAX_PIXEL_DIFF
    expected = _diffusers_img2img(tiny_flux_pipeline, image, 5, 0.75,
                                  num_inference_steps=defaults["num_inference_steps"],
                                  guidance_scale=defaults["guidance_scale"],
                                  max_sequence_length=defaults["max_sequence_length"])
    assert np.abs(image_to_image[0].astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF


def test_served_torch_target_applies_adapters_as_diffusers(torch_repository, torch_server, tiny_flux_dir,
                                                          tiny_flux_pipeline, tmp_path_factory):
    """Per-request adapters on the torch target: the bank goes into the traced program as it does into the
    ONNX graph (tests/test_lora_adapters.py)."""
    from machgen.builder.adapters import add_adapter
    from machgen.client import MachgenClient

    from test_lora_adapters import ADAPTERS, write_random_adapter

    root = tmp_path_factory.mktemp("torch-adapters")
    for seed, name in enumerate(("attn", "ff")):
        rank, alpha, targets = ADAPTERS[name]
        add_adapter(torch_repository, name, write_random_adapter(tiny_flux_dir, root / name, rank, alpha, targets,
                                                                 seed))
        tiny_flux_pipeline.load_lora_weights(root / name, adapter_name=name)
    defaults = json.loads((pipeline_dir(torch_repository, PIPELINE_NAME) / "pipeline.json").read_text())["defaults"]
    try:
        with MachgenClient(torch_server.grpc_url) as client:
            for seed, adapters in enumerate(({"attn": 1.0}, {"attn": 0.7, "ff": 0.4})):
                served = client.generate(PIPELINE_NAME, "a red cat", seed=seed, cache_policy="none",
                                         lora=list(adapters), lora_scale=list(adapters.values()))
                tiny_flux_pipeline.set_adapters(list(adapters), adapter_weights=list(adapters.values()))
                expected = diffusers_image(tiny_flux_pipeline, defaults, "a red cat", seed)
                assert np.abs(served[0].astype(int) - expected.astype(int)).max() <= MAX_PIXEL_DIFF
    finally:
        tiny_flux_pipeline.unload_lora_weights()


@pytest.mark.export
def test_sparse_attention_stays_an_op_in_the_torch_program(tiny_flux_pipeline, tmp_path):
    """--attention sparse-fp8 on the torch target: the program calls
    machgen::sparse_attention (the Triton kernel on CUDA, the reference here)."""
    from machgen.builder.build import AttentionOptions
    from machgen.builder.model_folder import served_defaults
    from machgen.builder.export import check_parity, export_torch
    from machgen.families.registry import get_family
    from machgen.plugins.ops import attention_swapped

    family = get_family("flux")
    exporter = family.exporter()
    config = AttentionOptions("sparse-fp8", block=2).config(exporter, served_defaults(
        tmp_path, family, tiny_flux_pipeline))
    (tail,) = [c for c in exporter.components(tiny_flux_pipeline) if c.spec.name == "denoiser_tail"]
    with attention_swapped(exporter.attention_modules, config):
        calls = export_torch(tail, tmp_path / "tail", "float32", "cpu")
        report = check_parity(tail, tmp_path / "tail" / "model.pt2")
    assert calls == 3  # the tail: one double-stream block (the head has the other), two single-stream
    assert report.max_abs_diff <= tail.spec.tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager():
    from machgen.runtime.torch_runner import CudaGraphs

    layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()

    def module(x):
        return layer(x)

    graphed = CudaGraphs(module, max_graphs=1)
    for rows in (2, 2, 3):  # the third shape is past the bound: eager
        x = torch.randn(rows, 64, device="cuda")
        torch.testing.assert_close(graphed(x=x)[0], module(x))
    assert len([g for g in graphed._graphs.values() if g is not None]) == 1
