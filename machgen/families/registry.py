"""The model-family registry.

Every package under ``machgen/families/`` registers its families in its
``spec.py`` with :func:`register_family`; everything else (CLI choices, the
generated repository, the served API, the client's and CLI's family inputs)
is derived from what they declare. Listing families imports only the spec
modules, which import no torch, diffusers or tritonclient.

The sampler never consults the registry: a repository's manifest names the
runtime class to load.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from machgen.contract.api import FamilyInput
from machgen.contract.manifest import load_object
from machgen.contract.specs import Capabilities, ServedDefaults


@dataclass(frozen=True)
class Family:
    """One served diffusers pipeline: what it can do and where its halves live."""

    name: str
    diffusers_pipeline: str  # the diffusers pipeline class name (model_index.json's _class_name)
    capabilities: Capabilities
    # "module:Class" of its FamilyRuntime (machgen/runtime/family.py): what the sampler runs.
    runtime: str
    # "module:Class" of its FamilyExport (machgen/builder/family_export.py): build time only.
    export: str
    # "module:function" returning (a tiny random-weight diffusers pipeline, its ServedDefaults).
    tiny: str
    # The API inputs only this family takes.
    inputs: tuple[FamilyInput, ...] = ()
    # Whether it serves a model of its pipeline class, from the model's
    # model_index.json (None: every one). Where several families serve one
    # class, one that says so wins over one that takes every model.
    serves: Callable[[Mapping[str, Any]], bool] | None = None
    # "module:function" returning (a tiny random-weight pipeline with a streaming mode, its ServedDefaults, its
    # card's "streaming" section), for a family that serves realtime sessions; None: it serves none.
    tiny_streaming: str | None = None

    def exporter(self) -> Any:
        """Its FamilyExport (machgen/builder/family_export.py), loaded by name: the registry is a light path
        (the CLI's start, listing families) that imports nothing of the build."""
        return load_object(self.export)(self)

    def tiny_model(self) -> tuple[Any, ServedDefaults]:
        return load_object(self.tiny)()


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make ``family`` known under its name."""
    if _FAMILIES.get(family.name, family) != family:
        raise ValueError(f"model family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def _load_family_packages() -> None:
    from machgen import families

    for info in pkgutil.iter_modules(families.__path__):
        if info.ispkg:
            importlib.import_module(f"{families.__name__}.{info.name}.spec")


def all_families() -> list[Family]:
    _load_family_packages()
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def family_names() -> list[str]:
    return [family.name for family in all_families()]


def get_family(name: str) -> Family:
    _load_family_packages()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(sorted(_FAMILIES))}") from None


def family_for_model(model_index: Mapping[str, Any]) -> Family:
    """The family serving a diffusers model folder, from its model_index.json."""
    pipeline_class = model_index["_class_name"]
    candidates = [f for f in all_families() if f.diffusers_pipeline == pipeline_class]
    chosen = ([f for f in candidates if f.serves is not None and f.serves(model_index)]
              or [f for f in candidates if f.serves is None])
    if not chosen:
        known = ", ".join(sorted({f.diffusers_pipeline for f in _FAMILIES.values()}))
        raise KeyError(f"no model family serves {pipeline_class!r} with this model_index.json; supported "
                       f"pipelines: {known}")
    return chosen[0]


def family_inputs() -> dict[str, tuple[FamilyInput, list[str]]]:
    """Every family input by name, with the families that take it."""
    found: dict[str, tuple[FamilyInput, list[str]]] = {}
    for family in all_families():
        for declared in family.inputs:
            found.setdefault(declared.name, (declared, []))[1].append(family.name)
    return found
