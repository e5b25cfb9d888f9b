"""From a diffusers model folder to a Triton model repository."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from machgen.builder.model_folder import (detect_family, load_pipeline, model_cache_settings,
                                          refuse_pickled_weights, served_defaults, streaming_settings)
from machgen.contract.adapters import write_component_layers
from machgen.contract.specs import ServedDefaults
from machgen.parallel.layout import ParallelLayout

if TYPE_CHECKING:  # pragma: no cover
    from machgen.builder.family_export import FamilyExport
    from machgen.builder.precision_sweep import SweepSettings
    from machgen.builder.repository import ServingOptions
    from machgen.plugins.schema import SparseAttentionConfig
    from machgen.contract.streaming import StreamingSettings

TARGETS = ("onnxruntime", "torch", "tensorrt")
ATTENTION_KINDS = ("dense", "sparse-fp8")


@dataclass(frozen=True)
class AttentionOptions:
    """How the denoiser's attention is exported."""

    kind: str = "dense"  # one of ATTENTION_KINDS
    block: int = 64  # tokens per query and key block of the sparse operator
    # How each query block picks its key blocks (besides the text and diagonal
    # ones, always kept): "cdf" keeps the fewest whose predicted attention
    # reaches cdf_threshold (adapts to how spread out the attention is),
    # "topk" a fixed share, topk_ratio.
    mask_method: str = "cdf"
    cdf_threshold: float = 0.9
    topk_ratio: float = 0.5

    def config(self, exporter: "FamilyExport", defaults: ServedDefaults) -> "SparseAttentionConfig | None":
        """The operator's attributes for this family, or None for dense attention."""
        from machgen.plugins.schema import SparseAttentionConfig

        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.kind!r} is not one of {', '.join(ATTENTION_KINDS)}")
        if self.kind == "dense":
            return None
        if not exporter.attention_modules:
            raise ValueError(f"family '{exporter.family.name}' declares no attention that SparseAttention can "
                             "replace")
        return SparseAttentionConfig(block_q=self.block, block_k=self.block, mask_method=self.mask_method,
                                     topk_ratio=self.topk_ratio, cdf_threshold=self.cdf_threshold,
                                     dense_prefix_tokens=exporter.dense_attention_tokens(defaults),
                                     precision="fp8_e4m3")


# What each target can build, its default first.
TARGET_PRECISIONS = {"onnxruntime": ("float", "int8"), "torch": ("float",), "tensorrt": ("bf16", "fp8")}


@dataclass(frozen=True)
class TargetOptions:
    """How the GPU targets export and run the components (the onnxruntime
    target always runs float32 on the CPU)."""

    # torch: where the programs are exported, checked and served: "cuda",
    # "cpu", or "auto" (CUDA when this machine has it).
    device: str = "auto"
    # torch: the programs' float dtype (bfloat16, float16, float32); "auto":
    # bfloat16 on CUDA, float32 on the CPU.
    dtype: str = "auto"
    # torch on CUDA: replay each shape bucket's step as a CUDA graph.
    cuda_graphs: bool = True
    # torch: torch.compile every program at load (minutes for a large model).
    compile: bool = False
    # The linear layers' precision, where the target can build it (TARGET_PRECISIONS); None: the target's
    # first. tensorrt: bf16, or fp8 (the denoisers' block linear layers as FP8 Q/DQ, builder/quantize_fp8.py,
    # and the FP8 attention plugin where built; BF16 elsewhere); onnxruntime: float (float32) or int8; torch:
    # float (the programs' --dtype).
    precision: str | None = None
    # onnxruntime int8: which layer groups stay float, chosen by the sensitivity sweep (builder/precision_sweep.py,
    # ``sweep``: its settings, None the defaults); off: every MatMul and Gemm of the denoisers int8.
    precision_sweep: bool = True
    sweep: "SweepSettings | None" = None
    # tensorrt: engines whose weights can be swapped (refit) without a rebuild.
    refittable: bool = True
    # tensorrt: tactic timings kept across builds (read, then rewritten).
    timing_cache: Path | None = None
    # onnxruntime and tensorrt: the ONNX exporter, "dynamo" or "torchscript" (the TorchScript-based one where a
    # component's file passes the checks of builder/export.py export_torchscript, dynamo elsewhere; 15-50x faster
    # per component it takes). None: $MACHGEN_ONNX_EXPORTER, else dynamo.
    onnx_exporter: str | None = None

    def target_precision(self, target: str) -> str:
        """The precision a build for ``target`` uses, or a refusal naming the option and the target."""
        built = TARGET_PRECISIONS[target]
        if self.precision is None:
            return built[0]
        if self.precision not in built:
            raise ValueError(f"--precision {self.precision}: the {target} target builds {', '.join(built)} only "
                             "(FP8 linear layers on the onnxruntime and torch targets are not built yet)")
        return self.precision

    def torch_device(self) -> str:
        import torch

        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def torch_dtype(self, device: str) -> str:
        from machgen.runtime.torch_runner import DTYPES

        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return dtype


@dataclass(frozen=True)
class ComponentResult:
    name: str
    max_abs_diff: float
    tolerance: float
    seconds: float
    # The exported file's bytes with its external data: its weights at the precision it was built in.
    file_bytes: int = 0


def _quiet_exporter() -> None:
    # The exporter warns once per missing torchvision op (none is used here), and its optimizer once per
    # torch.split it leaves alone (the Wan VAE's cache): neither is something a user can act on.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    logging.getLogger("onnxscript.optimizer._constant_folding").setLevel(logging.ERROR)


def _reached_by_swap(component, module_names, layers) -> bool:
    """Whether the attention swap can change ``component``: it holds one of
    ``layers`` (where the family names them), else a submodule of a class
    defined in one of ``module_names``."""
    if layers is not None:
        chosen = {id(layer) for layer in layers}
        return any(id(sub) in chosen for sub in component.module.modules())
    return any(type(sub).__module__ in module_names for sub in component.module.modules())


@contextlib.contextmanager
def attention_for(exporter: "FamilyExport", pipe, sparse, sparse_layers, on_ranks: bool,
                  defaults: ServedDefaults):
    """Inside, the attention a component exports with: ``sparse`` (a SparseAttentionConfig, or None: dense);
    for a component that runs on a parallel layout's ranks (``on_ranks``), the sequence attention (and the
    sparse calls as machgen::sequence_sparse_attention)."""
    from machgen.parallel.op import sequence_sparse_attention_swapped
    from machgen.plugins.ops import attention_swapped

    with contextlib.ExitStack() as stack:
        if on_ranks:
            stack.enter_context(exporter.sequence_attention_swap(pipe))
            if sparse is not None:  # inside the sequence swap: the calls it leaves run the sequence attention
                stack.enter_context(sequence_sparse_attention_swapped(
                    exporter.attention_modules, sparse, sparse_layers,
                    leading_tokens=exporter.dense_attention_tokens(defaults)))
        elif sparse is not None:
            stack.enter_context(attention_swapped(exporter.attention_modules, sparse, sparse_layers))
        yield


def build_repository(model_dir: Path, name: str, out: Path, target: str = "onnxruntime", lora: Path | None = None,
                     options: "ServingOptions | None" = None, attention: AttentionOptions = AttentionOptions(),
                     target_options: TargetOptions = TargetOptions(), export_cache: Path | None = None,
                     log: Callable[[str], None] = print, preview: bool = True, drop_unfit_adapters: bool = False,
                     discard_changes: bool = False, parallel: ParallelLayout | None = None,
                     streaming: "StreamingSettings | None" = None) -> list[ComponentResult]:
    """Export, check and write every component of the model in ``model_dir``
    (with ``lora`` fused into its weights first), served with ``options``;
    components found in ``export_cache`` (default: $MACHGEN_EXPORT_CACHE,
    builder/export_cache.py) are copied from there, not exported again.
    ``preview``: fit the latent-to-RGB preview projection on the built
    repository's own decodes (builder/preview_fit.py).

    Over an earlier build of the pipeline in ``out`` it keeps what users
    added since (adapters, a calibration, edits, their own files) or,
    before exporting anything, refuses with rebuild.RebuildRefused naming
    it; ``drop_unfit_adapters`` deletes the adapters that no longer fit,
    ``discard_changes`` replaces or deletes the rest (builder/rebuild.py).

    ``parallel``: the layout the denoiser's steps run under (torch target;
    builder/parallel.py), refused before any export where the model does
    not allow it.

    ``streaming``: the model's streaming mode (realtime sessions) in place of
    its card's (machgen.json's ``"streaming"``); either adds its components."""
    from machgen.builder.calibrate import calibration_summary
    from machgen.builder.export import ParityReport, check_parity, export_onnx, export_torch, onnx_exporter
    from machgen.builder.quantize import INT8_RELATIVE_TOLERANCE, component_weight_bytes, quantize_int8, weights_note
    from machgen.contract.specs import is_denoiser
    from machgen.builder.export_cache import ExportCache, cache_root, component_key
    from machgen.builder.rebuild import plan_rebuild
    from machgen.builder.repository import ServingOptions, TargetServing, render_repository, write_repository
    from machgen.builder.parallel import check_parallel_build, parallel_variant, write_shard_plan

    if target not in TARGETS:
        raise ValueError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    # Checked before minutes of export.
    target_options = replace(target_options, precision=target_options.target_precision(target))
    if target == "tensorrt":
        from machgen.builder.tensorrt_engine import require_tensorrt

        require_tensorrt()
    options = options or ServingOptions()
    _quiet_exporter()
    family = detect_family(model_dir)
    exporter = family.exporter()
    log(f"loading {model_dir} ({family.diffusers_pipeline}, family '{family.name}')")
    source = built_from(model_dir, lora)  # as loaded: the folder may change during minutes of export
    pipe = load_pipeline(model_dir, family)
    exporter.check(pipe)
    if lora is not None:
        log(f"fusing LoRA {lora}")
        refuse_pickled_weights(lora)
        pipe.load_lora_weights(lora, use_safetensors=True)
        pipe.fuse_lora()
        pipe.unload_lora_weights()  # the fused weights stay; the adapter layers go
    defaults = served_defaults(model_dir, family, pipe)
    settings = exporter.sampler_settings(pipe, defaults)
    sparse = attention.config(exporter, defaults)
    sparse_layers = exporter.sparse_attention_layers(pipe) if sparse is not None else None
    if sparse is not None:
        log(f"attention: SparseAttention {asdict(sparse)}")
    exports, specs, adapters = components_to_export(exporter, pipe, options, target, log)
    streaming = streaming if streaming is not None else streaming_settings(model_dir)
    if streaming is not None:
        streamed, streaming_runtime = exporter.streaming_components(pipe, streaming)
        exports += [(component, None) for component in streamed]
        specs.update({component.spec.name: component.spec for component in streamed})
        settings["streaming"] = {**streaming.to_json(), **streaming_runtime}
        log(f"streaming: chunks of {streaming.chunk_frames} latent frames, {len(streaming.timesteps)} steps, sink "
            f"{streaming.sink_frames}, window {streaming.window_frames or 'whole session'}")
    layout = parallel if parallel is not None and not parallel.is_single else None
    if layout is not None:
        check_parallel_build(layout, exporter, pipe, target, exporter.axis_ranges(defaults, settings),
                             sparse=sparse is not None)
        log(f"parallel layout: {layout} ({layout.world_size} ranks per step)")
    device, dtype = "cpu", "float32"
    if target == "torch":
        device = target_options.torch_device()
        dtype = target_options.torch_dtype(device)
        log(f"torch target: {dtype} on {device}")
        if (device, dtype) != ("cpu", "float32"):
            import torch

            pipe.to(device=device, dtype=getattr(torch, dtype))  # the components' modules share these weights
    # What each component that runs on the ranks exports as (the served interface stays its spec's).
    on_ranks = {} if layout is None else {
        component.spec.name: variant for component, _ in exports
        if (variant := parallel_variant(component, exporter)) is not None}
    serving = TargetServing(target, torch_device=device, torch_dtype=dtype,
                            parallel=layout.to_json() if layout is not None else None,
                            parallel_components=tuple(on_ranks))
    cache_settings = model_cache_settings(model_dir, sparse=sparse is not None)
    files = render_repository(name, family, specs, defaults, settings, options=options, cache=cache_settings,
                              attention=asdict(sparse) if sparse else None, serving=serving, adapters=adapters)
    # Before minutes of export: what the repository holds that this build would lose.
    plan = plan_rebuild(out, name, files, specs, adapters, drop_unfit_adapters, discard_changes)
    root = cache_root(export_cache)
    cache = ExportCache(root) if root is not None else None
    # What decides an export besides the component (the tensorrt target exports the ONNX file onnxruntime runs).
    export_options = {"format": "torch" if target == "torch" else "onnx", "dtype": dtype, "device": device}
    if target == "torch":
        export_options.update(cuda_graphs=target_options.cuda_graphs, compile=target_options.compile)
    onnx_exporter_name = onnx_exporter(target_options.onnx_exporter)
    if target != "torch" and onnx_exporter_name != "dynamo":
        # Keyed apart from the dynamo exporter's files (the keys of dynamo's, the default, stay as they were).
        export_options["onnx_exporter"] = onnx_exporter_name
    results: list[ComponentResult] = []
    sparse_nodes = 0
    precision: dict = {}  # the components built below float: what each got (builder/quantize.py)
    int8_parts: dict = {}  # the denoiser parts the sensitivity sweep chooses the int8 layers of, by name
    weight_bytes: dict[str, int] = {}  # each component's, as built (the manifest's weight_bytes)
    fp8_amax = None  # tensorrt fp8: the calibrated inputs of the pipeline's linear layers (builder/quantize_fp8.py)
    if target_options.precision == "fp8" and any(is_denoiser(c.spec.name) for c, _ in exports):
        from machgen.builder.precision_sweep import SweepSettings
        from machgen.builder.quantize_fp8 import calibrate_fp8

        fp8_amax = calibrate_fp8(pipe, defaults, (target_options.sweep or SweepSettings()).pairs, log)
    with tempfile.TemporaryDirectory(prefix="machgen-export-") as scratch:
        exported: dict[str, Path] = {}
        onnx_files: dict[str, Path] = {}  # the tensorrt target's checked ONNX files, beside its engines
        for index, (component, adapter_layers) in enumerate(exports, start=1):
            start = time.perf_counter()
            if component.spec.name in on_ranks:
                component = on_ranks[component.spec.name].component
            spec = component.spec
            log(f"[{index}/{len(exports)}] {spec.name}: exporting ({target})")
            folder = Path(scratch) / spec.name
            path = serving.model_file(folder) if target == "torch" else folder / "model.onnx"
            # The swap changes only components holding a module where the swapped calls are: the text encoders
            # and VAEs of a sparse build are those of the dense one (LTX-2's text connectors too, whose attention
            # is of the transformer's class but none of its swapped layers).
            swapped = sparse is not None and _reached_by_swap(component, exporter.attention_modules, sparse_layers)
            parallel_here = spec.name in on_ranks
            key = (component_key(component, **export_options, attention=asdict(sparse) if swapped else None,
                                 **({"parallel": str(layout)} if parallel_here else {}))
                   if cache is not None else None)
            cached = cache.load(key, folder) if cache is not None else None
            if cached is not None:
                nodes, report = cached["sparse_attention_nodes"], ParityReport(**cached["parity"])
                exported_by = cached.get("exporter", "an earlier build's exporter")
            else:
                # Swapped for the parity check too: torch then runs the operator's CPU reference.
                with attention_for(exporter, pipe, sparse, sparse_layers, parallel_here, defaults):
                    if target == "torch":
                        nodes = export_torch(component, folder, dtype, device,
                                             cuda_graphs=target_options.cuda_graphs, compile=target_options.compile)
                        exported_by = "torch.export"
                    else:
                        onnx_export = export_onnx(component, path, attention=sparse, exporter=onnx_exporter_name)
                        nodes, exported_by = onnx_export.sparse_attention_nodes, onnx_export.exporter
                    # On one rank (the plan is written after it): the program's sequence attention is SDPA.
                    report = check_parity(component, path, dtype, device)
                if parallel_here:
                    write_shard_plan(folder, on_ranks[spec.name].plan(layout))
                if adapter_layers is not None:
                    write_component_layers(folder, adapter_layers)
                if cache is not None:
                    cache.store(key, folder, {"sparse_attention_nodes": nodes, "parity": asdict(report),
                                              "exporter": exported_by})
            sparse_nodes += nodes
            if target_options.precision == "int8" and is_denoiser(spec.name) and target_options.precision_sweep:
                int8_parts[spec.name] = component  # quantized once the sweep has run on every part's float file
            elif target_options.precision == "int8" and is_denoiser(spec.name):
                precision[spec.name] = quantize_int8(path)
                report = check_parity(component, path, dtype, device, relative_tolerance=INT8_RELATIVE_TOLERANCE)
                log(f"[{index}/{len(exports)}] {spec.name}: int8, {len(precision[spec.name]['layers'])} layers "
                    f"(weights per output channel, inputs per call)")
            elif fp8_amax is not None and is_denoiser(spec.name):
                from machgen.builder.quantize_fp8 import FP8_RELATIVE_TOLERANCE, amax_by_name, quantize_fp8

                precision[spec.name] = quantize_fp8(path, amax_by_name(component.module, fp8_amax))
                report = check_parity(component, path, dtype, device, relative_tolerance=FP8_RELATIVE_TOLERANCE)
                log(f"[{index}/{len(exports)}] {spec.name}: fp8 Q/DQ, {len(precision[spec.name]['layers'])} layers "
                    f"(weights per output channel, inputs per tensor, calibrated), "
                    f"{len(precision[spec.name]['float_layers'])} kept in the engine's bf16")
            file_bytes = sum(item.stat().st_size for item in folder.glob(path.name + "*") if item.is_file())
            weight_bytes[spec.name] = component_weight_bytes(path)
            quantized = precision.get(spec.name)
            weights = weights_note(weight_bytes[spec.name], quantized and quantized["weight_bytes"]["float"],
                                   target_options.precision)
            log(f"[{index}/{len(exports)}] {spec.name}: max |{path.name} - torch| = {report.max_abs_diff:.3g} "
                f"(tolerance {report.tolerance:g}), {weights}"
                f"{' (float until the sweep)' if spec.name in int8_parts else ''}"
                f"{f', {nodes} SparseAttention calls' if nodes else ''}"
                f"{f', {len(adapter_layers)} adaptable layers' if adapter_layers else ''}, "
                f"{time.perf_counter() - start:.1f} s, {exported_by}{' (export cache)' if cached is not None else ''}")
            onnx_files[spec.name] = path
            if target == "tensorrt":
                path = _engine(exporter, component, path, defaults, settings, options, target_options, sparse, log)
            exported[spec.name] = path
            results.append(ComponentResult(spec.name, report.max_abs_diff, report.tolerance,
                                           time.perf_counter() - start, file_bytes))
        if int8_parts:
            _sweep_int8(name, files, exported, int8_parts, {a: model_dir / a for a in exporter.sampler_assets},
                        Path(scratch), target_options, precision, results, log, weight_bytes)
        float_total = sum(precision[part]["weight_bytes"]["float"] if part in precision else count
                          for part, count in weight_bytes.items())
        total = weights_note(sum(weight_bytes.values()), float_total if precision else None, target_options.precision)
        log(f"{len(results)} components: {total}")
        if target == "onnxruntime":
            fused = _fuse_chains(specs, exported, Path(scratch), log)
            for prefix, path in fused.items():
                weight_bytes[prefix] = component_weight_bytes(path)
                log(f"{prefix}: {weights_note(weight_bytes[prefix])}, its steps' again (a model of its own)")
            exported.update(fused)
        # In the build's own record too: the next build must not take this build's precision or weights for a
        # user's edit.
        for written in (plan.files, plan.own_files):
            _record_in_manifest(written, name, weight_bytes=dict(sorted(weight_bytes.items())), built_from=source,
                                **({"precision": precision} if precision else {}))
        if sparse is not None and not sparse_nodes:
            # Never a dense model under a sparse name.
            raise ValueError(f"no call of dispatch_attention_fn in {exporter.attention_modules} was exported: "
                             "the model would be dense")
        log(calibration_summary(cache_settings))
        assets = {asset: model_dir / asset for asset in exporter.sampler_assets}
        plan.refuse_overwriting(_exported_paths(name, files, exported), discard_changes)
        write_repository(out, name, plan.files, exported, assets, keep=plan.keep, remove=plan.remove_models)
        plan.finish(log)
        if preview:
            from machgen.builder.preview_fit import fit_repository_preview
            from machgen.contract.manifest import pipeline_dir

            fit_on = out
            if target == "tensorrt":
                # Engines run only inside Triton: the projection is fitted on the same components' ONNX files.
                fit_on = Path(scratch) / "onnxruntime-repository"
                write_repository(fit_on, name, render_repository(
                    name, family, specs, defaults, settings, options=options, cache=cache_settings,
                    serving=TargetServing("onnxruntime")), onnx_files, assets)
            fit_repository_preview(fit_on, name, log).save(pipeline_dir(out, name))
        plan.write_record({relative.split("/", 1)[0] for relative in files})
    log(f"wrote model repository {out} (public model '{name}', target {target})")
    return results


def _sweep_int8(name: str, files: dict[str, str], exported: dict[str, Path], int8_parts: dict, assets: dict,
                scratch: Path, target_options: TargetOptions, precision: dict, results: list[ComponentResult],
                log: Callable[[str], None], weight_bytes: dict[str, int]) -> None:
    """The sensitivity sweep over the denoiser parts' float files (builder/precision_sweep.py), then each part
    quantized without the layers it keeps float and checked against torch; what each got in ``precision``
    (the manifest's), ``results`` and ``weight_bytes``."""
    from machgen.builder.export import check_parity
    from machgen.builder.precision_sweep import SweepSettings, sweep_build
    from machgen.builder.quantize import INT8_RELATIVE_TOLERANCE, quantize_int8, weights_note

    choice = sweep_build(name, files, exported, {part: exported[part] for part in int8_parts}, assets, scratch,
                         target_options.sweep or SweepSettings(), log)
    for index, result in enumerate(results):
        if result.name not in int8_parts:
            continue
        path = exported[result.name]
        got = precision[result.name] = quantize_int8(path, exclude=choice.float_modules(result.name))
        got["sweep"] = choice.record(result.name)
        report = check_parity(int8_parts[result.name], path, "float32", "cpu",
                              relative_tolerance=INT8_RELATIVE_TOLERANCE)
        file_bytes = sum(item.stat().st_size for item in path.parent.glob(path.name + "*") if item.is_file())
        results[index] = replace(result, max_abs_diff=report.max_abs_diff, tolerance=report.tolerance,
                                 file_bytes=file_bytes)
        weight_bytes[result.name] = got["weight_bytes"]["int8"]
        log(f"{result.name}: int8, {len(got['layers'])} layers, {len(got['float_layers'])} kept float (the "
            f"sweep's choice); max |{path.name} - torch| = {report.max_abs_diff:.3g} (tolerance "
            f"{report.tolerance:g}), {weights_note(got['weight_bytes']['int8'], got['weight_bytes']['float'], 'int8')}")


def built_from(model_dir: Path, lora: Path | None) -> dict:
    """The manifest's ``built_from``: the model folder (absolute) and its files' digests (source_digests), and
    the LoRA fused into it alike; what calibrate checks a quantized build's float reference against."""
    record: dict = {"model": str(Path(model_dir).resolve()), "files": source_digests(model_dir)}
    if lora is not None:
        record["lora"] = {"path": str(Path(lora).resolve()), "files": source_digests(lora)}
    return record


def source_digests(path: Path) -> dict[str, str]:
    """Each file's digest under ``path`` (a file: its own) by relative path, as a rebuild digests the files it
    wrote (whole up to 64 MiB, larger ones by size, head and tail: at most 64 MiB read of any file). Hidden
    files and the model card (machgen.json) are left out: calibrating the folder rewrites the card's cache
    defaults, and the served defaults it holds are compared apart (calibrate.check_reference)."""
    from machgen.builder.model_folder import SERVING_FILE
    from machgen.builder.rebuild import file_digest

    path = Path(path)
    if path.is_file():
        return {path.name: file_digest(path)}
    relatives = sorted(item.relative_to(path).as_posix() for item in path.rglob("*") if item.is_file())
    return {relative: file_digest(path / relative) for relative in relatives
            if relative != SERVING_FILE and not any(part.startswith(".") for part in relative.split("/"))}


def _record_in_manifest(files: dict[str, str], name: str, **fields) -> None:
    """The manifest among the files to write, with ``fields`` set (what each component built below float got,
    each component's weight bytes, the folder it was built from)."""
    from machgen.contract.manifest import MANIFEST_FILE, PipelineManifest, SAMPLER, model_name

    path = f"{model_name(name, SAMPLER)}/1/{MANIFEST_FILE}"
    manifest = PipelineManifest.from_json(json.loads(files[path]))
    files[path] = replace(manifest, **fields).render()


def _fuse_chains(specs: dict, onnx_files: dict[str, Path], scratch: Path,
                 log: Callable[[str], None]) -> dict[str, Path]:
    """The joined ONNX file of each chain the onnxruntime target serves as one model (repository.fused_chains).
    (The tensorrt target's ONNX repository for the preview fit needs none: it runs in process, head and tail
    apart.)"""
    from machgen.builder.chain import fuse_head_and_tail
    from machgen.builder.repository import TargetServing, denoiser_chains, fused_chains

    serving = TargetServing("onnxruntime")
    chains = denoiser_chains(specs, serving)
    fused = {}
    for prefix, spec in fused_chains(specs, serving).items():
        head, tail = chains[prefix]
        from_head = [tensor.name for tensor in spec.outputs if tensor not in tail.outputs]
        fused[prefix] = fuse_head_and_tail(onnx_files[head.name], onnx_files[tail.name],
                                           scratch / "fused" / prefix / "model.onnx", from_head)
        log(f"{prefix}: {head.name} and {tail.name} joined into one ONNX graph (a step that runs both)")
    return fused


def _exported_paths(name: str, files: dict[str, str], exported: dict[str, Path]) -> set[str]:
    """Where write_repository puts the exported files, relative to the repository."""
    from machgen.contract.manifest import in_sampler_file, model_name, pipeline_dir

    models = {relative.split("/", 1)[0] for relative in files}
    sampler = pipeline_dir(Path(), name)
    paths = set()
    for component, path in exported.items():
        for produced in path.parent.iterdir():
            served = model_name(name, component)
            paths.add(f"{served}/1/{produced.name}" if served in models
                      else (sampler / in_sampler_file(component, path.name)).parent.joinpath(produced.name).as_posix())
    return paths


def components_to_export(exporter: "FamilyExport", pipe, options: "ServingOptions", target: str = "onnxruntime",
                         log: Callable[[str], None] = print):
    """What a build exports and serves: [(component, its adaptable layers or
    None)], the specs the repository serves (a component with adapters also
    takes each row's adapters), and the manifest's AdapterSettings (None:
    built without adapters, ``options.max_lora_rank`` 0)."""
    model = _adaptable(exporter, pipe, options, target, log)
    components = exporter.components(pipe)
    specs = {component.spec.name: component.spec for component in components}
    if model is None:
        return [(component, None) for component in components], specs, None
    from machgen.builder.adapters import adapted, layers_of, served_spec
    from machgen.contract.adapters import AdapterSettings

    exports = []
    for component in components:
        with_bank = adapted(component, model)
        if with_bank is not None:
            specs[component.spec.name] = served_spec(component.spec)
        exports.append(with_bank or (component, None))
    adapters = AdapterSettings(options.max_lora_rank, options.max_loras,
                               {layer.name: (layer.in_features, layer.out_features)
                                for layer in layers_of(model).values()})
    return exports, specs, adapters.to_json()


def _adaptable(exporter: "FamilyExport", pipe, options: "ServingOptions", target: str, log: Callable[[str], None]):
    """The model whose linear layers take per-request adapters
    (``options.max_lora_rank`` > 0), made adaptable for export; else None."""
    if not options.max_lora_rank:
        return None
    if options.max_lora_rank < 0:
        raise ValueError(f"max_lora_rank {options.max_lora_rank} must be 0 (no adapters) or more")
    if target == "tensorrt":
        raise ValueError("per-request adapters (--max-lora-rank) are served by the onnxruntime and torch targets; "
                         "for a TensorRT engine fuse one adapter with --lora")
    model = exporter.adapted_model(pipe)
    if model is None:
        raise ValueError(f"family '{exporter.family.name}' serves no per-request adapters: build it with "
                         "--max-lora-rank 0 (fuse one adapter with --lora)")
    from machgen.builder.adapters import make_adaptable

    layers = make_adaptable(model)
    log(f"per-request adapters: {len(layers)} adaptable linear layers, rank up to {options.max_lora_rank}, "
        f"{options.max_loras} kept in memory per component")
    return model


def _engine(exporter: "FamilyExport", component, onnx_path: Path, defaults: ServedDefaults, settings: dict,
            options: "ServingOptions", target_options: TargetOptions, sparse, log: Callable[[str], None]) -> Path:
    """The tensorrt target: the component's engine built from its checked ONNX file."""
    from machgen.builder.tensorrt_engine import ENGINE_FILE, build_engine, shape_profile

    profile = shape_profile(component.spec, exporter.axis_ranges(defaults, settings), options.max_batch_size)
    folder = onnx_path.parent / "engine"
    build_engine(onnx_path, component.spec, profile, folder, target_options.precision,
                 refittable=target_options.refittable, timing_cache=target_options.timing_cache,
                 sparse_attention=sparse is not None, log=log)
    return folder / ENGINE_FILE
