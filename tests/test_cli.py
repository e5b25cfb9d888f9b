"""`machgen generate`'s model inputs: options as the served model publishes them; the CLIs' task names."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import typer

from machgen.cli import _family_options
from machgen.contract.tasks import TASKS, long_task_name, short_task_name
from machgen.contract.api import published_inputs
from machgen.contract.validation import InvalidArgument


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


def test_build_refuses_an_unknown_onnx_exporter_before_loading_anything(tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    from machgen.builder.cli import app

    model = Path(__file__).parent.parent / "models" / "shapes-flux"
    result = CliRunner().invoke(app, ["build", str(model), "--name", "shapes", "--out", str(tmp_path / "repo"),
                                      "--onnx-exporter", "legacy"])
    assert result.exit_code == 2 and "--onnx-exporter" in result.output and "dynamo" in result.output, result.output
    assert "Loading" not in result.output and not (tmp_path / "repo").exists()


@pytest.mark.parametrize("target,precision", [("onnxruntime", "fp8"), ("onnxruntime", "bf16"), ("torch", "int8")])
def test_build_refuses_a_precision_its_target_cannot_build_before_loading_anything(target, precision, tmp_path):
    """A precision the target does not build was once silently ignored (a float32 build under an int8 name):
    refused, naming the option, the target and what it builds."""
    from pathlib import Path

    from typer.testing import CliRunner

    from machgen.builder.cli import app

    model = Path(__file__).parent.parent / "models" / "shapes-flux"
    result = CliRunner().invoke(app, ["build", str(model), "--name", "shapes", "--out", str(tmp_path / "repo"),
                                      "--target", target, "--precision", precision])
    assert result.exit_code == 1, result.output
    assert f"--precision {precision}: the {target} target builds float" in " ".join(result.output.split())
    assert "Loading" not in result.output and not (tmp_path / "repo").exists()


def test_serve_verbose_asks_the_sampler_to_log_every_step(tmp_path):
    """machgen serve --verbose reaches the sampler (a step log costs every step a message to the server, so it
    is off otherwise); machgen serve always tells the samplers where to look for a stop."""
    from machgen.contract.manifest import STEP_LOG_ENV, STOP_FILE_ENV
    from machgen.server import TritonServer

    quiet, verbose = TritonServer(tmp_path).environment(), TritonServer(tmp_path, verbose=True).environment()
    assert STEP_LOG_ENV not in quiet and verbose[STEP_LOG_ENV] == "1"
    assert quiet[STOP_FILE_ENV] and verbose[STOP_FILE_ENV]


# Each task by its short name (what every CLI's --help documents) and its long name (the manifests', accepted too).
SPELLINGS = [(short, task.name) for short, task in TASKS.items()]


def unboxed(output: str) -> str:
    """A CLI's output with typer's error box taken away and its lines joined."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())


def test_every_task_is_named_short_or_long_and_either_name_gives_both():
    assert [short for short, _ in SPELLINGS] == ["t2i", "i2i", "t2v", "i2v", "r2v"]
    for short, long in SPELLINGS:
        assert short_task_name(short) == short_task_name(long) == short
        assert long_task_name(short) == long_task_name(long) == long
    assert short_task_name("video") is None and long_task_name("video") == "video" and long_task_name(None) is None


@pytest.mark.parametrize("spelling", ["short", "long"])
def test_generate_takes_either_name_of_a_task(spelling, tmp_path):
    """machgen generate --task checks a task's inputs by either name, before it reaches for a server."""
    from typer.testing import CliRunner

    from machgen.cli import app

    def refusal(task: str, out: str, *extra: str) -> str:
        result = CliRunner().invoke(app, ["generate", "--prompt", "x", "--model", "m", "--url", "127.0.0.1:1",
                                          "--task", task, "--out", str(tmp_path / out), *extra])
        assert result.exit_code == 2
        return unboxed(result.output)

    def named(short: str) -> str:
        return short if spelling == "short" else TASKS[short].name

    assert f"{named('t2v')} writes an .mp4 file" in refusal(named("t2v"), "clip.png")
    assert f"{named('t2i')} writes an image file" in refusal(named("t2i"), "image.mp4")
    assert f"{named('i2v')} needs --image" in refusal(named("i2v"), "clip.mp4")
    assert f"{named('r2v')} needs --reference-image" in refusal(named("r2v"), "clip.mp4")
    assert "'video' is not one of t2i, i2i, t2v, i2v, r2v" in refusal("video", "clip.mp4")


@pytest.mark.parametrize("task, expected", [("t2v", "text-to-video"), ("text-to-video", "text-to-video"),
                                            ("i2v", "image-to-video"), ("image-to-video", "image-to-video")])
def test_eval_takes_either_name_of_a_video_task(task, expected, monkeypatch):
    from typer.testing import CliRunner

    from machgen.builder import cli

    evaluated = []
    monkeypatch.setattr(cli, "_evaluate_video", lambda model_dir, url, name, protocol, task, *rest:
                        evaluated.append(task))
    result = CliRunner().invoke(cli.app, ["eval", "--url", "127.0.0.1:1", "--task", task])
    assert result.exit_code == 0, result.output
    assert evaluated == [expected]


@pytest.mark.parametrize("task", ["t2i", "text-to-image"])
def test_eval_takes_either_name_of_text_to_image(task, monkeypatch):
    from typer.testing import CliRunner

    from machgen.builder import cli, evaluate

    asked = []

    def served(url, name, prompts, protocol, **options):
        asked.append(len(prompts))
        return np.zeros((len(prompts), 64, 64, 3), np.uint8)

    monkeypatch.setattr(evaluate, "generate_served", served)
    result = CliRunner().invoke(cli.app, ["eval", "--url", "127.0.0.1:1", "--count", "2", "--task", task])
    assert result.exit_code == 0, result.output
    assert asked == [2] and json.loads(result.output)["count"] == 2
    refused = CliRunner().invoke(cli.app, ["eval", "--url", "127.0.0.1:1", "--task", "i2i"])
    assert refused.exit_code == 2 and "no evaluation set for 'i2i'" in unboxed(refused.output)


@pytest.mark.parametrize("task, expected", [("t2v", "text-to-video"), ("text-to-video", "text-to-video"),
                                            ("i2v", "image-to-video"), ("image-to-video", "image-to-video")])
def test_calibrate_takes_either_name_of_a_task(task, expected, monkeypatch, tmp_path):
    """machgen-build calibrate --task fits the task named either way (the pipeline and the fit are stand-ins:
    what is checked is which task reaches the fit)."""
    from typer.testing import CliRunner

    from machgen.builder import calibrate, cli, cli_calibrate
    from machgen.runtime import local

    class Pipeline:
        manifest = SimpleNamespace(tasks=("text-to-video", "image-to-video"), precision=None)
        sampler = SimpleNamespace(cache_settings=None)

        def __init__(self, repository, name):
            pass

    fitted = []

    def fit(pipeline, prompts, holdout, targets, task=None, **options):
        fitted.append((task, len(prompts[0])))
        return "fitted", []

    monkeypatch.setattr(cli_calibrate, "find_pipeline_dir", lambda repository, name: repository)
    monkeypatch.setattr(cli_calibrate, "PipelineManifest",
                        SimpleNamespace(read=lambda folder: SimpleNamespace(name="wan")))
    monkeypatch.setattr(local, "LocalPipeline", Pipeline)
    monkeypatch.setattr(calibrate, "calibrate", fit)
    monkeypatch.setattr(calibrate, "with_task", lambda model, fitted, task, first_task: fitted)
    monkeypatch.setattr(calibrate, "write_settings", lambda target, name, settings: target / "pipeline.json")
    arguments = ["calibrate", str(tmp_path), "--count", "2", "--holdout-count", "2", "--task"]
    result = CliRunner().invoke(cli.app, [*arguments, task])
    assert result.exit_code == 0, result.output
    # a task from a picture: each pair with one (prompt, seed, picture)
    assert fitted == [(expected, 3 if expected.startswith("image-to-") else 2)]
    refused = CliRunner().invoke(cli.app, [*arguments, "t2i"])
    assert refused.exit_code == 2
    assert "--task: 't2i' is not a task of this model (t2v, i2v)" in unboxed(refused.output)
