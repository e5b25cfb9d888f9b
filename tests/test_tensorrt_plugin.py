"""SparseAttention in the form TensorRT builds it (plugins/tensorrt_plugin.py)
where TensorRT is absent: the lowered graph (mask prediction in standard ONNX
ops, quantization and attention as ahead-of-time plugins) computes the
operator; the kernels take their parameters as TensorRT passes them; the PTX
compiles for Hopper. Registering the plugins needs TensorRT (skipped here)."""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from conftest import run_tensorrt_form
from machgen.plugins import ops, reference, schema, tensorrt_plugin, triton_kernel
from machgen.plugins.schema import DOMAIN, OP_TYPE, SparseAttentionConfig
from machgen.plugins.synthetic import video_like_qkv

HEAD_DIM = 32


def _single_node_model(config: SparseAttentionConfig):
    """One SparseAttention node on [batch, tokens, heads, 32] inputs, with its ONNX
    function, as the exporter writes it."""
    schema.register_onnx_schema()
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "tokens", "heads", HEAD_DIM])
              for name in ("q", "k", "v", "out")]
    node = helper.make_node(OP_TYPE, ["q", "k", "v"], ["out"], name="attention", domain=DOMAIN,
                            **config.onnx_attributes())
    model = helper.make_model(helper.make_graph([node], "one_node", values[:3], values[3:]),
                              opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)])
    ops.attach_onnx_function(model, config)
    return model


def _qkv():
    q, k, v = video_like_qkv(1, 10, 10, heads=2, head_dim=HEAD_DIM, sharpness=10.0)  # 100 tokens, last blocks partial
    return {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()}


@pytest.mark.parametrize("config", [
    SparseAttentionConfig(block_q=32, block_k=16, mask_method="cdf", cdf_threshold=0.6, dense_prefix_tokens=10,
                          precision="fp32"),
    SparseAttentionConfig(block_q=16, block_k=16, topk_ratio=0.3, dense_diagonal=0, precision="fp32",
                          softmax_scale=0.3),
    SparseAttentionConfig(block_q=16, block_k=32, mask_method="cdf", cdf_threshold=0.8, precision="fp8_e4m3"),
])
def test_lowered_graph_computes_the_operator(config):
    model = _single_node_model(config)
    feeds = _qkv()
    q, k, v = (torch.from_numpy(feeds[name]) for name in "qkv")
    mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
    assert 0 < float(mask.float().mean()) < 1
    dense_function = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (onnxruntime_out,) = dense_function.run(None, feeds)

    assert tensorrt_plugin.lower_for_tensorrt(model) == 1
    (lowered,) = run_tensorrt_form(model, feeds)
    lowered = torch.from_numpy(lowered)
    # The same kernels on the same mask, launched from torch: the lowered graph predicted that mask.
    assert reference.relative_l2(lowered, triton_kernel.sparse_attention(q, k, v, config)) < 1e-6
    exact = reference.sparse_attention(q, k, v, replace(config, precision="fp32"), mask=mask)
    if config.precision == "fp32":
        assert reference.relative_l2(lowered, exact) < 1e-5
        assert reference.relative_l2(torch.from_numpy(onnxruntime_out), exact) < 1e-5
    else:  # the interpreter rounds to float8 less closely than torch (and the hardware): 1.9x its error here
        fp8_error = reference.relative_l2(reference.sparse_attention(q, k, v, config, mask=mask), exact)
        assert reference.relative_l2(lowered, exact) < 2.5 * fp8_error
        assert reference.relative_l2(torch.from_numpy(onnxruntime_out), exact) < 1.01 * fp8_error

def test_lowered_graph_leaves_tensorrt_no_dense_fallback():
    config = SparseAttentionConfig(block_q=16, block_k=16, precision="fp8_e4m3")
    model = _single_node_model(config)
    tensorrt_plugin.lower_for_tensorrt(model)
    onnx.checker.check_model(model)
    assert not ops.sparse_attention_nodes(model) and not list(model.functions)
    plugins = [n for n in model.graph.node if n.domain == DOMAIN]
    assert sorted(n.op_type for n in plugins) == ["BlockQuantize"] * 3 + ["BlockSparseAttention"]
    for node in plugins:  # what TensorRT's ONNX parser reads to pick the plugin and its AOT implementation
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["plugin_namespace"] == DOMAIN.encode() and attributes["aot"] == 1
        fields = {f.name for f in tensorrt_plugin.PLUGINS[node.op_type].fields}
        assert set(attributes) - {"plugin_namespace", "aot"} == fields
    attention = next(n for n in plugins if n.op_type == "BlockSparseAttention")
    fields = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    assert fields["qk_scale"] == pytest.approx(HEAD_DIM ** -0.5) and fields["out_type"] == b"fp32"
    assert {n.domain for n in model.graph.node} == {"", DOMAIN}


def test_plugin_fields_named_after_the_operator_take_its_schema():
    attributes = {a.name: a for a in schema.ATTRIBUTES}
    for plugin in tensorrt_plugin.PLUGINS.values():
        for field in plugin.fields:
            if field.name in attributes:
                assert (field.kind, field.doc) == (attributes[field.name].kind, attributes[field.name].doc)
        signature = tensorrt_plugin.plugin_signature(plugin, object)
        assert list(signature.parameters) == [*(name.lower() for name in plugin.inputs),
                                              *(f.name for f in plugin.fields)]


def test_kernel_parameters_are_inputs_then_scalars_then_outputs():
    for plugin in tensorrt_plugin.PLUGINS.values():
        assert triton_kernel.runtime_parameters(plugin.kernel) == plugin.inputs + plugin.scalars + plugin.outputs


def test_launch_plans_follow_the_shapes():
    quantize, attention = tensorrt_plugin.PLUGINS["BlockQuantize"], tensorrt_plugin.PLUGINS["BlockSparseAttention"]
    fields = {"block": 64, "head_dim": 128, "precision": "fp8_e4m3", "transpose": 1}
    outputs, launch = tensorrt_plugin.launch_plan(quantize, [(2, 1000, 24, 128)], ["bf16"], fields)
    assert outputs == [((2, 24, 128, 1024), "fp8e4nv"), ((2, 24, 16), "fp32")]  # v's rows in whole blocks
    assert launch.grid == (16, 48) and launch.scalars == (1000, 24)
    assert launch.pointer_types == {"X": "bf16", "Out": "fp8e4nv", "Scale": "fp32"}
    shapes = [(2, 1000, 24, 128), (2, 900, 24, 128), (2, 24, 128, 960), (2, 24, 16), (2, 24, 15), (2, 24, 15),
              (2, 24, 16, 15), (2, 24, 16)]
    types = ["fp8e4nv"] * 3 + ["fp32"] * 3 + ["i32"] * 2
    fields = {"block_q": 64, "block_k": 64, "head_dim": 128, "precision": "fp8_e4m3", "qk_scale": 0.1,
              "out_type": "bf16"}
    outputs, launch = tensorrt_plugin.launch_plan(attention, shapes, types, fields)
    assert outputs == [((2, 1000, 24, 128), "bf16")]
    assert launch.grid == (16, 48)
    assert dict(zip(attention.scalars, launch.scalars)) == {"heads": 24, "tokens": 1000, "kv_tokens": 900,
                                                            "max_kept": 15}
    assert launch.constants["SCALE_LOG2"] == pytest.approx(0.1 / np.log(2))


@functools.lru_cache(maxsize=None)
def _compiled_for_hopper(plugin_name: str):
    """What aot_impl hands TensorRT for a bf16 model on an H100/H200 (lengths not whole blocks)."""
    plugin = tensorrt_plugin.PLUGINS[plugin_name]
    if plugin_name == "BlockQuantize":
        shapes, types = [(2, 1000, 24, 128)], ["bf16"]
        fields = {"block": 64, "head_dim": 128, "precision": "fp8_e4m3", "transpose": 1}
    else:
        shapes = [(2, 1000, 24, 128)] * 2 + [(2, 24, 128, 1024)] + [(2, 24, 16)] * 3 + [(2, 24, 16, 16), (2, 24, 16)]
        types = ["fp8e4nv"] * 3 + ["fp32"] * 3 + ["i32"] * 2
        fields = {"block_q": 64, "block_k": 64, "head_dim": 128, "precision": "fp8_e4m3", "qk_scale": 0.09,
                  "out_type": "bf16"}
    _, launch = tensorrt_plugin.launch_plan(plugin, shapes, types, fields)
    return triton_kernel.compile_ahead(plugin.kernel, launch.pointer_types, launch.constants, (9, 0))


@pytest.mark.parametrize("plugin_name", ["BlockQuantize", "BlockSparseAttention"])
def test_kernels_compile_ahead_of_time_for_hopper(plugin_name):
    """PTX whose entry takes exactly the plugin's parameters, and which ptxas assembles for sm_90a."""
    plugin, compiled = tensorrt_plugin.PLUGINS[plugin_name], _compiled_for_hopper(plugin_name)
    entry = re.search(rf"\.entry\s+{compiled.name}\s*\(([^)]*)\)", compiled.ptx).group(1)
    declared = [p.split()[1] for p in entry.split(",")]
    expected = ["u64"] * len(plugin.inputs) + ["u32"] * len(plugin.scalars) + ["u64"] * len(plugin.outputs)
    assert declared == [f".{kind}" for kind in expected]
    assert ".target sm_90a" in compiled.ptx and compiled.threads == 32 * triton_kernel.NUM_WARPS
    if plugin_name == "BlockSparseAttention":
        assert "cvt.rn.satfinite.e4m3x2.f32" in compiled.ptx  # FP8 probabilities
        assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in compiled.ptx  # Hopper's FP8 QK product
    assert len(triton_kernel.assemble(compiled, (9, 0))) > 0


@pytest.mark.parametrize("plugin_name", ["BlockQuantize", "BlockSparseAttention"])
def test_ahead_of_time_kernels_move_memory_in_16_byte_vectors(plugin_name):
    """TensorRT's lengths are unknown when the PTX is made: the kernels must still read and write whole
    16-byte vectors, and the attention kernel must stream its key and value blocks through asynchronous
    copies (the software pipeline). One-byte loads here are what a row of the true length gave."""
    ptx = _compiled_for_hopper(plugin_name).ptx
    accesses = re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*", ptx)
    narrow = [a for a in accesses if re.search(r"\.[bsu](8|16)$", a)]
    assert not narrow, sorted(set(narrow))
    assert any(a.endswith(".v4.b32") for a in accesses if a.startswith("ld"))
    assert any(a.endswith(".v4.b32") for a in accesses if a.startswith("st"))
    if plugin_name == "BlockSparseAttention":
        copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (0x10|16)", ptx)
        blocks_per_step = 2 * 64 * 128 // 16 // (32 * triton_kernel.NUM_WARPS)  # one k and one v block, fp8
        assert len(copies) >= blocks_per_step


def test_a_kernel_using_scratch_memory_is_refused():
    ptx = (".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_1\n)\n{\n\tld.param.b64 %rd1, [k_param_1];\n}\n")
    with pytest.raises(ValueError, match="scratch"):
        triton_kernel._without_scratch_parameters(ptx, "k", declared=1)
    unused = ptx.replace("[k_param_1]", "[k_param_0]")
    assert "k_param_1" not in triton_kernel._without_scratch_parameters(unused, "k", declared=1)


def test_tensorrt_plugins_register():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed")
    assert tensorrt_plugin.register() == ("machgen::BlockQuantize", "machgen::BlockSparseAttention")

