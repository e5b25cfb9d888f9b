"""The operator's GPU kernels, in OpenAI Triton: a block quantization and a
block-sparse flash attention with FP8 e4m3 QK and PV products on Hopper.

``_block_quantize`` rounds q, k or v once, in one pass, one program per
(block of tokens, batch x head): for ``fp8_e4m3`` the block's absolute
maximum maps to 448 (one float32 scale per block and head, as
plugins/reference.py rounds them); for ``bf16``/``fp32`` it only casts
(scale 1). It writes v transposed ([B, H, D, N] padded to whole blocks with
zeros) so that the PV product's second operand is K-major, as Hopper's FP8
tensor-core instructions want it, and so that the attention kernel reads
it with unmasked 16-byte copies whatever the length (the padded row length
is a multiple of the block, which the compiler sees; a row of the true
length, unknown when TensorRT compiles ahead of time, forced one-byte
loads outside the pipeline).

``_block_sparse_attention``: one program per (query block, batch x head)
walks only the key blocks its mask keeps (a list of indices per query
block, predicted by reference.block_mask), with the online softmax of
FlashAttention. The probabilities exp(s - running max), which lie in
(0, 1], are rounded to float8 with the fixed scale 448 before the PV
product; the row sums stay in float32.

Both kernels take their parameters in the order TensorRT's ahead-of-time
plugins launch a kernel with (tensorRT.plugin ``aot_impl``): input
pointers, then int32 scalars, then output pointers; everything else is a
compile-time constant, and tensors are contiguous. The same kernels are
launched from torch here (``sparse_attention``, the torch target and the
JIT path) and compiled to PTX by ``compile_ahead`` for the TensorRT plugins
(plugins/tensorrt_plugin.py), so there is one program for every target.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1
set before this module is imported): slow, and its float8 conversion
rounds differently from the hardware's, but the same program, which is how
the CPU tests check it. Compiling ahead of time needs no GPU either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import triton
import triton.language as tl

from machgen.plugins import reference
from machgen.plugins.schema import SparseAttentionConfig

PRECISION_CODES = {"fp8_e4m3": 0, "bf16": 1, "fp32": 2}
OPERAND_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
_LOG2_E = 1.4426950408889634
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _block_quantize(
    X, tokens, heads, Out, Scale,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    rows = block * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    real = rows[:, None] < tokens
    # int64 offsets: a batch of long videos passes 2^31 elements.
    offsets = ((b.to(tl.int64) * tokens + rows[:, None]) * heads + h) * HEAD_DIM + dims[None, :]
    x = tl.load(X + offsets, mask=real, other=0.0).to(tl.float32)
    if PRECISION == 0:
        scale = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12) / 448.0
        rounded = (x / scale).to(tl.float8e4nv)
    else:
        scale = 1.0
        rounded = x.to(Out.dtype.element_ty)
    if TRANSPOSE:  # [B, H, D, whole blocks], the padding zeros (x loads them as 0)
        padded = tl.cdiv(tokens, BLOCK) * BLOCK
        offsets = (batch_head.to(tl.int64) * HEAD_DIM + dims[None, :]) * padded + rows[:, None]
        tl.store(Out + offsets, rounded)
    else:
        tl.store(Out + offsets, rounded, mask=real)
    tl.store(Scale + batch_head * tl.cdiv(tokens, BLOCK) + block, scale)


@triton.jit
def _block_sparse_attention(
    Q, K, VT, QScale, KScale, VScale, KeptBlocks, KeptCount, heads, tokens, kv_tokens, max_kept, Out,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    SCALE_LOG2: tl.constexpr, EVEN_KV: tl.constexpr,
):
    query_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    q_blocks = tl.cdiv(tokens, BLOCK_Q)
    k_blocks = tl.cdiv(kv_tokens, BLOCK_K)
    rows = query_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = ((b.to(tl.int64) * tokens + rows[:, None]) * heads + h) * HEAD_DIM + dims[None, :]
    q = tl.load(Q + q_offsets, mask=rows[:, None] < tokens, other=0.0)
    q_scale = tl.load(QScale + batch_head * q_blocks + query_block)
    k_base = K + (b.to(tl.int64) * kv_tokens * heads + h) * HEAD_DIM
    kv_padded = k_blocks * BLOCK_K
    vt_base = VT + batch_head.to(tl.int64) * HEAD_DIM * kv_padded

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    kept = KeptBlocks + (batch_head * q_blocks + query_block).to(tl.int64) * max_kept
    count = tl.load(KeptCount + batch_head * q_blocks + query_block)
    for index in range(0, count):
        key_block = tl.load(kept + index)
        cols = key_block * BLOCK_K + tl.arange(0, BLOCK_K)
        k_pointers = k_base + cols[:, None] * (heads * HEAD_DIM) + dims[None, :]
        vt = tl.load(vt_base + dims[:, None] * kv_padded + cols[None, :])  # padded: always whole
        if EVEN_KV:  # every key block is whole: plain loads, no masking of the scores
            k = tl.load(k_pointers)
        else:
            k = tl.load(k_pointers, mask=cols[:, None] < kv_tokens, other=0.0)
        k_scale = tl.load(KScale + batch_head * k_blocks + key_block)
        v_scale = tl.load(VScale + batch_head * k_blocks + key_block)
        if PRECISION == 2:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * (q_scale * k_scale * SCALE_LOG2)  # log2 domain: exp2 below
        if not EVEN_KV:
            s = tl.where(cols[None, :] < kv_tokens, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if PRECISION == 0:
            pv = tl.dot((p * 448.0).to(tl.float8e4nv), tl.trans(vt)) * (v_scale / 448.0)
        elif PRECISION == 1:
            pv = tl.dot(p.to(tl.bfloat16), tl.trans(vt))
        else:
            pv = tl.dot(p, tl.trans(vt), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + q_offsets, out.to(Out.dtype.element_ty), mask=rows[:, None] < tokens)


def _cdiv(a, b):
    return -(-a // b)


def padded_tokens(tokens, block: int, cdiv: Callable = _cdiv):
    """Length of the transposed v operand's rows: whole blocks (same conventions as quantize_grid)."""
    return cdiv(tokens, block) * block


def quantize_grid(tokens, batch_heads, block: int, cdiv: Callable = _cdiv) -> tuple:
    """Programs of ``_block_quantize``; ``tokens``/``batch_heads`` may be
    ints or TensorRT shape expressions (with TensorRT's ``cdiv``)."""
    return cdiv(tokens, block), batch_heads


def attention_grid(tokens, batch_heads, block_q: int, cdiv: Callable = _cdiv) -> tuple:
    """Programs of ``_block_sparse_attention`` (same conventions as quantize_grid)."""
    return cdiv(tokens, block_q), batch_heads


def quantize_constants(block: int, head_dim: int, precision: str, transpose: bool) -> dict:
    return {"BLOCK": block, "HEAD_DIM": head_dim, "PRECISION": PRECISION_CODES[precision],
            "TRANSPOSE": int(transpose)}


def attention_constants(config: SparseAttentionConfig, head_dim: int, kv_tokens: int | None = None) -> dict:
    """The kernel's constants; ``kv_tokens`` when known at compile time (not
    for TensorRT, whose lengths are dynamic) lets whole key blocks skip masking."""
    # The softmax scale is a constant of the program: TensorRT passes kernels integer scalars only.
    return {"BLOCK_Q": config.block_q, "BLOCK_K": config.block_k, "HEAD_DIM": head_dim,
            "PRECISION": PRECISION_CODES[config.precision], "SCALE_LOG2": config.scale_for(head_dim) * _LOG2_E,
            "EVEN_KV": int(kv_tokens is not None and kv_tokens % config.block_k == 0)}


def quantize(x: torch.Tensor, block: int, precision: str, transpose: bool = False,
             num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, N, H, D] rounded as ``precision`` says, in the kernel's operand
    type ([B, H, D, N padded to whole blocks] when ``transpose``), and its
    per-(batch, head, block) float32 scales [B, H, blocks] (ones unless fp8)."""
    x = x.contiguous()
    batch, tokens, heads, head_dim = x.shape
    shape = (batch, heads, head_dim, padded_tokens(tokens, block)) if transpose else x.shape
    out = torch.empty(shape, dtype=OPERAND_DTYPES[precision], device=x.device)
    scale = torch.empty(batch, heads, _cdiv(tokens, block), dtype=torch.float32, device=x.device)
    _block_quantize[quantize_grid(tokens, batch * heads, block)](
        x, tokens, heads, out, scale, **quantize_constants(block, head_dim, precision, transpose),
        num_warps=num_warps)
    return out, scale


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: SparseAttentionConfig,
                     mask: torch.Tensor | None = None, num_warps: int = NUM_WARPS,
                     num_stages: int = NUM_STAGES) -> torch.Tensor:
    """The operator on q, k, v [B, N, H, D] (float32 or bfloat16), output in q's dtype;
    ``num_warps``/``num_stages`` are the launch's (perf/gpu_attention.py --tune)."""
    batch, tokens, heads, head_dim = q.shape
    if mask is None:
        mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
    kept, counts = reference.kept_block_lists(mask)
    return attend(*quantize(q, config.block_q, config.precision), *quantize(k, config.block_k, config.precision),
                  *quantize(v, config.block_k, config.precision, transpose=True), kept.to(torch.int32), counts,
                  config, out_dtype=q.dtype, num_warps=num_warps, num_stages=num_stages)


def attend(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, vt: torch.Tensor,
           v_scale: torch.Tensor, kept: torch.Tensor, counts: torch.Tensor, config: SparseAttentionConfig,
           out_dtype: torch.dtype, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> torch.Tensor:
    """The attention kernel on operands already rounded by ``quantize`` (v
    transposed and padded) and the kept block lists [B, H, q_blocks, most kept] int32."""
    batch, tokens, heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    _block_sparse_attention[attention_grid(tokens, batch * heads, config.block_q)](
        q, k, vt, q_scale, k_scale, v_scale, kept.contiguous(), counts.contiguous(), heads, tokens, k.shape[1],
        kept.shape[-1], out, **attention_constants(config, head_dim, k.shape[1]), num_warps=num_warps,
        num_stages=num_stages)
    return out


# Ahead-of-time compilation ------------------------------------------------------------------------------------

KERNELS = {"block_quantize": _block_quantize, "block_sparse_attention": _block_sparse_attention}
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32"}


@dataclass(frozen=True)
class CompiledKernel:
    """A kernel compiled for one GPU architecture, as TensorRT launches it:
    its parameters are its declared ones only (``parameters``: pointers,
    then int32 scalars, then pointers)."""

    name: str
    ptx: str
    threads: int  # per program (block_x of the launch)
    shared_bytes: int
    parameters: tuple[str, ...]


def runtime_parameters(kernel: str) -> tuple[str, ...]:
    """The kernel's parameters that are passed at launch (the rest are constants)."""
    function = _jit_function(KERNELS[kernel])
    return tuple(param.name for param in function.params if not param.is_constexpr)


def compile_ahead(kernel: str, pointer_types: Mapping[str, str], constants: Mapping[str, object],
                  capability: tuple[int, int], num_warps: int = NUM_WARPS,
                  num_stages: int = NUM_STAGES) -> CompiledKernel:
    """PTX of one of ``KERNELS`` for a GPU of compute ``capability``, with
    every pointer's element type given (Triton's names: ``TRITON_TYPES``)
    and every constant fixed; the other scalars are int32. Needs no GPU."""
    request = {"kernel": kernel, "pointer_types": dict(pointer_types), "constants": dict(constants),
               "capability": list(capability), "num_warps": num_warps, "num_stages": num_stages}
    if triton.knobs.runtime.interpret:
        # The interpreter leaves triton.language patched after a run (its device-function calls, tl.max
        # among them, do not restore it), which breaks compilation in this process: compile in a fresh one.
        import json
        import os
        import subprocess
        import sys

        env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-m", __name__, json.dumps(request)], env=env, check=True,
                              capture_output=True, text=True)
        answer = json.loads(done.stdout.splitlines()[-1])
        return CompiledKernel(**{**answer, "parameters": tuple(answer["parameters"])})
    return _compile(**request)


def _compile(kernel: str, pointer_types: Mapping[str, str], constants: Mapping[str, object],
             capability, num_warps: int, num_stages: int) -> CompiledKernel:
    from triton.backends.compiler import GPUTarget

    function = _jit_function(KERNELS[kernel])
    parameters = runtime_parameters(kernel)
    missing = [name for name in function.arg_names if name not in parameters and name not in constants]
    if missing:
        raise ValueError(f"{kernel}: no value for the constants {missing}")
    signature = {name: "constexpr" if name not in parameters else
                 f"*{pointer_types[name]}" if name in pointer_types else "i32" for name in function.arg_names}
    # Every pointer is taken as 16-byte aligned, as Triton's own launches specialise it for torch's allocations;
    # without that the compiler proves no alignment and loads byte by byte, outside the software pipeline.
    # TensorRT's activations are allocated aligned (assumed, as TensorRT-LLM's Triton plugin generator assumes).
    aligned = {(function.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointer_types}
    source = triton.compiler.ASTSource(fn=function, signature=signature, constexprs=dict(constants), attrs=aligned)
    major, minor = capability
    compiled = triton.compile(source, target=GPUTarget("cuda", major * 10 + minor, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    metadata = compiled.metadata
    ptx = _without_scratch_parameters(compiled.asm["ptx"], metadata.name, len(parameters))
    return CompiledKernel(name=metadata.name, ptx=ptx, threads=metadata.num_warps * 32,
                          shared_bytes=metadata.shared, parameters=parameters)


def _jit_function(function):
    """The compilable JITFunction (under the interpreter, ``triton.jit`` hands back an interpreted wrapper)."""
    from triton.runtime.jit import JITFunction

    return function if isinstance(function, JITFunction) else JITFunction(function.fn)


def _without_scratch_parameters(ptx: str, name: str, declared: int) -> str:
    """Triton appends pointer parameters of its own (global and profile
    scratch memory) after the declared ones. TensorRT launches a kernel with
    the declared ones only, so they are dropped from the entry; a kernel
    that uses them cannot be launched that way and is refused."""
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\((?P<params>[^)]*)\)", ptx)
    if entry is None:
        raise ValueError(f"no entry {name!r} in the PTX")
    params = [p.strip() for p in entry.group("params").split(",") if p.strip()]
    extra = params[declared:]
    body = ptx[entry.end():]
    for param in extra:
        param_name = param.split()[-1]
        if re.search(rf"\b{re.escape(param_name)}\b", body):
            raise ValueError(f"{name}: the kernel uses Triton's scratch parameter {param_name}; TensorRT's "
                             "ahead-of-time plugins cannot pass it")
    kept = ",\n\t".join(params[:declared])
    return ptx[:entry.start("params")] + f"\n\t{kept}\n" + ptx[entry.end("params"):]


def assemble(compiled: CompiledKernel, capability: tuple[int, int]) -> bytes:
    """The PTX through ptxas (the one Triton ships) into a cubin: proof that
    the PTX TensorRT will load is valid for that architecture."""
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia import compiler as nvidia

    number = capability[0] * 10 + capability[1]
    with tempfile.TemporaryDirectory() as folder:
        source, target = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(compiled.ptx)
        subprocess.run([nvidia.get_ptxas(number).path, f"--gpu-name={nvidia.sm_arch_from_capability(number)}",
                        str(source), "-o", str(target)], check=True, capture_output=True)
        return target.read_bytes()


if __name__ == "__main__":  # compile_ahead's fresh process: one JSON request in, one JSON answer out
    import json
    import sys
    from dataclasses import asdict

    print(json.dumps(asdict(_compile(**json.loads(sys.argv[1])))))
