"""machgen-build calibrate on a built repository, in-process."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from machgen.builder.calibrate import QualityTargets, Trial, calibrate, choose, magcache_schedule
from machgen.builder.cli import app
from machgen.builder.quality_promise import NO_BOUND, ORDER_STATISTIC, TailBound, share_below, tail_bound
from machgen.contract.manifest import pipeline_dir
from machgen.runtime.cache import CacheControls, CacheSettings
from machgen.runtime.local import LocalPipeline

from conftest import PIPELINE_NAME


def test_choose_takes_the_fewest_passes_that_hold_both_bounds():
    trials = [Trial("none", 0, 40, 99, 99), Trial("fbcache", 0.1, 30, 40, 35), Trial("fbcache", 0.3, 18, 34, 25),
              Trial("magcache", 0.1, 22, 33.5, 27), Trial("magcache", 0.2, 18.2, 33.1, 26.5)]
    exact = QualityTargets(33, 26)
    assert choose(trials, exact) == trials[4]
    assert choose(trials, replace(exact, worst_psnr=20)) == trials[4]  # as few passes, better worst case
    assert choose(trials[:3], replace(exact, worst_psnr=20)) == trials[2]
    assert choose(trials[1:], QualityTargets(50, 40)) is None
    # the worst case is held on the tail's lower bound, not on the worst image
    tails = [replace(trials[3], worst_tail_bound=TailBound(26.1, ORDER_STATISTIC, 0.96, 64, 1)),
             replace(trials[4], worst_tail_bound=TailBound(25.9, ORDER_STATISTIC, 0.96, 64, 1)),
             replace(trials[4], threshold=0.3, worst_tail_bound=TailBound(None, NO_BOUND, 0.95, 2))]
    assert choose(tails, exact) == tails[0]
    assert choose(tails, replace(exact, worst_psnr=25.9)) == tails[1]  # no bound from 2 pairs: never holds
    bounded = [replace(trials[3], psnr_bound=32.9), replace(trials[4], psnr_bound=33.0)]
    assert choose(bounded, exact) == bounded[1]
    assert choose(bounded, replace(exact, mean_psnr=33.05)) is None
    # as many tail passes: the one that also skips the head (MagCache) is faster
    heads = [replace(trials[4], head_calls=20), replace(trials[4], policy="magcache", head_calls=8, psnr_worst=26.2)]
    assert choose(heads, exact) == heads[1]


def test_the_worst_case_is_a_tail_promise_held_on_the_fit_and_judged_by_the_held_out_share():
    rng = np.random.default_rng(3)
    scores = list(rng.normal(36, 3, 64))
    targets = QualityTargets(33, 26)
    fitted = targets.tail_bound(scores)
    assert fitted.psnr == round(min(scores), 2) and fitted.method == ORDER_STATISTIC  # 64 pairs: the minimum
    assert targets.tail_bound(scores[:40]).psnr == round(tail_bound(scores[:40]).psnr, 2)  # normal tolerance
    # held out: at most 5 % under the target meets it, whatever the minimum
    held_out = sorted(rng.normal(36, 2, 64))
    assert targets.met_by(36, share_below([20.0] * 3 + held_out[3:], 26))  # 3 of 64: 4.7 %
    assert not targets.met_by(36, share_below([20.0] * 4 + held_out[4:], 26))  # 4 of 64: 6.2 %
    assert not targets.met_by(32.9, share_below(held_out, 26))
    assert replace(targets, worst_tail=0.1).met_by(36, share_below([20.0] * 6 + held_out[6:], 26))
    assert targets.to_json() == {"target_psnr": 33, "worst_psnr": 26, "worst_tail": 0.05, "confidence": 0.95}
    for bad in ({"worst_tail": 0}, {"worst_tail": 1.5}, {"confidence": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QualityTargets(**bad)


def test_a_calibration_made_before_the_tail_promise_still_serves_and_states_one():
    """The committed models were calibrated with a margin on the worst image: their records load as they are, and
    64 held-out pairs make the held-out minimum the tail's order-statistic bound."""
    from pathlib import Path

    from machgen.builder.calibrate import calibration_summary
    from machgen.builder.model_folder import model_cache_settings

    committed = model_cache_settings(Path(__file__).resolve().parents[1] / "models" / "shapes-flux")
    # its record as a calibration before the tail promise wrote it (what the committed one holds today)
    earlier = ("threshold", "tail_passes", "psnr_mean", "psnr_worst", "meets_targets")
    calibration = {**{key: value for key, value in committed.calibration.items() if key != "worst_tail"},
                   "held_out": {policy: {key: figures[key] for key in earlier}
                                for policy, figures in committed.calibration["held_out"].items()}}
    settings, policy = replace(committed, calibration=calibration), committed.default_policy
    figures = calibration["held_out"][policy]
    quality = settings.held_out_quality(policy, settings.thresholds[policy])
    confidence = 1 - 0.95 ** calibration["holdout_prompts"]
    assert (quality["psnr_worst"], quality["psnr_tail_bound"]) == (figures["psnr_worst"], figures["psnr_worst"])
    assert quality["promise"] == (f"95 % of requests >= {calibration['worst_psnr']:g} dB (bound "
                                  f"{figures['psnr_worst']:.1f} dB at {100 * confidence:.0f} % confidence from "
                                  f"{calibration['holdout_prompts']} held-out pairs)")
    assert f"; promise: {quality['promise']}" in calibration_summary(settings)
    # too few held-out pairs for the minimum to bound the tail: no promise stated
    fewer = replace(settings, calibration={**calibration, "holdout_prompts": 32})
    assert "promise" not in fewer.held_out_quality(policy, settings.thresholds[policy])


def test_a_shortfall_names_each_missed_target_and_by_how_much():
    """What calibrate says where a quantized build's uncached output misses the targets against float."""
    from machgen.builder.calibrate import calibration_summary, missed_targets

    targets = QualityTargets(33, 26)
    holding = Trial("none", 0, 20, 40, 35, psnr_bound=39.0,
                    worst_tail_bound=TailBound(30.0, ORDER_STATISTIC, 0.96, 64, 1))
    assert missed_targets(holding, targets) is None
    short = replace(holding, psnr_bound=31.5, worst_tail_bound=TailBound(24.75, ORDER_STATISTIC, 0.96, 64, 1))
    words = missed_targets(short, targets)
    assert words == ("the mean's bound 31.50 dB is 1.50 dB under the 33 dB targeted (--target-psnr); the 5 % tail "
                     "bound 24.75 dB is 1.25 dB under the 26 dB targeted (--worst-psnr)")
    assert missed_targets(replace(short, psnr_bound=33.0), targets).startswith("the 5 % tail bound 24.75 dB")
    unbounded = replace(holding, worst_tail_bound=TailBound(None, NO_BOUND, 0.95, 2))
    assert missed_targets(unbounded, targets).startswith("2 pairs give no bound for the 5 % tail")
    record = {"output": "float", "model": "models/x", "precision": {"denoiser_tail": "int8"}, "misses": words}
    summary = calibration_summary(CacheSettings(calibration={"reference": record}))
    assert summary == (f"cache default: none (every step computed); int8 (denoiser_tail) uncached misses the targets "
                       f"against the float output on the fit set ({words}), so cache reuse stays off")


def test_the_mean_bound_is_a_prediction_bound_for_the_held_out_mean():
    scores = [30.0, 32.0, 34.0, 36.0]  # mean 33, sample deviation 2.58
    bound = QualityTargets(confidence=0.95, holdout_pairs=64).mean_bound(scores)
    assert bound == pytest.approx(33 - 1.6449 * np.std(scores, ddof=1) * np.sqrt(1 / 4 + 1 / 64), abs=1e-3)
    # more fit pairs or lower confidence: a tighter bound; one score: the score
    assert QualityTargets(holdout_pairs=64).mean_bound(scores * 16) > bound
    assert QualityTargets(confidence=0.6, holdout_pairs=64).mean_bound(scores) > bound
    assert QualityTargets().mean_bound([31.0]) == 31.0


@pytest.mark.parametrize("model", ["shapes-flux", "shapes-wan"])
def test_a_sparse_build_reports_no_expected_psnr_that_dense_attention_measured(model):
    from pathlib import Path

    from machgen.builder.model_folder import model_cache_settings
    from machgen.builder.calibrate import calibration_summary

    folder = Path(__file__).resolve().parents[1] / "models" / model
    dense, sparse = model_cache_settings(folder), model_cache_settings(folder, sparse=True)
    policy = dense.default_policy
    threshold = dense.thresholds[policy]
    assert dense.held_out_quality(policy, threshold) is not None  # the committed model's calibration
    assert sparse.held_out_quality(policy, threshold) is None
    assert (sparse.default_policy, sparse.thresholds, sparse.magnitude_ratios) == (
        dense.default_policy, dense.thresholds, dense.magnitude_ratios)  # the same cache default served
    assert "dense attention" in calibration_summary(sparse)
    for task, settings in dense.tasks.items():  # settings fitted for another task: theirs dropped too
        policy = settings.default_policy
        assert settings.held_out_quality(policy, settings.thresholds[policy]) is not None
        assert sparse.for_task(task).held_out_quality(policy, settings.thresholds[policy]) is None
        assert sparse.for_task(task).thresholds == settings.thresholds


def test_cache_settings_of_another_task_are_stored_beside_the_models_and_run_by_its_requests():
    from machgen.builder.calibrate import with_task
    from machgen.contract.request import GenerationRequest
    from machgen.runtime.sampler import measured_by_calibration, request_task

    text = CacheSettings("magcache", {"magcache": 0.1}, (1.0, 0.9), calibration={"task": "text-to-video"})
    pictured = CacheSettings("magcache", {"magcache": 0.3}, (1.0, 0.8), calibration={"task": "image-to-video"})
    model = with_task(text, pictured, "image-to-video", "text-to-video")
    assert model.for_task("image-to-video") == pictured
    assert model.for_task("text-to-video") is model and replace(model, tasks={}) == text  # the model's own
    assert CacheSettings.from_json(json.loads(json.dumps(model.to_json()))) == model
    assert "tasks" not in text.to_json()  # a model fitted for one task stores what it did before
    refitted = with_task(model, replace(text, thresholds={"magcache": 0.2}), "text-to-video", "text-to-video")
    assert refitted.thresholds == {"magcache": 0.2} and refitted.tasks == model.tasks

    tasks = ("text-to-video", "image-to-video")
    from_text = GenerationRequest(prompt="a red circle moves up", negative_prompt="", seed=0, num_inference_steps=2,
                                  guidance_scale=5.0, true_cfg_scale=1.0, height=8, width=8)
    from_picture = replace(from_text, image=np.zeros((8, 8, 3), np.uint8))
    assert (request_task(from_text, tasks), request_task(from_picture, tasks)) == tasks
    # the held-out figures speak for requests of the kind they were measured on
    assert measured_by_calibration(from_text, text) and not measured_by_calibration(from_picture, text)
    assert measured_by_calibration(from_picture, pictured) and not measured_by_calibration(from_text, pictured)


def test_a_magcache_schedule_is_known_before_any_generation():
    """Calibration runs one trial per distinct MagCache schedule: it is decided by the ratios and controls alone."""
    settings = CacheSettings(magnitude_ratios=(1.0,) + (0.95,) * 9,
                             controls={"magcache": CacheControls(warmup_steps=2, final_steps=0,
                                                                 max_consecutive_skips=2)})
    # error after one skip 0.05, after two 0.05 + (1 - 0.95**2) = 0.1475
    assert magcache_schedule(settings, 0.1)[1] == (0, 1, 3, 5, 7, 9)
    assert magcache_schedule(settings, 0.5)[1] == (0, 1, 4, 7)  # two skips at most, then a computed step
    assert magcache_schedule(settings, 0.6) == magcache_schedule(settings, 0.5)


def test_calibrate_writes_the_defaults_the_sampler_serves(built_repository, tmp_path):
    source, _ = built_repository
    repository = tmp_path / "repository"
    shutil.copytree(source, repository)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na green circle at the top left\na blue dog\n")
    holdout = tmp_path / "holdout.txt"
    holdout.write_text("a red cat\na white square\na yellow bird\n")  # the first is another pair: other seed
    result = CliRunner().invoke(app, ["calibrate", str(repository), "--prompts", str(prompts), "--count", "3",
                                      "--holdout-prompts", str(holdout), "--holdout-count", "2",
                                      "--target-psnr", "25", "--confidence", "0.5", "--worst-tail", "0.1",
                                      "--warmup-steps", "1", "--final-steps", "1", "--max-consecutive-skips", "2"])
    assert result.exit_code == 0, result.output
    cache = json.loads((pipeline_dir(repository, PIPELINE_NAME) / "pipeline.json").read_text())["cache"]
    steps = json.loads((pipeline_dir(repository, PIPELINE_NAME) / "pipeline.json").read_text())[
        "defaults"]["num_inference_steps"]
    assert len(cache["magnitude_ratios"]) == steps and cache["magnitude_ratios"][0] == 1.0
    assert cache["calibration"]["target_psnr"] == 25 and all(c["warmup_steps"] == 1 for c in cache["controls"].values())
    assert (cache["calibration"]["worst_tail"], cache["calibration"]["worst_psnr"]) == (0.1, 18)
    chosen = cache["calibration"]["chosen"]
    assert chosen and set(chosen) <= {"fbcache", "magcache"}
    assert "reference" not in cache["calibration"]  # a float build: against its own uncached output, as ever
    assert cache["default_policy"] in chosen
    for policy, trial in chosen.items():
        # 3 fit pairs: too few for an order statistic, the normal tolerance bound holds the 90 % promise
        assert trial["psnr_mean"] >= 25 and trial["worst_tail_bound"]["psnr"] >= 18
        assert trial["worst_tail_bound"]["method"] == "normal tolerance" and trial["worst_tail_bound"]["pairs"] == 3
        assert cache["thresholds"][policy] == trial["threshold"]
    held_out = cache["calibration"]["held_out"]
    assert set(held_out) == set(chosen) and cache["calibration"]["holdout_prompts"] == 2
    default = held_out[cache["default_policy"]]
    assert default["threshold"] == chosen[cache["default_policy"]]["threshold"]
    assert f"held out 2 pairs: {default['tail_passes']:.1f} tail passes, mean {default['psnr_mean']:.2f} dB" \
        in result.output
    # the held-out report: the share under the worst-case target, its upper bound and the promise in words
    assert (default["below_worst"] > 0) == (default["psnr_worst"] < 18)
    assert default["meets_targets"] == (default["psnr_mean"] >= 25 and default["below_fraction"] <= 0.1)
    assert default["promise"].startswith("90 % of requests >= ") and "from 2 held-out pairs" in default["promise"]
    assert f"promise: {default['promise']}" in result.output
    assert f"{default['below_worst']} of 2 under 18 dB" in result.output

    # the sampler now serves MagCache and the calibrated default
    local = LocalPipeline(repository, PIPELINE_NAME)
    assert "magcache" in local.sampler.cache_settings.available()
    _, stats = local.generate("a red cat", seed=0)
    assert stats.cache_policy == cache["default_policy"]
    # with the quality calibration measured for it on the held-out prompts; none for another setting
    assert (stats.expected_psnr, stats.expected_psnr_worst) == (default["psnr_mean"], default["psnr_worst"])
    assert (stats.expected_psnr_tail_bound, stats.expected_psnr_promise) == (
        default["worst_tail_bound"]["psnr"], default["promise"])
    _, stats = local.generate("a red cat", seed=0, cache_policy=cache["default_policy"], cache_threshold=9.5)
    assert stats.expected_psnr is None and stats.expected_psnr_worst is None and stats.expected_psnr_promise is None
    # nor uncached on a float build: its uncached output is the reference itself
    _, stats = local.generate("a red cat", seed=0, cache_policy="none")
    assert stats.expected_psnr is None and stats.expected_psnr_tail_bound is None
    # nor for requests of a kind it did not measure: from a picture, or part of the schedule
    picture = np.full((64, 64, 3), 128, dtype=np.uint8)
    for kind in ({"image": picture, "strength": 0.6, "height": 64, "width": 64}, {"stop_step": steps // 2}):
        _, stats = local.generate("a red cat", seed=0, **kind)
        assert stats.cache_policy == cache["default_policy"] and stats.expected_psnr is None, kind
    images, stats = local.generate("a red cat", seed=0, cache_policy="magcache", cache_threshold=0.0)
    reference, _ = local.generate("a red cat", seed=0, cache_policy="none")
    np.testing.assert_array_equal(images, reference)  # threshold 0 never skips
    assert stats.denoiser_tail_calls == steps

    # --policy fits only the policies named
    only = tmp_path / "only-magcache"
    shutil.copytree(source, only)
    result = CliRunner().invoke(app, ["calibrate", str(only), "--prompts", str(prompts), "--count", "2",
                                      "--holdout-prompts", str(holdout), "--holdout-count", "1", "--target-psnr", "25",
                                      "--warmup-steps", "1", "--final-steps", "1", "--max-consecutive-skips", "2",
                                      "--policy", "magcache"])
    assert result.exit_code == 0, result.output
    assert "fbcache" not in result.output
    cache = json.loads((pipeline_dir(only, PIPELINE_NAME) / "pipeline.json").read_text())["cache"]
    assert set(cache["calibration"]["chosen"]) <= {"magcache"}
    refused = CliRunner().invoke(app, ["calibrate", str(only), "--policy", "teacache"])
    assert refused.exit_code == 2 and "teacache: calibrate fits fbcache, magcache" in refused.output
    refused = CliRunner().invoke(app, ["calibrate", str(only), "--worst-tail", "0"])
    assert refused.exit_code == 2 and "--worst-tail" in refused.output


def test_calibrates_help_offers_the_worst_tail_not_a_margin():
    shown = CliRunner().invoke(app, ["calibrate", "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "--worst-tail" in shown.output and "--worst-margin" not in shown.output


def test_the_held_out_set_changes_the_report_never_the_choice(built_repository):
    repository, _ = built_repository
    pipeline = LocalPipeline(repository, PIPELINE_NAME)
    served = pipeline.sampler.cache_settings
    fit = [("a red circle at the top left", 0), ("a blue square", 1), ("a green cat", 2)]
    holdouts = ([("a white triangle at the center", 7), ("a yellow dog", 8)],
                [("a magenta square at the top right", 9), ("a red circle at the top left", 10)])
    grids = {"fbcache": (0.2, 0.6), "magcache": (0.2, 0.6)}
    seen = []
    generate = pipeline.generate

    def recorded(prompt, seed=None, **options):
        seen.append((prompt, seed))
        return generate(prompt, seed=seed, **options)

    pipeline.generate = recorded
    results = []
    for holdout in holdouts:
        pipeline.sampler.cache_settings, seen[:] = served, []
        results.append(calibrate(pipeline, fit, holdout, QualityTargets(25, 18, confidence=0.5),
                                 control_grid=[CacheControls(1, 0, 2, 2)], threshold_grids=grids,
                                 log=lambda line: None))
        reported = next(index for index, pair in enumerate(seen) if pair not in fit)
        assert set(seen[:reported]) == set(fit)
        assert set(seen[reported:]) == set(holdout)  # after the choice, the held-out set only

    (first, first_trials), (second, second_trials) = results
    assert first_trials == second_trials
    report_only = ("held_out", "holdout_prompts")
    assert first.calibration["held_out"] and first.calibration["held_out"] != second.calibration["held_out"]
    assert replace(first, calibration={k: v for k, v in first.calibration.items() if k not in report_only}) == \
        replace(second, calibration={k: v for k, v in second.calibration.items() if k not in report_only})
    with pytest.raises(ValueError, match="held-out set must be one the fit never sees"):
        calibrate(pipeline, fit, [fit[1]], log=lambda line: None)
    with pytest.raises(ValueError, match="needs fit and held-out prompts"):
        calibrate(pipeline, fit, [], log=lambda line: None)


def test_a_video_model_is_measured_on_every_frame():
    """Calibration compares whole clips (every frame's PSNR counts), images as images."""
    from types import SimpleNamespace

    from machgen.builder.calibrate import run_prompts

    clip = np.arange(3 * 4 * 4 * 3, dtype=np.uint8).reshape(3, 4, 4, 3)

    def model(tasks):
        return SimpleNamespace(manifest=SimpleNamespace(tasks=tasks),
                               generate=lambda prompt, seed, **options: (clip, {"seed": seed}))

    videos, stats = run_prompts(model(("text-to-video", "image-to-video")), [("a red circle moves up", 3)])
    assert np.array_equal(videos[0], clip) and stats == [{"seed": 3}]
    images, _ = run_prompts(model(("text-to-image",)), [("a red circle", 3)])
    assert np.array_equal(images[0], clip[0])
