"""The int8 sensitivity sweep (builder/precision_sweep.py, machgen-build build --precision int8): on a tiny Flux
with one layer group made sensitive to int8 on purpose (its float function unchanged), the sweep finds that
group, keeps it float in every graph it writes, records why, and the build holds its quality target where
the all-int8 build does not."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from machgen.builder.quantize import INT8_RELATIVE_TOLERANCE

NAME = "sweep"
# The single-stream block whose output projection is made sensitive, the value channel moved and by how much.
SENSITIVE_BLOCK, CHANNEL, SCALE = 0, 0, 2.0**16  # a power of two: the float weights scale exactly
SENSITIVE_MODULE = f"single_transformer_blocks.{SENSITIVE_BLOCK}.proj_out"
PAIRS = 1
FRESH = dict(prompt="a green square at the bottom right", seed=11)


def sensitive_model(tiny_flux_dir, folder):
    """The tiny Flux with one value channel of a single-stream block's attention divided by SCALE in to_v and
    multiplied back in the matching input column of the block's proj_out. Attention is linear in each value
    channel, so the float model computes what it did; but int8 rounds proj_out's other weights against a
    scale SCALE times larger (one scale per output row), and its input's tiny channel against the others'."""
    import torch
    from diffusers import FluxTransformer2DModel

    shutil.copytree(tiny_flux_dir, folder)
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    block = transformer.single_transformer_blocks[SENSITIVE_BLOCK]
    with torch.no_grad():
        block.attn.to_v.weight[CHANNEL] /= SCALE
        block.attn.to_v.bias[CHANNEL] /= SCALE
        block.proj_out.weight[:, CHANNEL] *= SCALE
    transformer.save_pretrained(folder / "transformer")
    return folder


@pytest.fixture(scope="module")
def sensitive_flux_dir(tiny_flux_dir, tmp_path_factory):
    return sensitive_model(tiny_flux_dir, tmp_path_factory.mktemp("models") / "sensitive-flux")


def build(model, out, lines, **target):
    from machgen.builder.build import TargetOptions, build_repository
    from machgen.builder.repository import ServingOptions

    build_repository(model, NAME, out, log=lines.append, preview=False,
                     options=ServingOptions(in_flight=2, component_instances=1), target_options=TargetOptions(**target))
    return out


@pytest.fixture(scope="module")
def builds(sensitive_flux_dir, tmp_path_factory):
    """The sensitive model built float and int8 with the sweep (with its build log), and the float build's
    denoiser files quantized whole (every layer int8: what the build without the sweep would serve, had its
    parity check not refused it)."""
    from machgen.builder.precision_sweep import SweepSettings
    from machgen.builder.quantize import quantize_int8

    built = {}
    for label, target in (("float", {}), ("sweep", dict(precision="int8", sweep=SweepSettings(pairs=PAIRS)))):
        lines = []
        built[label] = (build(sensitive_flux_dir, tmp_path_factory.mktemp(f"{label}-repository"), lines, **target),
                        lines)
    whole = tmp_path_factory.mktemp("int8-repository") / "repository"
    shutil.copytree(built["float"][0], whole)
    for part in ("denoiser", "denoiser_head", "denoiser_tail", "denoiser_reuse"):
        quantize_int8(graph_file(whole, part))
    built["int8"] = (whole, [])
    return built


def table_rows(lines):
    """The sweep table's rows in the build log: (rank, group, the rest of the row)."""
    header = next(index for index, line in enumerate(lines) if line.split()[:3] == ["rank", "group", "layers"])
    start, end = lines[header].index("group"), lines[header].index("layers")
    rows = []
    for line in lines[header + 1:]:
        if not line[:start].strip().isdigit():
            break
        rows.append((int(line[:start]), line[start:end].strip(), line[end:]))
    return rows


def manifest_of(repository):
    return json.loads((repository / f"{NAME}_sampler" / "1" / "pipeline.json").read_text())


def graph_file(repository, component):
    folder = repository / f"{NAME}_{component}" / "1"
    if not folder.is_dir():
        folder = repository / f"{NAME}_sampler" / "1" / "components" / component
    return folder / "model.onnx"


def graph(repository, component):
    return onnx.load(str(graph_file(repository, component)))


@pytest.mark.export
def test_the_sweep_ranks_the_group_made_sensitive_first_and_keeps_it_alone_float(builds):
    precision = manifest_of(builds["sweep"][0])["precision"]
    kept = {part: entry["sweep"]["float_groups"] for part, entry in precision.items()}
    tail_kept = kept["denoiser_tail"]
    assert len(tail_kept) == 1 and SENSITIVE_MODULE.replace(".proj_out", " proj_out") in next(iter(tail_kept))
    assert kept["denoiser_head"] == {} and kept["denoiser_reuse"] == {}  # the group has no layer there
    assert [module.split(".", 1)[1] for module in precision["denoiser_tail"]["float_layers"]] == [SENSITIVE_MODULE]
    sweep = precision["denoiser_tail"]["sweep"]  # all int8 breaks the parity check's bound; the choice holds both
    assert sweep["all_int8"]["departure"] > INT8_RELATIVE_TOLERANCE >= sweep["chosen"]["departure"]
    assert sweep["chosen"]["psnr_worst"] >= sweep["min_psnr"]
    assert sweep["chosen"]["output_error"] < sweep["all_int8"]["output_error"]
    rank, group, rest = table_rows(builds["sweep"][1])[0]
    assert (rank, group) == (1, next(iter(tail_kept))) and "float:" in rest


@pytest.mark.export
def test_the_layers_kept_float_stay_float_in_every_graph_written(builds):
    from machgen.builder.quantize import linear_layers

    repository = builds["sweep"][0]
    float_layers = {part: entry["float_layers"] for part, entry in manifest_of(repository)["precision"].items()}
    for part, expected in float_layers.items():
        written = graph(repository, part)
        assert sorted(layer.module for layer in linear_layers(written)) == sorted(expected), part
        assert any(node.op_type == "MatMulInteger" for node in written.graph.node), part
    joined = graph(repository, "denoiser")  # the head and tail the server loads as one graph
    assert len(linear_layers(joined)) == len(float_layers["denoiser_head"]) + len(float_layers["denoiser_tail"]) == 1
    onnx.checker.check_model(joined, full_check=True)


@pytest.mark.export
def test_without_the_sweep_the_parity_check_refuses_the_sensitive_model_in_int8(sensitive_flux_dir,
                                                                               tmp_path_factory):
    from machgen.builder.export import ParityError

    with pytest.raises(ParityError, match="denoiser_tail"):
        build(sensitive_flux_dir, tmp_path_factory.mktemp("refused"), [], precision="int8", precision_sweep=False)


@pytest.mark.export
def test_the_build_log_prints_the_table_a_row_per_group(builds):
    from machgen.builder.layer_groups import group_layers
    from machgen.builder.quantize import linear_layers

    repository, lines = builds["float"][0], builds["sweep"][1]
    groups = group_layers({part: linear_layers(graph(repository, part))
                           for part in ("denoiser_head", "denoiser_tail", "denoiser_reuse")})
    rows = table_rows(lines)
    assert [rank for rank, _, _ in rows] == list(range(1, len(groups) + 1))
    assert sorted(group for _, group, _ in rows) == sorted(group.name for group in groups)
    assert all("float:" in rest or "int8:" in rest for _, _, rest in rows)
    assert any(line.startswith("all int8: PSNR") for line in lines)
    assert any(line.startswith("chosen: 1 of") for line in lines)


@pytest.mark.export
def test_the_groups_follow_the_transformers_blocks(builds, tiny_flux_dir):
    from diffusers import FluxTransformer2DModel

    from machgen.builder.layer_groups import group_layers
    from machgen.builder.quantize import linear_layers

    repository = builds["float"][0]
    layers = {part: linear_layers(graph(repository, part))
              for part in ("denoiser_head", "denoiser_tail", "denoiser_reuse")}
    groups = group_layers(layers)
    modules = [module for group in groups for module in group.modules]
    assert sorted(modules) == sorted({layer.module for found in layers.values() for layer in found})  # each once
    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    linear = {name for name, module in transformer.named_modules() if type(module).__name__ == "Linear"}
    assert {module.split(".", 1)[1] for module in modules} == linear  # every linear layer, as the model names it

    def group_of(path):
        return next(group for group in groups if any(module.endswith("." + path) for module in group.modules))

    for index in range(len(transformer.transformer_blocks)):
        qkv = group_of(f"transformer_blocks.{index}.attn.to_q")
        assert sorted(module.rsplit(".", 1)[1] for module in qkv.modules) == ["to_k", "to_q", "to_v"]
        assert group_of(f"transformer_blocks.{index}.attn.to_out.0") != qkv
    for group in groups:  # no group spans two blocks
        assert len({".".join(module.split(".")[:3]) for module in group.modules if "blocks." in module}) <= 1


@pytest.mark.export
def test_the_sweeps_choice_holds_its_target_on_a_fresh_prompt_and_beats_all_int8(builds):
    from machgen.builder.evaluate import psnr
    from machgen.runtime.local import LocalPipeline

    target = manifest_of(builds["sweep"][0])["precision"]["denoiser_tail"]["sweep"]["min_psnr"]
    images = {label: LocalPipeline(repository, NAME).generate(FRESH["prompt"], seed=FRESH["seed"],
                                                              cache_policy="none")[0][0]
              for label, (repository, _) in builds.items()}
    assert psnr(images["sweep"], images["float"]) >= max(target, psnr(images["int8"], images["float"]) + 3)


def test_the_sweeps_options_are_refused_where_they_would_be_ignored():
    from machgen.builder.precision_sweep import sweep_settings

    assert sweep_settings("int8", True, 45.0, 2).min_psnr == 45.0
    with pytest.raises(ValueError, match="--int8-min-psnr: applies to --precision int8"):
        sweep_settings("float", True, 45.0, None)
    with pytest.raises(ValueError, match="--precision-sweep-pairs: applies .*--no-precision-sweep"):
        sweep_settings("int8", False, None, 3)
    with pytest.raises(ValueError, match="--int8-min-psnr: .*between 0 and 99"):
        sweep_settings("int8", True, 120.0, None)
    assert np.isclose(sweep_settings(None, True, None, None).pairs, 4)
    assert sweep_settings("fp8", True, None, 2).pairs == 2  # the tensorrt fp8 calibration's pairs
    with pytest.raises(ValueError, match="--int8-min-psnr: applies to --precision int8"):
        sweep_settings("fp8", True, 45.0, 2)


def test_layers_are_named_grouped_and_excluded_by_module_in_a_graph_of_the_torchscript_exporters_names(tmp_path):
    """A small graph named as the TorchScript-based exporter names nodes: the groups follow the block and the
    shared inputs, and a Gemm excluded by its module stays float (the quantizer renames a Gemm before it skips
    the excluded nodes)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from machgen.builder.layer_groups import group_layers
    from machgen.builder.quantize import linear_layers, quantize_int8

    rng = np.random.default_rng(0)
    weights = {name: numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), name)
               for name in ("norm.weight", "wq", "wk", "wp")}
    weights["norm.bias"] = numpy_helper.from_array(np.zeros(8, np.float32), "norm.bias")
    nodes = [helper.make_node("Gemm", ["x", "norm.weight", "norm.bias"], ["h"], "/module/blocks.0/norm/linear/Gemm",
                              transB=1),
             helper.make_node("MatMul", ["h", "wq"], ["q"], "/module/blocks.0/attn/to_q/MatMul"),
             helper.make_node("MatMul", ["h", "wk"], ["k"], "/module/blocks.0/attn/to_k/MatMul"),
             helper.make_node("Add", ["q", "k"], ["y"], "/module/blocks.0/Add"),
             helper.make_node("MatMul", ["y", "wp"], ["out"], "/module/proj_out/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8])], list(weights.values()))
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))

    layers = linear_layers(onnx.load(str(path)))
    assert [layer.module for layer in layers] == ["module.blocks.0.norm.linear", "module.blocks.0.attn.to_q",
                                                  "module.blocks.0.attn.to_k", "module.proj_out"]
    groups = group_layers({"denoiser_tail": layers})
    assert [(group.name, group.modules) for group in groups] == [
        ("blocks.0 norm.linear", ("module.blocks.0.norm.linear",)),
        ("blocks.0 attn.to_q/to_k", ("module.blocks.0.attn.to_q", "module.blocks.0.attn.to_k")),
        ("proj_out", ("module.proj_out",))]
    got = quantize_int8(path, exclude=["module.blocks.0.norm.linear"], out=tmp_path / "int8.onnx")
    written = onnx.load(str(tmp_path / "int8.onnx"))
    assert [layer.module for layer in linear_layers(written)] == got["float_layers"] == ["module.blocks.0.norm.linear"]
    assert sorted(got["layers"]) == ["module.blocks.0.attn.to_k", "module.blocks.0.attn.to_q", "module.proj_out"]
    assert sum(node.op_type == "MatMulInteger" for node in written.graph.node) == 3
    x = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    exact, near = (ort.InferenceSession(str(file)).run(None, x)[0] for file in (path, tmp_path / "int8.onnx"))
    assert np.abs(near - exact).max() <= INT8_RELATIVE_TOLERANCE * np.abs(exact).max()
