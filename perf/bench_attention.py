"""SparseAttention on the CPU, in one run: the operator against dense attention.

Three tables:

1. synthetic: video-like q, k, v (plugins/synthetic.py: tokens on a
   frames x height x width grid, attention falling off with distance) at
   N = 4k and 16k tokens; per setting, the share of query-key products the
   mask skips, the relative L2 error against exact float64 attention, and
   the CPU time of the block-skipping reference against torch's dense
   scaled_dot_product_attention (float32) on the same inputs;
2. captured: q, k, v recorded from every attention call of the trained
   model's diffusers pipeline, the same figures per setting;
3. end to end: the trained model built dense and with ``--attention
   sparse-fp8``, both run in-process on the same prompts and seeds (the
   ONNX Runtime target: the operator's masked dense form, so no speed-up
   there): PSNR against dense and prompt accuracy.

    python perf/bench_attention.py
    python perf/bench_attention.py --record perf/RESULTS.md

``--save-captured FILE`` measures nothing: it writes the trained model's
q, k, v of every call of three steps (first, middle, last) at its largest
size, in bfloat16, for the kernel's check on a GPU (perf/gpu_check.sh
--prepare; perf/gpu_attention.py reads it).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import record  # noqa: E402

SECTION = "bench_attention"
# Grids of the synthetic inputs: 4,096 and 16,384 tokens.
SYNTHETIC_GRIDS = ((16, 16, 16), (16, 32, 32))


def settings(block: int, dense_prefix: int = 0):
    from machgen.plugins.schema import SparseAttentionConfig

    base = SparseAttentionConfig(block_q=block, block_k=block, dense_prefix_tokens=dense_prefix)
    return {
        "fp8, no mask": replace(base, topk_ratio=1.0),
        "fp32, topk 0.5": replace(base, topk_ratio=0.5, precision="fp32"),
        "fp8, topk 0.5": replace(base, topk_ratio=0.5),
        "fp8, topk 0.25": replace(base, topk_ratio=0.25),
        "fp8, cdf 0.9": replace(base, mask_method="cdf", cdf_threshold=0.9),
        "fp8, cdf 0.95": replace(base, mask_method="cdf", cdf_threshold=0.95),
    }


def best_time(function, repeats: int) -> tuple[float, object]:
    """(best of ``repeats`` timings, the last result)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result


def measure(q, k, v, config, exact, repeats: int) -> dict:
    from machgen.plugins import reference

    heads_first = q.transpose(1, 2), k.transpose(1, 2)
    mask = reference.block_mask(*heads_first, config)
    oracle = reference.oracle_block_mask(*heads_first, mask, config)
    # Timed as a user calls it: the mask predicted inside.
    seconds, out = best_time(lambda: reference.sparse_attention(q, k, v, config), repeats)
    return {"skipped": reference.skipped_fraction(mask, q.shape[1], k.shape[1], config.block_q, config.block_k),
            "error": reference.relative_l2(out, exact),
            "oracle_error": reference.relative_l2(reference.sparse_attention(q, k, v, config, mask=oracle), exact),
            "seconds": seconds}


def synthetic_table(heads: int, head_dim: int, sharpness: float, block: int) -> str:
    import torch

    from machgen.plugins import reference
    from machgen.plugins.synthetic import video_like_qkv

    lines = []
    for frames, height, width in SYNTHETIC_GRIDS:
        tokens = frames * height * width
        repeats = 3 if tokens <= 4096 else 1
        q, k, v = video_like_qkv(frames, height, width, heads=heads, head_dim=head_dim, sharpness=sharpness)
        exact = reference.dense_attention_float64(q, k, v)
        layout = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        sdpa, sdpa_out = best_time(lambda: torch.nn.functional.scaled_dot_product_attention(*layout), repeats)
        sdpa_out = sdpa_out.transpose(1, 2)
        lines.append(f"| {tokens:,} | dense SDPA, fp32 | 0 % | {reference.relative_l2(sdpa_out, exact):.2e} | - | "
                     f"{sdpa:.3f} | 1.00x |")
        for name, config in settings(block).items():
            row = measure(q, k, v, config, exact, repeats)
            lines.append(f"| {tokens:,} | {name} | {100 * row['skipped']:.1f} % | {row['error']:.2e} | "
                         f"{row['oracle_error']:.2e} | {row['seconds']:.3f} | {sdpa / row['seconds']:.2f}x |")
            print(lines[-1], flush=True)
    return "\n".join([
        f"Synthetic video-like inputs (plugins/synthetic.py, sharpness {sharpness:g}): batch 1, {heads} heads, "
        f"head_dim {head_dim}, blocks of {block} tokens, no dense prefix. Error: relative L2 against exact "
        "float64 attention; oracle: the same with the best mask of the same size (the blocks holding most of the "
        "exact attention), what a perfect predictor would reach. Time: the CPU reference "
        "(plugins/reference.py, torch, gathers only the kept blocks) against torch's dense "
        "scaled_dot_product_attention in float32, best of 3 runs at 4k, one at 16k; ratio above 1: the reference "
        "is faster.",
        "",
        "| tokens | setting | products skipped | rel. L2 error | oracle's | CPU s | vs SDPA |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *lines,
    ])


def captured_activations(model_dir: Path, prompts, size: int, **call):
    """q, k, v of every attention call of the diffusers pipeline at ``size`` px."""
    import diffusers.models.transformers.transformer_flux as flux_module

    from machgen.builder.evaluate import generate_with_diffusers

    calls = []
    original = flux_module.dispatch_attention_fn

    def recording(query, key, value, *args, **kwargs):
        calls.append((query.detach().clone(), key.detach().clone(), value.detach().clone()))
        return original(query, key, value, *args, **kwargs)

    flux_module.dispatch_attention_fn = recording
    try:
        generate_with_diffusers(model_dir, prompts, height=size, width=size, **call)
    finally:
        flux_module.dispatch_attention_fn = original
    return calls


def save_captured(model_dir: Path, text_tokens: int, path: Path, steps: int = 20, size: int = 128) -> None:
    import torch

    from machgen.builder import shapes

    calls = captured_activations(model_dir, shapes.evaluation_prompts(1, seed=5), size, num_inference_steps=steps)
    per_step = len(calls) // steps
    kept = [call for step in (0, steps // 2, steps - 1) for call in calls[step * per_step:(step + 1) * per_step]]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model_dir.name, "text_tokens": text_tokens,
                "calls": [tuple(x.to(torch.bfloat16) for x in call) for call in kept]}, path)
    print(f"wrote {len(kept)} attention calls of {model_dir.name} at {size}x{size} to {path} "
          f"({path.stat().st_size / 2**20:.1f} MiB)")


def captured_table(model_dir: Path, prompts, block: int, text_tokens: int) -> str:
    import numpy as np

    from machgen.plugins import reference

    lines = []
    for size in (64, 128):
        calls = captured_activations(model_dir, prompts, size)
        exact = [reference.dense_attention_float64(q, k, v) for q, k, v in calls]
        for name, config in settings(block, dense_prefix=text_tokens).items():
            rows = [measure(q, k, v, config, want, 1) for (q, k, v), want in zip(calls, exact)]
            lines.append(f"| {size}x{size} | {calls[0][0].shape[1]} | {name} | "
                         f"{100 * np.mean([r['skipped'] for r in rows]):.1f} % | "
                         f"{np.mean([r['error'] for r in rows]):.2e} | {np.max([r['error'] for r in rows]):.2e} | "
                         f"{np.mean([r['oracle_error'] for r in rows]):.2e} |")
            print(lines[-1], flush=True)
    return "\n".join([
        f"Captured from `{model_dir.name}`: q, k, v of every attention call (every block, every step, both CFG "
        f"passes) of diffusers' FluxPipeline on {len(prompts)} prompts at 64x64 (the served default) and "
        f"128x128 (the largest allowed); blocks of {block} tokens, the {text_tokens} text tokens dense.",
        "",
        "| size | tokens | setting | products skipped (mean) | rel. L2 error mean | worst call | oracle's mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *lines,
    ])


def end_to_end_table(model_dir: Path, prompts, attention) -> str:
    import numpy as np

    from machgen.builder.build import build_repository
    from machgen.builder.evaluate import psnr, score
    from machgen.runtime.local import LocalPipeline

    labels = [label for _, _, label in prompts]
    images, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="machgen-bench-attention-") as scratch:
        for kind, options in (("dense", replace(attention, kind="dense")), ("sparse-fp8", attention)):
            repository = Path(scratch) / kind
            build_repository(model_dir, "model", repository, attention=options, log=lambda line: None)
            pipeline = LocalPipeline(repository, "model", intra_op_threads=1)
            start = time.perf_counter()
            images[kind] = [pipeline.generate(prompt, seed=seed, cache_policy="none")[0][0]
                            for prompt, seed, _ in prompts]
            seconds[kind] = (time.perf_counter() - start) / len(prompts)
    scores = [psnr(a, b) for a, b in zip(images["sparse-fp8"], images["dense"])]
    accuracy = {kind: score(found, labels).colour_shape for kind, found in images.items()}
    return "\n".join([
        f"`{model_dir.name}` at its served defaults, {len(prompts)} prompt/seed pairs, uncached, built with "
        f"`--attention sparse-fp8 --attention-block {attention.block} --attention-mask {attention.mask_method}"
        f"{f' --attention-cdf-threshold {attention.cdf_threshold:g}' if attention.mask_method == 'cdf' else ''}"
        f"{f' --attention-topk-ratio {attention.topk_ratio:g}' if attention.mask_method == 'topk' else ''}` "
        "and run in-process on the ONNX Runtime target (the operator's masked dense form: every product is "
        "still computed, so it is slower than dense there).",
        "",
        "| attention | PSNR vs dense, mean (worst) | colour+shape accuracy | s / image |",
        "| --- | --- | --- | --- |",
        f"| dense | - | {100 * accuracy['dense']:.1f} % | {seconds['dense']:.3f} |",
        f"| sparse-fp8 | {np.mean(scores):.1f} dB ({np.min(scores):.1f} dB) | "
        f"{100 * accuracy['sparse-fp8']:.1f} % | {seconds['sparse-fp8']:.3f} |",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("models/shapes-flux"))
    parser.add_argument("--heads", type=int, default=2, help="synthetic: attention heads (CPU time grows with them)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sharpness", type=float, default=12.0, help="synthetic: how local the attention is")
    parser.add_argument("--count", type=int, default=64, help="end to end: prompt/seed pairs")
    parser.add_argument("--block", type=int, default=8, help="trained model: tokens per block (it has 48-96)")
    parser.add_argument("--parts", default="synthetic,captured,end-to-end", help="which tables to measure")
    parser.add_argument("--record", type=Path, help="write the tables into this markdown file")
    parser.add_argument("--save-captured", type=Path, metavar="FILE",
                        help="only write the trained model's q, k, v for perf/gpu_attention.py")
    args = parser.parse_args()
    parts = args.parts.split(",")

    import torch

    from machgen.builder import shapes
    from machgen.builder.build import AttentionOptions, detect_family, load_pipeline, served_defaults

    header = (f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__} with "
              f"{torch.get_num_threads()} threads, measured {time.strftime('%Y-%m-%d %H:%M')}.")
    family = detect_family(args.model_dir)
    text_tokens = family.exporter().dense_attention_tokens(
        served_defaults(args.model_dir, family, load_pipeline(args.model_dir, family)))
    if args.save_captured:
        save_captured(args.model_dir, text_tokens, args.save_captured)
        return 0
    measurements = {
        "synthetic": lambda: synthetic_table(args.heads, args.head_dim, args.sharpness, block=64),
        "captured": lambda: captured_table(args.model_dir, shapes.evaluation_prompts(4, seed=5), args.block,
                                           text_tokens),
        "end-to-end": lambda: end_to_end_table(args.model_dir, shapes.evaluation_prompts(args.count),
                                               AttentionOptions("sparse-fp8", block=args.block)),
    }
    unknown = set(parts) - set(measurements)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(measurements)}")
    tables = {part: measure_part() for part, measure_part in measurements.items() if part in parts}
    for part, table in tables.items():
        table = f"{header}\n\n{table}"
        print(f"\n{part}\n{table}")
        if args.record:
            record(args.record, f"{SECTION}-{part}:{args.model_dir.name}", table,
                   f"Sparse attention, {part} (perf/bench_attention.py)")
    if args.record:
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
