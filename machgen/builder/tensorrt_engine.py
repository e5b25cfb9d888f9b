"""The ``tensorrt`` target: one TensorRT engine per component, built from the
component's exported ONNX file and served by Triton's TensorRT backend
(``platform: "tensorrt_plan"``).

Written against TensorRT 10's documented Python API; TensorRT cannot be
installed on the machines this was written on, so ``build_engine`` and
``refit_engine`` have not run anywhere (their tests skip without TensorRT).
What runs everywhere: the optimization profiles derived from the family's
shape ranges, and the engine metadata (machgen/contract/engines.py, which
the serving side checks against its host).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Mapping

from machgen.contract.engines import ENGINE_FILE, EngineMetadata, host_gpu
from machgen.contract.specs import AxisRange, ComponentSpec

PRECISIONS = ("bf16", "fp8")


class TensorRTUnavailable(RuntimeError):
    """This environment has no TensorRT (or no GPU to build for)."""


def require_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise TensorRTUnavailable(
            "the tensorrt target needs TensorRT: install the tensorrt Python package whose version matches the "
            "TensorRT of the Triton container that will serve the engines (for example inside "
            "nvcr.io/nvidia/tritonserver:<release>-py3), on a machine with that container's GPU") from None
    return tensorrt


def shape_profile(spec: ComponentSpec, ranges: Mapping[str, AxisRange],
                  max_batch_size: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape of every input: fixed sizes as they are, the
    batch axis 1..``max_batch_size`` (opt 2: one true-CFG request), other
    named axes from the family's ``ranges``."""
    axes = {"batch": AxisRange(1, min(2, max_batch_size), max_batch_size), **ranges}
    profile = {}
    for tensor in spec.inputs:
        missing = [d for d in tensor.shape if isinstance(d, str) and d not in axes]
        if missing:
            raise ValueError(f"{spec.name}.{tensor.name}: the family gives no range for axes {missing}")
        bounds = [(d, d, d) if isinstance(d, int) else (axes[d].min, axes[d].opt, axes[d].max) for d in tensor.shape]
        profile[tensor.name] = tuple(tuple(b[i] for b in bounds) for i in range(3))
    return profile


def build_engine(onnx_path: Path, spec: ComponentSpec, profile: Mapping[str, tuple], out: Path, precision: str,
                 refittable: bool = True, timing_cache: Path | None = None, sparse_attention: bool = False,
                 log: Callable[[str], None] = print) -> EngineMetadata:
    """Build, serialize and describe the engine of one component into ``out``."""
    trt = require_tensorrt()
    gpu_name, capability = host_gpu()
    if gpu_name is None:
        raise TensorRTUnavailable("the tensorrt target builds on the GPU that will serve it; this host has none")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    plugins: tuple[str, ...] = ()
    fp8_attention = False
    if sparse_attention:
        onnx_path, fp8_attention = _lowered_for_tensorrt(onnx_path)
        from machgen.plugins.tensorrt_plugin import register

        plugins = register()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: the only mode of TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(os.fspath(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"{spec.name}: TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.BF16)
    if precision == "fp8" or fp8_attention:
        # FP8 where the graph says so (Q/DQ pairs, the FP8 attention plugins' operands); BF16 elsewhere.
        config.set_flag(trt.BuilderFlag.FP8)
    if refittable:
        # Weights can be swapped (a fused LoRA) without a rebuild: refit_engine.
        config.set_flag(trt.BuilderFlag.REFIT)
    cache_bytes = timing_cache.read_bytes() if timing_cache is not None and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    optimization = builder.create_optimization_profile()
    for name, (smallest, best, largest) in profile.items():
        optimization.set_shape(name, smallest, best, largest)
    config.add_optimization_profile(optimization)
    config.progress_monitor = _progress_monitor(trt, spec.name, log)
    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"{spec.name}: TensorRT failed to build the engine (see its log above)")
    out.mkdir(parents=True, exist_ok=True)
    (out / ENGINE_FILE).write_bytes(bytes(plan))
    if timing_cache is not None:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    metadata = EngineMetadata(tensorrt_version=trt.__version__, gpu_name=gpu_name, compute_capability=capability,
                              precision=precision, refittable=refittable, plugins=plugins)
    metadata.write(out)
    log(f"{spec.name}: engine built in {time.perf_counter() - start:.0f} s ({precision}, {gpu_name})")
    return metadata


def _lowered_for_tensorrt(onnx_path: Path) -> tuple[Path, bool]:
    """The component's file with its SparseAttention nodes rewritten into
    the ahead-of-time plugins (plugins/tensorrt_plugin.py), written beside
    it so that its external weights resolve; and whether they run in FP8."""
    import onnx

    from machgen.plugins.tensorrt_plugin import lower_for_tensorrt

    model = onnx.load(os.fspath(onnx_path), load_external_data=False)
    fp8 = any(a.name == "precision" and a.s == b"fp8_e4m3" for n in model.graph.node for a in n.attribute)
    if not lower_for_tensorrt(model):
        return onnx_path, False
    lowered = onnx_path.with_name(onnx_path.stem + ".tensorrt.onnx")
    onnx.save_model(model, os.fspath(lowered))
    return lowered, fp8


def _progress_monitor(trt, component: str, log: Callable[[str], None]):
    """Engine builds take minutes: report each phase as TensorRT starts it."""

    class Progress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                log(f"{component}: TensorRT {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            pass

    return Progress()


def refit_engine(engine_folder: Path, onnx_path: Path) -> None:
    """Swap a refittable engine's weights for those of ``onnx_path`` (the
    same component exported with other weights, a fused LoRA for example)."""
    trt = require_tensorrt()
    metadata = EngineMetadata.read(engine_folder)
    if not metadata.refittable:
        raise ValueError(f"{engine_folder}: the engine was built without --refittable; rebuild it")
    logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(logger).deserialize_cuda_engine((engine_folder / ENGINE_FILE).read_bytes())
    refitter = trt.Refitter(engine, logger)
    if not trt.OnnxParserRefitter(refitter, logger).refit_from_file(os.fspath(onnx_path)):
        raise RuntimeError(f"{engine_folder}: {onnx_path} does not match the engine's weights")
    if not refitter.refit_cuda_engine():
        raise RuntimeError(f"{engine_folder}: TensorRT refused the new weights")
    (engine_folder / ENGINE_FILE).write_bytes(bytes(engine.serialize()))
