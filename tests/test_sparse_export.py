"""``machgen-build build --attention sparse-fp8`` on the tiny Flux: the graph
carries the operator, and the served pipeline equals diffusers' pipeline
running the same operator (its CPU reference) in place of attention."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from conftest import component_onnx
from machgen.builder.build import AttentionOptions
from machgen.contract.manifest import pipeline_dir
from machgen.plugins.schema import DOMAIN, OP_TYPE

SPARSE = AttentionOptions("sparse-fp8", block=4, mask_method="cdf", cdf_threshold=0.8)
NAME = "flux_sparse"


@pytest.fixture(scope="module")
def sparse_build(built_repository, tiny_flux_dir, tmp_path_factory):
    """(repository, build log) of the tiny Flux with sparse attention, built after the dense one
    (built_repository), which filled the session's export cache."""
    from machgen.builder.build import build_repository

    out = tmp_path_factory.mktemp("sparse-repository")
    logs = []
    build_repository(tiny_flux_dir, NAME, out, attention=SPARSE, log=logs.append, preview=False)
    return out, logs


@pytest.fixture(scope="module")
def sparse_repository(sparse_build):
    return sparse_build[0]


def test_a_sparse_build_takes_the_components_without_attention_from_the_dense_build(sparse_build):
    """The swap cannot change the text encoders or the VAE: their exports come from the export cache."""
    _, logs = sparse_build
    progress = {line.split(":")[0].split("] ")[1]: line for line in logs if "max |" in line}
    cached = {name for name, line in progress.items() if line.endswith("(export cache)")}
    # The denoiser's (the reuse path holds the transformer's output layers: keyed as swapped, to be safe).
    assert set(progress) - cached == {"denoiser_head", "denoiser_tail", "denoiser_reuse"}
    assert {"text_encoder", "text_encoder_2", "vae_decoder"} <= cached


def test_denoiser_graphs_carry_the_operator(sparse_repository, tiny_flux_pipeline):
    transformer = tiny_flux_pipeline.transformer.config
    for component, blocks in (("denoiser_head", 1), ("denoiser_tail", transformer.num_layers - 1
                                                      + transformer.num_single_layers)):
        model = onnx.load(component_onnx(sparse_repository, component, NAME))
        nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
        assert len(nodes) == blocks
        assert [f.name for f in model.functions if f.domain == DOMAIN] == [OP_TYPE]
    pipeline = json.loads((pipeline_dir(sparse_repository, NAME) / "pipeline.json").read_text())
    assert pipeline["attention"]["precision"] == "fp8_e4m3"
    assert pipeline["attention"]["dense_prefix_tokens"] == pipeline["defaults"]["max_sequence_length"]


def test_served_sparse_pipeline_equals_diffusers_with_the_operator(sparse_repository, tiny_flux_dir,
                                                                   tiny_flux_pipeline, monkeypatch):
    import torch

    from machgen.builder.model_folder import detect_family, served_defaults
    from machgen.runtime.local import LocalPipeline
    from machgen.plugins import reference
    from machgen.plugins.ops import attention_swapped

    skipped = []
    block_mask = reference.block_mask

    def recording_block_mask(q, k, config):
        mask = block_mask(q, k, config)
        skipped.append(reference.skipped_fraction(mask, q.shape[2], k.shape[2], config.block_q, config.block_k))
        return mask

    monkeypatch.setattr(reference, "block_mask", recording_block_mask)
    family = detect_family(tiny_flux_dir)
    exporter = family.exporter()
    defaults = served_defaults(tiny_flux_dir, family, tiny_flux_pipeline)
    config = SPARSE.config(exporter, defaults)
    served, _ = LocalPipeline(sparse_repository, NAME).generate("a red circle", seed=3, cache_policy="none")
    with attention_swapped(exporter.attention_modules, config):
        expected = tiny_flux_pipeline(
            "a red circle", generator=torch.Generator().manual_seed(3), height=defaults.height, width=defaults.width,
            num_inference_steps=defaults.num_inference_steps, guidance_scale=defaults.guidance_scale,
            max_sequence_length=defaults.max_sequence_length, output_type="np").images
    dense = tiny_flux_pipeline(
        "a red circle", generator=torch.Generator().manual_seed(3), height=defaults.height, width=defaults.width,
        num_inference_steps=defaults.num_inference_steps, guidance_scale=defaults.guidance_scale,
        max_sequence_length=defaults.max_sequence_length, output_type="np").images
    assert np.abs(served.astype(np.int16) - (expected * 255).round().astype(np.int16)).max() <= 2
    assert np.mean(skipped) > 0.05  # blocks really were dropped ...
    assert np.abs(expected - dense).max() > 1e-3  # ... and it shows (random weights: barely)


def test_sparse_attention_needs_a_family_that_declares_its_attention(tiny_flux_dir, tmp_path, monkeypatch):
    from machgen.builder.build import build_repository
    from machgen.families.flux.export import FluxExport

    monkeypatch.setattr(FluxExport, "attention_modules", ())
    with pytest.raises(ValueError, match="no attention"):
        build_repository(tiny_flux_dir, NAME, tmp_path, attention=SPARSE, log=lambda line: None)
    assert not any(tmp_path.iterdir())


def test_tensorrt_form_of_the_tail_equals_the_tail_running_the_kernels(sparse_repository, tiny_flux_dir,
                                                                       tiny_flux_pipeline, tmp_path, monkeypatch):
    """The tail's file as the tensorrt target hands it to TensorRT's parser (every SparseAttention node
    lowered into standard ops and the ahead-of-time plugins), run on the CPU with the plugins' kernels,
    against the torch tail whose attention calls run the same kernels from torch."""
    import shutil

    import torch

    from conftest import run_tensorrt_form
    from machgen.builder.model_folder import served_defaults
    from machgen.builder.tensorrt_engine import _lowered_for_tensorrt
    from machgen.families.registry import get_family
    from machgen.plugins import reference, triton_kernel
    from machgen.plugins.ops import attention_swapped

    source = component_onnx(sparse_repository, "denoiser_tail", NAME)
    for path in source.parent.glob(source.name + "*"):  # the file and its external weights, if any
        shutil.copy(path, tmp_path)
    lowered_path, fp8 = _lowered_for_tensorrt(tmp_path / source.name)
    assert fp8 and lowered_path != tmp_path / source.name
    lowered = onnx.load(lowered_path)
    onnx.checker.check_model(lowered)
    transformer = tiny_flux_pipeline.transformer.config
    attention = [n for n in lowered.graph.node if n.op_type == "BlockSparseAttention"]
    assert len(attention) == transformer.num_layers - 1 + transformer.num_single_layers
    assert not [n for n in lowered.graph.node if n.op_type == OP_TYPE] and not list(lowered.functions)

    family = get_family("flux")
    exporter = family.exporter()
    tail = next(c for c in exporter.components(tiny_flux_pipeline) if c.spec.name == "denoiser_tail")
    got = run_tensorrt_form(lowered, {t.name: tail.sample_inputs[t.name].numpy() for t in tail.spec.inputs})
    monkeypatch.setattr(reference, "sparse_attention", triton_kernel.sparse_attention)  # the op's CPU kernel
    config = SPARSE.config(exporter, served_defaults(tiny_flux_dir, family, tiny_flux_pipeline))
    with attention_swapped(exporter.attention_modules, config), torch.no_grad():
        wanted = tail.module(**tail.sample_inputs)
    wanted = wanted if isinstance(wanted, tuple) else (wanted,)
    assert len(got) == len(wanted) == len(tail.spec.outputs)
    for value, want in zip(got, wanted):
        assert np.allclose(value, want.numpy(), rtol=1e-5, atol=1e-5)
