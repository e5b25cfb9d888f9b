"""Cache reuse across steps: our policies served through Triton against
diffusers' own cache hooks on the same model, in one run.

For each setting, over a fixed prompt/seed set at the model's served
defaults: tail evaluations per image (rows through the blocks after the
first: two per step with true CFG, as diffusers makes two passes), mean
end-to-end latency, PSNR and SSIM against the uncached output of the same
stack (served vs served, diffusers vs diffusers), and prompt accuracy.

    python perf/bench_cache.py                      # models/shapes-flux, calibrated defaults
    python perf/bench_cache.py --record perf/RESULTS.md
    python perf/bench_cache.py --holdout --record perf/RESULTS.md

--holdout runs 64 prompt/seed pairs from a generator seed that
`machgen-build calibrate` never uses (neither its fit nor its held-out set),
and checks the served default against diffusers' FluxPipeline run eagerly
(uncached), side by side: PSNR of the served default's images against
diffusers' own, accuracy against diffusers' uncached, end-to-end speed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, public_instances, record  # noqa: E402

SECTION = "bench_cache"
# --holdout's prompt set: a generator seed no calibration uses (builder/calibrate.py FIT_PROMPTS_SEED,
# HOLDOUT_PROMPTS_SEED), so the served default meets prompts it was neither fitted nor reported on.
BENCH_HOLDOUT_SEED = 9001
HOLDOUT_PAIRS = 64
# What the served default must show on it against diffusers eager (issue 25).
PROMISE = {"psnr_mean": 33.0, "psnr_worst": 26.0, "accuracy_points": 2.0, "speedup": 2.5}
SERVED_SETTINGS = [("fbcache", 0.1), ("fbcache", 0.2), ("fbcache", 0.3), ("fbcache", 0.4),
                   ("magcache", 0.1), ("magcache", 0.2), ("magcache", 0.3), ("magcache", 0.4)]


def summarise(stack, name, images, reference, seconds, passes, labels):
    import numpy as np

    from machgen.builder.evaluate import psnr, score, ssim

    psnrs = [psnr(a, b) for a, b in zip(images, reference)]
    accuracy = score(images, labels)
    return {"stack": stack, "setting": f"{stack} {name}", "tail_passes": float(np.mean(passes)),
            "seconds": float(np.mean(seconds)), "psnr_mean": float(np.mean(psnrs)), "psnr_worst": float(np.min(psnrs)),
            "ssim": float(np.mean([ssim(a, b) for a, b in zip(images, reference)])),
            "accuracy": accuracy.colour_shape, "images": images}


def printable(row) -> str:
    return json.dumps({key: value for key, value in row.items() if key != "images"})


def served_rows(repository: Path, name: str, prompts):
    from machgen.client import MachgenClient
    from machgen.server import Ports, TritonServer

    rows, labels = [], [label for _, _, label in prompts]
    settings = [("none", None), *SERVED_SETTINGS, ("default", None)]
    with TritonServer(repository, Ports(free_port(), free_port(), free_port())) as server:
        with MachgenClient(server.grpc_url) as client:
            for _ in range(2 * public_instances(repository, name)):  # warm-up: every instance, both row counts
                for policy in ("none", None):
                    client.generate(name, prompts[0][0], seed=prompts[0][1], cache_policy=policy)
            reference = None
            for policy, threshold in settings:
                images, seconds, passes = [], [], []
                for prompt, seed, _ in prompts:
                    options = {} if policy == "default" else {"cache_policy": policy, "cache_threshold": threshold}
                    start = time.perf_counter()
                    image, stats = client.generate_with_stats(name, prompt, seed=seed, **options)
                    seconds.append(time.perf_counter() - start)
                    images.append(image[0])
                    passes.append(stats["denoiser_tail_passes"])
                label = f"default ({stats['cache_policy']} {stats['cache_threshold']})" if policy == "default" \
                    else (policy if threshold is None else f"{policy} {threshold:g}")
                reference = images if reference is None else reference
                rows.append(summarise("machgen", label, images, reference, seconds, passes, labels))
                print(printable(rows[-1]), flush=True)
    return rows


def in_process_rows(repository: Path, name: str, prompts):
    """The same repository without Triton (machgen/runtime/local.py): what the served
    path costs on top of the components' own work."""
    from machgen.runtime.local import LocalPipeline

    pipeline = LocalPipeline(repository, name)
    pipeline.generate(prompts[0][0], seed=prompts[0][1])  # warm-up: sessions and first-call allocations
    rows, reference, labels = [], None, [label for _, _, label in prompts]
    for policy in ("none", None):
        images, seconds, passes = [], [], []
        for prompt, seed, _ in prompts:
            start = time.perf_counter()
            image, stats = pipeline.generate(prompt, seed=seed, cache_policy=policy)
            seconds.append(time.perf_counter() - start)
            images.append(image[0])
            passes.append(stats.denoiser_tail_passes)
        reference = images if reference is None else reference
        label = "none" if policy else f"default ({stats.cache_policy} {stats.cache_threshold})"
        rows.append(summarise("machgen in-process", label, images, reference, seconds, passes, labels))
        print(printable(rows[-1]), flush=True)
    return rows


def diffusers_rows(model_dir: Path, prompts):
    import numpy as np
    import torch
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    from machgen.builder.model_folder import detect_family, load_pipeline, served_defaults

    family = detect_family(model_dir)
    pipe = load_pipeline(model_dir, family)
    pipe.set_progress_bar_config(disable=True)
    defaults = served_defaults(model_dir, family, pipe)
    transformer = pipe.transformer
    passes = [0]
    # Counts real evaluations of the blocks after the first: cached blocks never reach their inner layers.
    transformer.transformer_blocks[1].attn.to_q.register_forward_hook(
        lambda *_: passes.__setitem__(0, passes[0] + 1))

    def run(prompt, seed):
        image = pipe(prompt, height=defaults.height, width=defaults.width,
                     num_inference_steps=defaults.num_inference_steps, guidance_scale=defaults.guidance_scale,
                     true_cfg_scale=defaults.true_cfg_scale, negative_prompt=defaults.negative_prompt,
                     max_sequence_length=defaults.max_sequence_length,
                     generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images[0]
        return (image * 255).round().astype(np.uint8)

    steps = defaults.num_inference_steps
    # diffusers' own MagCache calibration: it prints the ratios of each CFG branch at the end of a run.
    transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for prompt, seed, _ in prompts[:8]:
            run(prompt, seed)
    transformer.disable_cache()
    ratios = np.mean([json.loads(m) for m in re.findall(r"^\[[^\]]*\]$", printed.getvalue(), re.M)], axis=0)

    settings = [("none", None)]
    settings += [(f"FirstBlockCache {t:g}", FirstBlockCacheConfig(threshold=t)) for t in (0.05, 0.1, 0.2, 0.3)]
    settings += [(f"MagCache {t:g}", MagCacheConfig(threshold=t, num_inference_steps=steps,
                                                    mag_ratios=ratios.tolist())) for t in (0.06, 0.12, 0.24)]
    settings += [(f"TaylorSeer lite, interval {n}", TaylorSeerCacheConfig(
        cache_interval=n, disable_cache_before_step=3, max_order=1, use_lite_mode=True,
        taylor_factors_dtype=torch.float32)) for n in (2, 3, 5)]
    rows, reference, labels = [], None, [label for _, _, label in prompts]
    run(prompts[0][0], prompts[0][1])  # warm-up
    for name, config in settings:
        if config is not None:
            transformer.enable_cache(config)
        images, seconds, counted = [], [], []
        for prompt, seed, _ in prompts:
            passes[0] = 0
            start = time.perf_counter()
            images.append(run(prompt, seed))
            seconds.append(time.perf_counter() - start)
            counted.append(passes[0])
        if config is not None:
            transformer.disable_cache()
        reference = images if reference is None else reference
        rows.append(summarise("diffusers", name, images, reference, seconds, counted, labels))
        print(printable(rows[-1]), flush=True)
    return rows


def holdout_prompts(count: int):
    """``count`` pairs no calibration saw: refused if any is in calibrate's default sets."""
    from machgen.datasets import shapes
    from machgen.builder.calibrate import FIT_PAIRS, FIT_PROMPTS_SEED, HOLDOUT_PAIRS as CALIBRATION_HOLDOUT, \
        HOLDOUT_PROMPTS_SEED

    prompts = shapes.evaluation_prompts(count, seed=BENCH_HOLDOUT_SEED)
    calibration = {(prompt, seed) for size, generator in ((FIT_PAIRS, FIT_PROMPTS_SEED),
                                                           (CALIBRATION_HOLDOUT, HOLDOUT_PROMPTS_SEED))
                   for prompt, seed, _ in shapes.evaluation_prompts(size, seed=generator)}
    shared = calibration & {(prompt, seed) for prompt, seed, _ in prompts}
    assert not shared, f"pairs calibration used: {sorted(shared)}"
    return prompts


def promise_lines(rows) -> list[str]:
    """The served default against diffusers eager (uncached) on the same pairs."""
    import numpy as np

    from machgen.builder.evaluate import psnr

    default = next(r for r in rows if r["setting"].startswith("machgen default"))
    served_none = next(r for r in rows if r["setting"] == "machgen none")
    eager = next(r for r in rows if r["setting"] == "diffusers none")
    lines = []
    for row in (default, served_none):
        scores = [psnr(a, b) for a, b in zip(row["images"], eager["images"])]
        mean, worst = float(np.mean(scores)), float(np.min(scores))
        speedup = eager["seconds"] / row["seconds"]
        points = 100 * (row["accuracy"] - eager["accuracy"])
        holds = (mean >= PROMISE["psnr_mean"] and worst >= PROMISE["psnr_worst"]
                 and abs(points) <= PROMISE["accuracy_points"] and speedup >= PROMISE["speedup"])
        lines.append(f"| {row['setting']} | {mean:.2f} ({worst:.2f}) | {100 * row['accuracy']:.1f} % vs "
                     f"{100 * eager['accuracy']:.1f} % ({points:+.1f} points) | {row['seconds']:.3f} vs "
                     f"{eager['seconds']:.3f} | {speedup:.2f}x | {'yes' if holds else 'no'} |")
    return [
        "",
        "Against diffusers' FluxPipeline run eagerly (uncached) on the same pairs: PSNR of our images against its "
        f"images; the promise: mean >= {PROMISE['psnr_mean']:g} dB, worst >= {PROMISE['psnr_worst']:g} dB, "
        f"accuracy within {PROMISE['accuracy_points']:g} points, at least {PROMISE['speedup']:g}x faster.",
        "",
        "| served | PSNR vs diffusers eager, mean (worst) dB | colour+shape | s / image | faster | holds |",
        "| --- | --- | --- | --- | --- | --- |",
        *lines,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("models/shapes-flux"))
    parser.add_argument("--repository", type=Path, help="model repository built from it (default: build one)")
    parser.add_argument("--name", default="shapes", help="served model name")
    parser.add_argument("--count", type=int, help=f"prompt/seed pairs (default: 32; {HOLDOUT_PAIRS} with --holdout)")
    parser.add_argument("--holdout", action="store_true",
                        help="pairs no calibration used, and the served default against diffusers eager")
    parser.add_argument("--record", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()

    from machgen.datasets import shapes
    from machgen.builder.build import build_repository

    if args.holdout:
        prompts = holdout_prompts(args.count or HOLDOUT_PAIRS)
    else:
        prompts = shapes.evaluation_prompts(args.count or 32)
    with tempfile.TemporaryDirectory(prefix="machgen-bench-cache-") as scratch:
        repository = args.repository
        if repository is None:
            repository = Path(scratch) / "repository"
            build_repository(args.model_dir, args.name, repository)
        rows = served_rows(repository, args.name, prompts)
        rows += in_process_rows(repository, args.name, prompts)
    rows += diffusers_rows(args.model_dir, prompts)

    baseline = {r["stack"]: r for r in rows if r["setting"] == f"{r['stack']} none"}
    lines = []
    for r in rows:
        base = baseline[r["stack"]]
        quality = "-" if r is base else f"{r['psnr_mean']:.1f} ({r['psnr_worst']:.1f}) | {r['ssim']:.4f}"
        if r is base:
            quality += " | -"
        lines.append(f"| {r['setting']} | {r['tail_passes']:.1f} | {base['tail_passes'] / r['tail_passes']:.2f}x | "
                     f"{r['seconds']:.3f} | {base['seconds'] / r['seconds']:.2f}x | {quality} | "
                     f"{100 * r['accuracy']:.1f} % |")
    pairs = (f"{len(prompts)} prompt/seed pairs from generator seed {BENCH_HOLDOUT_SEED}, which no calibration uses"
             if args.holdout else f"{len(prompts)} prompt/seed pairs")
    table = "\n".join([
        f"Model `{args.model_dir.name}` at its served defaults, {pairs}, "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), measured {time.strftime('%Y-%m-%d %H:%M')}. "
        "Quality is against the uncached output of the same stack; speed-ups are against that stack's uncached "
        "run. machgen: served through Triton, end to end; machgen in-process: the same repository run by "
        "machgen/runtime/local.py without Triton. diffusers: FluxPipeline with its cache hooks "
        "(MagCache ratios from diffusers' own calibration mode).",
        "",
        "| setting | tail passes / image | fewer | s / image | faster | PSNR mean (worst) dB | SSIM | "
        "colour+shape |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *lines,
        *(promise_lines(rows) if args.holdout else []),
    ])
    print(table)
    if args.record:
        section = f"{SECTION}{'-holdout' if args.holdout else ''}:{args.model_dir.name}"
        title = "Cache reuse on held-out prompts (perf/bench_cache.py --holdout)" if args.holdout \
            else "Cache reuse (perf/bench_cache.py)"
        record(args.record, section, table, title)
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
