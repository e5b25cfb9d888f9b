"""`machgen generate`'s family inputs: options derived from the families' declarations."""

import pytest
import typer

from machgen.cli import _family_flags_help, _family_options


def test_family_inputs_are_options_of_their_own_typed_as_declared():
    options = _family_options(["--stg-scale", "2", "--stg-block", "1", "--stg-block=3", "--guidance-scale-2", "4"],
                              ["modality_scale=2.5", "audio_guidance_scale=1"])
    assert options == {"stg_scale": 2.0, "stg_blocks": [1, 3], "guidance_scale_2": 4.0, "modality_scale": 2.5,
                       "audio_guidance_scale": 1.0}
    # --input names any input; one no family declares goes as written (the server's metadata types it)
    assert _family_options([], ["stg_blocks=0,1", "future_input=7"]) == {"stg_blocks": [0, 1], "future_input": "7"}


@pytest.mark.parametrize("extra, pairs, words", [
    (["--no-such-flag", "1"], [], "no such option: --no-such-flag"),
    (["--stg-scale"], [], "needs a value"),
    (["--stg-scale", "much"], [], "not a FP32 value"),
    ([], ["stg_scale"], "is not NAME=VALUE"),
])
def test_bad_family_options_are_named(extra, pairs, words):
    with pytest.raises(typer.BadParameter, match=words):
        _family_options(extra, pairs)


def test_help_lists_every_family_input_with_its_families():
    text = _family_flags_help()
    for flag, families in (("--stg-block INT32 (repeatable)", "ltx2, ltx2-i2v"),
                           ("--guidance-scale-2 FP32", "wan")):
        assert flag in text and families in text


@pytest.mark.parametrize("weights", ["transformer/diffusion_pytorch_model.bin", "vae/model.pt", "lora.ckpt"])
def test_build_refuses_pickled_weights_by_name(weights, tmp_path):
    """A model folder with pickle-based weights is refused before anything loads (loading a pickle runs
    its code); the message names the file."""
    import shutil
    from pathlib import Path

    from typer.testing import CliRunner

    from machgen.builder.cli import app

    model = tmp_path / "model"
    shutil.copytree(Path(__file__).parent.parent / "models" / "shapes-flux", model)
    (model / weights).parent.mkdir(parents=True, exist_ok=True)
    (model / weights).write_bytes(b"not loaded")
    result = CliRunner().invoke(app, ["build", str(model), "--name", "shapes", "--out", str(tmp_path / "repo")])
    assert result.exit_code != 0
    assert "pickle-based weights" in result.output and Path(weights).name in result.output
    assert not (tmp_path / "repo").exists()


def test_serve_verbose_asks_the_sampler_to_log_every_step(tmp_path):
    """machgen serve --verbose reaches the sampler (a step log costs every step a message to the server, so it
    is off otherwise); machgen serve always tells the samplers where to look for a stop."""
    from machgen.contract.manifest import STEP_LOG_ENV, STOP_FILE_ENV
    from machgen.server import TritonServer

    quiet, verbose = TritonServer(tmp_path).environment(), TritonServer(tmp_path, verbose=True).environment()
    assert STEP_LOG_ENV not in quiet and verbose[STEP_LOG_ENV] == "1"
    assert quiet[STOP_FILE_ENV] and verbose[STOP_FILE_ENV]
