"""Per-request LoRA adapters: where a repository keeps them and how the
sampler and the components speak of them. Only numpy-free constants and
dataclasses; the builder writes by these, the runtime reads by them.

A repository built with adapters (``machgen-build build --max-lora-rank R``)
keeps them under the sampler's folder, one folder each:

    NAME_sampler/1/adapters/<adapter>/adapter.safetensors   per adapted layer
        "<layer>.down" [rank, in] and "<layer>.up" [out, rank], the up
        projection already multiplied by the layer's alpha / rank
    NAME_sampler/1/adapters/<adapter>/adapter.json          AdapterInfo

Each denoiser component that holds adaptable layers takes two more batched
inputs from the sampler, the adapters of each row (``ADAPTER_NAMES_INPUT``,
names padded with empty ones to ``MAX_ADAPTERS_PER_REQUEST``) and their
scales; the component's process turns them into its exported graph's own
inputs (``graph_inputs``) from the adapters it keeps in memory, so adapter
weights never travel between processes. The graph computes, for every
adaptable linear layer, ``W x + sum_a scale[row, a] up_a (down_a x)`` on
the rows that name adapters, and ``W x`` alone on the others.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from machgen.contract.specs import TensorSpec

ADAPTERS_DIR = "adapters"
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_INFO = "adapter.json"
# Beside an adapted component's exported file: its layers, in its graph's input order.
COMPONENT_ADAPTERS_FILE = "adapters.json"
# What a request may ask (the API's ``lora``/``lora_scale``) and what the sampler sends each denoiser call.
MAX_ADAPTERS_PER_REQUEST = 4
ADAPTER_NAMES_INPUT = "lora_names"
ADAPTER_SCALES_INPUT = "lora_scales"
# The graph's inputs: the rows that name an adapter, each one's scale of every rank of the call's bank (one axis
# for all layers: the bank is the call's adapters side by side, zero where an adapter leaves a layer alone),
# then per layer its down and up projections. Rows that name none are not in the low-rank products at all.
ROWS_INPUT = "lora_rows"
ROW_SCALES_INPUT = "lora_row_scales"
ROWS_AXIS = "lora_rows"
RANK_AXIS = "lora_rank"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_adapter_name(name: str) -> str:
    """``name`` if it can name an adapter (a folder name: letters, digits, ``._-``, at most 64), else ValueError."""
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"adapter name {name!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit")
    return name


@dataclass(frozen=True)
class AdapterLayer:
    """A linear layer an adapter may change: its module path in the model and its sizes."""

    name: str
    in_features: int
    out_features: int


def down_input(index: int) -> str:
    return f"lora_down_{index}"


def up_input(index: int) -> str:
    return f"lora_up_{index}"


def graph_inputs(layers: tuple[AdapterLayer, ...]) -> tuple[TensorSpec, ...]:
    """The inputs an adapted component's graph takes besides its own."""
    specs = [TensorSpec(ROWS_INPUT, "int64", (ROWS_AXIS,)),
             TensorSpec(ROW_SCALES_INPUT, "float32", (ROWS_AXIS, RANK_AXIS))]
    for index, layer in enumerate(layers):
        specs.append(TensorSpec(down_input(index), "float32", (RANK_AXIS, layer.in_features)))
        specs.append(TensorSpec(up_input(index), "float32", (layer.out_features, RANK_AXIS)))
    return tuple(specs)


def selection_inputs() -> tuple[TensorSpec, ...]:
    """What the sampler sends an adapted component per row (its Triton config lists these)."""
    return (TensorSpec(ADAPTER_NAMES_INPUT, "BYTES", ("batch", MAX_ADAPTERS_PER_REQUEST)),
            TensorSpec(ADAPTER_SCALES_INPUT, "float32", ("batch", MAX_ADAPTERS_PER_REQUEST)))


def write_component_layers(folder: Path, layers: tuple[AdapterLayer, ...]) -> None:
    (Path(folder) / COMPONENT_ADAPTERS_FILE).write_text(
        json.dumps({"layers": [asdict(layer) for layer in layers]}, indent=1) + "\n")


def read_component_layers(folder: Path) -> tuple[AdapterLayer, ...] | None:
    """The adaptable layers of the component exported to ``folder``, or None: it takes no adapters."""
    path = Path(folder) / COMPONENT_ADAPTERS_FILE
    if not path.is_file():
        return None
    return tuple(AdapterLayer(**layer) for layer in json.loads(path.read_text())["layers"])


@dataclass(frozen=True)
class AdapterSettings:
    """A repository's adapter serving, in its manifest (None there: built without adapters)."""

    max_rank: int  # the largest rank ``lora add`` accepts
    max_loaded: int  # adapters each component process keeps in memory (least recently used leave first)
    # Every adaptable layer of the model: name -> [in_features, out_features], what ``lora add`` checks against.
    layers: Mapping[str, tuple[int, int]]

    def to_json(self) -> dict[str, Any]:
        return {"max_rank": self.max_rank, "max_loaded": self.max_loaded,
                "layers": {name: list(sizes) for name, sizes in self.layers.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "AdapterSettings | None":
        if not data:
            return None
        return cls(int(data["max_rank"]), int(data["max_loaded"]),
                   {name: (int(sizes[0]), int(sizes[1])) for name, sizes in data["layers"].items()})


@dataclass(frozen=True)
class AdapterInfo:
    """What ``lora add`` recorded of one adapter (``adapter.json``)."""

    name: str
    rank: int  # the largest of its layers' ranks
    layers: int  # how many layers it changes
    source: str  # the folder it was added from
    sha256: str  # of the source weights file


def adapters_root(pipeline_folder: str | os.PathLike) -> Path:
    """Where a pipeline's adapters live, from its sampler's version folder (manifest.pipeline_dir)."""
    return Path(pipeline_folder) / ADAPTERS_DIR


def installed_adapters(root: str | os.PathLike) -> dict[str, AdapterInfo]:
    """The adapters under ``root`` (adapters_root) that are complete, by name."""
    found = {}
    root = Path(root)
    if not root.is_dir():
        return found
    for folder in sorted(root.iterdir()):
        if folder.name.startswith("."):  # being added or removed
            continue
        info, weights = folder / ADAPTER_INFO, folder / ADAPTER_WEIGHTS
        if info.is_file() and weights.is_file():
            found[folder.name] = AdapterInfo(**json.loads(info.read_text()))
    return found


def served_adapters(adapters: Mapping[str, Any] | None, pipeline_folder: str | os.PathLike
                    ) -> tuple[Path | None, int]:
    """(where the adapters are, how many a process keeps) of a pipeline whose
    manifest says ``adapters`` (None: it serves none, and the folder is None)."""
    settings = AdapterSettings.from_json(adapters)
    if settings is None:
        return None, 0
    return adapters_root(pipeline_folder), settings.max_loaded
