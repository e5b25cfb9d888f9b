"""The generated repository is pinned by golden files (UPDATE_GOLDEN=1 rewrites them)."""

import os
from pathlib import Path

import pytest

from machgen.builder.build import served_defaults
from machgen.builder.registry import get_family
from machgen.builder.repository import pipeline_dir, render_repository

from conftest import PIPELINE_NAME, component_onnx

GOLDEN = Path(__file__).parent / "golden" / "flux"


@pytest.fixture(scope="module")
def rendered(tiny_flux_dir, tiny_flux_pipeline):
    family = get_family("flux")
    defaults = served_defaults(tiny_flux_dir, family, tiny_flux_pipeline)
    return render_repository("flux", family, family.specs(tiny_flux_pipeline), defaults,
                             family.sampler_settings(tiny_flux_pipeline, defaults))


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
    repository, results = built_repository
    for relative, text in rendered.items():
        assert (repository / relative).read_text() == text
    for result in results:
        assert component_onnx(repository, result.name).stat().st_size > 0
    # in-sampler components are no Triton models
    assert component_onnx(repository, "denoiser_reuse").parent.parent.name == "components"
    assert not (repository / "flux_denoiser_reuse").exists()
    for asset in ("tokenizer", "tokenizer_2", "scheduler"):
        assert (pipeline_dir(repository, PIPELINE_NAME) / asset).is_dir()
