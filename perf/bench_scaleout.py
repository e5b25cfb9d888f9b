"""Scale-out on one host: ``machgen serve --replicas 2``'s HAProxy against one server, side by side in one run.

    .venv/bin/python perf/bench_scaleout.py                                   # the default model (make demo)
    .venv/bin/python perf/bench_scaleout.py --repository R --model NAME --concurrency 8 --requests 64

Two supervised replicas start behind the balancer (machgen/replicas.py). Measured, in this order:
- latency of one request at a time, straight to replica 0 and through the balancer with replica 1 in
  maintenance (the balancer's overhead: same server, same requests);
- throughput at ``--concurrency`` straight to replica 0, through the balancer to one replica, and through it
  to both; the ratio 2 replicas / 1 is printed with the CPU cores the host has (replicas share them: on a
  2-core machine two cannot be faster than one);
- every answer compared with the first answer for its seed (nothing lost, nothing different).
Writes the table into perf/RESULTS.md ("Scale-out").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("a red circle at the top left", "a blue square at the bottom right", "a green triangle in the middle")


def run(url: str, model: str, requests: int, concurrency: int, steps: int, expected: dict) -> dict:
    """``requests`` at ``concurrency`` over gRPC to ``url``: wall seconds, per-request latencies, failures."""
    from machgen.client import MachgenClient

    latencies, failures = [], []
    lock = threading.Lock()
    local = threading.local()

    def one(index: int) -> None:
        if not hasattr(local, "client"):
            local.client = MachgenClient(url)
        seed = index % len(PROMPTS)
        started = time.perf_counter()
        try:
            image = local.client.generate(model, PROMPTS[seed], seed=seed, num_inference_steps=steps)
            problem = None if seed not in expected or np.array_equal(image, expected[seed]) else "differs"
            expected.setdefault(seed, image)
        except Exception as err:  # noqa: BLE001 - counted
            problem = str(err)
        with lock:
            latencies.append(time.perf_counter() - started)
            if problem:
                failures.append(problem)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    return {"wall": time.perf_counter() - started, "latencies": latencies, "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--latency-requests", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-record", action="store_true", help="print only, leave perf/RESULTS.md alone")
    args = parser.parse_args()

    from machgen.replicas import ReplicaSet, ReplicaSettings
    from machgen.server import Ports

    ports = Ports(free_port(), free_port(), free_port())
    replicas = ReplicaSet(args.repository, ports, ReplicaSettings(count=2), log=lambda line: None)
    print("starting 2 replicas behind HAProxy ...", flush=True)
    replicas.start()
    balancer, direct = f"127.0.0.1:{ports.grpc}", replicas.replicas[0].server.grpc_url
    expected: dict = {}
    try:
        run(direct, args.model, 2 * len(PROMPTS), 1, args.steps, expected)  # warm-up, and each seed's answer
        replicas.balancer.set_state(1, "maint")
        rows = {}
        for name, url in (("direct", direct), ("balancer", balancer)):
            rows[f"latency {name}"] = run(url, args.model, args.latency_requests, 1, args.steps, expected)
        for name, url in (("1 server, direct", direct), ("1 replica, balancer", balancer)):
            rows[name] = run(url, args.model, args.requests, args.concurrency, args.steps, expected)
        replicas.balancer.set_state(1, "ready")
        replicas.balancer.wait_up(1)
        rows["2 replicas, balancer"] = run(balancer, args.model, args.requests, args.concurrency, args.steps,
                                           expected)
    finally:
        replicas.drain()

    def p50(row) -> float:
        return statistics.median(row["latencies"])

    overhead_ms = (p50(rows["latency balancer"]) - p50(rows["latency direct"])) * 1000
    lines = [f"{args.model}, {args.steps} steps, gRPC, {os.cpu_count()} CPU cores on the host, "
             f"{time.strftime('%Y-%m-%d')}", "",
             "| run | requests | concurrency | p50 latency | throughput | lost or different |",
             "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        concurrency = 1 if name.startswith("latency") else args.concurrency
        lines.append(f"| {name} | {len(row['latencies'])} | {concurrency} | {p50(row) * 1000:.0f} ms | "
                     f"{len(row['latencies']) / row['wall']:.2f} req/s | {len(row['failures'])} |")
    one = len(rows["1 replica, balancer"]["latencies"]) / rows["1 replica, balancer"]["wall"]
    two = len(rows["2 replicas, balancer"]["latencies"]) / rows["2 replicas, balancer"]["wall"]
    lines += ["", f"2 replicas / 1 replica through the balancer: {two / one:.2f}x throughput on "
                  f"{os.cpu_count()} cores; the balancer adds {overhead_ms:.1f} ms to a request's p50 "
                  f"({p50(rows['latency balancer']) / p50(rows['latency direct']):.3f}x)."]
    table = "\n".join(lines)
    print(table)
    if not args.no_record:
        record(ROOT / "perf" / "RESULTS.md", f"scaleout:{args.model}", table, "Scale-out")
    lost = sum(len(row["failures"]) for row in rows.values())
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
