"""machgen-build calibrate on an int8 build (issue 62): fitted and reported against the float output (a float build
of the folder the int8 build came from, which the build records), so the promise it serves holds for int8 and cache
reuse together, and an uncached request reports what int8 alone costs against it."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest
from conftest import PIPELINE_NAME, build_tiny_repository
from typer.testing import CliRunner

from machgen.builder.calibrate import check_reference, write_settings
from machgen.builder.cli import app
from machgen.builder.evaluate import psnr
from machgen.contract.manifest import PipelineManifest, pipeline_dir
from machgen.runtime.cache import CacheSettings
from machgen.runtime.local import LocalPipeline

pytestmark = pytest.mark.export

FIT = ["a red cat", "a green circle at the top left", "a blue dog"]  # seeds 0, 1, 2 (calibrate's --prompts)
HOLDOUT = ["a white square", "a yellow bird"]  # seeds 1000000, 1000001 (--holdout-prompts)
HOLDOUT_FIRST_SEED = 1_000_000
# A few pairs, one control setting: quick; at confidence 0.5 the fit's bounds stay near its figures.
QUICK = ["--count", "3", "--holdout-count", "2", "--confidence", "0.5", "--worst-tail", "0.1", "--warmup-steps", "1",
         "--final-steps", "1", "--max-consecutive-skips", "2"]


def build_int8(model_dir, out, sweep: bool = True, lora=None):
    from machgen.builder.build import TargetOptions, build_repository
    from machgen.builder.precision_sweep import SweepSettings
    from machgen.builder.repository import ServingOptions

    build_repository(model_dir, PIPELINE_NAME, out, lora=lora, log=lambda line: None, preview=False,
                     options=ServingOptions(in_flight=2, component_instances=1),
                     target_options=TargetOptions(precision="int8", precision_sweep=sweep,
                                                  sweep=SweepSettings(pairs=1) if sweep else None))
    return out


@pytest.fixture(scope="module")
def int8_repository(tiny_flux_dir, tmp_path_factory):
    return build_int8(tiny_flux_dir, tmp_path_factory.mktemp("int8-repository"))


@pytest.fixture(scope="module")
def float_pipeline(tiny_flux_dir, tmp_path_factory):
    """The float build of the same folder, run here to recompute what calibration recorded."""
    return LocalPipeline(build_tiny_repository(tmp_path_factory, tiny_flux_dir, PIPELINE_NAME), PIPELINE_NAME)


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompts")
    (folder / "fit.txt").write_text("\n".join(FIT) + "\n")
    (folder / "holdout.txt").write_text("\n".join(HOLDOUT) + "\n")
    return ["--prompts", str(folder / "fit.txt"), "--holdout-prompts", str(folder / "holdout.txt")]


def unboxed(output: str) -> str:
    """A CLI's output with typer's error box taken away and its lines joined."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", output).split())


def copy_of(repository, tmp_path):
    copy = tmp_path / "repository"
    shutil.copytree(repository, copy)
    return copy


def cache_of(repository) -> dict:
    return json.loads((pipeline_dir(repository, PIPELINE_NAME) / "pipeline.json").read_text())["cache"]


def pairs(prompts, first_seed=0):
    return [(prompt, first_seed + index) for index, prompt in enumerate(prompts)]


def scores(pipeline, reference, pairs_, **options) -> list[float]:
    return [psnr(pipeline.generate(prompt, seed=seed, **options)[0][0],
                 reference.generate(prompt, seed=seed, cache_policy="none")[0][0]) for prompt, seed in pairs_]


def test_an_int8_build_is_fitted_and_reported_against_the_float_output(int8_repository, float_pipeline, tiny_flux_dir,
                                                                       prompt_files, tmp_path):
    repository = copy_of(int8_repository, tmp_path)
    quantized = set(PipelineManifest.read(pipeline_dir(repository, PIPELINE_NAME)).precision)
    # without --reference-model: the folder the build recorded, unchanged since
    result = CliRunner().invoke(app, ["calibrate", str(repository), "--target-psnr", "25", *prompt_files, *QUICK])
    assert result.exit_code == 0, result.output
    model = tiny_flux_dir.resolve()
    assert f"--reference-model not given: the float reference is the folder this build recorded, {model} " \
           "(every file as it was at the build)" in result.output
    cache = cache_of(repository)
    calibration = cache["calibration"]
    reference = calibration["reference"]
    assert (reference["output"], reference["model"]) == ("float", str(model)) and "lora" not in reference
    assert set(reference["precision"]) == quantized and set(reference["precision"].values()) == {"int8"}
    assert "misses" not in reference
    # int8 alone, uncached, against float: finite and under the 99 dB of identical images (float against itself)
    local = LocalPipeline(repository, PIPELINE_NAME)
    for figures, pairs_ in ((reference["uncached"]["fit"], pairs(FIT)),
                            (reference["uncached"]["held_out"], pairs(HOLDOUT, HOLDOUT_FIRST_SEED))):
        assert math.isfinite(figures["psnr_worst"]) and figures["psnr_worst"] <= figures["psnr_mean"] < 99
        recomputed = scores(local, float_pipeline, pairs_, cache_policy="none")
        assert (figures["psnr_mean"], figures["psnr_worst"]) == (round(float(np.mean(recomputed)), 2),
                                                                  round(min(recomputed), 2))
    assert "uncached, against the float output: fit 3 pairs" in result.output

    # the chosen settings: held out against float, int8 and cache reuse together, and served as expected PSNR
    policy = cache["default_policy"]
    assert policy in calibration["chosen"], result.output
    held_out = calibration["held_out"][policy]
    joint = scores(local, float_pipeline, pairs(HOLDOUT, HOLDOUT_FIRST_SEED), cache_policy=policy,
                   cache_threshold=held_out["threshold"])
    assert (held_out["psnr_mean"], held_out["psnr_worst"]) == (round(float(np.mean(joint)), 2), round(min(joint), 2))
    _, stats = local.generate(HOLDOUT[0], seed=HOLDOUT_FIRST_SEED)
    assert (stats.cache_policy, stats.expected_psnr, stats.expected_psnr_worst) == (
        policy, held_out["psnr_mean"], held_out["psnr_worst"])
    assert stats.expected_psnr_promise == held_out["promise"]

    # uncached (policy none): what int8 alone costs against the float output, held out, as a cached setting reports
    uncached = reference["uncached"]["held_out"]
    _, stats = local.generate(HOLDOUT[0], seed=HOLDOUT_FIRST_SEED, cache_policy="none")
    assert (stats.cache_policy, stats.expected_psnr, stats.expected_psnr_worst) == (
        "none", uncached["psnr_mean"], uncached["psnr_worst"])
    assert (stats.expected_psnr_tail_bound, stats.expected_psnr_promise) == (uncached["worst_tail_bound"]["psnr"],
                                                                             uncached["promise"])
    # nor for requests of a kind calibration did not measure: from a picture, or part of the schedule
    picture = np.full((64, 64, 3), 128, dtype=np.uint8)
    for kind in ({"image": picture, "strength": 0.6, "height": 64, "width": 64}, {"stop_step": 2}):
        _, stats = local.generate(HOLDOUT[0], seed=HOLDOUT_FIRST_SEED, cache_policy="none", **kind)
        assert stats.expected_psnr is None and stats.expected_psnr_promise is None, kind


def test_a_target_the_int8_build_misses_uncached_keeps_cache_reuse_off(int8_repository, tiny_flux_dir, prompt_files,
                                                                       tmp_path):
    repository = copy_of(int8_repository, tmp_path)
    result = CliRunner().invoke(app, ["calibrate", str(repository), "--reference-model", str(tiny_flux_dir),
                                      "--target-psnr", "95", "--worst-psnr", "90", *prompt_files, *QUICK])
    assert result.exit_code == 0, result.output
    cache = cache_of(repository)
    calibration = cache["calibration"]
    fit = calibration["reference"]["uncached"]["fit"]
    assert fit["psnr_bound"] < 95
    misses = calibration["reference"]["misses"]
    assert f"the mean's bound {fit['psnr_bound']:.2f} dB is {95 - fit['psnr_bound']:.2f} dB under the 95 dB" in misses
    assert "misses the targets against the float output on the fit set" in result.output and misses in result.output
    assert "Cache reuse stays off (policy none)" in result.output
    assert "fbcache threshold" not in result.output and "magcache threshold" not in result.output  # nothing fitted
    assert cache["default_policy"] == "none" and calibration["chosen"] == {} and calibration["held_out"] == {}
    assert calibration["reference"]["uncached"]["held_out"]["psnr_mean"] < 95  # still reported, held out
    # served uncached, with the figures of int8 alone against the float output
    uncached = calibration["reference"]["uncached"]["held_out"]
    _, stats = LocalPipeline(repository, PIPELINE_NAME).generate(FIT[0], seed=0)
    assert (stats.cache_policy, stats.expected_psnr, stats.expected_psnr_worst) == (
        "none", uncached["psnr_mean"], uncached["psnr_worst"])


def test_a_float_build_or_a_model_folder_takes_no_reference_and_a_reference_must_be_the_same_model(
        int8_repository, float_pipeline, tiny_flux_dir):
    refused = CliRunner().invoke(app, ["calibrate", str(float_pipeline.repository), "--reference-model",
                                       str(tiny_flux_dir)])
    assert refused.exit_code == 2 and "--reference-model" in refused.output
    assert "is a float build: its own uncached output is the float output" in unboxed(refused.output)
    refused = CliRunner().invoke(app, ["calibrate", str(tiny_flux_dir), "--reference-model", str(tiny_flux_dir)])
    assert refused.exit_code == 2 and "whose calibration build is float" in unboxed(refused.output)
    refused = CliRunner().invoke(app, ["calibrate", str(int8_repository), "--reference-model",
                                       str(int8_repository)])
    assert refused.exit_code == 2 and "is not a diffusers model folder" in unboxed(refused.output)

    int8 = PipelineManifest.read(pipeline_dir(int8_repository, PIPELINE_NAME))
    check_reference(int8, float_pipeline.manifest)
    fewer_steps = replace(float_pipeline.manifest, defaults=replace(float_pipeline.manifest.defaults,
                                                                    num_inference_steps=2))
    with pytest.raises(ValueError, match="num_inference_steps"):
        check_reference(int8, fewer_steps)
    with pytest.raises(ValueError, match="itself built in int8"):
        check_reference(int8, int8)


def test_calibrate_refuses_a_recorded_folder_that_changed_or_is_gone_and_a_rebuild_records_its_own(
        tiny_flux_dir, tmp_path_factory, prompt_files):
    from machgen.builder.rebuild import file_digest, record_path

    # a copy the test may change, built without the sweep (its float files: the export cache's)
    model = tmp_path_factory.mktemp("m") / "model"
    shutil.copytree(tiny_flux_dir, model)
    repository = build_int8(model, tmp_path_factory.mktemp("r"), sweep=False)
    recorded = PipelineManifest.read(pipeline_dir(repository, PIPELINE_NAME)).built_from
    files = {path.relative_to(model).as_posix() for path in model.rglob("*") if path.is_file()}
    assert recorded["model"] == str(model.resolve()) and "lora" not in recorded
    assert set(recorded["files"]) == files - {"machgen.json"}  # the card's cache defaults: calibrate's to write
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert recorded["files"][weights] == file_digest(model / weights)
    built = cache_of(repository)

    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text() + "\n")  # other bytes: no longer the files it was built from
    refused = CliRunner().invoke(app, ["calibrate", str(repository), *prompt_files, *QUICK])
    said = unboxed(refused.output)
    assert refused.exit_code == 2 and "--reference-model" in refused.output
    assert "int8" in said and "keeps no float weights" in said
    assert f"the build recorded the model folder {model.resolve()} ({len(files) - 1} files), but since the build " \
           "1 file changed (scheduler/scheduler_config.json): pass --reference-model" in said
    shutil.rmtree(model)
    refused = CliRunner().invoke(app, ["calibrate", str(repository), *prompt_files, *QUICK])
    assert refused.exit_code == 2 and f"but {model.resolve()} is gone: pass --reference-model," in unboxed(
        refused.output)
    assert cache_of(repository) == built  # nothing written

    # cache defaults written as calibrate writes them, then built again over it from another folder: the defaults
    # kept, the record the new folder's, in the manifest and the build's own record alike (no user's edit)
    write_settings(repository, PIPELINE_NAME, replace(CacheSettings.from_json(built), default_policy="fbcache"))
    other = tmp_path_factory.mktemp("o") / "model"
    shutil.copytree(tiny_flux_dir, other)
    build_int8(other, repository, sweep=False)
    rebuilt = PipelineManifest.read(pipeline_dir(repository, PIPELINE_NAME)).built_from
    assert rebuilt == {"model": str(other.resolve()), "files": recorded["files"]}  # the same files, elsewhere
    assert json.loads(record_path(repository, PIPELINE_NAME).read_text())["manifest"]["built_from"] == rebuilt
    assert cache_of(repository)["default_policy"] == "fbcache"


def test_the_recorded_folder_of_a_build_that_fused_a_lora_is_the_float_reference_with_the_lora_fused(
        tiny_flux_dir, tmp_path_factory, prompt_files):
    from machgen.builder.build import build_repository
    from test_lora_adapters import write_random_adapter

    lora = write_random_adapter(tiny_flux_dir, tmp_path_factory.mktemp("lora") / "lora", 4, None,
                                ["to_q", "to_k", "to_v", "proj_out"], seed=0)
    repository = build_int8(tiny_flux_dir, tmp_path_factory.mktemp("r"), sweep=False, lora=lora)
    recorded = PipelineManifest.read(pipeline_dir(repository, PIPELINE_NAME)).built_from
    assert recorded["lora"]["path"] == str(lora.resolve()) and set(recorded["lora"]["files"]) == {
        path.name for path in lora.iterdir()}
    result = CliRunner().invoke(app, ["calibrate", str(repository), "--target-psnr", "25", *prompt_files, *QUICK])
    assert result.exit_code == 0, result.output
    assert f"the float reference is the folder this build recorded, {tiny_flux_dir.resolve()} with the LoRA " \
           f"{lora.resolve()} fused" in result.output
    reference = cache_of(repository)["calibration"]["reference"]
    assert (reference["model"], reference["lora"]) == (str(tiny_flux_dir.resolve()), str(lora.resolve()))
    # what int8 alone costs: against a float build with the same LoRA fused
    float_lora = tmp_path_factory.mktemp("f")
    build_repository(tiny_flux_dir, PIPELINE_NAME, float_lora, lora=lora, log=lambda line: None, preview=False)
    held_out = pairs(HOLDOUT, HOLDOUT_FIRST_SEED)
    recomputed = scores(LocalPipeline(repository, PIPELINE_NAME), LocalPipeline(float_lora, PIPELINE_NAME), held_out,
                        cache_policy="none")
    uncached = reference["uncached"]["held_out"]
    assert (uncached["psnr_mean"], uncached["psnr_worst"]) == (round(float(np.mean(recomputed)), 2),
                                                                round(min(recomputed), 2))
