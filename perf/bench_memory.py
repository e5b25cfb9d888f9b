"""Resident memory per in-flight request slot of a served model.

Builds the model's repository with N requests in flight (``--in-flight``),
serves it, keeps N requests running, and reads every Python-backend
process of the server from /proc while they run: its resident set (RSS),
its proportional share (PSS: shared pages divided among the processes
that map them) and its private memory (what the process alone holds,
freed when it exits). Per slot, the public model's instances (one per
slot) and the one sampler process (shared by all slots) count; the
components' processes serve every slot and are listed apart.

Before this layout the public model was the sampler itself, one process
per slot with torch, diffusers and the tokenizers loaded: the row "one
process per slot" is that cost, the sampler process's own memory per slot.

    python perf/bench_memory.py                                  # models/shapes-flux, 8 slots
    python perf/bench_memory.py --in-flight 16 --record perf/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, record  # noqa: E402

SECTION = "bench_memory"
ROOT = Path(__file__).resolve().parent.parent


def process_memory(pid: int) -> dict[str, float]:
    """RSS, PSS and private memory of ``pid`` in MiB (/proc/PID/smaps_rollup)."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        values[key] = int(value.split()[0]) / 1024
    return {"rss": values["Rss"], "pss": values["Pss"],
            "private": values["Private_Clean"] + values["Private_Dirty"]}


def stub_processes(repository: Path) -> dict[str, list[int]]:
    """The server's Python-backend processes by the model they serve."""
    found = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if arguments and arguments[0].endswith(b"triton_python_backend_stub") and len(arguments) > 1:
            model_file = Path(arguments[1].decode())
            if repository in model_file.parents:
                found[model_file.parent.parent.name].append(int(entry.name))
    return found


def measure(repository: Path, name: str, in_flight: int, steps: int) -> tuple[dict, float]:
    """Memory of each model's processes (MiB, the peak of each while N requests
    run) and the seconds the requests took."""
    from machgen.client import MachgenClient
    from machgen.server import Ports, TritonServer

    peaks: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    with TritonServer(repository, Ports(free_port(), free_port(), free_port())) as server:

        def generate(seed: int) -> None:
            with MachgenClient(server.grpc_url) as client:
                client.generate(name, "a red circle at the top left", seed=seed, num_inference_steps=steps)

        with MachgenClient(server.grpc_url) as client:  # every process past its first request's allocations
            for _ in range(2):
                threads = [threading.Thread(target=client.generate, args=(name, "a blue square"),
                                            kwargs={"seed": seed, "num_inference_steps": 2})
                           for seed in range(in_flight)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
        threads = [threading.Thread(target=generate, args=(seed,)) for seed in range(in_flight)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            for model, pids in stub_processes(repository).items():
                for pid in pids:
                    try:
                        memory = process_memory(pid)
                    except OSError:
                        continue
                    peak = peaks[model].setdefault(pid, memory)
                    for key, value in memory.items():
                        peak[key] = max(peak[key], value)
            time.sleep(0.05)
        seconds = time.perf_counter() - start
    return peaks, seconds


def table(peaks: dict, name: str, in_flight: int) -> str:
    public, sampler = f"{name}", f"{name}_sampler"

    def each(model: str) -> dict[str, float]:
        values = list(peaks[model].values())
        return {key: sum(v[key] for v in values) / len(values) for key in ("rss", "pss", "private")}

    def row(what: str, count, memory: dict[str, float]) -> str:
        return f"| {what} | {count} | {memory['rss']:.0f} | {memory['pss']:.0f} | {memory['private']:.0f} |"

    lines = ["| processes | count | RSS MiB each | PSS MiB each | private MiB each |", "|---|---|---|---|---|",
             row(f"public model `{public}` (one per slot)", len(peaks[public]), each(public)),
             row(f"sampler `{sampler}` (all slots)", len(peaks[sampler]), each(sampler))]
    for model in sorted(set(peaks) - {public, sampler}):
        lines.append(row(f"component `{model}` (all slots)", len(peaks[model]), each(model)))
    per_slot = {key: each(public)[key] + each(sampler)[key] * len(peaks[sampler]) / in_flight
                for key in ("rss", "pss", "private")}
    before = each(sampler)
    lines += ["", "| per in-flight slot | RSS MiB | PSS MiB | private MiB |", "|---|---|---|---|",
              f"| public instance + sampler / {in_flight} (this layout) | {per_slot['rss']:.0f} | "
              f"{per_slot['pss']:.0f} | {per_slot['private']:.0f} |",
              f"| one process per slot holding the sampler (the layout before) | {before['rss']:.0f} | "
              f"{before['pss']:.0f} | {before['private']:.0f} |"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "shapes-flux")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="steps of each measured request (keeps them running)")
    parser.add_argument("--record", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()

    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    name = "bench"
    with tempfile.TemporaryDirectory(prefix="machgen-bench-memory-") as scratch:
        repository = Path(scratch).resolve()
        build_repository(args.model, name, repository, options=ServingOptions(in_flight=args.in_flight),
                         log=lambda line: None)
        peaks, seconds = measure(repository, name, args.in_flight, args.steps)
    text = table(peaks, name, args.in_flight)
    header = (f"{args.model.name}, {args.in_flight} requests of {args.steps} steps in flight ({seconds:.1f} s), "
              f"{os.cpu_count()} CPU cores, measured {time.strftime('%Y-%m-%d %H:%M')}; the peak of each process "
              "while they ran.")
    print(header + "\n\n" + text)
    if args.record:
        record(args.record, f"{SECTION}:{args.model.name}", header + "\n\n" + text, "Memory per in-flight request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
