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

With the video default (``--model-dir models/shapes-wan``) the loops run
through /v1/videos, scored by the moving-shapes detector; a video job makes
one clip, so the full runs are ``--variants`` jobs sent at once.

    python perf/bench_agents.py
    python perf/bench_agents.py --record perf/RESULTS.md
    python perf/bench_agents.py --model-dir models/shapes-wan --name shapes-video --parts loops --record perf/RESULTS.md
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
        try:
            for future in burst_done:
                future.result()
        finally:  # a failed request ends the run (else the person's loop would wait for the burst forever)
            burst_s = time.monotonic() - started
            done.set()
        person_thread.result()
    wall = time.monotonic() - started
    return {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99), "count": len(latencies),
            "burst_s": burst_s, "throughput": (burst + len(latencies)) / wall}


class Jobs:
    """Jobs of one served model through ``machgen api``: images by /v1/images/generations (answered when
    done), videos by /v1/videos (polled until done); each job's results as pictures [H, W, 3] or clips
    [F, H, W, 3]."""

    def __init__(self, api: str, name: str, video: bool):
        self.api, self.name, self.video = api, name, video

    def run(self, **fields) -> dict:
        import httpx

        route = "/v1/videos" if self.video else "/v1/images/generations"
        answer = httpx.post(f"{self.api}{route}", timeout=600, json={"model": self.name, **fields})
        answer.raise_for_status()
        job_id = answer.json()["id"] if self.video else answer.json()["machgen"]["job_id"]
        job = httpx.get(f"{self.api}/v1/jobs/{job_id}", timeout=30).json()
        while job["status"] not in ("completed", "failed", "cancelled"):
            time.sleep(0.02)
            job = httpx.get(f"{self.api}/v1/jobs/{job_id}", timeout=30).json()
        if job["status"] != "completed":
            raise RuntimeError(f"job {job_id}: {job['error']}")
        return job

    def runs(self, fields: list[dict]) -> list[dict]:
        """Jobs sent at once (each its own request), answered in order."""
        with ThreadPoolExecutor(len(fields)) as pool:
            return list(pool.map(lambda one: self.run(**one), fields))

    def results(self, job: dict) -> list:
        import io

        import httpx
        import numpy as np
        from PIL import Image

        media = []
        for index in range(job["n"]):
            data = httpx.get(f"{self.api}/v1/jobs/{job['id']}/content", params={"index": index}, timeout=60).content
            if self.video:
                from machgen.client.video import read_mp4

                with tempfile.TemporaryDirectory() as folder:
                    (Path(folder) / "clip.mp4").write_bytes(data)
                    media.append(read_mp4(Path(folder) / "clip.mp4")[0])
            else:
                media.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
        return media


def other_colour(prompt: str) -> str:
    """The prompt with its colour changed: "a red circle ..." -> "a green circle ...", the same shape and place
    (or motion)."""
    colour = prompt.split()[1]
    return prompt.replace(colour, "green" if colour != "green" else "red", 1)


def agent_loops(jobs: Jobs, prompts: list[tuple[str, int]], variants: int, keep: int, steps: int) -> dict:
    """Explore against full runs, and refine against fresh jobs, one loop at a time. The full runs: the same
    seeds as one job of ``variants`` images, or (a video job makes one clip) as ``variants`` jobs at once."""
    from machgen.api.explore import shapes_score

    explore_s = full_s = explore_denoiser = full_denoiser = refine_s = fresh_s = 0.0
    agreed = 0
    at = max(steps // 4, 1)
    for prompt, seed in prompts:
        started = time.monotonic()
        explored = jobs.run(prompt=prompt, seed=seed, n=variants,
                            explore={"keep": keep, "at_step": at, "scorer": "shapes"})
        explore_s += time.monotonic() - started
        explore_denoiser += sum(v["denoiser_seconds"] for v in explored["explored"]["variants"])
        started = time.monotonic()
        if jobs.video:
            full = jobs.runs([{"prompt": prompt, "seed": seed + index} for index in range(variants)])
        else:
            full = [jobs.run(prompt=prompt, seed=seed, n=variants)]
        full_s += time.monotonic() - started
        full_denoiser += sum(stats["denoiser_seconds"] for job in full for stats in job["stats"])
        scores = [shapes_score(media, prompt) for job in full for media in jobs.results(job)]
        winner = explored["explored"]["variants"][0]["index"]
        agreed += scores[winner] >= max(scores)

        kept = jobs.run(prompt=prompt, seed=seed, keep_latents=[steps // 2])
        started = time.monotonic()
        jobs.run(prompt=other_colour(prompt), parent=kept["id"], step=steps // 2)
        refine_s += time.monotonic() - started
        started = time.monotonic()
        jobs.run(prompt=other_colour(prompt), seed=seed)
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
    parser.add_argument("--model-dir", type=Path, default=Path("models/shapes-flux"),
                        help="the image default, or the video default (models/shapes-wan: its loops through "
                             "/v1/videos)")
    parser.add_argument("--repository", type=Path, help="model repository built from it (default: build one)")
    parser.add_argument("--name", default="shapes", help="served model name")
    parser.add_argument("--parts", default="burst,loops",
                        help="burst (a person's latency under an agent's burst), loops (explore and refine), or both")
    parser.add_argument("--burst", type=int, default=48, help="the agent's requests, sent at once")
    parser.add_argument("--idle-requests", type=int, default=20, help="the person's requests alone")
    parser.add_argument("--variants", type=int, default=8, help="an explore job's variants")
    parser.add_argument("--keep", type=int, default=2, help="the variants an explore continues")
    parser.add_argument("--loop-prompts", type=int, default=8, help="held-out prompts the loops run")
    parser.add_argument("--record", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"burst", "loops"}:
        parser.error("--parts: burst, loops or both")

    from machgen.builder.build import build_repository
    from machgen.contract.manifest import PipelineManifest, pipeline_dir
    from machgen.server import Ports, TritonServer

    with tempfile.TemporaryDirectory(prefix="machgen-bench-agents-") as scratch:
        repository = args.repository
        if repository is None:
            repository = Path(scratch) / "repository"
            build_repository(args.model_dir, args.name, repository)
        defaults = PipelineManifest.read(pipeline_dir(repository, args.name)).defaults
        video, steps = defaults.num_frames > 1, int(defaults.num_inference_steps)
        with TritonServer(repository, Ports(free_port(), free_port(), free_port())) as server:
            url = server.grpc_url
            for seed in range(2 * public_instances(repository, args.name)):  # warm-up
                one_request(url, args.name, "a green triangle", seed)
            if "burst" in parts:
                idle = [one_request(url, args.name, "a red circle at the top left", 20_000 + seed)
                        for seed in range(args.idle_requests)]
                results = {"fair": scenario(url, args.name, args.burst, fair=True),
                           "first come": scenario(url, args.name, args.burst, fair=False)}
            if "loops" in parts:
                api, api_url = start_api(url, Path(scratch) / "api")
                try:
                    loops = agent_loops(Jobs(api_url, args.name, video), held_out_prompts(video, args.loop_prompts),
                                        args.variants, args.keep, steps)
                finally:
                    api.terminate()
                    api.wait()
    tables = []
    if "burst" in parts:
        tables.append((f"{SECTION}:{args.model_dir.name}", burst_table(args, idle, results),
                       "A person's latency under an agent's burst (perf/bench_agents.py)"))
    if "loops" in parts:
        tables.append((f"{SECTION}-loops:{args.model_dir.name}", loops_table(args, loops, steps, video),
                       "An agent's explore and refine loops against plain jobs (perf/bench_agents.py)"))
    for section, table, title in tables:
        print(table, end="\n\n")
        if args.record:
            record(args.record, section, table, title)
    if args.record:
        print(f"recorded in {args.record}")
    return 0


def held_out_prompts(video: bool, count: int) -> list[tuple[str, int]]:
    """The last ``count`` pairs of the trained default's held-out evaluation set."""
    if video:
        from machgen.datasets.moving_shapes import evaluation_prompts
    else:
        from machgen.datasets.shapes import evaluation_prompts
    return [(prompt, seed) for prompt, seed, *_ in evaluation_prompts()[-count:]]


def burst_table(args, idle: list[float], results: dict) -> str:
    idle_p50, idle_p99 = percentile(idle, 0.5), percentile(idle, 0.99)
    loss = 1 - results["fair"]["throughput"] / results["first come"]["throughput"]
    lines = [f"| idle (the person alone) | {len(idle)} | {idle_p50:.3f} | {idle_p99:.3f} | 1.00x | - | - |"]
    for label, row in results.items():
        lines.append(f"| {label} | {row['count']} | {row['p50']:.3f} | {row['p99']:.3f} | "
                     f"**{row['p99'] / idle_p50:.2f}x** | {row['burst_s']:.1f} | {row['throughput']:.2f} |")
    return "\n".join([
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


def loops_table(args, loops: dict, steps: int, video: bool) -> str:
    what = "clips (/v1/videos)" if video else "images"
    plain = f"{args.variants} plain jobs sent at once" if video else "one plain job"
    detector = "moving-shapes detector: colour, shape, direction" if video else "detector"
    return "\n".join([
        f"The same model through `machgen api`, {what}, one loop at a time, {loops['count']} held-out prompts of "
        f"its evaluation set, {steps} steps, measured {time.strftime('%Y-%m-%d %H:%M')}. Explore: "
        f"{args.variants} seeds scored by the built-in scorer (`shapes`, the {detector}) after step {loops['at']} "
        f"(a quarter), the best {args.keep} continued from their latents there; against the same {args.variants} "
        f"seeds as {plain}. Winner: the explore's first scores as well as the best of the full runs (the "
        f"detector on their final results). Refine: a job's latents after step {steps // 2} continued with a new "
        f"prompt (parent, step), against a fresh job of that prompt.",
        "",
        "| loop | ours s | plain s | time ratio | denoiser-time ratio | winner kept |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| explore {args.variants} -> {args.keep} at step {loops['at']} | {loops['explore_s']:.2f} | "
        f"{loops['full_s']:.2f} | **{loops['wall_ratio']:.2f}** | **{loops['denoiser_ratio']:.2f}** | "
        f"{loops['agreed']} of {loops['count']} |",
        f"| refine from step {steps // 2} of {steps} | {loops['refine_s']:.2f} | {loops['fresh_s']:.2f} | "
        f"**{loops['refine_s'] / loops['fresh_s']:.2f}** | - | - |",
    ])


if __name__ == "__main__":
    sys.exit(main())
