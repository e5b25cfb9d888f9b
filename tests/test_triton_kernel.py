"""The OpenAI Triton kernel of SparseAttention against the CPU reference.

On a CUDA machine it runs compiled on the GPU; elsewhere under Triton's
interpreter (the same program, on numpy), so the kernel's indexing, mask
walk and online softmax are checked on every machine. The interpreter's
float8 conversion rounds differently from the hardware's, so FP8 is
checked against exact attention with a tolerance rather than bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton
triton_kernel = pytest.importorskip("machgen.plugins.triton_kernel", reason="OpenAI Triton is not installed")

from machgen.plugins import reference  # noqa: E402
from machgen.plugins.schema import SparseAttentionConfig  # noqa: E402
from machgen.plugins.synthetic import video_like_qkv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(tokens=(2, 6, 8), heads=2, head_dim=32):
    q, k, v = video_like_qkv(*tokens, heads=heads, head_dim=head_dim, sharpness=10.0)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize("precision, tolerance", [
    ("fp32", 1e-5),
    pytest.param("bf16", 2e-2, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="needs CUDA: Triton 3.9's interpreter multiplies bfloat16 as raw bits (checked: "
                                "tl.dot of two bf16 tiles is off by 1e10); perf/gpu_check.sh checks bf16 on a GPU")),
])
def test_kernel_equals_the_reference(precision, tolerance):
    q, k, v = _inputs(tokens=(1, 10, 10))  # 100 tokens: the last blocks are partial
    config = SparseAttentionConfig(block_q=32, block_k=16, mask_method="cdf", cdf_threshold=0.6,
                                   dense_prefix_tokens=10, precision=precision)
    mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
    assert not bool(mask.all())
    got = triton_kernel.sparse_attention(q, k, v, config, mask=mask)
    want = reference.sparse_attention(q, k, v, config, mask=mask)
    assert reference.relative_l2(got, want) < tolerance


def test_fp8_kernel_is_close_to_exact_attention_and_never_nan():
    q, k, v = _inputs()
    config = SparseAttentionConfig(block_q=16, block_k=16, topk_ratio=1.0, precision="fp8_e4m3")
    got = triton_kernel.sparse_attention(q, k, v, config)
    assert torch.isfinite(got).all()
    assert reference.relative_l2(got, reference.dense_attention_float64(q, k, v)) < 0.06


def test_kernel_reads_only_the_kept_blocks():
    q, k, v = _inputs(tokens=(1, 4, 16), heads=1)  # 64 tokens, four blocks of 16
    config = SparseAttentionConfig(block_q=16, block_k=16, topk_ratio=0.25, dense_diagonal=0, precision="fp32")
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool, device=DEVICE)
    mask[..., 0] = True  # every query block reads key block 0 only
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, 16:], v_poisoned[:, 16:] = float("nan"), float("nan")
    got = triton_kernel.sparse_attention(q, k_poisoned, v_poisoned, config, mask=mask)
    assert torch.isfinite(got).all()
    assert reference.relative_l2(got, reference.sparse_attention(q, k, v, config, mask=mask)) < 1e-5


def test_whole_key_blocks_take_the_unmasked_path_and_agree():
    """64 keys in blocks of 16 compile the kernel without masking (EVEN_KV); 60 with it."""
    q, k, v = _inputs(tokens=(1, 8, 8))  # 64 tokens
    config = SparseAttentionConfig(block_q=16, block_k=16, topk_ratio=0.5, precision="fp32")
    assert triton_kernel.attention_constants(config, 32, 64)["EVEN_KV"] == 1
    assert triton_kernel.attention_constants(config, 32, 60)["EVEN_KV"] == 0
    assert triton_kernel.attention_constants(config, 32)["EVEN_KV"] == 0  # TensorRT: lengths unknown
    for tokens in (64, 60):
        got = triton_kernel.sparse_attention(q[:, :tokens], k[:, :tokens], v[:, :tokens], config)
        want = reference.sparse_attention(q[:, :tokens], k[:, :tokens], v[:, :tokens], config)
        assert reference.relative_l2(got, want) < 1e-5
