"""machgen-build calibrate on an int8 build (issue 62): fitted and reported against the float output (a float build
of the folder the int8 build came from), so the promise it serves holds for int8 and cache reuse together."""

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

from machgen.builder.calibrate import check_reference
from machgen.builder.cli import app
from machgen.builder.evaluate import psnr
from machgen.contract.manifest import PipelineManifest, pipeline_dir
from machgen.runtime.local import LocalPipeline

pytestmark = pytest.mark.export

FIT = ["a red cat", "a green circle at the top left", "a blue dog"]  # seeds 0, 1, 2 (calibrate's --prompts)
HOLDOUT = ["a white square", "a yellow bird"]  # seeds 1000000, 1000001 (--holdout-prompts)
HOLDOUT_FIRST_SEED = 1_000_000
# A few pairs, one control setting: quick; at confidence 0.5 the fit's bounds stay near its figures.
QUICK = ["--count", "3", "--holdout-count", "2", "--confidence", "0.5", "--worst-tail", "0.1", "--warmup-steps", "1",
         "--final-steps", "1", "--max-consecutive-skips", "2"]


@pytest.fixture(scope="module")
def int8_repository(tiny_flux_dir, tmp_path_factory):
    from machgen.builder.build import TargetOptions, build_repository
    from machgen.builder.precision_sweep import SweepSettings
    from machgen.builder.repository import ServingOptions

    out = tmp_path_factory.mktemp("int8-repository")
    build_repository(tiny_flux_dir, PIPELINE_NAME, out, log=lambda line: None, preview=False,
                     options=ServingOptions(in_flight=2, component_instances=1),
                     target_options=TargetOptions(precision="int8", sweep=SweepSettings(pairs=1)))
    return out


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
    built = cache_of(repository)
    refused = CliRunner().invoke(app, ["calibrate", str(repository), *prompt_files, *QUICK])
    assert refused.exit_code == 2 and "--reference-model" in refused.output
    assert "int8" in unboxed(refused.output) and "keeps no float weights" in unboxed(refused.output)
    assert cache_of(repository) == built  # nothing written

    result = CliRunner().invoke(app, ["calibrate", str(repository), "--reference-model", str(tiny_flux_dir),
                                      "--target-psnr", "25", *prompt_files, *QUICK])
    assert result.exit_code == 0, result.output
    cache = cache_of(repository)
    calibration = cache["calibration"]
    reference = calibration["reference"]
    assert (reference["output"], reference["model"]) == ("float", str(tiny_flux_dir))
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
    _, stats = LocalPipeline(repository, PIPELINE_NAME).generate(FIT[0], seed=0)
    assert stats.cache_policy == "none" and stats.expected_psnr is None


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
