"""SparseAttention on a CUDA GPU: check the Triton kernel, then time it
against dense attention. Run by perf/gpu_check.sh; needs torch with CUDA and
OpenAI Triton, nothing else of machgen's dependencies.

Checks (printed, and the script exits non-zero when one fails): the kernel
in fp8_e4m3, bf16 and fp32 against the operator's float32 reference
(plugins/reference.py, the same mask) on random and on video-like inputs,
and on the trained model's captured ones where `perf/gpu_check.sh --prepare`
wrote them: no NaN, and an error at most 1.25x that of the reference
rounding the same way, on every call.

Ahead of time (what TensorRT's plugins run): both kernels compiled to PTX
for this GPU by plugins/triton_kernel.py's compile_ahead, loaded and
launched through the CUDA driver with exactly the parameters TensorRT
passes (inputs, int32 scalars from the launch plan, outputs), against the
same kernels launched by Triton from torch, both timed.

Timing: CUDA events after warm-up, median of the repeats; batch 1, 24
heads, head_dim 128, bf16 inputs; dense is torch's
scaled_dot_product_attention (bf16, the flash backend where available);
ours is the whole operator (mask prediction, kept lists, FP8 quantization
kernels, attention kernel) and the attention kernel alone on operands
already quantized; sparsity by a top-k mask without dense blocks.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402

TOKENS = (4096, 16384, 32768, 65536)
SPARSITIES = (0.0, 0.5, 0.75, 0.9)
HEADS, HEAD_DIM = 24, 128


CHECK_HEADER = ["| inputs | precision | kernel vs float32 (rel. L2) | reference in that precision vs float32 | "
                "kernel vs that reference | NaN |", "| --- | --- | --- | --- | --- | --- |"]
PRECISIONS = ("fp8_e4m3", "bf16", "fp32")
# Where `perf/gpu_check.sh --prepare` puts the trained model's activations (perf/bench_attention.py --save-captured).
CAPTURED = Path(__file__).resolve().parent.parent / "build" / "gpu-captured" / "shapes-flux.pt"


def checks() -> list[str]:
    from machgen.plugins.schema import SparseAttentionConfig
    from machgen.plugins.synthetic import video_like_qkv

    failures, lines = [], list(CHECK_HEADER)
    gen = torch.Generator(device="cuda").manual_seed(0)
    random_inputs = tuple(torch.randn(1, 4096, HEADS, HEAD_DIM, device="cuda", generator=gen) for _ in range(3))
    video_inputs = tuple(x.cuda() for x in video_like_qkv(16, 16, 16, heads=HEADS, head_dim=HEAD_DIM, sharpness=12))
    base = SparseAttentionConfig(block_q=64, block_k=64, topk_ratio=0.5)
    for name, inputs in (("random 4k", random_inputs), ("video-like 4k", video_inputs)):
        _check(name, [inputs], base, PRECISIONS, lines, failures)
    print("\n".join(lines), flush=True)
    return failures


def captured_checks(path: Path = CAPTURED, device: str = "cuda", precisions=PRECISIONS,
                    limit: int | None = None) -> list[str]:
    """The kernel on the trained model's q, k, v (every call of a few steps), at the operator's settings
    for that model: blocks of 16 tokens (the kernel's smallest), the text dense, a cdf mask."""
    from machgen.plugins.schema import SparseAttentionConfig

    if not path.is_file():
        print(f"no captured activations at {path} (perf/gpu_check.sh --prepare writes them): not checked")
        return []
    captured = torch.load(path)
    calls = [tuple(x.to(device=device, dtype=torch.float32) for x in call) for call in captured["calls"][:limit]]
    base = SparseAttentionConfig(block_q=16, block_k=16, mask_method="cdf", cdf_threshold=0.9,
                                 dense_prefix_tokens=captured["text_tokens"])
    failures, lines = [], list(CHECK_HEADER)
    name = f"{captured['model']} {calls[0][0].shape[1]} tokens, {len(calls)} calls (mean, worst)"
    _check(name, calls, base, precisions, lines, failures)
    print("\n".join(lines), flush=True)
    return failures


def _check(name: str, calls: list, base, precisions, lines: list[str], failures: list[str]) -> None:
    """One row per precision: the kernel on each call's q, k, v [B, N, H, D] against float32 attention
    with the same mask. The kernel must be as accurate as the operator's definition (the reference
    rounding the same way): its error at most 1.25x the reference's, plus 1e-4, on every call. They round
    the probabilities against different maxima (the running one, the final one), so they do not agree
    bit for bit."""
    from machgen.plugins import reference, triton_kernel

    masks = [reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), base) for q, k, _ in calls]
    wanted = [reference.sparse_attention(q, k, v, replace(base, precision="fp32"), mask=mask)
              for (q, k, v), mask in zip(calls, masks)]
    for precision in precisions:
        config = replace(base, precision=precision)
        errors, allowed, apart, nan = [], [], [], False
        try:
            for (q, k, v), mask, want in zip(calls, masks, wanted):
                got = triton_kernel.sparse_attention(q, k, v, config, mask=mask)
                same_rounding = reference.sparse_attention(q, k, v, config, mask=mask)
                errors.append(reference.relative_l2(got, want))
                allowed.append(reference.relative_l2(same_rounding, want))
                apart.append(reference.relative_l2(got, same_rounding))
                nan = nan or bool(torch.isnan(got).any())
        except Exception as err:  # a kernel that does not compile here is a failed check, not the end
            lines.append(f"| {name} | {precision} | {type(err).__name__}: {str(err)[:200]} | - | - | - |")
            failures.append(lines[-1])
            continue

        def summary(values: list[float]) -> str:
            return f"{values[0]:.2e}" if len(values) == 1 else f"{sum(values) / len(values):.2e} ({max(values):.2e})"

        lines.append(f"| {name} | {precision} | {summary(errors)} | {summary(allowed)} | {summary(apart)} | "
                     f"{'yes' if nan else 'no'} |")
        if nan or any(not error <= 1.25 * limit + 1e-4 for error, limit in zip(errors, allowed)):
            failures.append(lines[-1])


def ahead_of_time_checks() -> list[str]:
    """The PTX TensorRT would load, launched as TensorRT launches it, against Triton's own launch."""
    from machgen.plugins import reference, tensorrt_plugin, triton_kernel
    from machgen.plugins.schema import SparseAttentionConfig

    failures = []
    lines = ["| kernel | PTX | launched by the driver vs by Triton | ms, driver vs Triton |",
             "| --- | --- | --- | --- |"]
    capability = torch.cuda.get_device_capability()
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(1, 4096, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    config = SparseAttentionConfig(block_q=64, block_k=64, topk_ratio=0.5)
    kept, counts = reference.kept_block_lists(reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config),
                                              trim=False)
    quantize, attention = tensorrt_plugin.PLUGINS["BlockQuantize"], tensorrt_plugin.PLUGINS["BlockSparseAttention"]
    try:
        operands = []
        for x, block, transpose in ((q, config.block_q, 0), (k, config.block_k, 0), (v, config.block_k, 1)):
            fields = {"block": block, "head_dim": HEAD_DIM, "precision": config.precision, "transpose": transpose}
            outputs, relaunch = _driver_launch(quantize, [x], fields, capability, lines)
            want = triton_kernel.quantize(x, block, config.precision, transpose=bool(transpose))
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn
                       else torch.equal(a, b) for a, b in zip(outputs, want))
            triton_ms = median_ms(lambda: triton_kernel.quantize(x, block, config.precision, bool(transpose)))
            lines[-1] += f" {'identical' if same else 'DIFFERENT'} | {median_ms(relaunch):.3f} vs {triton_ms:.3f} |"
            if not same:
                failures.append(lines[-1])
            operands.append(outputs)
        (q8, q_scale), (k8, k_scale), (vt8, v_scale) = operands
        fields = {"block_q": 64, "block_k": 64, "head_dim": HEAD_DIM, "precision": config.precision,
                  "qk_scale": config.scale_for(HEAD_DIM), "out_type": "bf16"}
        inputs = [q8, k8, vt8, q_scale, k_scale, v_scale, kept.to(torch.int32).contiguous(), counts]
        (out,), relaunch = _driver_launch(attention, inputs, fields, capability, lines)

        def triton_launch():
            return triton_kernel.attend(q8, q_scale, k8, k_scale, vt8, v_scale, inputs[6], counts, config,
                                        out_dtype=torch.bfloat16)

        error = reference.relative_l2(out, triton_launch())
        lines[-1] += f" rel. L2 {error:.1e} | {median_ms(relaunch):.3f} vs {median_ms(triton_launch):.3f} |"
        if not error < 1e-3:
            failures.append(lines[-1])
    except Exception as err:  # a failed compile or launch is a failed check, not the end of the script
        lines.append(f"| - | {type(err).__name__}: {str(err)[:300]} | - | - |")
        failures.append(lines[-1])
    print("\n".join(lines), flush=True)
    return failures


def _driver_launch(plugin, inputs: list, fields: dict, capability, lines: list[str]) -> tuple[list, Callable]:
    """``plugin``'s kernel as TensorRT runs an ahead-of-time plugin: its PTX
    loaded by the CUDA driver, launched with inputs, scalars and outputs;
    returns the outputs and the launch (to time it: the PTX is compiled
    without knowing the lengths, as TensorRT's is)."""
    import ctypes

    from machgen.plugins import tensorrt_plugin, triton_kernel

    torch_types = {name: dtype for dtype, name in triton_kernel.TRITON_TYPES.items()}
    outputs, launch = tensorrt_plugin.launch_plan(plugin, [tuple(t.shape) for t in inputs],
                                                  [triton_kernel.TRITON_TYPES[t.dtype] for t in inputs], fields)
    results = [torch.empty(shape, dtype=torch_types[kind], device="cuda") for shape, kind in outputs]
    compiled = triton_kernel.compile_ahead(plugin.kernel, launch.pointer_types, launch.constants, capability)
    lines.append(f"| {plugin.name} {fields.get('transpose', '')} | {compiled.name}, {len(compiled.parameters)} "
                 f"parameters, {compiled.shared_bytes} B shared |")
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: CUDA driver error {status}")

    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(compiled.ptx.encode() + b"\0")),
          "cuModuleLoadData")
    check(cuda.cuModuleGetFunction(ctypes.byref(function), module, compiled.name.encode()), "cuModuleGetFunction")
    if compiled.shared_bytes > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cuda.cuFuncSetAttribute(function, 8, compiled.shared_bytes), "cuFuncSetAttribute")
    values = ([ctypes.c_void_p(t.data_ptr()) for t in inputs] + [ctypes.c_int32(int(n)) for n in launch.scalars]
              + [ctypes.c_void_p(t.data_ptr()) for t in results])
    parameters = (ctypes.c_void_p * len(values))(*[ctypes.addressof(x) for x in values])
    grid_x, grid_y = (int(n) for n in launch.grid)
    cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def launch_once() -> None:
        check(cuda.cuLaunchKernel(function, grid_x, grid_y, 1, compiled.threads, 1, 1, compiled.shared_bytes,
                                  torch.cuda.current_stream().cuda_stream, ctypes.cast(parameters, ctypes.c_void_p),
                                  None), "cuLaunchKernel")

    launch_once()
    torch.cuda.synchronize()
    return results, launch_once


def timings() -> str:
    from machgen.plugins import reference, triton_kernel
    from machgen.plugins.schema import SparseAttentionConfig

    lines = ["| tokens | sparsity | dense SDPA bf16 ms | ours ms (attention kernel) | speed-up | "
             "kernel TFLOP/s (kept) |", "| --- | --- | --- | --- | --- | --- |"]
    for tokens in TOKENS:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        layout = [x.transpose(1, 2) for x in (q, k, v)]
        dense_ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(*layout))
        for sparsity in SPARSITIES:
            config = SparseAttentionConfig(block_q=64, block_k=64, topk_ratio=1.0 - sparsity, dense_diagonal=0)
            mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
            kept = float(mask.float().mean())
            try:
                total_ms = median_ms(lambda: triton_kernel.sparse_attention(q, k, v, config))
                lists = [t.to(torch.int32) for t in reference.kept_block_lists(mask)]
                operands = [*triton_kernel.quantize(q, 64, config.precision),
                            *triton_kernel.quantize(k, 64, config.precision),
                            *triton_kernel.quantize(v, 64, config.precision, transpose=True)]
                kernel_ms = median_ms(lambda: triton_kernel.attend(*operands, *lists, config,
                                                                   out_dtype=torch.bfloat16))
            except Exception as err:
                lines.append(f"| {tokens:,} | {100 * (1 - kept):.0f} % | {dense_ms:.2f} | "
                             f"{type(err).__name__}: {str(err)[:200]} | - | - |")
                print(lines[-1], flush=True)
                continue
            flops = 4 * tokens * tokens * HEAD_DIM * HEADS * kept
            lines.append(f"| {tokens:,} | {100 * (1 - kept):.0f} % | {dense_ms:.2f} | {total_ms:.2f} "
                         f"({kernel_ms:.2f}) | {dense_ms / total_ms:.2f}x | {flops / kernel_ms / 1e9:.0f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def tune(tokens: int = 32768, sparsity: float = 0.5) -> None:
    """Launch settings and block shapes of the kernel at one size (kernel with a given mask)."""
    from machgen.plugins import reference, triton_kernel
    from machgen.plugins.schema import SparseAttentionConfig

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    print(f"| block q x k | warps | stages | ms ({tokens:,} tokens, {100 * sparsity:.0f} % skipped) |", flush=True)
    for block_q, block_k in ((64, 64), (128, 64), (128, 128)):
        config = SparseAttentionConfig(block_q=block_q, block_k=block_k, topk_ratio=1 - sparsity, dense_diagonal=0)
        mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), config)
        for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4)):
            try:
                ms = median_ms(lambda: triton_kernel.sparse_attention(q, k, v, config, mask=mask, num_warps=warps,
                                                                    num_stages=stages))
                print(f"| {block_q} x {block_k} | {warps} | {stages} | {ms:.2f} |", flush=True)
            except Exception as err:
                print(f"| {block_q} x {block_k} | {warps} | {stages} | {type(err).__name__} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="also write the tables (markdown) here")
    parser.add_argument("--tune", action="store_true", help="time launch settings instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    if args.tune:
        tune()
        return 0
    header = (f"{torch.cuda.get_device_name()}, torch {torch.version.__version__}, CUDA {torch.version.cuda}, "
              f"measured {time.strftime('%Y-%m-%d %H:%M')}")
    print(header, flush=True)
    failures = checks() + captured_checks() + ahead_of_time_checks()
    table = timings()
    if args.out:
        with open(args.out, "w") as out:
            out.write(f"{header}\n\n{table}\n")
    if failures:
        print("FAILED checks:\n" + "\n".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
