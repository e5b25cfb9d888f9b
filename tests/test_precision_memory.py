"""Weight bytes per component (builder/quantize.py, the build log and the manifest's ``weight_bytes``) and
perf/bench_precision.py's memory table: float against int8, weights and the served server's memory (issue 62)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from machgen.builder.quantize import (component_weight_bytes, format_bytes, initializer_bytes, onnx_weight_bytes,
                                      quantize_int8, weights_note)
from machgen.contract.manifest import ManifestError, PipelineManifest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_MANIFEST = Path(__file__).parent / "golden" / "flux" / "flux_sampler" / "1" / "pipeline.json"


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"dense": rng.standard_normal((16, 8)).astype(np.float32),
            "codes": rng.integers(-128, 127, (8, 8), dtype=np.int8),
            "half": rng.standard_normal((4, 4)).astype(np.float16)}


def _model_with_a_subgraph(weights: dict[str, np.ndarray], branch_weight: np.ndarray) -> onnx.ModelProto:
    """x [1, 16] @ dense, plus an If whose branches hold initializers of their own."""

    def branch(name: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node("Identity", [f"{name}_w"], [f"{name}_out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)],
                                 initializer=[numpy_helper.from_array(branch_weight, f"{name}_w")])

    nodes = [helper.make_node("MatMul", ["x", "dense"], ["y"]),
             helper.make_node("If", ["flag"], ["chosen"], then_branch=branch("then"), else_branch=branch("else"))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8]),
                               helper.make_tensor_value_info("chosen", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(value, name) for name, value in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_weight_bytes_count_every_initializer_at_its_type_inline_or_in_external_data(tmp_path):
    weights, branch_weight = _weights(), np.arange(6, dtype=np.float64)
    model = _model_with_a_subgraph(weights, branch_weight)
    expected = sum(value.nbytes for value in weights.values()) + 2 * branch_weight.nbytes
    assert initializer_bytes(model.graph) == expected
    inline = tmp_path / "inline" / "model.onnx"
    inline.parent.mkdir()
    onnx.save_model(model, str(inline))
    external = tmp_path / "external" / "model.onnx"
    external.parent.mkdir()
    onnx.save_model(model, str(external), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    stored = onnx.load(str(external), load_external_data=False)
    assert any(tensor.data_location == TensorProto.EXTERNAL for tensor in stored.graph.initializer)
    assert onnx_weight_bytes(inline) == onnx_weight_bytes(external) == component_weight_bytes(external) == expected
    # The external file holds what was counted (no less: the counting reads no data).
    assert (external.parent / "model.onnx.data").stat().st_size >= sum(value.nbytes for value in weights.values())


def test_a_torch_program_weighs_what_its_component_json_counted_and_another_file_is_refused(tmp_path):
    from machgen.runtime.torch_runner import INFO_FILE, TorchComponentInfo

    info = TorchComponentInfo(inputs=("x",), outputs=("y",), dtype="float32", device="cpu", weight_bytes=123_456)
    (tmp_path / INFO_FILE).write_text(info.to_json())
    (tmp_path / "model.pt2").write_bytes(b"")
    assert component_weight_bytes(tmp_path / "model.pt2") == info.weight_bytes
    with pytest.raises(ValueError, match="neither an ONNX file nor a torch-target program"):
        component_weight_bytes(tmp_path / "elsewhere" / "model.plan")


def _linear_model(path: Path, weight: np.ndarray) -> Path:
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "proj.weight"], ["y"], name="proj")], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, weight.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, weight.shape[1]])],
                              initializer=[numpy_helper.from_array(weight, "proj.weight")])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("in_place", [True, False])
def test_int8_quantization_records_the_weight_bytes_before_and_after(tmp_path, in_place):
    weight = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    path = _linear_model(tmp_path / "model.onnx", weight)
    out = path if in_place else tmp_path / "int8" / "model.onnx"
    got = quantize_int8(path, out=out)
    assert got["weight_bytes"] == {"float": weight.nbytes, "int8": onnx_weight_bytes(out)}
    # int8 codes for each weight, and a float32 scale and an int8 zero point per output channel.
    assert got["weight_bytes"]["int8"] >= weight.size + weight.shape[1] * 5
    assert got["weight_bytes"]["int8"] < weight.nbytes / 2
    assert quantize_int8(_linear_model(tmp_path / "again.onnx", weight), record=False) == {}


def test_the_build_log_says_each_weight_bytes_and_float_against_int8_with_the_ratio():
    assert format_bytes(20) == "20 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(5 * 2**30 // 2) == "2.50 GiB"
    assert weights_note(3 * 2**20) == "weights 3.00 MiB"
    assert weights_note(3 * 2**20, 12 * 2**20, "float") == "weights 3.00 MiB"  # a float build says no ratio
    note = weights_note(1_000_000, 3_500_000, "int8")
    assert note == f"weights {format_bytes(1_000_000)} int8 against {format_bytes(3_500_000)} float (0.29x)"


def test_the_manifest_records_weight_bytes_and_reads_manifests_written_before_it():
    text = GOLDEN_MANIFEST.read_text()
    assert "weight_bytes" not in json.loads(text)  # as every build wrote it before the field
    before = PipelineManifest.from_json(json.loads(text))
    assert before.weight_bytes is None
    assert before.render() == text  # rendered before export: the same file as before the field
    counts = {"denoiser_head": 1_234, "denoiser_tail": 56_789, "denoiser": 58_023}
    data = {**json.loads(text), "weight_bytes": counts}
    after = PipelineManifest.from_json(json.loads(PipelineManifest.from_json(data).render()))
    assert after.weight_bytes == counts
    for wrong in ({"denoiser_head": -1}, {"denoiser_head": "12"}, [1, 2]):
        with pytest.raises(ManifestError, match="weight_bytes"):
            PipelineManifest.from_json({**data, "weight_bytes": wrong})


def _rows(text: str, pattern: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if re.match(rf"\| {pattern} \|", line)]


@pytest.mark.export
@pytest.mark.integration
def test_bench_precision_memory_only_measures_weights_and_the_served_memory(tiny_flux_dir, tmp_path):
    results = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, str(ROOT / "perf" / "bench_precision.py"), "--memory-only",
                           "--models", "image", "--image-model", str(tiny_flux_dir), "--builds", str(tmp_path),
                           "--record", str(results)], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = results.read_text()
    section = f"bench_precision_memory:{tiny_flux_dir.name}"
    assert f"## Low precision: weights and server memory (perf/bench_precision.py), {tiny_flux_dir.name}" in text
    assert f"<!-- {section}:begin -->" in text and f"<!-- {section}:end -->" in text
    assert "| component | float MiB | int8 MiB | int8 / float |" in text
    assert "| served build | processes | RSS ready, MiB | RSS after warm-up, MiB | PSS after warm-up, MiB |" in text

    manifests = {precision: PipelineManifest.read(tmp_path / f"{tiny_flux_dir.name}-{precision}" / "shapes_sampler"
                                                  / "1") for precision in ("float", "int8")}
    for component in ("text_encoder", "denoiser_head", "denoiser_tail", "denoiser"):
        (row,) = _rows(text, re.escape(component) + r"( \(joined[^|]*)?")
        assert row[1:3] == [f"{manifests[precision].weight_bytes[component] / 2**20:.2f}"
                            for precision in ("float", "int8")]
    joined = {name for name, entry in manifests["float"].components.items() if entry.steps}
    float_total, int8_total = (sum(count for name, count in manifests[precision].weight_bytes.items()
                                   if name not in joined) for precision in ("float", "int8"))
    assert 0 < int8_total < float_total
    (total,) = _rows(text, r"\*\*all components\*\*[^|]*")
    assert total[1:] == [f"{float_total / 2**20:.2f}", f"{int8_total / 2**20:.2f}", f"{int8_total / float_total:.2f}x"]
    # The tiny model's norms and biases stay float, and the sweep may keep a group float: the tail shrinks anyway.
    assert manifests["int8"].weight_bytes["denoiser_tail"] < manifests["float"].weight_bytes["denoiser_tail"]
    assert manifests["int8"].weight_bytes["text_encoder"] == manifests["float"].weight_bytes["text_encoder"]
    served = {row[0]: row for row in _rows(text, "(float|int8)")}
    assert set(served) == {"float", "int8"}
    for row in served.values():
        processes, rss_ready, rss_warm, pss_warm = int(row[1]), *(float(cell) for cell in row[2:5])
        assert processes > 2 and rss_ready > 0 and rss_warm > 0 and 0 < pss_warm <= rss_warm
    (difference,) = _rows(text, "int8 - float")
    assert float(difference[3]) == pytest.approx(float(served["int8"][3]) - float(served["float"][3]), abs=0.02)
