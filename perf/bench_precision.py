"""Low-precision linear layers against float and against diffusers, in one run (issue 62): the image default
(models/shapes-flux) and the video default (models/shapes-wan), each built twice (`machgen-build build
--precision float` and `--precision int8`, the onnxruntime target), run in process by
machgen/runtime/local.py's LocalPipeline (the served sampler and exported files, without Triton), with cache
reuse off (cache_policy none) and at the model's calibrated default, against diffusers' FluxPipeline /
WanPipeline run eagerly and uncached at the card's settings on the same prompt/seed pairs.

    OMP_NUM_THREADS=1 python perf/bench_precision.py                  # 32 held-out pairs per model
    OMP_NUM_THREADS=1 python perf/bench_precision.py --quick          # 4 pairs, to check it runs
    OMP_NUM_THREADS=1 python perf/bench_precision.py --record perf/RESULTS.md

The pairs come from generator seed BENCH_HOLDOUT_SEED of the datasets' evaluation_prompts, which neither
`machgen-build calibrate` (its fit and held-out sets) nor the other benchmarks (seed 9001) use; refused if a
pair is in calibrate's default sets. In rounds of a few pairs, diffusers and every setting take their turn,
the order of the settings turned by one each round, since a shared machine's speed drifts over minutes. One
thread everywhere (torch and ONNX Runtime), as the issue's probe measured. Per setting: tail passes, seconds
per image or clip (the generate call, text encoding to decoded pixels), the ratio against diffusers eager,
PSNR against diffusers' float output (mean and worst image or clip; a clip's PSNR over all its frames), the
detector's accuracy (images: colour+shape; video: colour, shape and direction all right) and the bytes of the
denoiser's files (the build's file_bytes of its head, tail and reuse graphs; the joined head+tail graph that
the server loads is a copy of the same weights and not counted again).

Memory (after the speed and quality runs, or alone with --memory-only: builds, serves, measures, nothing else):
per component, the weight bytes each build's manifest records (``weight_bytes``), float against int8; then each
build served alone by the real tritonserver (machgen/server.py), one after the other in the same run: the
resident memory (RSS, psutil) summed over tritonserver and all its Python-backend stub processes once the server
is ready and again after a fixed warm-up (WARMUP_ALONE requests one after another, then WARMUP_TOGETHER at
once, at the served defaults), with the proportional share (PSS: a page shared by N processes counted 1/N) after
the warm-up beside it, since the stubs share their libraries' pages and RSS counts those in each.

    OMP_NUM_THREADS=1 python perf/bench_precision.py --memory-only --record perf/RESULTS.md
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

from common import free_port, record  # noqa: E402

SECTION = "bench_precision"
# Issue 62's number: no calibration and no other benchmark draws its pairs from this generator seed.
BENCH_HOLDOUT_SEED = 6262
PAIRS = 32
QUICK_PAIRS = 4
ROUND_PAIRS = 4
PRECISIONS = ("float", "int8")
POLICIES = ("none", None)  # None: no cache_policy given, the model's calibrated default
# (folder, served name, kind, the speed-up the goal asks of it) for the image and the video default.
MODELS = {"image": (Path("models/shapes-flux"), "shapes", 5.0),
          "video": (Path("models/shapes-wan"), "shapes-video", 3.5)}
GOAL_PSNR = {"mean": 33.0, "worst": 26.0}
MEMORY_SECTION = "bench_precision_memory"
# The warm-up before the second memory reading: requests one after another (a lone request's steps may run in the
# sampler's own sessions), then together (the served denoiser model's), each at the served defaults.
WARMUP_ALONE = 2
WARMUP_TOGETHER = 2
WARMUP_PROMPTS = ("a red circle at the top left", "a blue square at the center", "a green triangle at the right",
                  "a yellow circle at the bottom")
SERVER_START_S = 360.0


def holdout_pairs(kind: str, count: int):
    """``count`` (prompt, seed, label or motion) no calibration saw: refused if any is in calibrate's sets."""
    from machgen.builder.calibrate import FIT_PAIRS, FIT_PROMPTS_SEED, HOLDOUT_PAIRS, HOLDOUT_PROMPTS_SEED
    from machgen.datasets import moving_shapes, shapes

    dataset = shapes if kind == "image" else moving_shapes
    calibration = {(prompt, seed) for size, generator in ((FIT_PAIRS, FIT_PROMPTS_SEED),
                                                           (HOLDOUT_PAIRS, HOLDOUT_PROMPTS_SEED))
                   for prompt, seed, _ in dataset.evaluation_prompts(size, seed=generator)}
    pairs = dataset.evaluation_prompts(count, seed=BENCH_HOLDOUT_SEED)
    shared = calibration & {(prompt, seed) for prompt, seed, _ in pairs}
    assert not shared, f"pairs calibration used: {sorted(shared)}"
    return pairs


def build(model_dir: Path, name: str, precision: str, out: Path) -> tuple[Path, int]:
    """The repository built at ``precision`` in ``out`` (kept there and taken again on a later run, with its
    denoiser bytes in bench_precision.json), and the bytes of its denoiser's files."""
    from machgen.builder.build import TargetOptions, build_repository
    from machgen.contract.specs import is_denoiser

    noted = out / "bench_precision.json"
    if noted.exists():
        return out, json.loads(noted.read_text())["denoiser_bytes"]
    start = time.perf_counter()
    results = build_repository(model_dir, name, out, preview=False, log=lambda line: None,
                               target_options=TargetOptions(precision=precision))
    denoiser_bytes = sum(result.file_bytes for result in results if is_denoiser(result.name))
    noted.write_text(json.dumps({"denoiser_bytes": denoiser_bytes,
                                 "components": {r.name: r.file_bytes for r in results}}))
    print(f"built {model_dir.name} {precision} in {time.perf_counter() - start:.0f} s: denoiser "
          f"{denoiser_bytes / 2**20:.2f} MiB", flush=True)
    return out, denoiser_bytes


def build_folder(scratch: Path, model_dir: Path, precision: str) -> Path:
    return scratch / f"{model_dir.name}-{precision}"


def eager_runner(model_dir: Path, kind: str):
    """A function (prompt, seed) -> uint8 image [H, W, 3] or clip [F, H, W, 3] from diffusers eager, uncached,
    at the card's settings."""
    import numpy as np
    import torch

    from machgen.builder.evaluate import sample_videos
    from machgen.builder.model_folder import detect_family, load_pipeline, served_defaults

    family = detect_family(model_dir)
    pipe = load_pipeline(model_dir, family)
    pipe.set_progress_bar_config(disable=True)
    defaults = served_defaults(model_dir, family, pipe)
    if kind == "video":
        return lambda prompt, seed: sample_videos(pipe, defaults, [(prompt, seed, None)])[0]

    def image(prompt, seed):
        out = pipe(prompt, height=defaults.height, width=defaults.width,
                   num_inference_steps=defaults.num_inference_steps, guidance_scale=defaults.guidance_scale,
                   true_cfg_scale=defaults.true_cfg_scale, negative_prompt=defaults.negative_prompt,
                   max_sequence_length=defaults.max_sequence_length,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images[0]
        return (out * 255).round().astype(np.uint8)

    return image


def accuracy(kind: str, outputs, pairs) -> float:
    from machgen.builder.evaluate import score, score_motion

    truths = [truth for _, _, truth in pairs]
    return score(outputs, truths).colour_shape if kind == "image" else score_motion(outputs, truths).all_three


def measure(kind: str, model_dir: Path, pairs, round_pairs: int, scratch: Path) -> tuple[dict, list[dict]]:
    """diffusers' row and one row per (precision, policy), run in alternating rounds."""
    import numpy as np
    import torch

    from machgen.builder.evaluate import psnr
    from machgen.runtime.local import LocalPipeline

    torch.set_num_threads(1)
    _, name, _ = MODELS[kind]
    built = {precision: build(model_dir, name, precision, build_folder(scratch, model_dir, precision))
             for precision in PRECISIONS}
    pipelines = {precision: LocalPipeline(repository, name, intra_op_threads=1)
                 for precision, (repository, _) in built.items()}
    eager = eager_runner(model_dir, kind)
    settings = [("diffusers", None, None)] + [("machgen", precision, policy) for precision in PRECISIONS
                                              for policy in POLICIES]
    outputs = {setting: [None] * len(pairs) for setting in settings}
    seconds = {setting: [] for setting in settings}
    passes = {setting: [] for setting in settings}
    labels = {}

    def run(setting, index):
        prompt, seed, _ = pairs[index]
        stack, precision, policy = setting
        if stack == "diffusers":
            return eager(prompt, seed), None
        frames, stats = pipelines[precision].generate(prompt, seed=seed, cache_policy=policy)
        return frames[0] if kind == "image" else frames, stats

    for setting in settings:  # warm-up: sessions and first-call allocations, both row counts
        run(setting, 0)
    for number, first in enumerate(range(0, len(pairs), round_pairs)):
        turn = number % len(settings)
        for setting in settings[turn:] + settings[:turn]:
            for index in range(first, min(first + round_pairs, len(pairs))):
                start = time.perf_counter()
                output, stats = run(setting, index)
                seconds[setting].append(time.perf_counter() - start)
                outputs[setting][index] = output
                if stats is not None:
                    passes[setting].append(stats.denoiser_tail_passes)
                    threshold = "" if stats.cache_threshold is None else f" {stats.cache_threshold:g}"
                    labels[setting] = "none" if setting[2] else f"default ({stats.cache_policy}{threshold})"
        print(f"{kind}: {min(first + round_pairs, len(pairs))}/{len(pairs)} pairs", flush=True)
    for pipeline in pipelines.values():
        pipeline.close()

    reference = outputs[settings[0]]
    eager_row = {"setting": "diffusers eager (float, uncached)", "seconds": float(np.mean(seconds[settings[0]])),
                 "accuracy": accuracy(kind, reference, pairs)}
    rows = []
    for setting in settings[1:]:
        _, precision, _ = setting
        scores = [psnr(output, ref) for output, ref in zip(outputs[setting], reference)]
        rows.append({"setting": f"machgen {precision} {labels[setting]}", "precision": precision,
                     "cached": setting[2] is None, "tail_passes": float(np.mean(passes[setting])),
                     "seconds": float(np.mean(seconds[setting])), "psnr_mean": float(np.mean(scores)),
                     "psnr_worst": float(np.min(scores)), "accuracy": accuracy(kind, outputs[setting], pairs),
                     "denoiser_bytes": built[precision][1]})
    for row in (eager_row, *rows):
        print(json.dumps(row), flush=True)
    return eager_row, rows


def table(kind: str, model_dir: Path, eager: dict, rows: list[dict], pairs: int,
          round_pairs: int) -> tuple[str, list[str]]:
    """The markdown table, and the settings that meet the goal."""
    _, _, speedup_goal = MODELS[kind]
    unit = "image" if kind == "image" else "clip"
    what = "colour+shape" if kind == "image" else "colour, shape and direction"
    lines = [f"| {eager['setting']} | - | {eager['seconds']:.3f} | 1.00x | - | {100 * eager['accuracy']:.1f} % | - "
             "| - |"]
    met = []
    for row in rows:
        speedup = eager["seconds"] / row["seconds"]
        holds = (speedup >= speedup_goal and row["psnr_mean"] >= GOAL_PSNR["mean"]
                 and row["psnr_worst"] >= GOAL_PSNR["worst"])
        if holds:
            met.append(row["setting"])
        points = 100 * (row["accuracy"] - eager["accuracy"])
        lines.append(f"| {row['setting']} | {row['tail_passes']:.1f} | {row['seconds']:.3f} | **{speedup:.2f}x** | "
                     f"{row['psnr_mean']:.2f} ({row['psnr_worst']:.2f}) | {100 * row['accuracy']:.1f} % "
                     f"({points:+.1f}) | {row['denoiser_bytes'] / 2**20:.2f} | {'yes' if holds else 'no'} |")
    text = "\n".join([
        f"Model `{model_dir.name}` ({kind} default), {pairs} prompt/seed pairs from generator seed "
        f"{BENCH_HOLDOUT_SEED} (the dataset's evaluation_prompts), which no calibration uses, in process "
        f"(machgen/runtime/local.py LocalPipeline over each build, no Triton), one thread (torch and ONNX Runtime), "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), measured {time.strftime('%Y-%m-%d %H:%M')}. In rounds "
        f"of {round_pairs} pairs that diffusers and every setting run in turn (the order turned by one each round). "
        f"Seconds per {unit}: the generate call, prompt to decoded pixels; faster: diffusers' "
        f"{'FluxPipeline' if kind == 'image' else 'WanPipeline'} run eagerly, uncached, in float32 at the card's "
        f"settings, over it. PSNR against diffusers' output for the same pair (mean and worst {unit}). Accuracy: "
        f"the detector's {what} right (points against diffusers). Denoiser MiB: the build's file_bytes of its "
        f"denoiser graphs (head, tail and reuse; the joined head+tail graph holds the same weights again). "
        f"Goal (issue 62): at least {speedup_goal:g}x "
        f"faster than diffusers at {GOAL_PSNR['mean']:g} dB mean and {GOAL_PSNR['worst']:g} dB worst or better.",
        "",
        f"| setting | tail passes / {unit} | s / {unit} | faster | PSNR vs diffusers, mean (worst) dB | accuracy | "
        "denoiser MiB | goal met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *lines,
        "",
        f"Goal for the {kind} default: " + (f"met by {', '.join(met)}." if met else "not met by any setting."),
    ])
    return text, met


def manifest_weights(repository: Path, name: str) -> tuple[dict[str, int], set[str]]:
    """The weight bytes per component that the build's manifest records, and which of them are joined chains
    (their steps' weights again)."""
    from machgen.contract.manifest import PipelineManifest, pipeline_dir

    manifest = PipelineManifest.read(pipeline_dir(repository, name))
    if manifest.weight_bytes is None:
        raise SystemExit(f"{repository}: its manifest records no weight_bytes (built before machgen recorded them): "
                         "delete the build there and run again")
    return dict(manifest.weight_bytes), {component for component, entry in manifest.components.items()
                                         if entry.steps}


def server_memory(pid: int) -> dict[str, float]:
    """RSS and PSS in bytes summed over process ``pid`` and all its descendants, and how many they are."""
    import psutil

    root = psutil.Process(pid)
    total = {"processes": 0, "rss": 0, "pss": 0}
    for process in [root, *root.children(recursive=True)]:
        try:
            info = process.memory_full_info()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        total["processes"] += 1
        total["rss"] += info.rss
        total["pss"] += info.pss
    return total


def served_memory(repository: Path, name: str) -> dict[str, float]:
    """The build served alone: its server's memory once ready, and after the warm-up."""
    import threading

    from machgen.client import MachgenClient
    from machgen.server import Ports, TritonServer

    server = TritonServer(repository, Ports(free_port(), free_port(), free_port()))
    try:
        server.start(timeout=SERVER_START_S)
        ready = server_memory(server.process.pid)
        with MachgenClient(server.grpc_url) as client:
            for seed in range(WARMUP_ALONE):
                client.generate(name, WARMUP_PROMPTS[seed % len(WARMUP_PROMPTS)], seed=seed)
        failures = []

        def together(seed: int) -> None:
            try:
                with MachgenClient(server.grpc_url) as client:
                    client.generate(name, WARMUP_PROMPTS[seed % len(WARMUP_PROMPTS)], seed=seed)
            except Exception as error:  # noqa: BLE001 (said below, after the others have finished)
                failures.append(error)

        threads = [threading.Thread(target=together, args=(WARMUP_ALONE + index,))
                   for index in range(WARMUP_TOGETHER)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise RuntimeError(f"warm-up request failed: {failures[0]}")
        warm = server_memory(server.process.pid)
    finally:
        server.stop()
    return {"processes": warm["processes"], "rss_ready": ready["rss"], "rss_warm": warm["rss"],
            "pss_warm": warm["pss"]}


def memory(kind: str, model_dir: Path, scratch: Path) -> dict:
    """Each precision's weights (from its build's manifest) and its served server's memory, measured one build
    after the other in this run."""
    _, name, _ = MODELS[kind]
    found = {}
    for precision in PRECISIONS:
        repository, _ = build(model_dir, name, precision, build_folder(scratch, model_dir, precision))
        weights, chains = manifest_weights(repository, name)
        start = time.perf_counter()
        served = served_memory(repository, name)
        print(json.dumps({"memory": f"{model_dir.name} {precision}", **served,
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)
        found[precision] = {"weights": weights, "chains": chains, "served": served}
    return found


def mib(count: float) -> str:
    return f"{count / 2**20:.2f}"


def memory_table(kind: str, model_dir: Path, found: dict, command: str) -> str:
    """The markdown of ``memory``'s figures: weights per component, then the served memory, float against int8."""
    low = PRECISIONS[-1]
    chains = set().union(*(found[precision]["chains"] for precision in PRECISIONS))
    names = sorted(set().union(*(found[precision]["weights"] for precision in PRECISIONS)),
                   key=lambda component: (component in chains, component))

    def ratio(value: float, base: float) -> str:
        return f"{value / base:.2f}x" if base else "-"

    def weight_row(label: str, counts: list) -> str:
        cells = [mib(count) if count is not None else "-" for count in counts]
        known = counts[0] is not None and counts[-1] is not None
        return f"| {label} | {' | '.join(cells)} | {ratio(counts[-1], counts[0]) if known else '-'} |"

    weight_lines = []
    for component in names:
        label = f"{component} (joined: its steps' weights again, a model of its own)" if component in chains \
            else component
        weight_lines.append(weight_row(label, [found[p]["weights"].get(component) for p in PRECISIONS]))
    totals = [sum(count for component, count in found[p]["weights"].items() if component not in chains)
              for p in PRECISIONS]
    weight_lines.append(weight_row("**all components** (joined copies aside)", totals))
    served = {precision: found[precision]["served"] for precision in PRECISIONS}
    server_lines = [f"| {precision} | {served[precision]['processes']} | {mib(served[precision]['rss_ready'])} | "
                    f"{mib(served[precision]['rss_warm'])} | {mib(served[precision]['pss_warm'])} |"
                    for precision in PRECISIONS]
    base, other = served[PRECISIONS[0]], served[low]
    server_lines.append(
        f"| {low} - {PRECISIONS[0]} | | {mib(other['rss_ready'] - base['rss_ready'])} | "
        f"{mib(other['rss_warm'] - base['rss_warm'])} | {mib(other['pss_warm'] - base['pss_warm'])} |")
    return "\n".join([
        f"Model `{model_dir.name}` ({kind} default), `machgen-build build --precision float` and `--precision "
        f"{low}` (onnxruntime target), {os.cpu_count()} CPU cores ({platform.machine()}), measured "
        f"{time.strftime('%Y-%m-%d %H:%M')}. Weights: each component's bytes as its build's manifest records them "
        f"(`weight_bytes`: the ONNX graph's initializers, external data included). Served: each build alone "
        f"by tritonserver, one after the other in this run; RSS (psutil) summed over tritonserver and all its "
        f"Python-backend stubs once ready and after the warm-up ({WARMUP_ALONE} requests one after another, then "
        f"{WARMUP_TOGETHER} at once, served defaults); PSS after the warm-up (shared pages divided among the "
        f"processes that map them). Command: `{command}`.",
        "",
        f"| component | {' MiB | '.join(PRECISIONS)} MiB | {low} / {PRECISIONS[0]} |",
        "| --- | --- | --- | --- |",
        *weight_lines,
        "",
        "| served build | processes | RSS ready, MiB | RSS after warm-up, MiB | PSS after warm-up, MiB |",
        "| --- | --- | --- | --- | --- |",
        *server_lines,
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--count", type=int, help=f"held-out prompt/seed pairs per model (default {PAIRS}; "
                                                  f"{QUICK_PAIRS} with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_PAIRS} pairs, to check that it runs")
    parser.add_argument("--round", type=int, default=ROUND_PAIRS, help="pairs a setting runs before the next's turn")
    parser.add_argument("--builds", type=Path,
                        help="keep the four builds here and take them again on a later run (default: a temporary "
                             "folder)")
    parser.add_argument("--record", type=Path, help="write the tables into this markdown file")
    parser.add_argument("--memory-only", action="store_true",
                        help="build, serve and measure the weights and the server's memory; no speed or quality runs")
    parser.add_argument("--image-model", type=Path, default=MODELS["image"][0],
                        help=f"the image model's folder (default {MODELS['image'][0]})")
    parser.add_argument("--video-model", type=Path, default=MODELS["video"][0],
                        help=f"the video model's folder (default {MODELS['video'][0]})")
    args = parser.parse_args()
    model_dirs = {"image": args.image_model, "video": args.video_model}
    count = args.count or (QUICK_PAIRS if args.quick else PAIRS)
    if count < 1 or args.round < 1:
        parser.error("--count and --round must be at least 1")

    verdicts = {}
    with tempfile.TemporaryDirectory(prefix="machgen-bench-precision-") as scratch:
        builds = args.builds or Path(scratch)
        for kind in args.models:
            model_dir = model_dirs[kind]
            if not args.memory_only:
                pairs = holdout_pairs(kind, count)
                eager, rows = measure(kind, model_dir, pairs, args.round, builds)
                text, verdicts[kind] = table(kind, model_dir, eager, rows, len(pairs), args.round)
                print(text, flush=True)
                if args.record:
                    record(args.record, f"{SECTION}:{model_dir.name}", text,
                           "Low precision against float and diffusers (perf/bench_precision.py)")
                    print(f"recorded in {args.record}")
            command = "OMP_NUM_THREADS=1 python perf/bench_precision.py " + " ".join(sys.argv[1:])
            text = memory_table(kind, model_dir, memory(kind, model_dir, builds), command)
            print(text, flush=True)
            if args.record:
                record(args.record, f"{MEMORY_SECTION}:{model_dir.name}", text,
                       "Low precision: weights and server memory (perf/bench_precision.py)")
                print(f"recorded in {args.record}")
    for kind, met in verdicts.items():
        print(f"goal for the {kind} default ({MODELS[kind][2]:g}x at {GOAL_PSNR['mean']:g} dB mean, "
              f"{GOAL_PSNR['worst']:g} worst): " + (f"met by {', '.join(met)}" if met else "not met by any setting"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
