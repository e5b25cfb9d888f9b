"""A build over an earlier build of its pipeline keeps what users added since (builder/rebuild.py), without an
export: the repository is the golden render of the tiny Flux, written and rewritten as build_repository writes
it. The rebuild of a real repository with adapters is in test_lora_adapters.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from machgen.builder.rebuild import BUILD_RECORD_FILE, RebuildRefused, plan_rebuild
from machgen.builder.repository import write_repository

GOLDEN = Path(__file__).parent / "golden" / "flux"
MANIFEST = "flux_sampler/1/pipeline.json"


def golden_files(name: str = "flux") -> dict[str, str]:
    """The golden render of the tiny Flux, as pipeline ``name``."""
    files = {str(path.relative_to(GOLDEN)): path.read_text() for path in GOLDEN.rglob("*") if path.is_file()}
    if name == "flux":
        return files
    return {relative.replace("flux", name, 1): text.replace('"flux', f'"{name}') for relative, text in files.items()}


def build(out: Path, files: dict[str, str], name: str = "flux", **flags) -> list[str]:
    """What build_repository does around its export, with nothing exported; its log."""
    logs: list[str] = []
    adapters = json.loads(files[f"{name}_sampler/1/pipeline.json"])["adapters"]
    plan = plan_rebuild(out, name, files, [], adapters, **flags)
    write_repository(out, name, plan.files, {}, {}, keep=plan.keep, remove=plan.remove_models)
    plan.finish(logs.append)
    plan.write_record({relative.split("/", 1)[0] for relative in files})
    return logs


def manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def changed(files: dict[str, str], relative: str, old: str, new: str) -> dict[str, str]:
    assert old in files[relative]
    return {**files, relative: files[relative].replace(old, new)}


def with_manifest(files: dict[str, str], change) -> dict[str, str]:
    """``files`` whose manifest ``change`` (a function of its JSON) changed, as the build renders it."""
    data = json.loads(files[MANIFEST])
    change(data)
    return {**files, MANIFEST: json.dumps(data, indent=2, sort_keys=True) + "\n"}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_calibration_edits_and_own_files_are_kept_by_every_rebuild(tmp_path):
    from machgen.builder.calibrate import write_settings
    from machgen.runtime.cache import CacheSettings

    out, files = tmp_path / "repository", golden_files()
    build(out, files)
    assert (out / "flux_sampler/1" / BUILD_RECORD_FILE).is_file()
    # What users do to a built repository: calibrate it, edit a default and a config, add a file.
    calibrated = CacheSettings(default_policy="fbcache", thresholds={"fbcache": 0.31, "magcache": 0.12},
                               magnitude_ratios=(1.0, 0.97, 0.95))
    write_settings(out, "flux", calibrated)
    edited = manifest(out)
    edited["defaults"]["guidance_scale"] = 5.0
    (out / MANIFEST).write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")
    config = out / "flux_text_encoder/config.pbtxt"
    config.write_text(config.read_text().replace("count: 2", "count: 3"))
    (out / "flux_sampler/1/NOTES.md").write_text("ours\n")

    for _ in range(2):  # and the next rebuild again: the record keeps the build's own text, not the kept one
        logs = build(out, files)
        assert manifest(out)["cache"] == calibrated.to_json()
        assert manifest(out)["defaults"]["guidance_scale"] == 5.0
        assert "count: 3" in config.read_text()
        assert (out / "flux_sampler/1/NOTES.md").read_text() == "ours\n"
        assert any("cache" in line and "defaults.guidance_scale" in line for line in logs), logs
        assert any("flux_text_encoder/config.pbtxt" in line for line in logs), logs

    # A rebuild that writes a default of its own keeps the calibration and the other edits beside it.
    new_height = with_manifest(files, lambda data: data["defaults"].update(height=128))
    build(out, new_height)
    assert manifest(out)["defaults"]["height"] == 128 and manifest(out)["defaults"]["guidance_scale"] == 5.0
    assert manifest(out)["cache"] == calibrated.to_json()
    from machgen.contract.manifest import PipelineManifest

    assert PipelineManifest.read(out / "flux_sampler/1").defaults.guidance_scale == 5.0


def test_what_the_rebuild_would_replace_is_refused_by_name_and_discarded_only_when_asked(tmp_path):
    from machgen.builder.calibrate import write_settings
    from machgen.runtime.cache import CacheSettings

    out, files = tmp_path / "repository", golden_files()
    build(out, files)
    write_settings(out, "flux", CacheSettings(default_policy="fbcache"))
    public = out / "flux/config.pbtxt"
    public.write_text(public.read_text().replace("count: 8", "count: 2"))
    (out / "flux_vae_encoder/1/mine.txt").write_text("ours\n")
    before = _snapshot(out)

    # The model card brings a calibration of its own, --in-flight changes, and no more VAE encoder.
    rebuilt = changed(with_manifest(files, lambda data: data["cache"].update(default_policy="magcache")),
                      "flux/config.pbtxt", "count: 8", "count: 4")
    rebuilt = {relative: text for relative, text in rebuilt.items() if not relative.startswith("flux_vae_encoder")}
    with pytest.raises(RebuildRefused) as refused:
        build(out, rebuilt)
    message = str(refused.value)
    for named in ("flux_sampler/1/pipeline.json: cache", "flux/config.pbtxt: changed since the last build",
                  "flux_vae_encoder/1/mine.txt: no build wrote it", "--discard-changes"):
        assert named in message, message
    assert "flux_vae_encoder/config.pbtxt" not in message  # as the last build wrote it: not the user's
    assert _snapshot(out) == before  # refused before anything was written

    logs = build(out, rebuilt, discard_changes=True)
    assert manifest(out)["cache"]["default_policy"] == "magcache"
    assert "count: 4" in public.read_text()
    assert not (out / "flux_vae_encoder").exists()
    assert sum("discarded" in line for line in logs) == 3, logs


def test_another_pipeline_of_the_repository_is_never_touched(tmp_path):
    out = tmp_path / "repository"
    build(out, golden_files("other"), name="other")
    build(out, golden_files())
    other = _snapshot(out / "other_sampler") | _snapshot(out / "other")
    (out / "flux_sampler/1/NOTES.md").write_text("ours\n")
    build(out, {relative: text for relative, text in golden_files().items()
                if not relative.startswith("flux_vae_encoder")})
    assert _snapshot(out / "other_sampler") | _snapshot(out / "other") == other
    assert (out / "other_vae_encoder/config.pbtxt").is_file() and not (out / "flux_vae_encoder").exists()
    # A pipeline whose models would be another's is refused: flux's denoiser chain is "flux_denoiser".
    with pytest.raises(ValueError, match="flux_denoiser \\(a model of pipeline 'flux'\\)"):
        build(out, golden_files("flux_denoiser"), name="flux_denoiser")


def _adapter(root: Path, name: str, layers: dict[str, tuple[int, int, int]]) -> None:
    from safetensors.numpy import save_file

    folder = root / name
    folder.mkdir(parents=True)
    save_file({f"{layer}.{part}": np.zeros(shape, np.float32) for layer, (rank, fan_in, fan_out) in layers.items()
               for part, shape in (("down", (rank, fan_in)), ("up", (fan_out, rank)))},
              str(folder / "adapter.safetensors"))
    (folder / "adapter.json").write_text(json.dumps({"name": name, "rank": max(r for r, _, _ in layers.values()),
                                                     "layers": len(layers), "source": "-", "sha256": "-"}))


def test_adapters_are_checked_against_the_new_build(tmp_path):
    from machgen.builder.adapters import list_adapters

    out, files = tmp_path / "repository", golden_files()
    build(out, files)
    root = out / "flux_sampler/1/adapters"
    _adapter(root, "small", {"context_embedder": (2, 32, 32)})
    _adapter(root, "wide", {"context_embedder": (8, 32, 32), "norm_out.linear": (8, 32, 64)})
    build(out, files)
    assert sorted(list_adapters(out)) == ["small", "wide"]  # as lora add left them
    # The adapters' own check of lora add, not merely their presence.
    _adapter(root, "elsewhere", {"context_embedder": (2, 32, 32), "nowhere.linear": (2, 32, 32)})
    _adapter(root, "bent", {"context_embedder": (2, 31, 32)})
    narrower = with_manifest(files, lambda data: data["adapters"].update(max_rank=4))
    with pytest.raises(RebuildRefused) as refused:
        build(out, narrower)
    message = str(refused.value)
    assert "adapter 'wide': context_embedder: rank 8 is over this build's maximum 4" in message
    assert "adapter 'elsewhere': nowhere.linear: this build's model has no such linear layer" in message
    assert "adapter 'bent': context_embedder: down [2, 31] / up [32, 2] do not fit" in message
    assert "'small'" not in message and "--drop-unfit-adapters" in message
    logs = build(out, narrower, drop_unfit_adapters=True)
    assert sorted(list_adapters(out)) == ["small"]
    assert sorted(line.split("'")[1] for line in logs if line.startswith("deleted adapter")) == \
        ["bent", "elsewhere", "wide"]
    # Built without adapter inputs: none can be served.
    without = with_manifest(files, lambda data: data.update(adapters=None))
    with pytest.raises(RebuildRefused, match="adapter 'small': this build serves no per-request adapters"):
        build(out, without)
