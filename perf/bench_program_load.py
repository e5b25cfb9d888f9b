"""The torch target's program load: ``torch.export.load`` against
machgen's ``load_program`` (runtime/program_load.py), on the same files, in
one run, alternating so that neither gets a warmer process.

Every ``model.pt2`` of a torch-target repository is loaded ``--rounds``
times each way; the table gives each component's median seconds and the
ratio. Without ``--repository`` a tiny Wan 2.2 (two experts, every axis
dynamic) is built for the torch target first (a minute).

    python perf/bench_program_load.py --record perf/RESULTS.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

SECTION = "bench_program_load"


def tiny_wan_repository(folder: Path) -> Path:
    from machgen.builder.build import build_repository
    from machgen.builder.model_folder import write_tiny_model
    from machgen.builder.repository import ServingOptions
    from machgen.families.registry import get_family

    model = write_tiny_model(get_family("wan"), folder / "tiny-wan")
    repository = folder / "repository"
    build_repository(model, "wan", repository, target="torch", preview=False,
                     options=ServingOptions(component_instances=1), log=lambda line: print(line, flush=True))
    return repository


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, help="a torch-target model repository (default: a tiny Wan)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--record", type=Path, help="write the table into this RESULTS.md")
    args = parser.parse_args()

    import torch

    import machgen.parallel.op  # noqa: F401 - the programs may call machgen's ops
    import machgen.plugins.ops  # noqa: F401
    from machgen.runtime.program_load import load_program

    with tempfile.TemporaryDirectory() as scratch:
        repository = args.repository or tiny_wan_repository(Path(scratch))
        files = sorted(repository.glob("*/1/model.pt2"))
        if not files:
            raise SystemExit(f"{repository}: no model.pt2 (not a torch-target repository)")
        ways = {"torch.export.load": lambda path: torch.export.load(str(path)), "load_program": load_program}
        seconds: dict = {(way, path): [] for way in ways for path in files}
        load_program(files[0])  # the first load of a process imports what every later one uses
        for _ in range(args.rounds):
            for path in files:
                for way, load in ways.items():
                    start = time.perf_counter()
                    load(path)
                    seconds[way, path].append(time.perf_counter() - start)

    rows, totals = [], {way: 0.0 for way in ways}
    for path in files:
        plain, ours = (statistics.median(seconds[way, path]) for way in ways)
        totals["torch.export.load"] += plain
        totals["load_program"] += ours
        rows.append(f"| {path.parent.parent.name} | {plain:.2f} | {ours:.2f} | **{plain / ours:.2f}x** |")
    plain, ours = totals.values()
    table = "\n".join([
        f"{'A tiny Wan 2.2 (two experts)' if args.repository is None else repository.name}, torch target, every "
        f"`model.pt2` loaded {args.rounds} times each way, alternating; median seconds. "
        f"{platform.machine()}, torch {torch.__version__}, measured {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "| component | torch.export.load s | load_program s | faster |",
        "| --- | --- | --- | --- |",
        *rows,
        f"| all | {plain:.2f} | {ours:.2f} | **{plain / ours:.2f}x** |",
    ])
    print(table)
    if args.record:
        record(args.record, f"{SECTION}:{'tiny-wan' if args.repository is None else repository.name}", table,
               "Loading a torch-target program (perf/bench_program_load.py)")


if __name__ == "__main__":
    main()
