"""Per-request LoRA adapters at build time: the denoiser's linear layers
made adaptable for export (the graph takes a bank of adapters and each
row's scales as inputs, contract/adapters.py), and ``lora add``'s check and
conversion of a diffusers-format adapter into a repository."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import torch

from machgen.builder.family_export import ExportableComponent
from machgen.contract.adapters import (
    ADAPTER_INFO,
    ADAPTER_WEIGHTS,
    ROW_SCALES_INPUT,
    ROWS_AXIS,
    ROWS_INPUT,
    AdapterInfo,
    AdapterLayer,
    AdapterSettings,
    adapters_root,
    check_adapter_name,
    down_input,
    graph_inputs,
    installed_adapters,
    selection_inputs,
    up_input,
)
from machgen.contract.manifest import PipelineManifest, find_pipeline_dir

# diffusers' file name for a LoRA in its own format.
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


class AdaptableLinear(torch.nn.Module):
    """A linear layer plus, while ``bank`` is set, the adapters of the rows
    that name some: ``W x + ((down x[rows]) * row_scales) up^T`` added to
    those rows, with the bank's adapters side by side on one rank axis."""

    def __init__(self, base: torch.nn.Linear, name: str):
        super().__init__()
        self.base = base
        self.layer_name = name
        self.bank: tuple[torch.Tensor, ...] | None = None
        self._called = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._called = True
        out = self.base(x)
        if self.bank is None:
            return out
        down, up, rows, row_scales = self.bank
        low = torch.nn.functional.linear(x.index_select(0, rows), down.to(x.dtype))
        # [rows, 1, ..., rank]: unsqueezed, not viewed to sizes, which the TorchScript exporter writes as a Reshape
        # to [rows, 1, -1] that ONNX Runtime refuses on the empty bank of a call without adapters.
        scales = row_scales.to(x.dtype)
        for _ in range(x.dim() - 2):
            scales = scales.unsqueeze(1)
        low = low * scales
        return out.index_add(0, rows, torch.nn.functional.linear(low, up.to(x.dtype)))


def make_adaptable(model: torch.nn.Module) -> dict[str, AdaptableLinear]:
    """Every ``torch.nn.Linear`` of ``model`` replaced, in place, by an
    AdaptableLinear named by its module path (as adapters name it)."""
    layers = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                path = f"{name}.{child_name}" if name else child_name
                layers[path] = AdaptableLinear(child, path)
                setattr(module, child_name, layers[path])
    return layers


def layers_of(model: torch.nn.Module) -> dict[str, AdapterLayer]:
    return {module.layer_name: AdapterLayer(module.layer_name, module.base.in_features, module.base.out_features)
            for module in model.modules() if isinstance(module, AdaptableLinear)}


class _AdaptedForward(torch.nn.Module):
    """A component's module that also takes the adapter bank of ``layers``
    (its forward, generated in ``adapted``, names every input: torch.export
    binds inputs by the signature)."""

    def __init__(self, module: torch.nn.Module, layers: list[AdaptableLinear], own_inputs: tuple[str, ...]):
        super().__init__()
        self.module = module
        self.adapted = layers
        self.own_inputs = own_inputs

    def _run(self, inputs: dict[str, torch.Tensor]):
        rows, row_scales = inputs[ROWS_INPUT], inputs[ROW_SCALES_INPUT]
        for index, layer in enumerate(self.adapted):
            layer.bank = (inputs[down_input(index)], inputs[up_input(index)], rows, row_scales)
        try:
            return self.module(**{name: inputs[name] for name in self.own_inputs})
        finally:
            for layer in self.adapted:
                layer.bank = None


def adapted(component: ExportableComponent, model: torch.nn.Module, sample_rank: int = 3
            ) -> tuple[ExportableComponent, tuple[AdapterLayer, ...]] | None:
    """``component`` exported with the bank inputs of the adaptable layers
    of ``model`` (make_adaptable) that its forward calls, with a random
    sample bank (so the parity check covers the adapters' path), and those
    layers; None when it calls none."""
    modules = [module for module in model.modules() if isinstance(module, AdaptableLinear)]
    for module in modules:
        module._called = False
    with torch.no_grad():
        component.module(**component.sample_inputs)
    called = [module for module in modules if module._called]
    if not called:
        return None
    layers = tuple(AdapterLayer(m.layer_name, m.base.in_features, m.base.out_features) for m in called)
    own = tuple(tensor.name for tensor in component.spec.inputs)
    extra = graph_inputs(layers)
    names = own + tuple(tensor.name for tensor in extra)
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {', '.join(names)}):\n    return self._run({{{', '.join(f'{n!r}: {n}' for n in names)}}})",
         namespace)
    module_class = type("AdaptedForward", (_AdaptedForward,), {"forward": namespace["forward"],
                                                              "__module__": _AdaptedForward.__module__})
    batch = len(next(iter(component.sample_inputs.values())))
    generator = torch.Generator().manual_seed(1)
    # Every row of the sample names adapters (sizes over 1: the trace keeps the axes dynamic).
    sample = {ROWS_INPUT: torch.arange(batch), ROW_SCALES_INPUT: torch.rand(batch, sample_rank, generator=generator)}
    for index, layer in enumerate(layers):
        sample[down_input(index)] = torch.randn(sample_rank, layer.in_features, generator=generator) * 0.1
        sample[up_input(index)] = torch.randn(layer.out_features, sample_rank, generator=generator) * 0.1
    spec = replace(component.spec, inputs=component.spec.inputs + extra)
    # The rows a call adapts are distinct (a row twice would get its adapters twice): the TorchScript exporter's
    # check at other sizes keeps them, and doubles the rank.
    return replace(component, spec=spec, module=module_class(component.module, called, own).eval(),
                   sample_inputs={**component.sample_inputs, **sample}, first_row=_first_row,
                   axis_growth={**component.axis_growth, ROWS_AXIS: 1}), layers


def _first_row(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bank inputs of the parity check's first row alone: the sample rows that are row 0."""
    kept = inputs[ROWS_INPUT] < 1
    return {**inputs, ROWS_INPUT: inputs[ROWS_INPUT][kept], ROW_SCALES_INPUT: inputs[ROW_SCALES_INPUT][kept]}


def served_spec(spec):
    """An adapted component's spec as the sampler and Triton see it: its own inputs plus each row's adapters."""
    return replace(spec, inputs=spec.inputs + selection_inputs())


# --- lora add / list / remove

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pattern_value(pattern: dict, layer: str, default: float) -> float:
    """PEFT's rank/alpha pattern lookup: a key names the layer or a suffix of its path."""
    for key, value in pattern.items():
        if layer == key or layer.endswith("." + key):
            return float(value)
    return default


def _layer_scales(state: dict, alphas: dict | None, metadata: dict | None, layers: list[str]) -> dict[str, float]:
    """Each layer's alpha / rank, as diffusers' load_lora_weights sets PEFT's
    scaling: from the checkpoint's alphas or its saved LoRA config, else 1."""
    ranks = {layer: state[f"{layer}.lora_B.weight"].shape[1] for layer in layers}
    if metadata:
        alpha, rank = float(metadata.get("lora_alpha", metadata.get("r", 1))), float(metadata.get("r", 1))
        return {layer: _pattern_value(metadata.get("alpha_pattern") or {}, layer, alpha)
                / _pattern_value(metadata.get("rank_pattern") or {}, layer, rank) for layer in layers}
    if alphas:  # a layer without an alpha of its own takes the most common one (diffusers' get_peft_kwargs)
        found = {key.rsplit(".alpha", 1)[0]: float(value) for key, value in alphas.items()}
        common = collections.Counter(found.values()).most_common(1)[0][0]
        return {layer: found.get(layer, common) / ranks[layer] for layer in layers}
    return {layer: 1.0 for layer in layers}


def read_adapter(adapter_dir: Path, settings: AdapterSettings, load_state: Callable, prefix: str
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter in ``adapter_dir`` (diffusers format, safetensors only)
    as layer -> (down [rank, in], up [out, rank] times alpha / rank),
    checked against the model: every layer it changes must be an adaptable
    layer of the model with the same sizes, and no rank over the maximum.
    ``load_state(folder)`` is the family's diffusers loader
    (``lora_state_dict``: converts other trainers' key formats), ``prefix``
    the adapted model's (``transformer.``). Raises ValueError."""
    from machgen.builder.model_folder import refuse_pickled_weights

    adapter_dir = Path(adapter_dir)
    refuse_pickled_weights(adapter_dir)
    weights = adapter_dir / LORA_WEIGHTS if adapter_dir.is_dir() else adapter_dir
    if not weights.is_file():
        raise ValueError(f"{adapter_dir}: no {LORA_WEIGHTS} (a diffusers-format LoRA, safetensors)")
    state, alphas, metadata = load_state(weights)
    others = sorted({key.split(".")[0] for key in state if not key.startswith(prefix)})
    if others:
        raise ValueError(f"{adapter_dir}: it changes {', '.join(others)}, and per-request adapters change the "
                         f"denoiser alone (the prompt cache is shared by all requests): fuse it at build time with "
                         "machgen-build build --lora instead")
    state = {key[len(prefix):]: value for key, value in state.items()}
    alphas = {key.removeprefix(prefix): value for key, value in (alphas or {}).items()}
    odd = sorted(key for key in state if not (key.endswith(".lora_A.weight") or key.endswith(".lora_B.weight")))
    if odd:
        raise ValueError(f"{adapter_dir}: weights of a kind per-request adapters do not serve ({', '.join(odd[:4])}"
                         f"{', ...' if len(odd) > 4 else ''}: DoRA magnitudes or LoRA biases); fuse it with --lora")
    layers = sorted({key.rsplit(".lora_", 1)[0] for key in state})
    problems = []
    for layer in layers:
        down, up = state.get(f"{layer}.lora_A.weight"), state.get(f"{layer}.lora_B.weight")
        if down is None or up is None:
            problems.append(f"{layer}: lora_A or lora_B missing")
            continue
        if layer not in settings.layers:
            problems.append(f"{layer}: the model has no such linear layer")
            continue
        in_features, out_features = settings.layers[layer]
        if down.shape[1] != in_features or up.shape[0] != out_features or down.shape[0] != up.shape[1]:
            problems.append(f"{layer}: lora_A {list(down.shape)} / lora_B {list(up.shape)} do not fit the layer's "
                            f"[{out_features}, {in_features}]")
        elif down.shape[0] > settings.max_rank:
            problems.append(f"{layer}: rank {down.shape[0]} is over the repository's maximum {settings.max_rank} "
                            "(machgen-build build --max-lora-rank)")
    if problems:
        raise ValueError(f"{adapter_dir} does not fit this model:\n  " + "\n  ".join(problems[:10])
                         + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""))
    scales = _layer_scales(state, alphas, metadata, layers)
    return {layer: (state[f"{layer}.lora_A.weight"].float(), state[f"{layer}.lora_B.weight"].float() * scales[layer])
            for layer in layers}


def _adapter_settings(repository: Path, pipeline: str | None) -> tuple[Path, PipelineManifest, AdapterSettings]:
    folder = find_pipeline_dir(repository, pipeline)
    manifest = PipelineManifest.read(folder)
    settings = AdapterSettings.from_json(manifest.adapters)
    if settings is None:
        raise ValueError(f"model '{manifest.name}' was built without per-request adapters: rebuild it with "
                         "machgen-build build --max-lora-rank R")
    return folder, manifest, settings


def add_adapter(repository: Path, name: str, adapter_dir: Path, pipeline: str | None = None,
                replace_existing: bool = False) -> AdapterInfo:
    """Check ``adapter_dir`` against the served model and store it as ``name``
    (a running server serves it from its next request)."""
    from safetensors.torch import save_file

    from machgen.families.registry import get_family

    check_adapter_name(name)
    folder, manifest, settings = _adapter_settings(repository, pipeline)
    root = adapters_root(folder)
    if (root / name).exists() and not replace_existing:
        raise ValueError(f"adapter '{name}' is already in {root} (remove it first, or --replace)")
    exporter = get_family(manifest.family).exporter()
    weights = read_adapter(adapter_dir, settings, exporter.adapter_state_dict, exporter.adapted_prefix)
    source = Path(adapter_dir) / LORA_WEIGHTS if Path(adapter_dir).is_dir() else Path(adapter_dir)
    info = AdapterInfo(name=name, rank=max(down.shape[0] for down, _ in weights.values()), layers=len(weights),
                       source=os.fspath(Path(adapter_dir).resolve()), sha256=_sha256(source))
    root.mkdir(parents=True, exist_ok=True)
    # Written beside, then moved in: a server reading the folder sees the old adapter or the new one, whole.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    tensors = {}
    for layer, (down, up) in weights.items():
        tensors[f"{layer}.down"] = down.contiguous()
        tensors[f"{layer}.up"] = up.contiguous()
    save_file(tensors, os.fspath(staging / ADAPTER_WEIGHTS))
    (staging / ADAPTER_INFO).write_text(json.dumps(asdict(info), indent=2) + "\n")
    if (root / name).exists():
        shutil.rmtree(root / name)
    staging.rename(root / name)
    return info


def list_adapters(repository: Path, pipeline: str | None = None) -> dict[str, AdapterInfo]:
    folder, _, _ = _adapter_settings(repository, pipeline)
    return installed_adapters(adapters_root(folder))


def remove_adapter(repository: Path, name: str, pipeline: str | None = None) -> None:
    folder, _, _ = _adapter_settings(repository, pipeline)
    target = adapters_root(folder) / check_adapter_name(name)
    if not target.is_dir():
        raise ValueError(f"no adapter '{name}' in {adapters_root(folder)}")
    # Moved aside first: a request checks for the adapter's folder, so it is gone at once.
    trash = Path(tempfile.mkdtemp(prefix=f".removed-{name}.", dir=adapters_root(folder)))
    target.rename(trash / name)
    shutil.rmtree(trash)
