"""The SparseAttention operator: schema, mask, CPU reference, ONNX form."""

from __future__ import annotations

import inspect
import math
import warnings

import numpy as np
import pytest
import torch

from machgen.plugins import ops, reference, schema
from machgen.plugins.schema import SparseAttentionConfig

warnings.filterwarnings("ignore", category=UserWarning)


def _qkv(batch=2, tokens=50, heads=3, head_dim=16, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, tokens, heads, head_dim, generator=gen) * scale for _ in range(3))


CONFIGS = [
    SparseAttentionConfig(block_q=8, block_k=8, topk_ratio=0.5, precision="fp32"),
    SparseAttentionConfig(block_q=8, block_k=12, mask_method="cdf", cdf_threshold=0.7, dense_prefix_tokens=11,
                          precision="fp8_e4m3"),
    SparseAttentionConfig(block_q=16, block_k=4, topk_ratio=0.3, dense_diagonal=0, precision="bf16",
                          softmax_scale=0.2),
]


def test_one_schema_for_every_form():
    names = [a.name for a in schema.ATTRIBUTES]
    assert list(SparseAttentionConfig().onnx_attributes()) == names
    assert list(inspect.signature(ops.sparse_attention_op._init_fn).parameters)[3:] == names
    schema.register_onnx_schema()
    import onnx

    registered = onnx.defs.get_schema(schema.OP_TYPE, schema.OP_VERSION, schema.DOMAIN)
    assert sorted(registered.attributes) == sorted(names)


@pytest.mark.parametrize("field, value", [("mask_method", "random"), ("precision", "int4"), ("topk_ratio", 0.0),
                                          ("cdf_threshold", 1.5), ("block_q", 0)])
def test_config_rejects_bad_attributes(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SparseAttentionConfig(**{field: value})


def test_nothing_masked_in_fp32_is_exact_attention():
    q, k, v = _qkv(tokens=37)
    config = SparseAttentionConfig(block_q=8, block_k=8, topk_ratio=1.0, precision="fp32")
    exact = reference.dense_attention_float64(q, k, v)
    assert reference.relative_l2(reference.sparse_attention(q, k, v, config), exact) < 1e-6
    assert reference.relative_l2(reference.masked_dense_attention(q, k, v, config), exact) < 1e-6


@pytest.mark.parametrize("config", CONFIGS)
def test_block_skipping_reference_equals_masked_dense_form(config):
    q, k, v = _qkv(tokens=53)
    skipping = reference.sparse_attention(q, k, v, config)
    masked = reference.masked_dense_attention(q, k, v, config)
    assert torch.isfinite(skipping).all()
    assert float((skipping - masked).abs().max()) < 1e-5


def test_reference_never_reads_dropped_blocks():
    # Per query block, NaNs in the key/value blocks it drops would poison any product that touched them.
    q, k, v = _qkv(batch=1, tokens=64, heads=1)
    config = SparseAttentionConfig(block_q=8, block_k=8, topk_ratio=0.25, precision="fp32")
    mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
    clean = reference.sparse_attention(q, k, v, config)
    for query_block in range(8):
        dropped = [block for block in range(8) if not bool(mask[0, 0, query_block, block])]
        assert dropped
        k_poisoned, v_poisoned = k.clone(), v.clone()
        for block in dropped:
            k_poisoned[0, block * 8:(block + 1) * 8] = float("nan")
            v_poisoned[0, block * 8:(block + 1) * 8] = float("nan")
        rows = slice(query_block * 8, (query_block + 1) * 8)
        poisoned = reference.sparse_attention(q, k_poisoned, v_poisoned, config, mask=mask)
        assert torch.equal(poisoned[:, rows], clean[:, rows])
    assert torch.isnan(reference.masked_dense_attention(q, k_poisoned, v_poisoned, config)).any()


def test_mask_keeps_what_the_method_says():
    q, k, _ = (x.transpose(1, 2) for x in _qkv(tokens=80))
    topk = SparseAttentionConfig(block_q=8, block_k=8, topk_ratio=0.3, dense_diagonal=0)
    mask = reference.block_mask(q, k, topk)
    assert (mask.sum(-1) >= math.ceil(0.3 * 10)).all() and (mask.sum(-1) <= 10).all()

    cdf = SparseAttentionConfig(block_q=8, block_k=8, mask_method="cdf", cdf_threshold=0.8, dense_diagonal=0)
    mask = reference.block_mask(q, k, cdf)
    pooled_scores = reference.pooled(q, 8) @ reference.pooled(k, 8).transpose(-1, -2) * cdf.scale_for(16)
    kept_mass = (torch.softmax(pooled_scores, dim=-1) * mask).sum(-1)
    assert (kept_mass >= 0.8 - 1e-6).all()

    dense = SparseAttentionConfig(block_q=8, block_k=8, topk_ratio=0.1, dense_prefix_tokens=12)
    mask = reference.block_mask(q, k, dense)
    assert mask[..., :2, :].all() and mask[..., :, :2].all()  # blocks 0 and 1 hold the 12 prefix tokens
    assert mask.diagonal(dim1=-2, dim2=-1).all()


def test_sparsity_on_video_like_attention_is_cheap_in_error():
    from machgen.plugins.synthetic import video_like_qkv

    q, k, v = video_like_qkv(4, 8, 8, heads=2, head_dim=32, sharpness=12.0)
    exact = reference.dense_attention_float64(q, k, v)
    for config in (SparseAttentionConfig(block_q=16, block_k=16, topk_ratio=0.5, precision="fp32"),
                   SparseAttentionConfig(block_q=16, block_k=16, mask_method="cdf", cdf_threshold=0.9)):
        mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
        skipped = reference.skipped_fraction(mask, 256, 256, 16, 16)
        error = reference.relative_l2(reference.sparse_attention(q, k, v, config), exact)
        # A blind mask (every other block and the diagonal) skips about as much; the prediction must matter.
        blind = torch.eye(16, dtype=torch.bool).expand_as(mask).clone()
        blind[..., ::2] = True
        blind_error = reference.relative_l2(reference.sparse_attention(q, k, v, config, mask=blind), exact)
        assert skipped >= 0.3 and error < 0.05 and error < blind_error / 2, (skipped, error, blind_error)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e4])
def test_fp8_emulation_error_is_small_and_finite_at_any_scale(magnitude):
    q, k, v = _qkv(tokens=40, scale=1.0)
    q, k, v = q * magnitude / 4, k / magnitude / 4, v * magnitude  # logits stay O(1)
    fp8 = SparseAttentionConfig(block_q=8, block_k=8, topk_ratio=1.0, precision="fp8_e4m3")
    out = reference.sparse_attention(q, k, v, fp8)
    error = reference.relative_l2(out, reference.dense_attention_float64(q, k, v))
    assert torch.isfinite(out).all()
    assert 1e-4 < error < 0.06, error  # rounded (not silently fp32) and close


def _export(config, heads=3, head_dim=16):
    from torch.export import Dim

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return ops.sparse_attention(q * 0.5, k, v, config) + 1.0

    samples = tuple(torch.randn(2, 29, heads, head_dim) for _ in range(3))
    axes = {0: Dim("batch", min=1), 1: Dim("tokens", min=2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Block(), samples, dynamo=True, input_names=["q", "k", "v"],
                                    custom_translation_table=ops.onnx_translation(),
                                    dynamic_shapes=(axes, axes, axes), verbose=False)
    return Block(), program.model_proto


@pytest.mark.export
def test_onnx_export_carries_the_node_and_onnxruntime_runs_its_body():
    import onnx
    import onnxruntime

    config = CONFIGS[1]
    module, model = _export(config)
    nodes = [n for n in model.graph.node if n.domain == schema.DOMAIN]
    assert [n.op_type for n in nodes] == [schema.OP_TYPE]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attributes["mask_method"] == b"cdf" and attributes["block_k"] == 12
    assert ops.attach_onnx_function(model, config) == 1
    onnx.checker.check_model(model)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, tokens in ((1, 29), (3, 70)):
        q, k, v = _qkv(batch=batch, tokens=tokens, seed=tokens)
        got = session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()})[0]
        assert np.abs(got - module(q, k, v).numpy()).max() < 1e-5


def test_onnx_function_refuses_nodes_of_another_configuration():
    _, model = _export(CONFIGS[0])
    with pytest.raises(ValueError, match="differ"):
        ops.attach_onnx_function(model, CONFIGS[2])


def test_swap_replaces_unmasked_dispatch_calls_only():
    import diffusers.models.transformers.transformer_flux as flux

    q, k, v = _qkv(batch=1, tokens=24, heads=2)
    config = SparseAttentionConfig(block_q=8, block_k=8, topk_ratio=0.34, precision="fp32")
    dense = flux.dispatch_attention_fn(q, k, v)
    with ops.attention_swapped([flux.__name__], config):
        swapped = flux.dispatch_attention_fn(q, k, v)
        masked_call = flux.dispatch_attention_fn(q, k, v, attn_mask=torch.ones(1, 1, 24, 24, dtype=torch.bool))
    assert torch.allclose(swapped, reference.sparse_attention(q, k, v, config))
    assert not torch.allclose(swapped, dense, atol=1e-3)
    assert torch.allclose(masked_call, dense, atol=1e-5)
    assert torch.equal(flux.dispatch_attention_fn(q, k, v), dense)  # restored

