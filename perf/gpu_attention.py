"""SparseAttention on a CUDA GPU: check the Triton kernel, then time it
against dense attention. Run by perf/gpu_check.sh; needs torch with CUDA and
OpenAI Triton, nothing else of machgen's dependencies.

Checks (printed, and the script exits non-zero when one fails): the kernel
in fp8_e4m3, bf16 and fp32 against the operator's float32 reference
(plugins/reference.py, the same mask) on random and on video-like inputs:
no NaN, and an error at most 1.25x that of the reference rounding the same
way.

Timing: CUDA events after warm-up, median of the repeats; batch 1, 24
heads, head_dim 128, bf16 inputs; dense is torch's
scaled_dot_product_attention (bf16, the flash backend where available);
ours is the whole operator (mask prediction, FP8 quantization, kernel) and
the kernel alone; sparsity by a top-k mask without dense blocks.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402

TOKENS = (4096, 16384, 32768, 65536)
SPARSITIES = (0.0, 0.5, 0.75, 0.9)
HEADS, HEAD_DIM = 24, 128


def checks() -> list[str]:
    from machgen.plugins import reference, triton_kernel
    from machgen.plugins.schema import SparseAttentionConfig
    from machgen.plugins.synthetic import video_like_qkv

    failures = []
    lines = ["| inputs | precision | kernel vs float32 (rel. L2) | reference in that precision vs float32 | "
             "kernel vs that reference | NaN |", "| --- | --- | --- | --- | --- | --- |"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    random_inputs = tuple(torch.randn(1, 4096, HEADS, HEAD_DIM, device="cuda", generator=gen) for _ in range(3))
    video_inputs = tuple(x.cuda() for x in video_like_qkv(16, 16, 16, heads=HEADS, head_dim=HEAD_DIM, sharpness=12))
    # The kernel must be as accurate as the operator's definition (the reference rounding the same way): its
    # error against float32 at most 1.25x the reference's, plus 1e-4. They round the probabilities against
    # different maxima (the running one, the final one), so they do not agree bit for bit.
    precisions = ("fp8_e4m3", "bf16", "fp32")
    for name, (q, k, v) in (("random 4k", random_inputs), ("video-like 4k", video_inputs)):
        base = SparseAttentionConfig(block_q=64, block_k=64, topk_ratio=0.5)
        mask = reference.block_mask(q.transpose(1, 2), k.transpose(1, 2), base)
        want = reference.sparse_attention(q, k, v, replace(base, precision="fp32"), mask=mask)
        for precision in precisions:
            config = replace(base, precision=precision)
            try:
                got = triton_kernel.sparse_attention(q, k, v, config, mask=mask)
            except Exception as err:  # a kernel that does not compile here is a failed check, not the end
                lines.append(f"| {name} | {precision} | {type(err).__name__}: {str(err)[:200]} | - | - | - |")
                failures.append(lines[-1])
                continue
            same_rounding = reference.sparse_attention(q, k, v, config, mask=mask)
            error, allowed = reference.relative_l2(got, want), 1.25 * reference.relative_l2(same_rounding, want) + 1e-4
            nan = bool(torch.isnan(got).any())
            lines.append(f"| {name} | {precision} | {error:.2e} | {allowed - 1e-4:.2e} | "
                         f"{reference.relative_l2(got, same_rounding):.2e} | {'yes' if nan else 'no'} |")
            if nan or not error <= allowed:
                failures.append(lines[-1])
    print("\n".join(lines), flush=True)
    return failures


def timings() -> str:
    from machgen.plugins import reference, triton_kernel
    from machgen.plugins.schema import SparseAttentionConfig

    lines = ["| tokens | sparsity | dense SDPA bf16 ms | ours ms (kernel) | speed-up | kernel TFLOP/s (kept) |",
             "| --- | --- | --- | --- | --- | --- |"]
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
                kernel_ms = median_ms(lambda: triton_kernel.sparse_attention(q, k, v, config, mask=mask))
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
    failures = checks()
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
