"""machgen-build calibrate on a built repository, in-process."""

import json
import shutil

import numpy as np
from typer.testing import CliRunner

from machgen.builder.calibrate import Trial, choose
from machgen.builder.cli import app
from machgen.contract.manifest import pipeline_dir
from machgen.runtime.local import LocalPipeline

from conftest import PIPELINE_NAME


def test_choose_takes_the_fewest_passes_that_hold_both_bounds():
    trials = [Trial("none", 0, 40, 99, 99), Trial("fbcache", 0.1, 30, 40, 35), Trial("fbcache", 0.3, 18, 34, 25),
              Trial("magcache", 0.1, 22, 33.5, 27), Trial("magcache", 0.2, 18.2, 33.1, 26.5)]
    assert choose(trials, 33, 26) == trials[4]
    assert choose(trials, 33, 20) == trials[4]  # as few passes, better worst case
    assert choose(trials[:3], 33, 20) == trials[2]
    assert choose(trials[1:], 50, 40) is None


def test_calibrate_writes_the_defaults_the_sampler_serves(built_repository, tmp_path):
    source, _ = built_repository
    repository = tmp_path / "repository"
    shutil.copytree(source, repository)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na green circle at the top left\na blue dog\n")
    result = CliRunner().invoke(app, ["calibrate", str(repository), "--prompts", str(prompts), "--count", "3",
                                      "--target-psnr", "25", "--warmup-steps", "1", "--final-steps", "1",
                                      "--max-consecutive-skips", "2"])
    assert result.exit_code == 0, result.output
    cache = json.loads((pipeline_dir(repository, PIPELINE_NAME) / "pipeline.json").read_text())["cache"]
    steps = json.loads((pipeline_dir(repository, PIPELINE_NAME) / "pipeline.json").read_text())[
        "defaults"]["num_inference_steps"]
    assert len(cache["magnitude_ratios"]) == steps and cache["magnitude_ratios"][0] == 1.0
    assert cache["calibration"]["target_psnr"] == 25 and all(c["warmup_steps"] == 1 for c in cache["controls"].values())
    chosen = cache["calibration"]["chosen"]
    assert chosen and set(chosen) <= {"fbcache", "magcache"}
    assert cache["default_policy"] in chosen
    for policy, trial in chosen.items():
        assert trial["psnr_mean"] >= 25 and trial["psnr_worst"] >= 18
        assert cache["thresholds"][policy] == trial["threshold"]

    # the sampler now serves MagCache and the calibrated default
    local = LocalPipeline(repository, PIPELINE_NAME)
    assert "magcache" in local.sampler.cache_settings.available()
    _, stats = local.generate("a red cat", seed=0)
    assert stats.cache_policy == cache["default_policy"]
    images, stats = local.generate("a red cat", seed=0, cache_policy="magcache", cache_threshold=0.0)
    reference, _ = local.generate("a red cat", seed=0, cache_policy="none")
    np.testing.assert_array_equal(images, reference)  # threshold 0 never skips
    assert stats.denoiser_tail_calls == steps
