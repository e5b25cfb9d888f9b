"""Where an export's time goes, per component, and the TorchScript-based
exporter (``torch.onnx.export(..., dynamo=False)``) beside today's dynamo
one, on the same module and sample inputs, in one process.

For each model (a family's tiny random-weight model, as the tests write it,
or a model folder) and each component a build exports: the dynamo path's
torch.export trace, its conversion and the build's parity check (CPU
seconds of this process: on a machine shared with other work they move
less than wall seconds); then the TorchScript export (CPU seconds), whether
it worked, its TracerWarnings, its parity against torch on the same two
input sets as the build's check (the sample inputs and their first row
alone: a batch size the trace did not see), whether a build takes it
(``export.export_torchscript``: those checks and the one at other sizes)
and that one's cost, and both files' ONNX Runtime run time on the sample
inputs (median of ``--runs``). One JSON line per component (``--json``).

    OMP_NUM_THREADS=1 python perf/bench_export.py flux wan models/shapes-flux
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _model_folder(name: str, scratch: Path) -> Path:
    if Path(name).is_dir():
        return Path(name)
    from machgen.builder.model_folder import write_tiny_model
    from machgen.families.registry import get_family

    return write_tiny_model(get_family(name), scratch / f"tiny-{name}")


def _run_seconds(path: Path, inputs: dict, runs: int) -> float:
    from machgen.runtime.components import open_component

    session = open_component(path, device="cpu")
    session.run(inputs)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torchscript_diagnosis(component, path: Path) -> tuple[float, str, list[str]]:
    """What export.export_torchscript does, step by step: (export seconds, "exported" or why it failed, the
    trace's TracerWarnings)."""
    import warnings

    import torch

    from machgen.builder import export

    spec = component.spec
    export._register_torchscript_translations()
    names = [t.name for t in spec.inputs]
    dynamic_axes = {t.name: {axis: size for axis, size in enumerate(t.shape) if isinstance(size, str)}
                    for t in spec.inputs + spec.outputs}
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.process_time()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            torch.onnx.export(export._positional(component.module, names),
                              tuple(component.sample_inputs[name] for name in names), str(path), dynamo=False,
                              input_names=names, output_names=[t.name for t in spec.outputs],
                              dynamic_axes=dynamic_axes, opset_version=torch.onnx._constants.ONNX_DEFAULT_OPSET)
            outcome = "exported"
        except Exception as error:  # noqa: BLE001 (what fails is what is measured)
            outcome = f"export failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    seconds = time.process_time() - start
    traced = sorted({f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:90]}" for w in caught
                     if issubclass(w.category, torch.jit.TracerWarning)})
    return seconds, outcome, traced


def measure(name: str, scratch: Path, runs: int, adapters: int) -> list[dict]:
    import onnx

    from machgen.builder import export
    from machgen.builder.build import _quiet_exporter, components_to_export
    from machgen.builder.model_folder import detect_family, load_pipeline
    from machgen.builder.repository import ServingOptions

    _quiet_exporter()
    folder = _model_folder(name, scratch)
    family = detect_family(folder)
    pipe = load_pipeline(folder, family)
    exports, _, _ = components_to_export(family.exporter(), pipe, ServingOptions(max_lora_rank=adapters),
                                         log=lambda line: None)
    rows = []
    traced = export.trace
    for component, _ in exports:
        spec = component.spec
        row = {"model": name, "component": spec.name}
        trace_seconds = []

        def timed_trace(*args, **kwargs):
            start = time.process_time()
            try:
                return traced(*args, **kwargs)
            finally:
                trace_seconds.append(time.process_time() - start)

        dynamo_path = scratch / name.replace("/", "_") / spec.name / "dynamo.onnx"
        export.trace = timed_trace
        try:
            start = time.process_time()
            export.export_onnx(component, dynamo_path, exporter="dynamo")
            row["dynamo_s"] = time.process_time() - start
        finally:
            export.trace = traced
        row["trace_s"] = trace_seconds[0]
        row["convert_s"] = row["dynamo_s"] - row["trace_s"]
        start = time.process_time()
        report = export.check_parity(component, dynamo_path)
        row["parity_s"] = time.process_time() - start
        row["dynamo_diff"], row["tolerance"] = report.max_abs_diff, report.tolerance
        sample = {t.name: component.sample_inputs[t.name] for t in spec.inputs}
        row["dynamo_run_s"] = _run_seconds(dynamo_path, sample, runs)
        script_path = dynamo_path.with_name("torchscript.onnx")
        row["torchscript_s"], row["torchscript"], row["tracer_warnings"] = torchscript_diagnosis(component,
                                                                                                script_path)
        if row["torchscript"] == "exported":
            start = time.process_time()
            try:
                report = export.check_parity(component, script_path)
                row["torchscript"] = "same outputs" if not row["tracer_warnings"] else "same outputs, traced values"
                row["torchscript_diff"] = report.max_abs_diff
                row["torchscript_run_s"] = _run_seconds(script_path, sample, runs)
            except Exception as error:  # noqa: BLE001
                row["torchscript"] = f"parity failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            row["torchscript_parity_s"] = time.process_time() - start
            ops = [node.op_type for node in onnx.load(script_path).graph.node]
            row["torchscript_nodes"], row["torchscript_scatternd"] = len(ops), ops.count("ScatterND")
        row["dynamo_nodes"] = len(onnx.load(dynamo_path).graph.node)
        # What a build takes (export.export_torchscript's checks, the sizes' among them), and what that costs.
        start = time.process_time()
        row["applies"] = export.export_torchscript(component, dynamo_path.with_name("checked.onnx"))
        row["torchscript_checked_s"] = time.process_time() - start
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="family names (their tiny model) or model folders")
    parser.add_argument("--runs", type=int, default=5, help="ONNX Runtime runs per file (median)")
    parser.add_argument("--max-lora-rank", type=int, default=0, help="export with per-request adapters")
    parser.add_argument("--json", type=Path, help="append the rows to this file (JSON lines)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as scratch:
        for name in args.models:
            try:
                rows = measure(name, Path(scratch), args.runs, args.max_lora_rank)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                continue
            if args.json:
                with args.json.open("a") as out:
                    out.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    sys.exit(main())
