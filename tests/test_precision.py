"""Lower precision per component (builder/quantize.py, machgen-build build --precision): the onnxruntime target's
int8 denoiser against the float build of the same tiny Flux, in process and served."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import PIPELINE_NAME, build_tiny_repository, serving

from machgen.client import MachgenClient

pytestmark = pytest.mark.export

PROMPT = "a red cat"
OPTIONS = dict(seed=3, num_inference_steps=6, cache_policy="none")


@pytest.fixture(scope="module")
def float_repository(tiny_flux_dir, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_flux_dir, PIPELINE_NAME)


@pytest.fixture(scope="module")
def int8_repository(tiny_flux_dir, tmp_path_factory):
    from machgen.builder.build import TargetOptions, build_repository
    from machgen.builder.precision_sweep import SweepSettings
    from machgen.builder.repository import ServingOptions

    out = tmp_path_factory.mktemp("int8-repository")
    lines: list[str] = []
    results = build_repository(tiny_flux_dir, PIPELINE_NAME, out, log=lines.append, preview=False,
                               options=ServingOptions(in_flight=2, component_instances=1),
                               target_options=TargetOptions(precision="int8", sweep=SweepSettings(pairs=1)))
    return out, results, lines


def manifest_of(repository):
    return json.loads((repository / f"{PIPELINE_NAME}_sampler" / "1" / "pipeline.json").read_text())


def test_the_denoiser_is_built_in_int8_and_the_manifest_and_log_say_what_each_layer_got(int8_repository,
                                                                                      float_repository):
    repository, results, lines = int8_repository
    precision = manifest_of(repository)["precision"]
    assert sorted(precision) == ["denoiser_head", "denoiser_reuse", "denoiser_tail"]
    for name, got in precision.items():
        assert got["precision"] == "int8" and got["layers"], name
        assert all(0 < low <= high for low, high in got["layers"].values()), name
        assert any(f"{name}: int8, {len(got['layers'])} layers" in line for line in lines), name
    assert manifest_of(float_repository).get("precision") is None
    sizes = {result.name: result.file_bytes for result in results}
    float_sizes = {name: (float_repository / f"{PIPELINE_NAME}_{name}" / "1" / "model.onnx").stat().st_size
                   for name in ("denoiser_head", "denoiser_tail", "text_encoder")}
    assert sizes["denoiser_tail"] < float_sizes["denoiser_tail"]  # the tiny model's norms and biases stay float
    assert sizes["text_encoder"] == float_sizes["text_encoder"]  # not quantized
    joined = onnx.load(str(repository / f"{PIPELINE_NAME}_denoiser" / "1" / "model.onnx"))
    assert any(node.op_type == "MatMulInteger" for node in joined.graph.node)
    onnx.checker.check_model(joined, full_check=True)


def psnr(a, b) -> float:
    error = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255**2 / max(error, 1e-12)))


def test_the_int8_build_stays_near_the_float_build_and_serves_what_it_computes_in_process(int8_repository,
                                                                                      float_repository):
    from machgen.runtime.local import LocalPipeline

    repository, _, _ = int8_repository
    int8 = LocalPipeline(repository, PIPELINE_NAME).generate(PROMPT, **OPTIONS)[0]
    exact = LocalPipeline(float_repository, PIPELINE_NAME).generate(PROMPT, **OPTIONS)[0]
    assert 30 <= psnr(int8, exact) < 100  # near, and not the float build under another name
    with serving(repository) as server, MachgenClient(server.grpc_url) as client:
        served = client.generate(PIPELINE_NAME, PROMPT, **OPTIONS)
    assert np.abs(served.astype(int) - int8.astype(int)).max() <= 1


def test_the_build_log_and_the_manifest_give_each_component_s_weight_bytes_float_against_int8(int8_repository,
                                                                                           float_repository):
    from machgen.builder.quantize import component_weight_bytes, weights_note
    from conftest import component_onnx

    repository, results, lines = int8_repository
    int8, floats = manifest_of(repository), manifest_of(float_repository)
    exported = {result.name for result in results}
    for manifest, built in ((int8, repository), (floats, float_repository)):
        assert set(manifest["weight_bytes"]) == exported | {"denoiser"}  # the joined chain holds its own copy
        for name in exported:
            assert manifest["weight_bytes"][name] == component_weight_bytes(component_onnx(built, name)), name
    for name, got in int8["precision"].items():
        counts = got["weight_bytes"]
        assert counts == {"float": floats["weight_bytes"][name], "int8": int8["weight_bytes"][name]}, name
        assert any(line.startswith(f"{name}: int8") and weights_note(counts["int8"], counts["float"], "int8") in line
                   for line in lines), name
    assert int8["weight_bytes"]["denoiser_tail"] < floats["weight_bytes"]["denoiser_tail"]
    assert int8["weight_bytes"]["text_encoder"] == floats["weight_bytes"]["text_encoder"]
    summary = [line for line in lines if line.startswith(f"{len(results)} components: weights ")]
    float_total = sum(floats["weight_bytes"][name] for name in exported)
    assert summary == [f"{len(results)} components: "
                       + weights_note(sum(int8["weight_bytes"][name] for name in exported), float_total, "int8")]


def test_an_fp8_denoiser_is_explicit_q_dq_calibrated_on_the_pipeline_and_near_its_float_module(tiny_flux_dir,
                                                                                              tmp_path):
    """The tensorrt target's --precision fp8 (builder/quantize_fp8.py), checked where TensorRT is absent: the
    denoiser parts' block layers get E4M3 weights per output channel and a calibrated Q/DQ pair on their
    inputs; ONNX Runtime runs the file (rounding to E4M3, multiplying in float) within FP8's tolerance of the
    float module, and the full ONNX checker accepts it."""
    from onnx import TensorProto

    from machgen.builder.build import components_to_export
    from machgen.builder.export import check_parity, export_onnx
    from machgen.builder.model_folder import detect_family, load_pipeline, served_defaults
    from machgen.builder.quantize_fp8 import FP8_MAX, FP8_RELATIVE_TOLERANCE, amax_by_name, calibrate_fp8, quantize_fp8
    from machgen.builder.repository import ServingOptions

    family = detect_family(tiny_flux_dir)
    pipe = load_pipeline(tiny_flux_dir, family)
    defaults = served_defaults(tiny_flux_dir, family, pipe)
    exports, _, _ = components_to_export(family.exporter(), pipe, ServingOptions(), "tensorrt", log=lambda _: None)
    lines: list[str] = []
    amax = calibrate_fp8(pipe, defaults, pairs=2, log=lines.append)
    assert lines and "calibrated on 2 prompt/seed pairs" in lines[0]
    for component in (c for c, _ in exports if c.spec.name in ("denoiser_head", "denoiser_tail")):
        path = tmp_path / component.spec.name / "model.onnx"
        export_onnx(component, path, exporter="torchscript")
        float_report = check_parity(component, path)
        record = quantize_fp8(path, amax_by_name(component.module, amax))
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        fp8 = [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN and t.dims]
        assert len(fp8) == len({layer for layer in record["layers"]}) > 0
        assert all(".transformer_blocks." in m or ".single_transformer_blocks." in m for m in record["layers"])
        assert record["float_layers"] and all(why == "outside the transformer blocks"
                                               for why in record["float_layers"].values())
        for entry in record["layers"].values():
            assert entry["input_scale"] > 0 and 0 < entry["weight_scale"][0] <= entry["weight_scale"][1]
        ops = [node.op_type for node in model.graph.node]
        assert ops.count("QuantizeLinear") >= 1 and ops.count("DequantizeLinear") > ops.count("QuantizeLinear")
        assert record["weight_bytes"]["fp8"] < record["weight_bytes"]["float"]
        report = check_parity(component, path, relative_tolerance=FP8_RELATIVE_TOLERANCE)
        assert report.max_abs_diff > 10 * float_report.max_abs_diff  # the layers did turn FP8
    assert max(amax.values()) / FP8_MAX > 0
