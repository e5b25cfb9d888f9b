"""`machgen generate`'s model inputs: options as the served model publishes them."""

import json

import numpy as np
import pytest
import typer

from machgen.cli import _family_options
from machgen.contract.api import InvalidArgument, published_inputs


def published(family: str):
    """A model of ``family``'s own inputs as a client reads them from its card (JSON and back)."""
    from machgen.families.registry import get_family

    card_inputs = [declared.published(declared.default) for declared in get_family(family).inputs]
    return published_inputs(json.loads(json.dumps(card_inputs)))


def test_the_published_description_is_the_declaration():
    from machgen.families.registry import family_inputs

    for declared, families in family_inputs().values():
        read_back = published(families[0])[declared.name]
        assert (read_back.tensor, read_back.flag, read_back.repeatable, read_back.default, read_back.default_doc) == (
            declared.tensor, declared.flag, declared.repeatable, declared.default, declared.default_doc)


@pytest.mark.parametrize("name, value, words", [
    ("stg_scale", np.array([1.0, 2.0], np.float32), "expected one element"),
    ("stg_blocks", np.array([[1, 2]], np.int32), "expected shape [-1]"),
    ("stg_blocks", np.array([1.5], np.float32), "expected INT32 values"),
])
def test_a_published_input_checks_type_and_shape(name, value, words):
    with pytest.raises(InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")) as refused:
        published("ltx2")[name].parse(name, value, {})
    assert refused.value.field == name
    assert published("ltx2")["stg_blocks"].parse("stg_blocks", np.array([0, 2], np.int32), {}) == [0, 2]


def test_a_card_without_inputs_falls_back_to_the_configs_tensors():
    """A repository built before cards described the model's own inputs: its config still lists their names,
    types and shapes, which is what the API and the client go by then (flags from the names)."""
    from machgen.api.triton import _own_inputs

    config = {"input": [{"name": "prompt", "data_type": "TYPE_STRING", "dims": ["1"]},
                        {"name": "stg_blocks", "data_type": "TYPE_INT32", "dims": ["-1"]},
                        {"name": "note", "data_type": "TYPE_STRING", "dims": ["1"]}]}
    found = published_inputs(_own_inputs(config))
    assert sorted(found) == ["note", "stg_blocks"]
    assert (found["stg_blocks"].tensor.triton_dtype, found["stg_blocks"].tensor.dims, found["stg_blocks"].flag,
            found["stg_blocks"].repeatable, found["note"].tensor.triton_dtype) == ("INT32", (-1,), "--stg-blocks",
                                                                                   True, "BYTES")
    assert _family_options(["--stg-blocks", "2"], ["note=hi"], found, "old") == {"stg_blocks": [2], "note": "hi"}


def test_model_inputs_are_the_flags_it_publishes_typed_as_published():
    options = _family_options(["--stg-scale", "2", "--stg-block", "1", "--stg-block=3"],
                              ["modality_scale=2.5", "audio_guidance_scale=1"], published("ltx2"), "clip")
    assert options == {"stg_scale": 2.0, "stg_blocks": [1, 3], "modality_scale": 2.5, "audio_guidance_scale": 1.0}
    # --input names any input; one the model does not publish goes as written (the client types or refuses it)
    assert _family_options([], ["stg_blocks=0,1", "future_input=7"], published("ltx2"), "clip") == {
        "stg_blocks": [0, 1], "future_input": "7"}
    assert _family_options(["--guidance-scale-2", "4"], [], published("wan"), "wan") == {"guidance_scale_2": 4.0}


@pytest.mark.parametrize("extra, pairs, words", [
    (["--no-such-flag", "1"], [], "no such option: --no-such-flag"),
    # another family's flag: not this model's
    (["--guidance-scale-2", "4"], [], "no such option: --guidance-scale-2 (clip publishes these of its own: "
                                      "--audio-guidance-rescale"),
    (["--stg-scale"], [], "needs a value"),
    (["--stg-scale", "much"], [], "not a FP32 value"),
    (["--stg-block", "1.5"], [], "not a INT32 value"),
    ([], ["stg_scale"], "is not NAME=VALUE"),
])
def test_bad_model_options_are_named(extra, pairs, words):
    with pytest.raises(typer.BadParameter) as refused:
        _family_options(extra, pairs, published("ltx2"), "clip")
    assert words in str(refused.value)


def test_a_model_without_inputs_of_its_own_refuses_every_flag():
    with pytest.raises(typer.BadParameter, match="publishes these of its own: none"):
        _family_options(["--stg-scale", "2"], [], {}, "flux")


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
