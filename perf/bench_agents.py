"""A person's latency while an agent bursts: fair scheduling against first-come order, in one run.

Serves the model (models/shapes-flux by default) and, through its
streaming twin (what the HTTP API calls), measures:

- idle: the person's request alone, one at a time (its latency without load);
- fair: the agent sends ``--burst`` requests at once (priority batch, owner
  "agent"), and the person sends one request at a time (priority
  interactive, owner "person") until the burst has finished;
- first come: the same, every request interactive and of one owner, so the
  sampler's step gate serves them in the order they came (as a FIFO queue).

Reported: the person's p50 and p99 latency in each (and as a multiple of
idle; the goal: p99 within 1.5x of idle), the burst's wall time, and the
throughput of all requests together (the goal: fairness costs at most 5 %).
Each request runs on its own client (one gRPC stream per client).

Then an agent's loops through ``machgen api`` on the same server, one job at
a time (held-out prompts of the shapes set):

- explore: ``--variants`` seeds pruned to ``--keep`` at a quarter of the
  steps by the built-in detector, against the same variants run in full as
  one job: denoiser seconds and wall time as ratios, and how often the
  explore's winner scores as well as the best of the full runs;
- refine: a kept job continued from half its steps with a new prompt,
  against a fresh job of that prompt: wall time as a ratio.

    python perf/bench_agents.py
    python perf/bench_agents.py --record perf/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, public_instances, record  # noqa: E402

SECTION = "bench_agents"
GOAL_P99 = 1.5
GOAL_THROUGHPUT_LOSS = 0.05


def percentile(values: list[float], share: float) -> float:
    import numpy as np

    return float(np.percentile(values, 100 * share))


def one_request(url: str, name: str, prompt: str, seed: int, **options) -> float:
    from machgen.client import MachgenClient

    with MachgenClient(url) as client:
        started = time.monotonic()
        client.generate(name, prompt, seed=seed, on_progress=lambda progress: None, **options)
        return time.monotonic() - started


def scenario(url: str, name: str, burst: int, fair: bool) -> dict:
    """The agent's burst and the person's requests one after another until the burst ends."""
    agent = dict(priority="batch", owner="agent") if fair else dict(priority="interactive", owner="everyone")
    person = dict(priority="interactive", owner="person") if fair else agent
    latencies: list[float] = []
    done = threading.Event()
    started = time.monotonic()

    def the_person():
        seed = 10_000
        while not done.is_set():
            latencies.append(one_request(url, name, "a red circle at the top left", seed, **person))
            seed += 1

    with ThreadPoolExecutor(burst + 1) as pool:
        burst_done = [pool.submit(one_request, url, name, "a blue square", seed, **agent) for seed in range(burst)]
        time.sleep(0.2)  # the burst first: the person comes to a full queue
        person_thread = pool.submit(the_person)
        for future in burst_done:
            future.result()
        burst_s = time.monotonic() - started
        done.set()
        person_thread.result()
    wall = time.monotonic() - started
    return {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99), "count": len(latencies),
            "burst_s": burst_s, "throughput": (burst + len(latencies)) / wall}


def api_job(api: str, name: str, **fields) -> dict:
    import httpx

    answer = httpx.post(f"{api}/v1/images/generations", timeout=600, json={"model": name, **fields})
    answer.raise_for_status()
    job = httpx.get(f"{api}/v1/jobs/{answer.json()['machgen']['job_id']}", timeout=30).json()
    return {**job, "images": answer.json()["data"]}


def picture(entry: dict):
    import base64
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(entry["b64_json"]))).convert("RGB"))


def agent_loops(api: str, name: str, prompts: list[tuple[str, int]], variants: int, keep: int, steps: int) -> dict:
    """Explore against full runs, and refine against fresh jobs, one job at a time."""
    from machgen.api.explore import shapes_score

    explore_s = full_s = explore_denoiser = full_denoiser = refine_s = fresh_s = 0.0
    agreed = 0
    at = max(steps // 4, 1)
    for prompt, seed in prompts:
        started = time.monotonic()
        explored = api_job(api, name, prompt=prompt, seed=seed, n=variants,
                           explore={"keep": keep, "at_step": at, "scorer": "shapes"})
        explore_s += time.monotonic() - started
        explore_denoiser += sum(v["denoiser_seconds"] for v in explored["explored"]["variants"])
        started = time.monotonic()
        full = api_job(api, name, prompt=prompt, seed=seed, n=variants)
        full_s += time.monotonic() - started
        full_denoiser += sum(stats["denoiser_seconds"] for stats in full["stats"])
        scores = [shapes_score(picture(entry), prompt) for entry in full["images"]]
        winner = explored["explored"]["variants"][0]["index"]
        agreed += scores[winner] >= max(scores)

        kept = api_job(api, name, prompt=prompt, seed=seed, keep_latents=[steps // 2])
        colour = prompt.split()[1]  # "a red circle at the top left": the same shape and place in another colour
        other = prompt.replace(colour, "green" if colour != "green" else "red", 1)
        started = time.monotonic()
        api_job(api, name, prompt=other, parent=kept["id"], step=steps // 2)
        refine_s += time.monotonic() - started
        started = time.monotonic()
        api_job(api, name, prompt=other, seed=seed)
        fresh_s += time.monotonic() - started
    return {"at": at, "denoiser_ratio": explore_denoiser / full_denoiser, "wall_ratio": explore_s / full_s,
            "agreed": agreed, "count": len(prompts), "refine_ratio": refine_s / fresh_s,
            "explore_s": explore_s / len(prompts), "full_s": full_s / len(prompts),
            "refine_s": refine_s / len(prompts), "fresh_s": fresh_s / len(prompts)}


def start_api(triton_url: str, folder: Path):
    import subprocess
    import urllib.request

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "machgen.cli", "api", "--triton", triton_url, "--port",
                                str(port), "--data-dir", str(folder)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("machgen api did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("models/shapes-flux"))
    parser.add_argument("--repository", type=Path, help="model repository built from it (default: build one)")
    parser.add_argument("--name", default="shapes", help="served model name")
    parser.add_argument("--burst", type=int, default=48, help="the agent's requests, sent at once")
    parser.add_argument("--idle-requests", type=int, default=20, help="the person's requests alone")
    parser.add_argument("--variants", type=int, default=8, help="an explore job's variants")
    parser.add_argument("--keep", type=int, default=2, help="the variants an explore continues")
    parser.add_argument("--loop-prompts", type=int, default=8, help="held-out prompts the loops run")
    parser.add_argument("--record", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()

    from machgen.builder.build import build_repository
    from machgen.server import Ports, TritonServer

    with tempfile.TemporaryDirectory(prefix="machgen-bench-agents-") as scratch:
        repository = args.repository
        if repository is None:
            repository = Path(scratch) / "repository"
            build_repository(args.model_dir, args.name, repository)
        with TritonServer(repository, Ports(free_port(), free_port(), free_port())) as server:
            url = server.grpc_url
            for seed in range(2 * public_instances(repository, args.name)):  # warm-up
                one_request(url, args.name, "a green triangle", seed)
            idle = [one_request(url, args.name, "a red circle at the top left", 20_000 + seed)
                    for seed in range(args.idle_requests)]
            results = {"fair": scenario(url, args.name, args.burst, fair=True),
                       "first come": scenario(url, args.name, args.burst, fair=False)}
            from machgen.builder.shapes import evaluation_prompts
            from machgen.contract.manifest import PipelineManifest, pipeline_dir

            steps = int(PipelineManifest.read(pipeline_dir(repository, args.name)).defaults.num_inference_steps)
            api, api_url = start_api(url, Path(scratch) / "api")
            try:
                held_out = [(prompt, seed) for prompt, seed, _ in evaluation_prompts(70)[-args.loop_prompts:]]
                loops = agent_loops(api_url, args.name, held_out, args.variants, args.keep, steps)
            finally:
                api.terminate()
                api.wait()
    idle_p50, idle_p99 = percentile(idle, 0.5), percentile(idle, 0.99)
    loss = 1 - results["fair"]["throughput"] / results["first come"]["throughput"]
    lines = [f"| idle (the person alone) | {len(idle)} | {idle_p50:.3f} | {idle_p99:.3f} | 1.00x | - | - |"]
    for label, row in results.items():
        lines.append(f"| {label} | {row['count']} | {row['p50']:.3f} | {row['p99']:.3f} | "
                     f"**{row['p99'] / idle_p50:.2f}x** | {row['burst_s']:.1f} | {row['throughput']:.2f} |")
    table = "\n".join([
        f"Model `{args.model_dir.name}` through its streaming twin, {os.cpu_count()} CPU cores ({platform.machine()}), "
        f"measured {time.strftime('%Y-%m-%d %H:%M')}. An agent sends {args.burst} requests at once; a person sends "
        "one request at a time until they are done. Fair: the agent's are batch (owner agent), the person's "
        "interactive (owner person); first come: all of one priority and owner, served in the order they came. "
        f"Latency in seconds; p99 as a multiple of the idle p50 (goal: p99 within {GOAL_P99:g}x of idle). "
        f"Throughput: all requests per second. Fairness cost {100 * loss:.1f} % of the throughput "
        f"(goal: at most {100 * GOAL_THROUGHPUT_LOSS:g} %).",
        "",
        "| scenario | person's requests | p50 s | p99 s | p99 / idle p50 | burst done after s | requests / s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *lines,
    ])
    loops_table = "\n".join([
        f"The same model through `machgen api`, one job at a time, {loops['count']} held-out prompts of the shapes "
        f"set, {steps} steps. Explore: {args.variants} seeds scored by the built-in detector (`shapes`) after step "
        f"{loops['at']} (a quarter), the best {args.keep} continued from their latents there; against the same "
        f"{args.variants} seeds as one plain job. Winner: the explore's first scores as well as the best of the "
        f"full runs (the detector on their final images). Refine: a job's latents after step {steps // 2} "
        f"continued with a new prompt (parent, step), against a fresh job of that prompt.",
        "",
        "| loop | ours s | plain s | time ratio | denoiser-time ratio | winner kept |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| explore {args.variants} -> {args.keep} at step {loops['at']} | {loops['explore_s']:.2f} | "
        f"{loops['full_s']:.2f} | **{loops['wall_ratio']:.2f}** | **{loops['denoiser_ratio']:.2f}** | "
        f"{loops['agreed']} of {loops['count']} |",
        f"| refine from step {steps // 2} of {steps} | {loops['refine_s']:.2f} | {loops['fresh_s']:.2f} | "
        f"**{loops['refine_s'] / loops['fresh_s']:.2f}** | - | - |",
    ])
    print(table)
    print()
    print(loops_table)
    if args.record:
        record(args.record, f"{SECTION}:{args.model_dir.name}", table,
               "A person's latency under an agent's burst (perf/bench_agents.py)")
        record(args.record, f"{SECTION}-loops:{args.model_dir.name}", loops_table,
               "An agent's explore and refine loops against plain jobs (perf/bench_agents.py)")
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
