"""Per-request LoRA adapters against a fused build and no adapter, and a mixed batch against a same-adapter batch,
measured side by side in one run on one Triton server (one repository, three builds of one model).

    .venv/bin/python perf/bench_lora.py                     # models/shapes-flux with its committed adapters
    .venv/bin/python perf/bench_lora.py --requests 32 --concurrency 8 --record perf/RESULTS.md

Builds (export cache shared): ``plain`` (--max-lora-rank 0), ``adapted`` (--max-lora-rank R, the committed
adapters added with machgen-build lora add) and ``fused`` (--lora: the first adapter fused into the weights).
Measured, in this order:
1. one request at a time (the model card's settings, uncached so each request runs every step): plain with no
   adapter, adapted with no adapter (what the adapter inputs cost when none is asked), adapted with the first
   adapter per request, fused; and diffusers' FluxPipeline with every adapter loaded, switching per request with
   set_adapters (how diffusers serves several adapters);
2. throughput at ``--concurrency``: every request with the same adapter, then requests cycling through no
   adapter, each adapter alone and all of them mixed (different adapters batched in one denoiser forward), with
   the rows per denoiser forward from Triton's statistics;
3. every served image checked against the first one for its request, within 2/255 (batched with others, a
   request's rows may round differently).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "lora"
ADAPTERS = {"orange": ROOT / "models" / "shapes-flux-orange-lora", "gray": ROOT / "models" / "shapes-flux-gray-lora"}
PROMPTS = {"": "a red circle at the top left", "orange": "a orange square at the bottom right",
           "gray": "a gray triangle at the center"}


def _prompt(adapters: dict[str, float]) -> str:
    return PROMPTS[next(iter(adapters), "")]


def _lora(adapters: dict[str, float]) -> dict:
    return {"lora": list(adapters), "lora_scale": list(adapters.values())} if adapters else {}


# Batched with other requests, a request's rows go through other kernels than alone: its pixels may move by a
# rounding step (the tests' tolerance).
MAX_PIXEL_DIFF = 2


def _check(seen: dict, key: tuple, image: np.ndarray) -> None:
    if key in seen:
        diff = int(np.abs(seen[key].astype(int) - image.astype(int)).max())
        assert diff <= MAX_PIXEL_DIFF, f"{key}: a different image ({diff}/255)"
    seen.setdefault(key, image)


def sequential(url: str, model: str, adapters: dict[str, float], requests: int, seen: dict) -> list[float]:
    from machgen.client import MachgenClient

    latencies = []
    with MachgenClient(url) as client:
        for index in range(requests + 2):
            started = time.perf_counter()
            image = client.generate(model, _prompt(adapters), seed=index % 4, cache_policy="none", **_lora(adapters))
            if index >= 2:  # two warm-up requests
                latencies.append(time.perf_counter() - started)
            _check(seen, (model, tuple(adapters.items()), index % 4), image)
    return latencies


def concurrent(url: str, model: str, sets: list[dict[str, float]], requests: int, concurrency: int,
               seen: dict) -> tuple[float, float]:
    """Requests per second and rows per denoiser-tail forward, ``requests`` cycling through ``sets``."""
    from machgen.client import MachgenClient

    local = threading.local()

    def one(index: int) -> None:
        if not hasattr(local, "client"):
            local.client = MachgenClient(url)
        adapters = sets[index % len(sets)]
        image = local.client.generate(model, _prompt(adapters), seed=index % 4, cache_policy="none",
                                      **_lora(adapters))
        _check(seen, (model, tuple(adapters.items()), index % 4), image)

    with MachgenClient(url) as client:
        rows_before, forwards_before = client.rows_and_forwards(f"{model}_denoiser_tail")
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))
        seconds = time.perf_counter() - started
        rows, forwards = client.rows_and_forwards(f"{model}_denoiser_tail")
    return requests / seconds, (rows - rows_before) / max(forwards - forwards_before, 1)


def diffusers_switching(model_dir: Path, adapters: dict[str, Path], requests: int, settings: dict) -> list[float]:
    """diffusers' FluxPipeline with every adapter loaded, each request choosing its own with set_adapters."""
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for name, folder in adapters.items():
        pipe.load_lora_weights(folder, adapter_name=name)
    names = list(adapters)
    latencies = []
    for index in range(requests + 2):
        name = names[index % len(names)]
        started = time.perf_counter()
        pipe.set_adapters([name], adapter_weights=[1.0])
        pipe(PROMPTS[name], generator=torch.Generator().manual_seed(index % 4), **settings)
        if index >= 2:
            latencies.append(time.perf_counter() - started)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "shapes-flux")
    parser.add_argument("--requests", type=int, default=24, help="per measurement")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=32)
    parser.add_argument("--record", type=Path, help="write the table into this file (perf/RESULTS.md)")
    args = parser.parse_args()

    from machgen.builder.adapters import add_adapter
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions
    from machgen.contract.manifest import PipelineManifest, pipeline_dir
    from machgen.server import Ports, TritonServer

    adapters = {name: folder for name, folder in ADAPTERS.items() if folder.is_dir()}
    first = next(iter(adapters))
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as scratch:
        repository = Path(scratch) / "repository"
        options = ServingOptions(in_flight=args.concurrency)
        build_repository(args.model_dir, "plain", repository, options=options, log=lambda line: None, preview=False)
        build_repository(args.model_dir, "adapted", repository, log=lambda line: None, preview=False,
                         options=ServingOptions(in_flight=args.concurrency, max_lora_rank=args.max_lora_rank))
        for name, folder in adapters.items():
            add_adapter(repository, name, folder, pipeline="adapted")
        build_repository(args.model_dir, "fused", repository, options=options, lora=adapters[first],
                         log=lambda line: None, preview=False)
        defaults = PipelineManifest.read(pipeline_dir(repository, "plain")).defaults
        seen: dict = {}
        rows = []
        with TritonServer(repository, Ports(free_port(), free_port(), free_port())) as server:
            url = server.grpc_url
            single = {
                "plain build, no adapter": sequential(url, "plain", {}, args.requests, seen),
                "adapted build, no adapter": sequential(url, "adapted", {}, args.requests, seen),
                f"adapted build, {first} per request": sequential(url, "adapted", {first: 1.0}, args.requests, seen),
                f"fused build ({first} in the weights)": sequential(url, "fused", {}, args.requests, seen),
            }
            same = concurrent(url, "adapted", [{first: 1.0}], args.requests, args.concurrency, seen)
            mixed_sets = [{}] + [{name: 1.0} for name in adapters] + [{name: 0.5 for name in adapters}]
            mixed = concurrent(url, "adapted", mixed_sets, args.requests, args.concurrency, seen)
        switching = diffusers_switching(args.model_dir, adapters, max(args.requests // 2, 4), dict(
            height=defaults.height, width=defaults.width, num_inference_steps=defaults.num_inference_steps,
            guidance_scale=defaults.guidance_scale, max_sequence_length=defaults.max_sequence_length))

    base = statistics.median(single["plain build, no adapter"])
    rows.append("| one request at a time | median ms | vs plain build |")
    rows.append("| --- | --- | --- |")
    for label, latencies in single.items():
        median = statistics.median(latencies)
        rows.append(f"| {label} | {median * 1000:.1f} | {median / base:.2f}x |")
    median = statistics.median(switching)
    rows.append(f"| diffusers FluxPipeline, set_adapters per request ({', '.join(adapters)}) | {median * 1000:.1f} | "
                f"{median / base:.2f}x |")
    rows.append("")
    rows.append(f"| {args.requests} requests at concurrency {args.concurrency}, adapted build | requests/s | "
                "rows per denoiser forward |")
    rows.append("| --- | --- | --- |")
    rows.append(f"| all with {first} | {same[0]:.2f} | {same[1]:.2f} |")
    rows.append(f"| mixed: none, {', '.join(adapters)} alone, all at 0.5 | {mixed[0]:.2f} | {mixed[1]:.2f} |")
    rows.append(f"| mixed / same | {mixed[0] / same[0]:.2f}x | |")
    table = "\n".join(rows) + (f"\n\n{args.model_dir.name}, {defaults.num_inference_steps} steps at "
                               f"{defaults.width}x{defaults.height}, uncached; {platform.processor() or 'CPU'}, "
                               f"{os.cpu_count()} cores; every repeated request gave its first image within 2/255.")
    print(table)
    if args.record:
        record(args.record, f"{SECTION}:{args.model_dir.name}", table, "Per-request LoRA adapters")


if __name__ == "__main__":
    main()
