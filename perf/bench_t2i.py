"""Text-to-image latency: the served pipeline against diffusers, side by side.

Both run the same model folder, prompt, seed, steps and size in one process
run, alternating request by request so that machine noise hits both alike.
Prints a markdown table with the ratio (diffusers time / served time; above
1 means the served pipeline is faster) and the largest pixel difference.
The served requests are uncached (``cache_policy`` none): the same work as
diffusers; cache reuse has its own benchmark (perf/bench_cache.py).

    python perf/bench_t2i.py                       # the tiny Flux, built on the fly
    python perf/bench_t2i.py --model-dir DIR --repository REPO --name NAME
    python perf/bench_t2i.py --record perf/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, public_instances, record  # noqa: E402

SECTION = "bench_t2i"


def _prepare(args, scratch: Path) -> tuple[Path, Path]:
    from machgen.builder.build import build_repository
    from machgen.builder.model_folder import write_tiny_model
    from machgen.families.registry import get_family

    model_dir = args.model_dir
    if model_dir is None:
        model_dir = write_tiny_model(get_family("flux"), scratch / "tiny-flux")
        print(f"built the tiny Flux in {model_dir}")
    repository = args.repository
    if repository is None:
        repository = scratch / "repository"
        build_repository(model_dir, args.name, repository)
    return model_dir, repository


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="diffusers model folder (default: the tiny Flux)")
    parser.add_argument("--repository", type=Path, help="model repository built from it (default: build one)")
    parser.add_argument("--name", default="flux", help="served model name")
    parser.add_argument("--prompt", default="a red cat at the top left")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the served default)")
    parser.add_argument("--sizes", type=int, nargs="+",
                        help="square image sizes to measure (default: the served default size)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--record", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()

    import numpy as np
    import torch

    from machgen.builder.model_folder import detect_family, load_pipeline
    from machgen.contract.manifest import pipeline_dir
    from machgen.client import MachgenClient
    from machgen.server import Ports, TritonServer

    with tempfile.TemporaryDirectory(prefix="machgen-bench-") as scratch:
        model_dir, repository = _prepare(args, Path(scratch))
        defaults = json.loads((pipeline_dir(repository, args.name) / "pipeline.json").read_text())["defaults"]
        steps = args.steps or defaults["num_inference_steps"]
        sizes = args.sizes or [defaults["height"]]
        pipe = load_pipeline(model_dir, detect_family(model_dir))
        pipe.set_progress_bar_config(disable=True)

        def run_diffusers(seed: int, size: int):
            # The served defaults, spelled out: what a client sending prompt, seed, steps and size gets.
            return np.asarray(pipe(args.prompt, height=size, width=size, num_inference_steps=steps,
                                   guidance_scale=defaults["guidance_scale"],
                                   true_cfg_scale=defaults["true_cfg_scale"],
                                   negative_prompt=defaults["negative_prompt"],
                                   max_sequence_length=defaults["max_sequence_length"],
                                   generator=torch.Generator("cpu").manual_seed(seed)).images[0])

        rows = []
        ports = Ports(free_port(), free_port(), free_port())
        with TritonServer(repository, ports) as server:
            url = server.grpc_url if args.protocol == "grpc" else server.http_url
            with MachgenClient(url, args.protocol) as client:
                def run_served(seed: int, size: int):
                    # Uncached, so both sides do the same work (cache reuse: perf/bench_cache.py).
                    return client.generate(args.name, args.prompt, seed=seed, num_inference_steps=steps,
                                           height=size, width=size, cache_policy="none")[0]

                for size in sizes:
                    for _ in range(2 * public_instances(repository, args.name)):  # warm-up: every instance
                        run_served(0, size)
                    run_diffusers(0, size)  # warm-up: first-call allocations
                    served, baseline, worst_diff = [], [], 0
                    for seed in range(1, args.repeats + 1):
                        start = time.perf_counter()
                        ours = run_served(seed, size)
                        served.append(time.perf_counter() - start)
                        start = time.perf_counter()
                        theirs = run_diffusers(seed, size)
                        baseline.append(time.perf_counter() - start)
                        worst_diff = max(worst_diff, int(np.abs(ours.astype(int) - theirs.astype(int)).max()))
                    served_s, baseline_s = statistics.median(served), statistics.median(baseline)
                    rows.append(f"| {size}x{size} | {baseline_s:.3f} | {served_s:.3f} | "
                                f"**{baseline_s / served_s:.2f}x** | {worst_diff} |")
                    print(rows[-1], flush=True)

    table = "\n".join([
        f"Model `{model_dir.name}`, {steps} steps, protocol {args.protocol}, median of {args.repeats} requests "
        f"each (alternating), {os.cpu_count()} CPU cores ({platform.machine()}), measured "
        f"{time.strftime('%Y-%m-%d %H:%M')}. Ratio = diffusers / served (above 1: served is faster).",
        "",
        "| size | diffusers FluxPipeline (s) | machgen served (s) | ratio | max pixel diff |",
        "| --- | --- | --- | --- | --- |",
        *rows,
    ])
    print(table)
    if args.record:
        record(args.record, f"{SECTION}:{model_dir.name}", table, "Text-to-image latency (perf/bench_t2i.py)")
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
