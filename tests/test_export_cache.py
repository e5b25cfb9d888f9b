"""The export cache: a key that changes with everything an export depends
on (and only with that), and a rebuild that copies every component."""

from __future__ import annotations

import filecmp
import shutil

import numpy as np


def _same_tree(left, right) -> bool:
    # Adapters are added to a built repository by tests of them (machgen-build lora add), not built.
    comparison = filecmp.dircmp(left, right, ignore=filecmp.DEFAULT_IGNORES + ["adapters"])
    if comparison.diff_files or comparison.left_only or comparison.right_only or comparison.funny_files:
        return False
    return all(_same_tree(left / name, right / name) for name in comparison.common_dirs)


def _components(model_dir):
    from machgen.builder.model_folder import detect_family, load_pipeline

    family = detect_family(model_dir)
    return {c.spec.name: c for c in family.exporter().components(load_pipeline(model_dir, family))}


def test_the_key_follows_the_weights_the_spec_and_the_options_not_the_folder(tiny_flux_dir, tmp_path):
    import dataclasses

    import torch

    from machgen.builder.export_cache import component_key

    options = {"format": "onnx", "dtype": "float32", "device": "cpu", "attention": None}
    moved = shutil.copytree(tiny_flux_dir, tmp_path / "elsewhere")
    first, again = _components(tiny_flux_dir), _components(moved)
    assert all(component_key(first[name], **options) == component_key(again[name], **options) for name in first)

    decoder = again["vae_decoder"]
    keys = {component_key(decoder, **options)}
    keys.add(component_key(decoder, **{**options, "dtype": "bfloat16"}))
    keys.add(component_key(dataclasses.replace(decoder, spec=dataclasses.replace(decoder.spec, tolerance=1.0)),
                           **options))
    decoder.module.scaling_factor += 1  # a plain setting of the wrapper
    keys.add(component_key(decoder, **options))
    with torch.no_grad():
        next(decoder.module.parameters()).view(-1)[0] += 1e-3
    keys.add(component_key(decoder, **options))
    assert len(keys) == 5


def test_the_key_follows_the_family_export_code_not_its_run_time_code(tiny_flux_dir, monkeypatch):
    """A family's runtime (how requests are served) and its docstrings there
    are no part of what an export depends on; its export module is."""
    from pathlib import Path

    import machgen.families.flux.export as flux_export
    import machgen.families.flux.runtime as flux_runtime
    from machgen.builder import export_cache

    components = _components(tiny_flux_dir)
    options = {"format": "onnx", "dtype": "float32", "device": "cpu", "attention": None}
    before = {name: export_cache.component_key(c, **options) for name, c in components.items()}
    sources = {path for c in components.values() for path in export_cache.export_sources(c.module)}
    assert Path(flux_export.__file__) in sources and Path(flux_runtime.__file__) not in sources

    def edited(edited_file):
        read = Path.read_bytes

        def read_bytes(path):
            return read(path) + b"\n# edited\n" if path == Path(edited_file) else read(path)
        return read_bytes

    monkeypatch.setattr(Path, "read_bytes", edited(flux_runtime.__file__))
    assert {name: export_cache.component_key(c, **options) for name, c in components.items()} == before
    monkeypatch.setattr(Path, "read_bytes", edited(flux_export.__file__))
    after = {name: export_cache.component_key(c, **options) for name, c in components.items()}
    assert all(after[name] != before[name] for name in before)


def test_a_rebuild_copies_every_component_from_the_cache(built_repository, tiny_flux_dir, tmp_path):
    """built_repository filled the session's cache ($MACHGEN_EXPORT_CACHE, set by conftest)."""
    from machgen.builder.build import build_repository
    from machgen.runtime.local import LocalPipeline

    from machgen.builder.repository import ServingOptions

    from conftest import ADAPTER_RANK, PIPELINE_NAME

    repository, first = built_repository
    logs = []
    again = build_repository(tiny_flux_dir, PIPELINE_NAME, tmp_path, log=logs.append,
                             options=ServingOptions(max_lora_rank=ADAPTER_RANK))
    progress = [line for line in logs if "max |" in line]
    assert len(progress) == len(first) and all(line.endswith("(export cache)") for line in progress)
    assert [(r.name, r.max_abs_diff) for r in first] == [(r.name, r.max_abs_diff) for r in again]
    assert _same_tree(repository, tmp_path)
    images = [LocalPipeline(folder, PIPELINE_NAME).generate("a red cat", seed=1, cache_policy="none")[0]
              for folder in (repository, tmp_path)]
    assert np.array_equal(*images)
