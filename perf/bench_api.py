"""The HTTP API's cost, measured side by side in one run on one served model.

1. Overhead per image request: the same requests (prompt, seed, steps, size)
   through ``POST /v1/images/generations`` (JSON, b64 PNG back) and straight
   to the plain model over gRPC (MachgenClient), sequentially; the ratio of
   median latencies and the difference in milliseconds.
2. Preview cost per step: streamed requests with a preview every step
   against the same requests with none (medians; the difference per step),
   and the projection alone (LatentPreview.render on this model's latents).
3. Events delivered for 16 concurrent streaming jobs: 16 image jobs
   submitted at once, each followed over ``/v1/jobs/ID/events``; every
   listener must see every step of its job, then its end.

    python perf/bench_api.py                              # models/shapes-flux, built here
    python perf/bench_api.py --repository REPO --name NAME --record perf/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, record  # noqa: E402

SECTION = "api"


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def overhead(api_url: str, grpc_url: str, name: str, steps: int, rounds: int) -> dict[str, float]:
    import httpx

    from machgen.client import MachgenClient

    body = {"model": name, "prompt": "a red circle at the top left", "num_inference_steps": steps}
    direct, through_api = [], []
    with MachgenClient(grpc_url) as client, httpx.Client(timeout=120) as http:
        for seed in range(rounds + 2):  # the first two warm up both paths
            start = time.perf_counter()
            client.generate(name, body["prompt"], seed=seed, num_inference_steps=steps)
            if seed >= 2:
                direct.append(time.perf_counter() - start)
            start = time.perf_counter()
            response = http.post(f"{api_url}/v1/images/generations", json={**body, "seed": seed})
            response.raise_for_status()
            if seed >= 2:
                through_api.append(time.perf_counter() - start)
    return {"direct_ms": _median_ms(direct), "api_ms": _median_ms(through_api)}


def preview_cost(grpc_url: str, name: str, steps: int, rounds: int) -> dict[str, float]:
    from machgen.client import MachgenClient

    timings = {0: [], 1: []}
    with MachgenClient(grpc_url) as client:
        for seed in range(rounds + 2):
            for interval in (0, 1):
                start = time.perf_counter()
                client.generate(name, "a blue square", seed=seed, num_inference_steps=steps,
                                preview_interval=interval, on_progress=lambda progress: None)
                if seed >= 2:
                    timings[interval].append(time.perf_counter() - start)
    without, with_previews = _median_ms(timings[0]), _median_ms(timings[1])
    return {"stream_ms": without, "stream_previews_ms": with_previews,
            "preview_per_step_ms": (with_previews - without) / (steps - 1)}


def projection_ms(repository: Path, name: str) -> float:
    import numpy as np

    from machgen.contract.manifest import pipeline_dir
    from machgen.runtime.preview import LatentPreview
    from machgen.runtime.local import LocalPipeline

    preview = LatentPreview.load(pipeline_dir(repository, name))
    pipeline = LocalPipeline(repository, name)
    request = pipeline.sampler.parse_request({"prompt": np.array([b"a cat"], dtype=object)}.get,
                                             pipeline.manifest.defaults)
    latents = pipeline.sampler.runtime.preview_latents(pipeline.sampler.generate(request).latents)
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        preview.render(latents)
        samples.append(time.perf_counter() - start)
    return _median_ms(samples)


async def concurrent_events(api_url: str, name: str, jobs: int, steps: int) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(timeout=300) as http:
        start = time.perf_counter()
        created = await asyncio.gather(*[
            http.post(f"{api_url}/v1/images/generations", json={
                "model": name, "prompt": f"a shape number {i}", "seed": i, "num_inference_steps": steps,
                "preview_interval": 4, "async": True}) for i in range(jobs)])
        ids = [response.json()["id"] for response in created]

        async def follow(job_id: str) -> tuple[int, int, str]:
            progress = previews = 0
            last = None
            async with http.stream("GET", f"{api_url}/v1/jobs/{job_id}/events") as response:
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        last = line[len("event: "):]
                        progress += last == "progress"
                        previews += last == "preview"
            return progress, previews, last

        results = await asyncio.gather(*[follow(job_id) for job_id in ids])
        seconds = time.perf_counter() - start
    return {"jobs": jobs, "steps": steps, "progress_events": sum(r[0] for r in results),
            "preview_events": sum(r[1] for r in results), "completed": sum(r[2] == "completed" for r in results),
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("models/shapes-flux"))
    parser.add_argument("--repository", type=Path, help="a built repository (default: build --model-dir)")
    parser.add_argument("--name", default="shapes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--record", type=Path, help="write the table into this RESULTS.md")
    args = parser.parse_args()

    from machgen.server import Ports, TritonServer

    with tempfile.TemporaryDirectory(prefix="machgen-bench-api-") as scratch:
        repository = args.repository
        if repository is None:
            from machgen.builder.build import build_repository

            repository = Path(scratch) / "repository"
            print(f"building {args.model_dir} ...", flush=True)
            build_repository(args.model_dir, args.name, repository, log=lambda line: None)
        with TritonServer(repository, Ports(free_port(), free_port(), free_port())) as server:
            port = free_port()
            api = subprocess.Popen([sys.executable, "-m", "machgen.cli", "api", "--triton", server.grpc_url,
                                    "--port", str(port), "--data-dir", str(Path(scratch) / "api")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            api_url = f"http://127.0.0.1:{port}"
            try:
                import httpx

                for _ in range(600):
                    try:
                        if httpx.get(f"{api_url}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.1)
                cost = overhead(api_url, server.grpc_url, args.name, args.steps, args.rounds)
                previews = preview_cost(server.grpc_url, args.name, args.steps, args.rounds)
                events = asyncio.run(concurrent_events(api_url, args.name, 16, args.steps))
            finally:
                api.terminate()
                api.wait()
        render_ms = projection_ms(repository, args.name)
    rows = [
        "| measure | value |",
        "| --- | --- |",
        f"| image request straight to Triton (gRPC), median | {cost['direct_ms']:.1f} ms |",
        f"| the same through `POST /v1/images/generations`, median | {cost['api_ms']:.1f} ms |",
        f"| API overhead per image request | {cost['api_ms'] - cost['direct_ms']:+.1f} ms "
        f"({cost['api_ms'] / cost['direct_ms']:.3f}x) |",
        f"| streamed request, no previews / a preview every step | {previews['stream_ms']:.1f} / "
        f"{previews['stream_previews_ms']:.1f} ms |",
        f"| preview cost per step, served (projection, relay, client) | {previews['preview_per_step_ms']:+.2f} ms |",
        f"| projection alone (LatentPreview.render, this model's latents) | {render_ms:.3f} ms |",
        f"| 16 concurrent streaming jobs: progress events delivered | {events['progress_events']} of "
        f"{16 * args.steps} |",
        f"| ... preview events, jobs completed, wall time | {events['preview_events']}, {events['completed']} of 16, "
        f"{events['seconds']:.1f} s |",
    ]
    table = (f"{args.steps} steps, default size, {args.rounds} sequential requests per path; "
             f"{platform.processor() or platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores.\n\n"
             + "\n".join(rows))
    print(table)
    print(json.dumps({"overhead": cost, "previews": previews, "events": events, "render_ms": render_ms}))
    if args.record:
        record(args.record, f"{SECTION}:{args.model_dir.name}", table, "HTTP API overhead, previews and events")


if __name__ == "__main__":
    main()
