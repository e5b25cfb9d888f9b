"""A cache of exported and checked components.

An export (torch.export, conversion, parity check) takes from seconds for a
tiny model to hours for a 14B transformer, and a rebuild usually repeats
most of it: new serving options, a LoRA that leaves the text encoders and
the VAE alone, a second model of a family that shares its VAE. The key of a
component is everything its export depends on: the spec, the target, dtype,
device and export options (the ONNX exporter, where not the default), the
versions of the exporting packages, the source of the wrapper modules (the
family's export.py, and what its classes derive from) and of the exporter,
every submodule's class, configuration and plain settings, every parameter
and buffer, and the sample inputs. The family's run-time code is not in it:
a change to how requests are served leaves every export valid. A hit copies
the files and the parity report of the first export; nothing is trusted
that a different input could have produced.

``machgen-build build --export-cache DIR`` or the ``MACHGEN_EXPORT_CACHE``
environment variable turns it on; entries are folders named by their key,
written atomically (a cache may be shared by concurrent builds).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import sys
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from machgen.builder.family_export import ExportableComponent

CACHE_ENV = "MACHGEN_EXPORT_CACHE"
# Bumped when what an entry holds, or how a key is made, changes.
_FORMAT = 1
_PACKAGES = ("torch", "onnx", "onnxscript", "onnxruntime", "diffusers", "transformers")
_REPORT = "export.json"
_PLAIN = (bool, int, float, str, type(None))
_NOT_PLAIN = object()
# Module attributes that do not change an export: the mode, and where transformers loaded a model from.
_NOT_SETTINGS = ("training", "name_or_path")


def cache_root(setting: str | os.PathLike | None) -> Path | None:
    """The cache folder: ``setting``, else $MACHGEN_EXPORT_CACHE, else none."""
    chosen = setting or os.environ.get(CACHE_ENV)
    return Path(chosen) if chosen else None


def _plain(value: Any) -> Any:
    """``value`` when made of plain data (numbers, text, lists and dicts of them), else _NOT_PLAIN."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(item) for item in value]
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    if isinstance(value, dict) and all(isinstance(key, _PLAIN) for key in value):
        items = {str(key): _plain(item) for key, item in value.items()}
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items.values()) else items
    return _NOT_PLAIN


def _settings(module) -> str:
    """A module's configuration and plain attributes, as text that is the same in every process
    (without the configuration's private keys: the folder it was loaded from, library versions)."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()
    config = {key: value for key, value in config.items() if not str(key).startswith("_")} \
        if isinstance(config, dict) else None
    attributes = {name: _plain(value) for name, value in vars(module).items()
                  if not name.startswith("_") and name not in _NOT_SETTINGS}
    return json.dumps({"config": config,
                       "attributes": {name: value for name, value in attributes.items() if value is not _NOT_PLAIN}},
                      sort_keys=True, default=str)


def export_sources(module) -> list[Path]:
    """The source files an export of ``module`` runs: those of machgen's own
    classes in it (a family's export.py, with the classes they derive from)
    and of the exporter. A family's runtime and spec are not among them."""
    files = {Path(inspect.getsourcefile(cls)) for sub in module.modules() for cls in type(sub).__mro__
             if cls.__module__.startswith("machgen.")}
    here = Path(__file__).resolve().parent
    files |= {here / "export.py", here / "torchscript_translations.py", here.parent / "plugins" / "ops.py"}
    return sorted(files)


def _add_tensor(digest, name: str, tensor) -> None:
    import torch

    tensor = tensor.detach().to("cpu").contiguous()
    digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    if tensor.numel():
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def component_key(component: ExportableComponent, **options: Any) -> str:
    """The cache key of exporting ``component`` with ``options`` (target, dtype, device, ...)."""
    digest = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            digest.update(repr(part).encode())
            digest.update(b"\0")

    add(_FORMAT, sys.version_info[:2], sorted(options.items()), component.spec)
    for package in _PACKAGES:
        try:
            add(package, metadata.version(package))
        except metadata.PackageNotFoundError:
            add(package, None)
    for source in export_sources(component.module):
        add(source.name)
        digest.update(source.read_bytes())
    for name, sub in component.module.named_modules():
        add(name, f"{type(sub).__module__}.{type(sub).__qualname__}", _settings(sub))
    for name, tensor in component.module.named_parameters():
        _add_tensor(digest, f"parameter {name}", tensor)
    for name, tensor in component.module.named_buffers():
        _add_tensor(digest, f"buffer {name}", tensor)
    for name in sorted(component.sample_inputs):
        _add_tensor(digest, f"input {name}", component.sample_inputs[name])
    return digest.hexdigest()


class ExportCache:
    """Exported component folders by key (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def load(self, key: str, folder: Path) -> dict[str, Any] | None:
        """The stored record of ``key`` with its files copied into ``folder``, or None."""
        entry = self.root / key
        if not (entry / _REPORT).is_file():
            return None
        shutil.copytree(entry, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns(_REPORT))
        return json.loads((entry / _REPORT).read_text())

    def store(self, key: str, folder: Path, record: dict[str, Any]) -> None:
        """Keep ``folder``'s files and ``record`` under ``key`` (the first writer wins)."""
        entry = self.root / key
        if entry.exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{key}.{uuid.uuid4().hex}"
        shutil.copytree(folder, staging)
        (staging / _REPORT).write_text(json.dumps(record, indent=2) + "\n")
        try:
            staging.rename(entry)
        except OSError:  # another build stored it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
