"""What a build over an existing repository keeps of what users added to it.

A build writes a record of what it wrote beside the manifest
(``NAME_sampler/1/build-record.json``: every file's digest, the manifest as
the build itself rendered it, its models). The next build of the same
pipeline compares the repository against it, before any export:

- adapters added with ``machgen-build lora add`` are carried over and
  checked against the new build as ``lora add`` checks them (layers,
  shapes, rank); one that no longer fits refuses the build unless
  ``drop_unfit_adapters`` deletes it;
- a field of ``pipeline.json`` changed since the build (a calibration's
  ``cache``, a hand-edited default) is kept where the new build would write
  what the last one did, and refuses the build where it would write another
  value (three-way, key by key; a calibration is one fit, kept or replaced
  whole);
- any other generated file changed since is kept on the same condition, else
  it refuses the build; a file no build wrote is kept where its model stays,
  and refuses the build where its model goes;
- ``discard_changes`` lets the build replace or delete the files and fields
  named in a refusal.

Models of other pipelines in the repository are never touched: a build whose
model names would be another pipeline's is refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from machgen.contract.adapters import ADAPTER_WEIGHTS, ADAPTERS_DIR, AdapterSettings, installed_adapters
from machgen.contract.manifest import MANIFEST_FILE, SAMPLER, STREAM, model_name

BUILD_RECORD_FILE = "build-record.json"
_RECORD_VERSION = 1
# A calibration is one fit of thresholds, controls and ratios: never merged key by key.
_WHOLE_FIELDS = ("cache",)
# Files up to this size are digested whole; larger ones (exported weights) by size, head and tail.
_WHOLE_FILE_BYTES = 64 << 20
_SAMPLE_BYTES = 8 << 20
_MISSING = object()


class RebuildRefused(ValueError):
    """The build would delete or replace what users added to the repository since its last build."""


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
            return digest.hexdigest()
        digest.update(f"{size}:".encode())
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(-_SAMPLE_BYTES, 2)
        digest.update(f.read())
    return "sampled:" + digest.hexdigest()


def _sampler_folder(name: str) -> str:
    return f"{model_name(name, SAMPLER)}/1"


def record_path(out: Path, name: str) -> Path:
    return Path(out) / _sampler_folder(name) / BUILD_RECORD_FILE


def _read_json(path: Path) -> Any:
    """The JSON in ``path``; None when there is no file; ValueError when it is not JSON."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err})") from None


def _manifest_models(name: str, manifest: Mapping[str, Any]) -> set[str]:
    """The Triton models a manifest of pipeline ``name`` names (for a repository built before build records)."""
    models = {name, model_name(name, STREAM), model_name(name, SAMPLER)}
    for entry in (manifest.get("components") or {}).values():
        if isinstance(entry, Mapping) and entry.get("model"):
            models.add(entry["model"])
    return models


def pipeline_models(out: Path, name: str) -> set[str] | None:
    """The models the last build of pipeline ``name`` in ``out`` wrote; None when it has none."""
    record = _read_json(record_path(out, name))
    if record is not None:
        return set(record["models"])
    manifest = _read_json(Path(out) / _sampler_folder(name) / MANIFEST_FILE)
    return _manifest_models(name, manifest) if manifest is not None else None


def _other_pipelines(out: Path, name: str) -> dict[str, str]:
    """Model -> pipeline, for the other pipelines of the repository."""
    owners = {}
    for path in sorted(Path(out).glob(f"*_{SAMPLER}/1/{MANIFEST_FILE}")):
        if path.parent.parent.name == model_name(name, SAMPLER):
            continue
        try:
            other = (_read_json(path) or {}).get("name")
            if not other or other == name or path.parent.parent.name != model_name(other, SAMPLER):
                continue
            models = pipeline_models(out, other) or ()
        except (ValueError, KeyError, AttributeError):  # not a manifest this code reads: its sampler is its own
            models = {path.parent.parent.name}
            other = path.parent.parent.name.removesuffix(f"_{SAMPLER}")
        for model in models:
            owners[model] = other
    return owners


def stored_adapter_problems(folder: Path, settings: AdapterSettings | None) -> list[str]:
    """Why the adapter ``lora add`` stored in ``folder`` cannot be served by a build with ``settings`` (empty:
    it can): the checks of ``lora add`` (builder/adapters.py read_adapter) on its stored weights."""
    if settings is None:
        return ["this build serves no per-request adapters (--max-lora-rank 0)"]
    from safetensors import safe_open

    shapes = {}
    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), framework="numpy") as weights:
        for key in weights.keys():
            shapes[key] = tuple(weights.get_slice(key).get_shape())
    problems = []
    for layer in sorted({key.rsplit(".", 1)[0] for key in shapes}):
        down, up = shapes.get(f"{layer}.down"), shapes.get(f"{layer}.up")
        if down is None or up is None or len(down) != 2 or len(up) != 2:
            problems.append(f"{layer}: down or up projection missing")
        elif layer not in settings.layers:
            problems.append(f"{layer}: this build's model has no such linear layer")
        elif (down[1], up[0]) != tuple(settings.layers[layer]) or down[0] != up[1]:
            in_features, out_features = settings.layers[layer]
            problems.append(f"{layer}: down {list(down)} / up {list(up)} do not fit the layer's "
                            f"[{out_features}, {in_features}]")
        elif down[0] > settings.max_rank:
            problems.append(f"{layer}: rank {down[0]} is over this build's maximum {settings.max_rank} "
                            "(--max-lora-rank)")
    if len(problems) > 3:
        problems = problems[:3] + [f"... and {len(problems) - 3} more layers"]
    return problems


def _merge(base: Any, ours: Any, theirs: Any, path: str, kept: list[str],
           conflicts: list[tuple[str, Any, Any]]) -> Any:
    """Three-way merge of JSON values: the repository's (``ours``) where only it changed since ``base`` (what
    the last build wrote), the new build's (``theirs``) where only that changed; both changed differently: a
    conflict (the new build's value is returned)."""
    if ours == base or ours == theirs:
        return theirs
    if all(isinstance(value, dict) for value in (base, ours, theirs)) and path not in _WHOLE_FIELDS:
        merged = {}
        for key in [*theirs, *(key for key in ours if key not in theirs)]:
            value = _merge(base.get(key, _MISSING), ours.get(key, _MISSING), theirs.get(key, _MISSING),
                           f"{path}.{key}" if path else key, kept, conflicts)
            if value is not _MISSING:
                merged[key] = value
        return merged
    if theirs == base:
        kept.append(path)
        return ours
    conflicts.append((path, _change(base, ours), _change(base, theirs)))
    return theirs


def _change(base: Any, value: Any) -> str:
    """``value`` as said in a refusal: for a section, the keys in which it differs from ``base``."""
    if value is _MISSING:
        return "nothing"
    if isinstance(value, dict) and isinstance(base, dict):
        keys = sorted(key for key in {*base, *value} if base.get(key, _MISSING) != value.get(key, _MISSING))
        return f"other {', '.join(keys)}"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class RebuildPlan:
    """What a build writes over the repository's last build of its pipeline, decided before it exports."""

    out: Path
    name: str
    files: dict[str, str]  # the files to write: the build's own, with the users' kept edits
    own_files: dict[str, str]  # the build's own render, what the record says it wrote
    keep: list[str] = field(default_factory=list)  # paths write_repository leaves in place
    foreign: list[str] = field(default_factory=list)  # kept files no build wrote (never recorded)
    remove_models: list[str] = field(default_factory=list)  # the last build's models this one does not write
    drop_adapters: dict[str, list[str]] = field(default_factory=dict)  # name -> why it no longer fits
    notes: list[str] = field(default_factory=list)  # what is carried over
    lost: list[str] = field(default_factory=list)  # what --discard-changes replaces or deletes

    @property
    def adapters_root(self) -> Path:
        return self.out / _sampler_folder(self.name) / ADAPTERS_DIR

    def refuse_overwriting(self, written: Iterable[str], discard_changes: bool) -> None:
        """Called with the paths the export writes: a kept file that is one of them would be replaced."""
        hit = sorted(set(self.foreign) & set(written))
        if hit and not discard_changes:
            raise RebuildRefused("machgen-build build would replace files no build wrote:\n  "
                                 + "\n  ".join(f"{path}: this build exports a file of that name" for path in hit)
                                 + "\nmove them away, or rebuild with --discard-changes to replace them")
        for path in hit:
            self.foreign.remove(path)
            self.lost.append(f"{path} (not from a build; replaced by this build's export)")

    def finish(self, log) -> None:
        """After the write: the unfit adapters deleted, what was kept and lost said."""
        for note in self.notes:
            log(note)
        for adapter, reasons in self.drop_adapters.items():
            target = self.adapters_root / adapter
            if target.is_dir():
                # Moved aside first: a request checks for the adapter's folder, so it is gone at once.
                trash = Path(tempfile.mkdtemp(prefix=f".removed-{adapter}.", dir=self.adapters_root))
                target.rename(trash / adapter)
                shutil.rmtree(trash)
            log(f"deleted adapter '{adapter}' (--drop-unfit-adapters): {'; '.join(reasons)}")
        for what in self.lost:
            log(f"discarded {what} (--discard-changes)")

    def write_record(self, models: Iterable[str]) -> Path:
        """The record of this build: every file of its models as it wrote them (a kept edit as the build's own
        text, so that the next build still sees it as the user's), adapters and kept foreign files left out."""
        own = {relative: text_digest(text) for relative, text in self.own_files.items()}
        skipped = set(self.foreign)
        adapters = f"{_sampler_folder(self.name)}/{ADAPTERS_DIR}/"
        record_file = f"{_sampler_folder(self.name)}/{BUILD_RECORD_FILE}"
        files = {}
        for model in sorted(set(models)):
            for path in sorted((self.out / model).rglob("*")):
                relative = path.relative_to(self.out).as_posix()
                if not path.is_file() or relative in skipped or relative == record_file \
                        or relative.startswith(adapters):
                    continue
                files[relative] = own.get(relative) or file_digest(path)
        manifest = json.loads(self.own_files[f"{_sampler_folder(self.name)}/{MANIFEST_FILE}"])
        path = record_path(self.out, self.name)
        path.write_text(json.dumps({"version": _RECORD_VERSION, "pipeline": self.name, "models": sorted(set(models)),
                                    "manifest": manifest, "files": files}, indent=1, sort_keys=True) + "\n")
        return path


def plan_rebuild(out: Path, name: str, files: dict[str, str], components: Iterable[str],
                 adapters: Mapping[str, Any] | None, drop_unfit_adapters: bool = False,
                 discard_changes: bool = False) -> RebuildPlan:
    """How the build of pipeline ``name`` (rendering ``files``, exporting ``components``, serving adapters by
    the manifest's AdapterSettings ``adapters``) goes over what ``out`` holds; RebuildRefused names what it
    would lose without the flags."""
    out = Path(out)
    plan = RebuildPlan(out, name, dict(files), dict(files))
    sampler = _sampler_folder(name)
    manifest_file = f"{sampler}/{MANIFEST_FILE}"
    adapters_dir = f"{sampler}/{ADAPTERS_DIR}"
    new_models = {relative.split("/", 1)[0] for relative in files}
    touched = new_models | {model_name(name, component) for component in components}

    record = _read_json(record_path(out, name))
    old_manifest = _read_json(out / manifest_file) if record is None else None
    old_models = (set(record["models"]) if record is not None
                  else _manifest_models(name, old_manifest) if old_manifest is not None else set())
    owners = _other_pipelines(out, name)
    clash = sorted((touched | old_models) & set(owners))
    if clash:
        raise ValueError(f"{out}: pipeline '{name}' would write or remove " + ", ".join(
            f"{model} (a model of pipeline '{owners[model]}')" for model in clash) + ": choose another --name")
    plan.remove_models = sorted(old_models - touched)

    refusals: list[str] = []
    discarded: list[str] = []

    def changed(relative: str, why: str) -> None:
        (discarded if discard_changes else refusals).append(f"{relative}: {why}")

    for model in sorted(old_models | {model for model in touched if (out / model).exists()}):
        for path in sorted((out / model).rglob("*")):
            relative = path.relative_to(out).as_posix()
            if path.is_dir() or relative == f"{sampler}/{BUILD_RECORD_FILE}" or relative == adapters_dir \
                    or relative.startswith(adapters_dir + "/"):
                continue
            going = model not in new_models  # an in-sampler component's old model folder goes too
            if record is not None and relative in record["files"]:
                if file_digest(path) == record["files"][relative]:
                    continue  # as the last build wrote it
                if relative == manifest_file:
                    _merge_manifest(plan, path, record["manifest"], changed)
                elif relative in files and text_digest(files[relative]) == record["files"][relative]:
                    plan.files[relative] = path.read_text()
                    plan.notes.append(f"kept your edit of {relative} (this build writes what the last one did)")
                else:
                    changed(relative, "changed since the last build, and this build "
                            + ("no longer writes its model" if going else "writes its own"))
            elif record is None and model in old_models:
                # Built before build records: its files are the build's, but a calibration shows in the manifest.
                if relative == manifest_file:
                    ours, theirs = (_read_json(path) or {}).get("cache"), json.loads(files[manifest_file])["cache"]
                    if ours != theirs:
                        changed(relative, "its cache defaults (a machgen-build calibrate result?) differ from "
                                "this build's, and the repository was built before build records, so which are "
                                "yours cannot be told")
            elif going or relative in files:
                changed(relative, "no build wrote it, and this build "
                        + ("no longer writes its model" if going else "writes its own"))
            else:
                plan.keep.append(relative)
                plan.foreign.append(relative)
                plan.notes.append(f"kept {relative} (no build wrote it)")

    unfit = {}
    installed = installed_adapters(out / adapters_dir)
    if installed:
        settings = AdapterSettings.from_json(adapters)
        for adapter in installed:
            reasons = stored_adapter_problems(out / adapters_dir / adapter, settings)
            if reasons:
                unfit[adapter] = reasons
        plan.notes.append(f"carried over adapters: {', '.join(sorted(set(installed) - set(unfit))) or 'none'}"
                          + (f" (dropped: {', '.join(unfit)})" if unfit and drop_unfit_adapters else ""))
    if (out / adapters_dir).is_dir():
        plan.keep.append(adapters_dir)
    if unfit and drop_unfit_adapters:
        plan.drop_adapters = unfit
        unfit = {}
    if unfit or refusals:
        lines = [f"adapter '{adapter}': " + "; ".join(reasons) for adapter, reasons in unfit.items()] + refusals
        flags = ([f"--drop-unfit-adapters to delete the adapter{'s' if len(unfit) > 1 else ''} "
                  f"{', '.join(repr(adapter) for adapter in unfit)}"] if unfit else []) \
            + (["--discard-changes to replace or delete the files named above"] if refusals else [])
        raise RebuildRefused(f"{out}: building '{name}' again would lose what was added to it since its last "
                             "build:\n  " + "\n  ".join(lines) + "\nkeep them elsewhere first, or rebuild with "
                             + " and ".join(flags))
    plan.lost = discarded
    return plan


def _merge_manifest(plan: RebuildPlan, path: Path, base: Mapping[str, Any], changed) -> None:
    """The repository's pipeline.json changed since the last build: its changed fields merged into the new one."""
    from machgen.contract.manifest import PipelineManifest

    relative = path.relative_to(plan.out).as_posix()
    try:
        ours = _read_json(path)
    except ValueError:
        changed(relative, "changed since the last build and no longer JSON")
        return
    theirs = json.loads(plan.files[relative])
    kept: list[str] = []
    conflicts: list[tuple[str, Any, Any]] = []
    merged = _merge(base, ours, theirs, "", kept, conflicts)
    for field_path, mine, new in conflicts:
        what = " (the cache defaults: a machgen-build calibrate result?)" if field_path == "cache" else ""
        changed(relative, f"{field_path}{what}: {mine} here since the last build, and this build writes {new}")
    if kept:
        PipelineManifest.from_json(merged, relative)  # what the sampler will read
        plan.files[relative] = json.dumps(merged, indent=2, sort_keys=True) + "\n"
        plan.notes.append(f"kept what was changed in {relative} since the last build: {', '.join(kept)}")
