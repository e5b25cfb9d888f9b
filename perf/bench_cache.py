"""Cache reuse across steps: our policies served through Triton against
diffusers' own cache hooks on the same model, in one run.

For each setting, over a fixed prompt/seed set at the model's served
defaults: tail evaluations per image (rows through the blocks after the
first: two per step with true CFG, as diffusers makes two passes), mean
end-to-end latency, PSNR and SSIM against the uncached output of the same
stack (served vs served, diffusers vs diffusers), and prompt accuracy.

    python perf/bench_cache.py                      # models/shapes-flux, calibrated defaults
    python perf/bench_cache.py --record perf/RESULTS.md
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
SERVED_SETTINGS = [("fbcache", 0.1), ("fbcache", 0.2), ("fbcache", 0.3), ("fbcache", 0.4),
                   ("magcache", 0.1), ("magcache", 0.2), ("magcache", 0.3), ("magcache", 0.4)]


def summarise(stack, name, images, reference, seconds, passes, labels):
    import numpy as np

    from machgen.builder.evaluate import psnr, score, ssim

    psnrs = [psnr(a, b) for a, b in zip(images, reference)]
    accuracy = score(images, labels)
    return {"stack": stack, "setting": f"{stack} {name}", "tail_passes": float(np.mean(passes)), "seconds": float(np.mean(seconds)),
            "psnr_mean": float(np.mean(psnrs)), "psnr_worst": float(np.min(psnrs)),
            "ssim": float(np.mean([ssim(a, b) for a, b in zip(images, reference)])),
            "accuracy": accuracy.colour_shape}


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
                print(json.dumps(rows[-1]), flush=True)
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
        print(json.dumps(rows[-1]), flush=True)
    return rows


def diffusers_rows(model_dir: Path, prompts):
    import numpy as np
    import torch
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    from machgen.builder.build import detect_family, load_pipeline, served_defaults

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
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("models/shapes-flux"))
    parser.add_argument("--repository", type=Path, help="model repository built from it (default: build one)")
    parser.add_argument("--name", default="shapes", help="served model name")
    parser.add_argument("--count", type=int, default=32, help="prompt/seed pairs")
    parser.add_argument("--record", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()

    from machgen.builder import shapes
    from machgen.builder.build import build_repository

    prompts = shapes.evaluation_prompts(args.count)
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
    table = "\n".join([
        f"Model `{args.model_dir.name}` at its served defaults, {len(prompts)} prompt/seed pairs, "
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
    ])
    print(table)
    if args.record:
        record(args.record, f"{SECTION}:{args.model_dir.name}", table, "Cache reuse (perf/bench_cache.py)")
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
