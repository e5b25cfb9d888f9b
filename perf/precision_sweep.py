"""The int8 sensitivity sweep (machgen/builder/precision_sweep.py) on the image default, models/shapes-flux: the
sweep's table as `machgen-build build --precision int8` logs it, and its effect, in one run.

    OMP_NUM_THREADS=1 python perf/precision_sweep.py                    # 12 held-out pairs
    OMP_NUM_THREADS=1 python perf/precision_sweep.py --quick            # 3 pairs, to check that it runs
    OMP_NUM_THREADS=1 python perf/precision_sweep.py --record perf/RESULTS.md

Four builds of the onnxruntime target (one export, shared through an export cache): float, int8 without the
sweep (every denoiser linear layer int8), int8 with the sweep at its default target (the card's calibrated
33 dB + 10), and int8 with the sweep at a stricter target (the default choice's worst image on the sweep's
pairs + 3 dB, which must keep more groups float: what buying quality costs in speed). Then, on prompt/seed
pairs of calibrate's held-out set (which the sweep, on the fit set, never saw), each build runs in process
(runtime/local.py LocalPipeline, one thread, uncached: int8 alone), in rounds of a few pairs that every build
takes in turn (the order turned by one each round, as the shared machine's speed drifts): seconds per image
(prompt to decoded pixels) and PSNR against the float build's image (mean and worst).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import record  # noqa: E402

SECTION = "precision_sweep"
MODEL, NAME = Path("models/shapes-flux"), "shapes"
PAIRS, QUICK_PAIRS, ROUND_PAIRS = 12, 3, 4
STRICT_MARGIN_DB = 3.0  # the strict target: this far above the default choice's worst image on the sweep's pairs


def build(out: Path, cache: Path, lines: list[str], **target) -> Path:
    """``out`` built with TargetOptions(**target) (kept there, with its log, and taken again on a later run)."""
    from machgen.builder.build import TargetOptions, build_repository

    noted = out / "precision_sweep.log"
    if noted.exists():
        lines.extend(noted.read_text().splitlines())
        return out
    start = time.perf_counter()
    build_repository(MODEL, NAME, out, preview=False, log=lines.append, export_cache=cache,
                     target_options=TargetOptions(**target))
    noted.write_text("\n".join(lines) + "\n")
    print(f"built {out.name} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def sweep_record(repository: Path) -> dict:
    """The manifest's record of the sweep, its groups kept float those of every denoiser part."""
    precision = json.loads((repository / f"{NAME}_sampler" / "1" / "pipeline.json").read_text())["precision"]
    kept = {group: why for entry in precision.values() for group, why in entry["sweep"]["float_groups"].items()}
    return {**precision["denoiser_tail"]["sweep"], "float_groups": kept}


def sweep_table(lines: list[str]) -> list[str]:
    """The sweep's table and summary from a build's log."""
    start = next(index for index, line in enumerate(lines) if line.startswith("precision sweep: ")
                 and "layer groups" in line)
    end = next(index for index in range(start + 1, len(lines)) if lines[index].startswith("precision sweep: ")
               and lines[index].endswith(" s"))
    return [line for line in lines[start:end + 1] if "groups measured" not in line]


def denoiser_bytes(repository: Path) -> int:
    files = [repository / f"{NAME}_denoiser_head" / "1", repository / f"{NAME}_denoiser_tail" / "1",
             repository / f"{NAME}_sampler" / "1" / "components" / "denoiser_reuse"]
    return sum(path.stat().st_size for folder in files for path in folder.glob("model.onnx*"))


def measure(builds: dict[str, Path], pairs: list[tuple], round_pairs: int) -> dict[str, dict]:
    """Seconds per image and PSNR against the float build, per build, in alternating rounds."""
    import numpy as np

    from machgen.builder.evaluate import psnr
    from machgen.runtime.local import LocalPipeline

    pipelines = {label: LocalPipeline(repository, NAME, intra_op_threads=1) for label, repository in builds.items()}
    labels = list(builds)
    images = {label: [None] * len(pairs) for label in labels}
    seconds = {label: [] for label in labels}

    def run(label, index):
        prompt, seed = pairs[index]
        return pipelines[label].generate(prompt, seed=seed, cache_policy="none")[0][0]

    for label in labels:  # warm-up: sessions and first-call allocations
        run(label, 0)
    for number, first in enumerate(range(0, len(pairs), round_pairs)):
        turn = number % len(labels)
        for label in labels[turn:] + labels[:turn]:
            for index in range(first, min(first + round_pairs, len(pairs))):
                start = time.perf_counter()
                images[label][index] = run(label, index)
                seconds[label].append(time.perf_counter() - start)
        print(f"{min(first + round_pairs, len(pairs))}/{len(pairs)} pairs", flush=True)
    for pipeline in pipelines.values():
        pipeline.close()
    rows = {}
    for label in labels:
        scores = [psnr(image, reference) for image, reference in zip(images[label], images["float"])]
        rows[label] = {"seconds": float(np.mean(seconds[label])), "psnr_mean": float(np.mean(scores)),
                       "psnr_worst": float(np.min(scores)), "denoiser_bytes": denoiser_bytes(builds[label])}
        print(json.dumps({"build": label, **rows[label]}), flush=True)
    return rows


def effect_table(rows: dict[str, dict], records: dict[str, dict]) -> list[str]:
    lines = ["| build | groups kept float | linear compute kept float | s / image | faster than float | "
             "PSNR vs float, mean (worst) dB | denoiser MiB | a step on the sweep's inputs, ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    float_seconds = rows["float"]["seconds"]
    for label, row in rows.items():
        sweep = records.get(label)
        kept = "all" if label == "float" else (", ".join(sweep["float_groups"]) or "none") if sweep else "none"
        compute = f"{100 * sweep['float_compute_share']:.1f} %" if sweep else "-"
        quality = "-" if label == "float" else f"{row['psnr_mean']:.2f} ({row['psnr_worst']:.2f})"
        step = (f"{sweep['step_ms']['chosen']:.2f} (float {sweep['step_ms']['float']:.2f}, all int8 "
                f"{sweep['step_ms']['int8']:.2f})") if sweep else "-"
        lines.append(f"| {label} | {kept} | {compute} | {row['seconds']:.3f} | "
                     f"**{float_seconds / row['seconds']:.2f}x** | {quality} | {row['denoiser_bytes'] / 2**20:.2f} | "
                     f"{step} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, help=f"held-out pairs (default {PAIRS}; {QUICK_PAIRS} with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_PAIRS} pairs, to check that it runs")
    parser.add_argument("--round", type=int, default=ROUND_PAIRS, help="pairs a build runs before the next's turn")
    parser.add_argument("--builds", type=Path, help="keep the builds here and take them again on a later run "
                                                    "(default: a temporary folder)")
    parser.add_argument("--record", type=Path, help="write the tables into this markdown file")
    args = parser.parse_args()
    count = args.count or (QUICK_PAIRS if args.quick else PAIRS)
    if count < 1 or args.round < 1:
        parser.error("--count and --round must be at least 1")
    import torch

    from machgen.builder.calibrate import HOLDOUT_PROMPTS_SEED
    from machgen.builder.precision_sweep import SweepSettings
    from machgen.datasets import shapes

    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory(prefix="machgen-precision-sweep-") as scratch:
        root = args.builds or Path(scratch)
        cache = root / "export-cache"
        logs: dict[str, list[str]] = {label: [] for label in ("float", "int8", "sweep", "strict")}
        builds = {"float": build(root / "float", cache, logs["float"]),
                  "int8": build(root / "int8", cache, logs["int8"], precision="int8", precision_sweep=False),
                  "sweep": build(root / "sweep", cache, logs["sweep"], precision="int8")}
        default = sweep_record(builds["sweep"])
        strict_psnr = round(default["chosen"]["psnr_worst"] + STRICT_MARGIN_DB, 1)
        builds["strict"] = build(root / "strict", cache, logs["strict"], precision="int8",
                                 sweep=SweepSettings(min_psnr=strict_psnr))
        records = {label: sweep_record(builds[label]) for label in ("sweep", "strict")}
        for label in ("sweep", "strict"):
            print("\n".join(sweep_table(logs[label])), flush=True)
        pairs = [(prompt, seed) for prompt, seed, _ in shapes.evaluation_prompts(count, seed=HOLDOUT_PROMPTS_SEED)]
        rows = measure(builds, pairs, args.round)
    renamed = {"float": "float", "int8": "all int8 (--no-precision-sweep)",
               "sweep": f"sweep, default target {default['min_psnr']:g} dB",
               "strict": f"sweep, target {strict_psnr:g} dB"}
    text = "\n".join([
        f"Model `{MODEL.name}` (image default), `machgen-build build --precision int8` (onnxruntime target) with "
        f"and without its sweep, measured {started} on {os.cpu_count()} CPU cores ({platform.machine()}) shared "
        f"with other work, one thread. The sweep: {default['pairs']} prompt/seed pairs of calibrate's fit set, "
        f"{default['steps']} steps, uncached; each layer group int8 alone, the rest float; (a) out err: the "
        "denoiser step's output (head and tail chained) against float on the recorded float inputs, relative RMS; "
        "departs: the largest output departure of a graph on its recorded inputs as a share of its largest float "
        "output (the build's parity check refuses beyond 5 %); compute: the group's share of a step's linear "
        "multiply-adds; PSNR: the pairs' images with that group alone int8 against the float build's. The table "
        "at the default target (the card's 33 dB + 10):",
        "", "```", *sweep_table(logs["sweep"]), "```", "",
        f"The stricter target, {strict_psnr:g} dB (the default choice's worst image on the sweep's pairs + "
        f"{STRICT_MARGIN_DB:g} dB), kept float: "
        + (", ".join(f"{group} ({why})" for group, why in records["strict"]["float_groups"].items()) or "none")
        + f" (chosen: {records['strict']['chosen']['psnr_mean']:.2f} dB mean, "
          f"{records['strict']['chosen']['psnr_worst']:.2f} worst on the sweep's pairs).",
        "",
        f"Effect on {len(pairs)} pairs of calibrate's held-out set (generator seed {HOLDOUT_PROMPTS_SEED}), which "
        f"the sweep never saw: each build in process (runtime/local.py), uncached, in rounds of {args.round} pairs "
        "that every build runs in turn; seconds per image, prompt to decoded pixels; PSNR against the float build's "
        "image; denoiser MiB: the head, tail and reuse graphs' files.",
        "",
        *effect_table({renamed[label]: row for label, row in rows.items()},
                      {renamed[label]: value for label, value in records.items()}),
    ])
    print(text, flush=True)
    if args.record:
        record(args.record, f"{SECTION}:{MODEL.name}", text, "INT8 sensitivity sweep (perf/precision_sweep.py)")
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
