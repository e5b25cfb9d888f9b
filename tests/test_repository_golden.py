"""The generated repository is pinned by golden files (UPDATE_GOLDEN=1 rewrites them)."""

import os
from pathlib import Path

import pytest

from machgen.builder.build import components_to_export
from machgen.builder.model_folder import load_pipeline, served_defaults
from machgen.builder.repository import ServingOptions, render_repository
from machgen.contract.manifest import pipeline_dir
from machgen.families.registry import get_family

from conftest import ADAPTER_RANK, PIPELINE_NAME, component_onnx

GOLDEN = Path(__file__).parent / "golden" / "flux"


@pytest.fixture(scope="module")
def rendered(tiny_flux_dir):
    """What the session's built_repository renders: the tiny Flux with per-request adapters (its own copy of the
    pipeline: making the transformer adaptable replaces its linear layers)."""
    family = get_family("flux")
    exporter = family.exporter()
    pipe = load_pipeline(tiny_flux_dir, family)
    defaults = served_defaults(tiny_flux_dir, family, pipe)
    options = ServingOptions(max_lora_rank=ADAPTER_RANK)
    _, specs, adapters = components_to_export(exporter, pipe, options, log=lambda line: None)
    return render_repository("flux", family, specs, defaults, exporter.sampler_settings(pipe, defaults),
                             options=options, adapters=adapters)


def test_rendered_repository_matches_golden_files(rendered):
    if os.environ.get("UPDATE_GOLDEN"):
        for relative, text in rendered.items():
            (GOLDEN / relative).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / relative).write_text(text)
    golden = {str(p.relative_to(GOLDEN)): p.read_text() for p in GOLDEN.rglob("*") if p.is_file()}
    assert sorted(golden) == sorted(rendered)
    for relative, text in rendered.items():
        assert text == golden[relative], f"{relative} differs from its golden file"


def test_built_repository_holds_the_rendered_files_and_engines(rendered, built_repository):
    import json

    repository, results = built_repository
    for relative, text in rendered.items():
        written = (repository / relative).read_text()
        if relative.endswith("/pipeline.json"):  # once exported, the build adds each component's weight bytes
            written = json.loads(written)  # and the folder it came from
            assert set(written.pop("weight_bytes")) >= {result.name for result in results}
            assert written.pop("built_from")["files"]
            written = json.dumps(written, indent=2, sort_keys=True) + "\n"
        assert written == text
    for result in results:
        assert component_onnx(repository, result.name).stat().st_size > 0
    # in-sampler components are no Triton models
    assert component_onnx(repository, "denoiser_reuse").parent.parent.name == "components"
    assert not (repository / "flux_denoiser_reuse").exists()
    for asset in ("tokenizer", "tokenizer_2", "scheduler"):
        assert (pipeline_dir(repository, PIPELINE_NAME) / asset).is_dir()


def test_the_manifest_reads_back_and_another_version_is_refused(rendered, tmp_path):
    import json

    from machgen.contract.manifest import ManifestError, PipelineManifest

    text = rendered["flux_sampler/1/pipeline.json"]
    (tmp_path / "pipeline.json").write_text(text)
    manifest = PipelineManifest.read(tmp_path)
    assert manifest.render() == text
    assert manifest.runtime == "machgen.families.flux.runtime:FluxRuntime"
    assert manifest.served_models["denoiser_tail"] == "flux_denoiser_tail"
    assert manifest.components["denoiser_reuse"].file == "components/denoiser_reuse/model.onnx"
    for version in (2, 4):
        (tmp_path / "pipeline.json").write_text(json.dumps({**json.loads(text), "version": version}))
        with pytest.raises(ManifestError, match=f"version {version}; this machgen serves version 3: rebuild"):
            PipelineManifest.read(tmp_path)
    (tmp_path / "pipeline.json").write_text(json.dumps({key: value for key, value in json.loads(text).items()
                                                        if key != "runtime"}))
    with pytest.raises(ManifestError, match="malformed.*runtime"):
        PipelineManifest.read(tmp_path)


@pytest.fixture(scope="module")
def flux_specs(tiny_flux_dir):
    """The tiny Flux's specs without adapters, as a plain build serves them."""
    family = get_family("flux")
    exporter = family.exporter()
    pipe = load_pipeline(tiny_flux_dir, family)
    defaults = served_defaults(tiny_flux_dir, family, pipe)
    _, specs, _ = components_to_export(exporter, pipe, ServingOptions(), log=lambda line: None)
    return family, specs, defaults, exporter.sampler_settings(pipe, defaults)


def test_the_onnxruntime_target_serves_head_and_tail_as_one_model_and_lone_steps_in_the_sampler(flux_specs):
    """Without adapters the onnxruntime target's chain is one Python model (their joined graph, builder/chain.py)
    with the ensemble's inputs and outputs, and the sampler is told how many sessions of it to keep for a lone
    request's steps; the torch target keeps the ensemble and no such sessions, and so does a build that turns
    them off."""
    from machgen.builder.repository import TargetServing, fused_chains

    family, specs, defaults, settings = flux_specs
    assert set(fused_chains(specs)) == {"denoiser"}
    chain = render_repository("flux", family, specs, defaults, settings)
    ensemble = (GOLDEN / "flux_denoiser" / "config.pbtxt").read_text()
    assert 'backend: "python"' in chain["flux_denoiser/config.pbtxt"] and "ensemble" not in chain[
        "flux_denoiser/config.pbtxt"]
    assert "OnnxComponentModel" in chain["flux_denoiser/1/model.py"]
    for block in ("input [", "output ["):
        assert chain["flux_denoiser/config.pbtxt"].split(block)[1].split("]\n")[0] == \
            ensemble.split(block)[1].split("]\n")[0]
    assert 'key: "lone_step_sessions"\n  value: { string_value: "2" }' in chain["flux_sampler/config.pbtxt"]
    # The one interactive request among batch ones computes its steps there too, the joined model's instances
    # niced (ServingOptions.denoiser_nice).
    assert 'key: "interactive_steps_in_sampler"\n  value: { string_value: "1" }' in chain["flux_sampler/config.pbtxt"]
    assert 'key: "nice"\n  value: { string_value: "10" }' in chain["flux_denoiser/config.pbtxt"]
    assert all('key: "nice"' not in text for path, text in chain.items() if path != "flux_denoiser/config.pbtxt")
    unniced = render_repository("flux", family, specs, defaults, settings, options=ServingOptions(denoiser_nice=0))
    assert "interactive_steps_in_sampler" not in unniced["flux_sampler/config.pbtxt"]
    assert 'key: "nice"' not in unniced["flux_denoiser/config.pbtxt"]
    torch_files = render_repository("flux", family, specs, defaults, settings, serving=TargetServing("torch"))
    assert not fused_chains(specs, TargetServing("torch"))
    assert 'platform: "ensemble"' in torch_files["flux_denoiser/config.pbtxt"]
    assert "lone_step_sessions" not in torch_files["flux_sampler/config.pbtxt"]
    assert "interactive_steps_in_sampler" not in torch_files["flux_sampler/config.pbtxt"]
    off = render_repository("flux", family, specs, defaults, settings,
                            options=ServingOptions(lone_steps_in_sampler=False))
    assert "lone_step_sessions" not in off["flux_sampler/config.pbtxt"]
    assert "interactive_steps_in_sampler" not in off["flux_sampler/config.pbtxt"]
    assert 'key: "nice"' not in off["flux_denoiser/config.pbtxt"]
