"""Throughput under concurrency, batching across requests on and off, measured with perf_analyzer.

Builds the model twice (components with Triton's dynamic batcher, and
without it: each call runs alone), serves each in turn, and runs
perf_analyzer over gRPC at each concurrency level (one run per level),
with prompt/seed inputs generated from the model's API. Besides
perf_analyzer's throughput and latency percentiles, each row gives the
rows per denoiser forward (Triton's statistics: above 1 means calls of
different requests shared a forward) and the CPU the server used (cores).

perf_analyzer comes from the tritonclient 2.51.0 wheel (the one matching
the bundled tritonserver): downloaded once into build/wheels with pip,
the binary extracted into build/perf_analyzer, its two shared libraries
linked from pytriton's bundled ones. The wheel itself is not installed.

    python perf/bench_batching.py                          # models/shapes-flux
    python perf/bench_batching.py --record perf/RESULTS.md --csv perf/batching.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, record  # noqa: E402

SECTION = "bench_batching"
ROOT = Path(__file__).resolve().parent.parent
PERF_ANALYZER_WHEEL = "tritonclient==2.51.0"
# perf_analyzer links these by their plain names; pytriton ships them with hashed ones.
PERF_ANALYZER_LIBS = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}


def perf_analyzer(cache: Path) -> tuple[Path, dict[str, str]]:
    """The perf_analyzer binary and the environment it runs in."""
    import pytriton

    binary, lib_dir = cache / "perf_analyzer", cache / "lib"
    if not binary.is_file():
        wheels = ROOT / "build" / "wheels"
        found = sorted(wheels.glob("tritonclient-2.51.0-*.whl"))
        if not found:
            print(f"downloading {PERF_ANALYZER_WHEEL} (for its perf_analyzer) into {wheels}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PERF_ANALYZER_WHEEL,
                            "--only-binary", ":all:", "-d", str(wheels)], check=True)
            found = sorted(wheels.glob("tritonclient-2.51.0-*.whl"))
        with zipfile.ZipFile(found[-1]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith("/bin/perf_analyzer"))
            cache.mkdir(parents=True, exist_ok=True)
            binary.write_bytes(wheel.read(member))
        binary.chmod(0o755)
    bundled = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    lib_dir.mkdir(parents=True, exist_ok=True)
    for plain, pattern in PERF_ANALYZER_LIBS.items():
        (target,) = bundled.glob(pattern)
        link = lib_dir / plain
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib_dir),
                                                                          os.environ.get("LD_LIBRARY_PATH")])))
    return binary, env


def input_data(prompts: list[tuple[str, int]], extra: dict) -> dict:
    """perf_analyzer's --input-data JSON: one entry per prompt/seed, typed by the public API."""
    from machgen.contract.api import API_INPUTS

    api = {t.name: t for t in API_INPUTS}
    unknown = set(extra) - set(api)
    if unknown:
        raise SystemExit(f"unknown API inputs: {sorted(unknown)}")
    return {"data": [{"prompt": [prompt], "seed": [seed], **{k: [v] for k, v in extra.items()}}
                     for prompt, seed in prompts]}


def _server_cpu_seconds(session_id: int) -> float:
    """CPU time so far of every process in the server's session (tritonserver and its Python stubs)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id:  # field 6 of stat: the session id
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def sweep(repository: Path, name: str, binary: Path, env: dict, data_file: Path, levels: list[int],
          measurement_ms: int, scratch: Path, label: str) -> list[dict]:
    from machgen.client import MachgenClient
    from machgen.server import Ports, TritonServer

    rows = []
    with TritonServer(repository, Ports(free_port(), free_port(), free_port())) as server, \
            MachgenClient(server.grpc_url) as client:
        # The model a step that runs the whole denoiser calls: the joined head and tail where the build joined
        # them (onnxruntime without adapters), else the tail (inside the ensemble).
        joined = (repository / f"{name}_denoiser" / "1" / "model.onnx").is_file()
        tail = f"{name}_denoiser" if joined else f"{name}_denoiser_tail"
        for level in levels:
            out = scratch / f"{label}-c{level}.csv"
            command = [str(binary), "-m", name, "-u", server.grpc_url, "-i", "grpc", "--input-data", str(data_file),
                       "--concurrency-range", str(level), "--measurement-interval", str(measurement_ms),
                       "--stability-percentage", "25", "--max-trials", "6", "-f", str(out)]
            if not rows:  # the first level also warms the server up (first-call allocations)
                subprocess.run(command[:command.index("-f")], env=env, capture_output=True, check=False)
            tail_before, cpu_before, start = client.rows_and_forwards(tail), _server_cpu_seconds(
                server.process.pid), time.monotonic()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"perf_analyzer failed at concurrency {level}:\n{done.stdout}\n{done.stderr}")
            cores = (_server_cpu_seconds(server.process.pid) - cpu_before) / (time.monotonic() - start)
            tail_after = client.rows_and_forwards(tail)
            with out.open() as handle:
                (measured,) = [r for r in csv.DictReader(handle) if int(r["Concurrency"]) == level]
            row = {"batching": label, "concurrency": level,
                   "throughput": float(measured["Inferences/Second"]),
                   "p50_ms": int(measured["p50 latency"]) / 1000, "p90_ms": int(measured["p90 latency"]) / 1000,
                   "p99_ms": int(measured["p99 latency"]) / 1000,
                   "tail_rows_per_forward": (tail_after[0] - tail_before[0]) / max(1, tail_after[1] - tail_before[1]),
                   "server_cores": cores}
            rows.append(row)
            print(f"{label:4s} c{level:<3d} {row['throughput']:6.2f} req/s  p50 {row['p50_ms']:7.1f} ms  "
                  f"p99 {row['p99_ms']:7.1f} ms  rows/forward {row['tail_rows_per_forward']:.2f}  "
                  f"cpu {cores:.2f} cores", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "shapes-flux")
    parser.add_argument("--name", default="shapes", help="served model name")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--measurement-ms", type=int, default=10000, help="perf_analyzer's measurement window")
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompt/seed pairs sent in turn")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=JSON",
                        help="an API input sent with every request, e.g. cache_policy='\"none\"'")
    parser.add_argument("--only", choices=("on", "off"), help="measure one configuration only")
    parser.add_argument("--perf-analyzer-dir", type=Path, default=ROOT / "build" / "perf_analyzer")
    parser.add_argument("--csv", type=Path, help="write every measured row here")
    parser.add_argument("--record", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()

    from machgen.datasets import shapes
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    binary, env = perf_analyzer(args.perf_analyzer_dir)
    extra = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.input)}
    prompts = [(prompt, seed) for prompt, seed, _ in shapes.evaluation_prompts(args.prompts, seed=5)]
    configurations = [("on", ServingOptions()), ("off", ServingOptions(batching=False))]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="machgen-bench-batching-") as scratch:
        data_file = Path(scratch) / "input.json"
        data_file.write_text(json.dumps(input_data(prompts, extra)))
        for label, options in configurations:
            if args.only and label != args.only:
                continue
            repository = Path(scratch) / f"repository-{label}"
            print(f"building {args.model_dir.name} with batching {label}", flush=True)
            build_repository(args.model_dir, args.name, repository, options=options, log=lambda line: None)
            rows += sweep(repository, args.name, binary, env, data_file, args.concurrency, args.measurement_ms,
                          Path(scratch), label)

    if args.csv:
        with args.csv.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    base = {r["batching"]: r["throughput"] for r in rows if r["concurrency"] == min(args.concurrency)}
    lines = [
        f"Model `{args.model_dir.name}`, served defaults (prompt and seed only: {args.prompts} prompt/seed pairs "
        f"in turn{', plus ' + ', '.join(args.input) if args.input else ''}), perf_analyzer 2.51 over gRPC, one "
        f"run per concurrency level, {args.measurement_ms / 1000:g} s windows until stable; "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), measured {time.strftime('%Y-%m-%d %H:%M')}. "
        f"Serving: {ServingOptions().in_flight} requests in flight; batching off = no dynamic batcher on "
        "the components (each call runs alone). Rows/forward: denoiser_tail rows per forward (Triton's "
        "statistics). CPU: cores the server's processes used.",
        "",
        "| batching | concurrency | throughput (req/s) | vs concurrency 1 | p50 (ms) | p99 (ms) | p99 / p50 "
        "| rows/forward | CPU (cores) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['batching']} | {r['concurrency']} | {r['throughput']:.2f} | "
                     f"{r['throughput'] / base[r['batching']]:.2f}x | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                     f"{r['p99_ms'] / r['p50_ms']:.2f} | {r['tail_rows_per_forward']:.2f} | "
                     f"{r['server_cores']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.record:
        record(args.record, f"{SECTION}:{args.model_dir.name}", table,
               "Batching across requests (perf/bench_batching.py)")
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
