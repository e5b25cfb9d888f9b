"""Per-request LoRA adapters inside a component's process (layout and
inputs: machgen/contract/adapters.py).

``AdapterStore`` keeps the most recently used adapters of a repository in
memory and lays out, for one forward, the bank of the adapters its rows
name; ``AdaptedRunner`` wraps a component's runner so that it takes the
sampler's per-row adapter names and scales instead of the graph's bank
inputs. Rows that name no adapter are left out of the low-rank products
(a forward without any runs them on no rows and a bank of rank 0); a row
with adapters runs the forward's whole bank, the other rows' adapters at
scale 0.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from machgen.contract.adapters import (
    ADAPTER_INFO,
    ADAPTER_NAMES_INPUT,
    ADAPTER_SCALES_INPUT,
    ADAPTER_WEIGHTS,
    ROW_SCALES_INPUT,
    ROWS_INPUT,
    AdapterLayer,
    down_input,
    graph_inputs,
    read_component_layers,
    up_input,
)
from machgen.runtime.onnx_runner import run_grouped
from machgen.runtime.tensors import as_numpy

# Banks (one per set of adapters in a forward) each process keeps laid out: steps of the same requests reuse them.
_BANKS_KEPT = 4


class AdapterNotFound(KeyError):
    """A row names an adapter the repository does not hold (removed after the request was accepted)."""


def _load_weights(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from safetensors.numpy import load_file

    tensors = load_file(os.fspath(folder / ADAPTER_WEIGHTS))
    layers = {key[:-len(".down")] for key in tensors if key.endswith(".down")}
    return {layer: (tensors[f"{layer}.down"], tensors[f"{layer}.up"]) for layer in layers}


class AdapterStore:
    """The adapters under ``root`` (contract.adapters.adapters_root), at most
    ``max_loaded`` in memory, loaded at first use: an adapter added to a
    running server is served by its next request, one replaced under the
    same name is read again. ``convert`` turns a laid-out bank's arrays into
    what the runner takes (torch tensors on its device); shared by the
    request threads of one process."""

    def __init__(self, root: str | os.PathLike, max_loaded: int, convert: Callable[[np.ndarray], Any] | None = None):
        self.root = Path(root)
        self.max_loaded = max(1, int(max_loaded))
        self.convert = convert or (lambda array: array)
        self._loaded: OrderedDict[str, tuple[int, dict]] = OrderedDict()
        self._banks: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def _version(self, name: str) -> int:
        try:
            return (self.root / name / ADAPTER_INFO).stat().st_mtime_ns
        except FileNotFoundError:
            raise AdapterNotFound(f"adapter '{name}' is not in {self.root} (removed?)") from None

    def weights(self, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Layer -> (down [rank, in], up [out, rank]) of adapter ``name``."""
        version = self._version(name)
        with self._lock:
            kept = self._loaded.get(name)
            if kept is not None and kept[0] == version:
                self._loaded.move_to_end(name)
                return kept[1]
        weights = _load_weights(self.root / name)
        with self._lock:
            self._loaded[name] = (version, weights)
            self._loaded.move_to_end(name)
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)
        return weights

    @property
    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def bank_feeds(self, layers: Sequence[AdapterLayer], names: np.ndarray, scales: np.ndarray) -> dict[str, Any]:
        """The graph inputs (contract.adapters.graph_inputs) of one forward
        whose rows name ``names`` [rows, K] (empty: none) at ``scales``."""
        rows = [[(_text(name), float(scale)) for name, scale in zip(row_names, row_scales) if _text(name)]
                for row_names, row_scales in zip(names, scales)]
        used = tuple(dict.fromkeys(name for row in rows for name, _ in row))
        # One store per runner (with_adapters), so its layers are always the same: the adapters key the bank.
        key = (used, tuple(self._version(name) for name in used))
        with self._lock:
            bank = self._banks.get(key)
            if bank is not None:
                self._banks.move_to_end(key)
        if bank is None:
            bank, offsets = self._lay_out(layers, used)
            bank = {"offsets": offsets, **{name: self.convert(value) for name, value in bank.items()}}
            with self._lock:
                self._banks[key] = bank
                while len(self._banks) > _BANKS_KEPT:
                    self._banks.popitem(last=False)
        offsets = bank["offsets"]
        rank = offsets[-1][1] if offsets else 0
        adapted = [index for index, row in enumerate(rows) if row]
        row_scales = np.zeros((len(adapted), rank), np.float32)
        columns = dict(zip(used, offsets))
        for position, index in enumerate(adapted):
            for name, scale in rows[index]:
                start, stop = columns[name]
                row_scales[position, start:stop] = scale
        return {**{name: value for name, value in bank.items() if name != "offsets"},
                ROWS_INPUT: self.convert(np.array(adapted, np.int64)), ROW_SCALES_INPUT: self.convert(row_scales)}

    def _lay_out(self, layers: Sequence[AdapterLayer], used: tuple[str, ...]):
        """Every layer's down [R, in] and up [out, R] with ``used``'s adapters
        side by side (each as wide as its largest rank, zero where it leaves
        the layer alone), and each adapter's columns."""
        weights = [self.weights(name) for name in used]
        widths = [max((down.shape[0] for down, _ in adapter.values()), default=0) for adapter in weights]
        bounds = np.cumsum([0] + widths)
        rank = int(bounds[-1])
        bank = {}
        for index, layer in enumerate(layers):
            down = np.zeros((rank, layer.in_features), np.float32)
            up = np.zeros((layer.out_features, rank), np.float32)
            for adapter, start in zip(weights, bounds[:-1]):
                if layer.name in adapter:
                    layer_down, layer_up = adapter[layer.name]
                    down[start:start + layer_down.shape[0]] = layer_down
                    up[:, start:start + layer_down.shape[0]] = layer_up
            bank[down_input(index)] = down
            bank[up_input(index)] = up
        return bank, [(int(start), int(stop)) for start, stop in zip(bounds[:-1], bounds[1:])]


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class AdaptedRunner:
    """A component runner that takes per-row adapter names and scales
    (contract.adapters.selection_inputs) in place of its graph's bank."""

    def __init__(self, runner: Any, layers: Sequence[AdapterLayer], store: AdapterStore):
        self.runner = runner
        self.layers = tuple(layers)
        self.store = store
        bank = {tensor.name for tensor in graph_inputs(self.layers)}
        self.input_names = [name for name in runner.input_names if name not in bank] + [ADAPTER_NAMES_INPUT,
                                                                                       ADAPTER_SCALES_INPUT]
        self.output_names = runner.output_names

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        feeds = {name: value for name, value in inputs.items()
                 if name not in (ADAPTER_NAMES_INPUT, ADAPTER_SCALES_INPUT)}
        feeds.update(self.store.bank_feeds(self.layers, as_numpy(inputs[ADAPTER_NAMES_INPUT]),
                                           as_numpy(inputs[ADAPTER_SCALES_INPUT])))
        return self.runner.run(feeds)

    def run_batches(self, batches: Sequence[Mapping[str, Any]], max_rows: int | None = None) -> list[dict[str, Any]]:
        return run_grouped(self.run, self.input_names, batches, max_rows)

    def __getattr__(self, name: str) -> Any:  # memory_report, path, ... of the runner
        return getattr(self.runner, name)


def with_adapters(runner: Any, component_folder: str | os.PathLike, adapters: str | os.PathLike | None,
                  max_loaded: int, convert: Callable[[np.ndarray], Any] | None = None) -> Any:
    """``runner`` as an AdaptedRunner when its component takes adapters
    (contract.adapters.COMPONENT_ADAPTERS_FILE beside its file), reading them
    from ``adapters``; else ``runner`` itself."""
    layers = read_component_layers(Path(component_folder))
    if layers is None or adapters is None:
        return runner
    return AdaptedRunner(runner, layers, AdapterStore(adapters, max_loaded, convert))
