"""SparseAttention on the CPU, in one run: the operator against dense attention.

Four tables:

1. synthetic: video-like q, k, v (plugins/synthetic.py: tokens on a
   frames x height x width grid, attention falling off with distance) at
   N = 4k and 16k tokens; per setting, the share of query-key products the
   mask skips, the relative L2 error against exact float64 attention, and
   the CPU time of the block-skipping reference against torch's dense
   scaled_dot_product_attention (float32) on the same inputs;
2. captured: q, k, v recorded from every self-attention call of a trained
   model's diffusers pipeline (the image default, or with ``--model-dir
   models/shapes-wan`` the video default) at its served size and at the
   largest it serves, the same figures per setting;
3. share: the share of the transformer's time its self-attention takes, at
   both sizes;
4. end to end: the trained model built dense and with ``--attention
   sparse-fp8``, both run in-process on the same prompts and seeds (the
   ONNX Runtime target: the operator's masked dense form, so no speed-up
   there): PSNR against dense and prompt accuracy (a video: colour, shape
   and direction).

    python perf/bench_attention.py
    python perf/bench_attention.py --model-dir models/shapes-wan --parts captured,share,end-to-end --count 32
    python perf/bench_attention.py --record perf/RESULTS.md

``--save-captured FILE`` measures nothing: it writes the trained model's
q, k, v of every call of three steps (first, middle, last) at its largest
size, in bfloat16, for the kernel's check on a GPU (perf/gpu_check.sh
--prepare; perf/gpu_attention.py reads it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class TrainedModel:
    """What the captured and end-to-end tables need of a trained model: an
    image model (shapes) or a video model (moving shapes), its prompts, its
    default and largest sizes, diffusers' outputs and their accuracy."""

    model_dir: Path
    attention_modules: tuple
    defaults: object  # ServedDefaults
    text_tokens: int

    @classmethod
    def load(cls, model_dir: Path) -> "TrainedModel":
        from machgen.builder.model_folder import detect_family, load_pipeline, served_defaults

        family = detect_family(model_dir)
        exporter = family.exporter()
        defaults = served_defaults(model_dir, family, load_pipeline(model_dir, family))
        return cls(model_dir, exporter.attention_modules, defaults, exporter.dense_attention_tokens(defaults))

    @property
    def video(self) -> bool:
        return self.defaults.max_frames > 1

    def prompts(self, count: int, seed: int | None = None):
        from machgen.datasets import moving_shapes, shapes

        dataset = moving_shapes if self.video else shapes
        return dataset.evaluation_prompts(count) if seed is None else dataset.evaluation_prompts(count, seed=seed)

    def sizes(self) -> list[dict]:
        """The served default's size and the largest the model serves (video: with their frame counts)."""
        d = self.defaults
        default, largest = dict(height=d.height, width=d.width), dict(height=d.max_height, width=d.max_width)
        if self.video:
            default["num_frames"], largest["num_frames"] = d.num_frames, d.max_frames
        return [default, largest]

    @staticmethod
    def size_label(size: dict) -> str:
        label = f"{size['width']}x{size['height']}"
        return f"{label}x{size['num_frames']}" if "num_frames" in size else label

    def generate_with_diffusers(self, prompts, **call):
        from machgen.builder.evaluate import generate_videos_with_diffusers, generate_with_diffusers

        if self.video:
            return generate_videos_with_diffusers(self.model_dir, prompts, **call)
        return generate_with_diffusers(self.model_dir, prompts, **call)

    def accuracy(self, outputs, prompts) -> float:
        """Colour and shape, and for a video its direction too, read right."""
        from machgen.builder.evaluate import score, score_motion

        labels = [label for _, _, label in prompts]
        return score_motion(outputs, labels).all_three if self.video else score(outputs, labels).colour_shape


@contextlib.contextmanager
def self_attention_recorded(model: TrainedModel, keep: bool = True):
    """Inside the block, every self-attention call the sparse swap would take
    runs torch's SDPA and is recorded: (q, k, v) when ``keep``, and its seconds."""
    import torch

    from machgen.plugins.ops import dispatch_swapped

    calls, seconds = [], []

    def recording(query, key, value, scale):
        if keep:
            calls.append((query.detach().clone(), key.detach().clone(), value.detach().clone()))
        start = time.perf_counter()
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (query, key, value)), scale=scale).transpose(1, 2)
        seconds.append(time.perf_counter() - start)
        return out

    with dispatch_swapped(model.attention_modules, recording):
        yield calls, seconds


def captured_activations(model: TrainedModel, prompts, size: dict, **call):
    """q, k, v of every self-attention call of the diffusers pipeline at ``size``."""
    with self_attention_recorded(model) as (calls, _):
        model.generate_with_diffusers(prompts, **size, **call)
    return calls


def save_captured(model: TrainedModel, path: Path, steps: int = 20) -> None:
    import torch

    size = model.sizes()[-1]
    calls = captured_activations(model, model.prompts(1, seed=5), size, num_inference_steps=steps)
    per_step = len(calls) // steps
    kept = [call for step in (0, steps // 2, steps - 1) for call in calls[step * per_step:(step + 1) * per_step]]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.model_dir.name, "text_tokens": model.text_tokens,
                "calls": [tuple(x.to(torch.bfloat16) for x in call) for call in kept]}, path)
    print(f"wrote {len(kept)} attention calls of {model.model_dir.name} at {model.size_label(size)} to {path} "
          f"({path.stat().st_size / 2**20:.1f} MiB)")


def captured_table(model: TrainedModel, prompts, block: int) -> str:
    import numpy as np

    from machgen.plugins import reference

    lines = []
    for size in model.sizes():
        calls = captured_activations(model, prompts, size)
        exact = [reference.dense_attention_float64(q, k, v) for q, k, v in calls]
        for name, config in settings(block, dense_prefix=model.text_tokens).items():
            rows = [measure(q, k, v, config, want, 1) for (q, k, v), want in zip(calls, exact)]
            lines.append(f"| {model.size_label(size)} | {calls[0][0].shape[1]} | {name} | "
                         f"{100 * np.mean([r['skipped'] for r in rows]):.1f} % | "
                         f"{np.mean([r['error'] for r in rows]):.2e} | {np.max([r['error'] for r in rows]):.2e} | "
                         f"{np.mean([r['oracle_error'] for r in rows]):.2e} |")
            print(lines[-1], flush=True)
    sizes = " and ".join(f"{model.size_label(size)} ({kind})" for size, kind in
                         zip(model.sizes(), ("the served default", "the largest allowed")))
    return "\n".join([
        f"Captured from `{model.model_dir.name}`: q, k, v of every self-attention call (every block, every step, "
        f"both CFG passes) of its diffusers pipeline on {len(prompts)} prompts at {sizes}; blocks of {block} "
        f"tokens, {f'the {model.text_tokens} text tokens dense' if model.text_tokens else 'no dense prefix'}.",
        "",
        "| size | tokens | setting | products skipped (mean) | rel. L2 error mean | worst call | oracle's mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *lines,
    ])


def attention_share_table(model: TrainedModel, prompts, steps: int = 4) -> str:
    """The share of the transformer's time that its self-attention takes, per size (diffusers, eager)."""
    import diffusers
    import torch

    class_name = json.loads((model.model_dir / "transformer" / "config.json").read_text())["_class_name"]
    transformer_class = getattr(diffusers, class_name)
    lines = []
    for size in model.sizes():
        forward = [0.0]
        original = transformer_class.forward

        def timed(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                forward[0] += time.perf_counter() - start

        transformer_class.forward = timed
        try:
            with self_attention_recorded(model, keep=False) as (_, seconds), torch.inference_mode():
                model.generate_with_diffusers(prompts, num_inference_steps=steps, **size)
        finally:
            transformer_class.forward = original
        lines.append(f"| {model.size_label(size)} | {len(seconds)} | {sum(seconds):.2f} | {forward[0]:.2f} | "
                     f"**{100 * sum(seconds) / forward[0]:.0f} %** |")
        print(lines[-1], flush=True)
    return "\n".join([
        f"`{model.model_dir.name}` in diffusers, eager, float32, {len(prompts)} prompts of {steps} steps each: "
        "the time of the self-attention calls the sparse swap takes (torch's SDPA) against the time of the "
        "transformer's forwards that hold them.",
        "",
        "| size | self-attention calls | attention s | transformer s | share |",
        "| --- | --- | --- | --- | --- |",
        *lines,
    ])


def end_to_end_table(model: TrainedModel, prompts, attention) -> str:
    import numpy as np

    from machgen.builder.build import build_repository
    from machgen.builder.evaluate import psnr
    from machgen.runtime.local import LocalPipeline

    outputs, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="machgen-bench-attention-") as scratch:
        for kind, options in (("dense", replace(attention, kind="dense")), ("sparse-fp8", attention)):
            repository = Path(scratch) / kind
            build_repository(model.model_dir, "model", repository, attention=options, log=lambda line: None)
            pipeline = LocalPipeline(repository, "model", intra_op_threads=1)
            start = time.perf_counter()
            made = [pipeline.generate(prompt, seed=seed, cache_policy="none")[0] for prompt, seed, _ in prompts]
            outputs[kind] = np.stack(made if model.video else [frames[0] for frames in made])
            seconds[kind] = (time.perf_counter() - start) / len(prompts)
    scores = [psnr(a, b) for a, b in zip(outputs["sparse-fp8"], outputs["dense"])]
    accuracy = {kind: model.accuracy(found, prompts) for kind, found in outputs.items()}
    what = "colour, shape and direction" if model.video else "colour+shape"
    unit = "clip" if model.video else "image"
    return "\n".join([
        f"`{model.model_dir.name}` at its served defaults, {len(prompts)} prompt/seed pairs, uncached, built with "
        f"`--attention sparse-fp8 --attention-block {attention.block} --attention-mask {attention.mask_method}"
        f"{f' --attention-cdf-threshold {attention.cdf_threshold:g}' if attention.mask_method == 'cdf' else ''}"
        f"{f' --attention-topk-ratio {attention.topk_ratio:g}' if attention.mask_method == 'topk' else ''}` "
        "and run in-process on the ONNX Runtime target (the operator's masked dense form: every product is "
        "still computed, so it is slower than dense there). PSNR per " + unit + (" over all its frames" if model.video
                                                                               else "") + ".",
        "",
        f"| attention | PSNR vs dense, mean (worst) | {what} accuracy | s / {unit} |",
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
    parser.add_argument("--captured-count", type=int, default=4,
                        help="captured: prompts whose every attention call is measured (a video's largest size "
                             "has thousands of tokens a call)")
    parser.add_argument("--block", type=int, default=8, help="trained model: tokens per block (it has 48-96)")
    parser.add_argument("--parts", default="synthetic,captured,share,end-to-end", help="which tables to measure")
    parser.add_argument("--record", type=Path, help="write the tables into this markdown file")
    parser.add_argument("--save-captured", type=Path, metavar="FILE",
                        help="only write the trained model's q, k, v for perf/gpu_attention.py")
    args = parser.parse_args()
    parts = args.parts.split(",")

    import torch

    from machgen.builder.build import AttentionOptions

    header = (f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__} with "
              f"{torch.get_num_threads()} threads, measured {time.strftime('%Y-%m-%d %H:%M')}.")
    model = TrainedModel.load(args.model_dir)
    if args.save_captured:
        save_captured(model, args.save_captured)
        return 0
    measurements = {
        "synthetic": lambda: synthetic_table(args.heads, args.head_dim, args.sharpness, block=64),
        "captured": lambda: captured_table(model, model.prompts(args.captured_count, seed=5), args.block),
        "share": lambda: attention_share_table(model, model.prompts(2, seed=5)),
        "end-to-end": lambda: end_to_end_table(model, model.prompts(args.count),
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
