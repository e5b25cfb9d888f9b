import subprocess
import sys
from pathlib import Path

import pytest

from machgen.families.registry import all_families, family_for_model, family_inputs, family_names, get_family


def test_flux_is_registered_under_its_pipeline_class():
    assert "flux" in family_names()
    assert family_for_model({"_class_name": "FluxPipeline"}).name == "flux"
    assert get_family("flux").name == "flux"


def test_unknown_family_and_pipeline_are_named_in_the_error():
    with pytest.raises(KeyError, match="nope"):
        get_family("nope")
    with pytest.raises(KeyError, match="StableCascadePipeline"):
        family_for_model({"_class_name": "StableCascadePipeline"})


@pytest.mark.parametrize("family", all_families(), ids=lambda f: f.name)
def test_every_familys_halves_load_by_the_paths_it_declares(family):
    from machgen.builder.family_export import FamilyExport
    from machgen.contract.manifest import load_object
    from machgen.runtime.family import FamilyRuntime

    runtime = load_object(family.runtime)
    assert issubclass(runtime, FamilyRuntime) and runtime.family is family
    assert isinstance(family.exporter(), FamilyExport)
    assert callable(load_object(family.tiny))


def test_listing_families_and_cli_start_do_not_import_heavy_packages():
    code = (
        "import sys\n"
        "from machgen.families.registry import family_names\n"
        "import machgen.builder.cli, machgen.cli\n"
        "family_names()\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'tritonclient', 'onnxruntime') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_listing_families_imports_nothing_of_the_build():
    """The registry is a light path: its families' build-time halves are named, not imported."""
    listing = "import sys\nfrom machgen.families.registry import all_families\nall_families()\nprint(*sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, check=True).stdout.split()
    assert [name for name in loaded if name == "torch" or name.startswith("machgen.builder")] == []


# Every module Triton's Python models or the in-process pipeline load: the models, the sampler with every
# family's runtime, the components' runners and the in-process pipeline.
RUN_TIME = ["machgen.runtime.triton_models.components", "machgen.runtime.triton_models.relays",
            "machgen.runtime.triton_models.sampler", "machgen.runtime.local", "machgen.runtime.torch_runner",
            "machgen.runtime.onnx_runner", "machgen.plugins.ops", *(f.runtime.partition(":")[0] for f in all_families())]
# What exists only to build: export, repository writing, training, engines, tiny test models.
BUILD_TIME = ("machgen.builder", *(f"{f.export.partition(':')[0]}" for f in all_families()),
              *(f"{f.tiny.partition(':')[0]}" for f in all_families()), "machgen.plugins.tensorrt_plugin")


def test_the_run_time_imports_no_build_time_module(tmp_path):
    """Every run-time module imported with the build-time ones made unimportable
    (a stub of Triton's triton_python_backend_utils stands in for the stub's own)."""
    (tmp_path / "triton_python_backend_utils.py").write_text("")
    code = (
        "import importlib, sys\n"
        "class Refuse:\n"
        f"    build = {BUILD_TIME!r}\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if any(name == b or name.startswith(b + '.') for b in self.build):\n"
        "            raise ImportError(f'build-time module {name} imported at run time')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        f"for module in {RUN_TIME!r}:\n"
        "    importlib.import_module(module)\n"
        "loaded = [m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in Refuse.build)]\n"
        "print('loaded:', loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": ""}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("loaded: []")


def test_the_api_table_lists_every_family_input_as_declared():
    page = (Path(__file__).parents[1] / "docs" / "model-api.md").read_text()
    for declared, families in family_inputs().values():
        assert declared.markdown_row() in page, f"docs/model-api.md lacks the row of {declared.name} ({families})"
