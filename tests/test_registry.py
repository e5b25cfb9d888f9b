import subprocess
import sys

import pytest

from machgen.builder.registry import family_for_pipeline, family_names, get_family


def test_flux_is_registered_under_its_pipeline_class():
    assert "flux" in family_names()
    assert family_for_pipeline("FluxPipeline").name == "flux"
    assert get_family("flux").name == "flux"


def test_unknown_family_and_pipeline_are_named_in_the_error():
    with pytest.raises(KeyError, match="nope"):
        get_family("nope")
    with pytest.raises(KeyError, match="StableCascadePipeline"):
        family_for_pipeline("StableCascadePipeline")


def test_listing_families_and_cli_start_do_not_import_heavy_packages():
    code = (
        "import sys\n"
        "from machgen.builder.registry import family_names\n"
        "import machgen.builder.cli, machgen.cli\n"
        "family_names()\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'tritonclient', 'onnxruntime') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
