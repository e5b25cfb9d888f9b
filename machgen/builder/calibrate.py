"""Fit each cache policy's threshold and controls to a quality target, in-process,
and report how the chosen settings hold on prompts the fit never saw.

Runs the fit prompt set uncached (recording MagCache's magnitude ratios on
the way), then each policy over a grid of thresholds and controls, and
keeps per policy the setting that skips most while holding the quality
targets against the uncached images (QualityTargets: a prediction bound on
the mean, a lower confidence bound on the PSNR of the worst tail). The
policy with the fewest tail passes becomes the served default. Only then
are the chosen settings run on the held-out prompt set, uncached and
cached: that report is recorded and printed, and never feeds back into
the choice.

A quantized build (an int8 denoiser: the manifest's ``precision``) is
scored against the float output instead of its own uncached output, which
would hide the int8 error: a FloatReference, the uncached output of a float
build of the model folder it came from (the parity check holds that build
to diffusers' float output). Every fit and held-out score is then the joint
effect of precision and cache reuse; the build's own uncached output is
scored too (what precision costs before any cache), and where even that
misses the targets on the fit set, cache reuse stays off.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from machgen.builder.evaluate import psnr
from machgen.builder.quality_promise import ShareBelow, TailBound, share_below, tail_bound
from machgen.contract.manifest import PipelineManifest, find_pipeline_dir
from machgen.runtime.cache import (WORST_TAIL, BlocksResidualRecorder, CacheControls, CacheSettings, StepCache,
                                   StepPlan, magnitude_ratios, tail_promise)

# (prompt, seed) pairs; for a task that starts from a picture, (prompt, seed, picture) triples.
Prompts = Sequence[tuple]
# Pairs of the fit and of the held-out set when the caller gives no count.
FIT_PAIRS = 64
HOLDOUT_PAIRS = 64
# The default prompt sets: shapes captions (a video model: moving-shapes captions), each set from its own
# generator seed (the noise seeds with them).
FIT_PROMPTS_SEED = 77
HOLDOUT_PROMPTS_SEED = 4242


@dataclass(frozen=True)
class QualityTargets:
    """What a calibrated setting must hold against the uncached output, on
    prompts it was not fitted on.

    The mean: a fitted setting's PSNRs predict a held-out set's mean only up
    to sampling error, so the fit set's mean must hold ``mean_psnr`` at the
    lower one-sided ``confidence`` prediction bound for the mean of
    ``holdout_pairs`` new pairs: mean - z * s * sqrt(1/n + 1/m) (normal
    quantile z, sample deviation s, n fit pairs, m held-out ones). The worst
    case: a set's minimum bounds nothing about the next set's, so the promise
    is on a tail, "at least 1 - ``worst_tail`` of requests get ``worst_psnr``
    dB or better", and the fit set holds it when its lower ``confidence``
    bound for the ``worst_tail``-quantile of its PSNRs does
    (quality_promise.tail_bound: an order statistic where the pairs allow,
    else a normal tolerance bound). A held-out set meets it when at most
    ``worst_tail`` of its pairs fall under ``worst_psnr``.
    """

    mean_psnr: float = 33.0
    worst_psnr: float = 26.0
    confidence: float = 0.95
    worst_tail: float = WORST_TAIL
    holdout_pairs: int = HOLDOUT_PAIRS

    def __post_init__(self):
        if not 0 < self.worst_tail < 1:
            raise ValueError(f"worst_tail: {self.worst_tail} is not a share of requests between 0 and 1")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence: {self.confidence} is not a probability between 0 and 1")

    def mean_bound(self, scores: Sequence[float]) -> float:
        """The prediction bound for a held-out set's mean PSNR, from ``scores``."""
        if len(scores) < 2:
            return float(np.mean(scores))
        z = statistics.NormalDist().inv_cdf(self.confidence)
        spread = float(np.std(scores, ddof=1))
        return float(np.mean(scores)) - z * spread * float(np.sqrt(1 / len(scores) + 1 / self.holdout_pairs))

    def tail_bound(self, scores: Sequence[float]) -> TailBound:
        """The lower bound for the ``worst_tail``-quantile of ``scores``, rounded as recorded."""
        bound = tail_bound(scores, self.worst_tail, self.confidence)
        return replace(bound, psnr=None if bound.psnr is None else round(bound.psnr, 2),
                       confidence=round(bound.confidence, 4))

    def holds(self, trial: "Trial") -> bool:
        return trial.bound >= self.mean_psnr and trial.worst_bound >= self.worst_psnr

    def met_by(self, mean: float, below: ShareBelow) -> bool:
        """Whether a held-out set's own figures meet the targets (its mean and its share under ``worst_psnr``:
        they are the outcome, not a prediction)."""
        return mean >= self.mean_psnr and below.fraction <= self.worst_tail

    def to_json(self) -> dict:
        return {"target_psnr": self.mean_psnr, "worst_psnr": self.worst_psnr, "worst_tail": self.worst_tail,
                "confidence": self.confidence}


THRESHOLD_GRIDS = {
    "fbcache": (0.2, 0.3, 0.4, 0.6),
    "magcache": (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.6, 0.8),
}
# Forcing the last step never paid on the shapes model (calibrated: final 0 for both policies), so the
# grid spends its time on longer skip runs and the negative row instead.
CONTROL_GRID = tuple(CacheControls(warmup, 0, skips, negative) for warmup in (3, 4) for skips in (2, 3, 4)
                     for negative in (1, 3, 5))


@dataclass(frozen=True)
class Trial:
    policy: str
    threshold: float
    tail_passes: float  # mean per image
    psnr_mean: float
    psnr_worst: float
    controls: CacheControls = CacheControls()
    psnr_bound: float | None = None  # QualityTargets.mean_bound of the scores; None: the mean
    head_calls: float = 0.0  # mean per image: MagCache's skipped steps run no head, First-Block Cache's do
    # QualityTargets.tail_bound of the scores; None: the worst image (the uncached trial: exact).
    worst_tail_bound: TailBound | None = None

    @property
    def bound(self) -> float:
        return self.psnr_mean if self.psnr_bound is None else self.psnr_bound

    @property
    def worst_bound(self) -> float:
        """What the worst-case promise is held on: the tail's lower bound (-inf where the pairs give none)."""
        return self.psnr_worst if self.worst_tail_bound is None else self.worst_tail_bound.value

    def label(self) -> str:
        return "none" if self.policy == "none" else f"{self.policy} {self.threshold:g}"


def makes_video(pipeline) -> bool:
    return any(task.endswith("-to-video") for task in pipeline.manifest.tasks)


def _result(pipeline, output: np.ndarray) -> np.ndarray:
    """What a request's quality is measured on: its image, or every frame of its clip."""
    return output if makes_video(pipeline) else output[0]


def _generate(pipeline, pair: tuple, **options):
    """One (prompt, seed[, picture]) pair's output and stats."""
    prompt, seed, *picture = pair
    return pipeline.generate(prompt, seed=seed, **({"image": picture[0]} if picture else {}), **options)


def run_prompts(pipeline, prompts: Prompts, **options) -> tuple[list[np.ndarray], list]:
    images, stats = [], []
    for pair in prompts:
        image, stat = _generate(pipeline, pair, **options)
        images.append(_result(pipeline, image))
        stats.append(stat)
    return images, stats


def quantized_components(manifest: PipelineManifest) -> dict[str, str]:
    """The components a build made below float, with their precision ({} for a float build)."""
    return {name: str(got.get("precision", "quantized")) for name, got in (manifest.precision or {}).items()}


def precision_words(quantized: Mapping[str, str]) -> str:
    """e.g. "int8 (denoiser_head, denoiser_tail)"."""
    kinds = sorted(set(quantized.values()))
    return f"{'/'.join(kinds)} ({', '.join(sorted(quantized))})"


@dataclass(frozen=True)
class FloatReference:
    """What a quantized build is scored against: the uncached output of ``pipeline``, a float build (a
    LocalPipeline) of the model folder ``model`` the quantized build came from (with ``lora`` fused, where the
    build recorded that it fused one)."""

    pipeline: Any
    model: str
    quantized: Mapping[str, str]  # the quantized build's components and their precision
    lora: str | None = None

    def outputs(self, prompts: Prompts) -> list[np.ndarray]:
        return run_prompts(self.pipeline, prompts, cache_policy="none")[0]

    def to_json(self) -> dict:
        return {"output": "float", "model": self.model, "precision": dict(self.quantized),
                **({"lora": self.lora} if self.lora else {})}


def check_reference(manifest: PipelineManifest, reference: PipelineManifest) -> None:
    """Refuses a float reference that is not the quantized build's model at the same served defaults: its
    scores would measure the difference of two models, not the quantized build's error."""
    if reference.precision:
        raise ValueError(f"the reference is itself built in {precision_words(quantized_components(reference))}")
    if (reference.family, tuple(reference.tasks)) != (manifest.family, tuple(manifest.tasks)):
        raise ValueError(f"the reference is a {reference.family} model ({', '.join(reference.tasks)}), the "
                         f"calibrated one {manifest.family} ({', '.join(manifest.tasks)}): give the model folder "
                         "it was built from")
    ours, theirs = manifest.defaults.to_json(), reference.defaults.to_json()
    differing = [f"{key} {ours[key]!r} here, {theirs.get(key)!r} in the reference" for key in ours
                 if ours[key] != theirs.get(key)]
    if differing:
        raise ValueError(f"the reference's served defaults differ ({'; '.join(differing)}): give the model folder "
                         "the build came from, with the model card (machgen.json) it was built with")


def record_magnitude_ratios(pipeline, prompts: Prompts) -> tuple[list[np.ndarray], list, list[float]]:
    """Uncached images and stats, and the mean per-step magnitude ratio of the blocks' residual."""
    run = pipeline.sampler.run_component
    per_prompt, images, stats = [], [], []
    try:
        for pair in prompts:
            pipeline.sampler.run_component = recorder = BlocksResidualRecorder(run)
            image, stat = _generate(pipeline, pair, cache_policy="none")
            images.append(_result(pipeline, image))
            stats.append(stat)
            per_prompt.append(magnitude_ratios(recorder.residuals))
    finally:
        pipeline.sampler.run_component = run
    return images, stats, [float(r) for r in np.mean(per_prompt, axis=0)]


def magcache_schedule(settings: CacheSettings, threshold: float) -> tuple:
    """What decides a MagCache request's images besides its prompt and seed:
    its controls and the steps that run the blocks. MagCache decides from the
    calibrated ratios alone, before any call, so this needs no generation."""
    cache = StepCache("magcache", threshold, settings)
    cache.start(len(settings.magnitude_ratios))
    computed = []
    for step in range(cache.total_steps):
        if cache.plan(step) is StepPlan.COMPUTE:
            computed.append(step)
            cache.state.reset()
            cache.state.has_residual = True
        else:
            cache.skipped(step)
    return cache.controls, tuple(computed)


def choose(trials: Sequence[Trial], targets: QualityTargets) -> Trial | None:
    """The fastest trial that holds the targets: the fewest tail passes (to
    the nearest whole pass), then the fewest head calls; among equals, the
    one with the best worst case (its tail's bound, then its worst image)."""
    holding = [t for t in trials if targets.holds(t)]
    return min(holding, key=lambda t: (round(t.tail_passes), round(t.head_calls), -t.worst_bound, -t.psnr_worst)) \
        if holding else None


def scores_against(images, reference) -> list[float]:
    return [psnr(a, b) for a, b in zip(images, reference)]


def scored_trial(policy: str, threshold: float, controls: CacheControls, scores: Sequence[float], stats,
                 targets: QualityTargets) -> Trial:
    return Trial(policy, threshold, float(np.mean([s.denoiser_tail_passes for s in stats])),
                 round(float(np.mean(scores)), 2), round(float(np.min(scores)), 2), controls,
                 round(targets.mean_bound(scores), 2), float(np.mean([s.denoiser_head_calls for s in stats])),
                 targets.tail_bound(scores))


def _tail_words(trial: Trial, targets: QualityTargets) -> str:
    bound = trial.worst_tail_bound
    return "" if bound is None else f", {bound.describe(targets.worst_tail)}"


def _below_words(figures: Mapping, pairs: int, target: float) -> str:
    """A held-out record's share under the worst-case target, in words (none for one recorded before it)."""
    if "below_worst" not in figures:
        return ""
    share = ShareBelow(figures["below_worst"], pairs, figures["below_upper_bound"], figures["below_confidence"])
    return f", {share.describe(target)}"


def disjoint_holdout(prompts: Prompts, holdout: Prompts) -> None:
    if not prompts or not holdout:
        raise ValueError(f"calibration needs fit and held-out prompts (got {len(prompts)} fit, {len(holdout)} "
                         "held out)")
    shared = {tuple(pair[:2]) for pair in prompts} & {tuple(pair[:2]) for pair in holdout}
    if shared:
        raise ValueError(f"{len(shared)} held-out prompt/seed pairs are fit pairs too (for example "
                         f"{sorted(shared)[0]}): the held-out set must be one the fit never sees")


def calibrate(pipeline, prompts: Prompts, holdout: Prompts, targets: QualityTargets = QualityTargets(),
              control_grid: Sequence[CacheControls] = CONTROL_GRID,
              threshold_grids: Mapping[str, Sequence[float]] = THRESHOLD_GRIDS,
              log: Callable[[str], None] = print, task: str | None = None,
              reference: FloatReference | None = None) -> tuple[CacheSettings, list[Trial]]:
    """New cache settings for ``pipeline`` (a LocalPipeline) at its served
    defaults, fitted on ``prompts`` and reported on ``holdout``, for requests
    of ``task`` (None: the model's first; one that starts from a picture
    takes (prompt, seed, picture) triples). The sampler runs them (for every
    task) when this returns; ``with_task`` files them among the model's.

    ``reference`` (a quantized build's FloatReference): every score is
    against its output, the pipeline's own uncached output scored as the
    "none" trial; where that trial misses the targets no policy is fitted
    and the default stays none."""
    disjoint_holdout(prompts, holdout)
    task = task or pipeline.manifest.tasks[0]
    log(f"uncached{' (the build alone)' if reference else ' reference'}: {len(prompts)} fit prompts ({task})")
    # Every request runs the settings under trial, whatever its task.
    settings = replace(pipeline.sampler.cache_settings.for_task(task), tasks={})
    pipeline.sampler.cache_settings = settings
    uncached, uncached_stats, ratios = record_magnitude_ratios(pipeline, prompts)
    settings = replace(settings, magnitude_ratios=tuple(round(r, 5) for r in ratios))
    shortfall = None
    if reference is None:
        baseline = uncached
        trials: list[Trial] = [Trial("none", 0.0, float(np.mean([s.denoiser_tail_passes for s in uncached_stats])),
                                     99.0, 99.0,
                                     head_calls=float(np.mean([s.denoiser_head_calls for s in uncached_stats])))]
    else:
        log(f"float reference: {len(prompts)} fit prompts, uncached, from a float build of {reference.model}; "
            f"every score below is against it ({precision_words(reference.quantized)} and cache reuse together)")
        baseline = reference.outputs(prompts)
        trials = [scored_trial("none", 0.0, CacheControls(), scores_against(uncached, baseline), uncached_stats,
                               targets)]
        log(f"uncached, {precision_words(reference.quantized)} alone: {_fit_words(trials[0], targets)}")
        shortfall = missed_targets(trials[0], targets)
        if shortfall is not None:
            log(f"uncached {'/'.join(sorted(set(reference.quantized.values())))} misses the targets against the "
                f"float output on the fit set: {shortfall}. Cache reuse stays off (policy none): no cached setting "
                "can hold a promise that the build misses uncached")
            threshold_grids = {}
    chosen: dict[str, Trial] = {}
    by_schedule: dict[tuple, Trial] = {}
    for policy, grid in threshold_grids.items():
        for controls in control_grid:
            pipeline.sampler.cache_settings = replace(settings, controls={policy: controls})
            for threshold in grid:
                schedule = magcache_schedule(pipeline.sampler.cache_settings, threshold) if policy == "magcache" \
                    else None
                if schedule in by_schedule:  # the same steps computed as a trial run already: the same images
                    trial = replace(by_schedule[schedule], threshold=threshold)
                else:
                    images, stats = run_prompts(pipeline, prompts, cache_policy=policy, cache_threshold=threshold)
                    trial = scored_trial(policy, threshold, controls, scores_against(images, baseline), stats,
                                         targets)
                    if schedule is not None:
                        by_schedule[schedule] = trial
                trials.append(trial)
                log(f"{policy} threshold {threshold:g}, {controls}: {trial.tail_passes:.1f} tail passes, "
                    f"PSNR mean {trial.psnr_mean:.1f} dB (bound {trial.bound:.1f}), worst {trial.psnr_worst:.1f} dB"
                    f"{_tail_words(trial, targets)}")
        best = choose([t for t in trials if t.policy == policy], targets)
        if best is not None:
            chosen[policy] = best
    # Uncached missing the targets (a quantized build): nothing holds, and none is what stays served.
    default = choose([trials[0], *chosen.values()], targets) or trials[0]
    calibration = {**targets.to_json(), "task": task, "prompts": len(prompts), "holdout_prompts": len(holdout),
                   "chosen": {p: {k: v for k, v in asdict(t).items() if k != "controls"} for p, t in chosen.items()}}
    if reference is not None:
        calibration["reference"] = {**reference.to_json(), "uncached": {"fit": _fit_record(trials[0])},
                                    **({"misses": shortfall} if shortfall else {})}
    settings = replace(
        settings,
        default_policy=default.policy,
        thresholds={**settings.thresholds, **{p: t.threshold for p, t in chosen.items()}},
        controls={**settings.controls, **{p: t.controls for p, t in chosen.items()}},
        calibration=calibration)
    pipeline.sampler.cache_settings = settings
    # The choice is made: only now does anything run the held-out prompts.
    held_out, held_out_uncached = report_held_out(pipeline, chosen, holdout, targets, log, reference)
    calibration = {**settings.calibration, "held_out": held_out}
    if reference is not None:
        calibration["reference"]["uncached"]["held_out"] = held_out_uncached
    settings = replace(settings, calibration=calibration)
    pipeline.sampler.cache_settings = settings
    log(f"default: {default.label()}")
    if reference is not None:
        log(f"{precision_words(reference.quantized)} uncached, against the float output: fit {len(prompts)} pairs: "
            f"{_fit_words(trials[0], targets)}; held out {len(holdout)} pairs: "
            f"{_held_out_words(held_out_uncached, len(holdout), targets)}")
    for policy, trial in chosen.items():
        figures = held_out[policy]
        log(f"{trial.label()}{' (default)' if policy == default.policy else ''}: "
            f"fit {len(prompts)} pairs: {trial.tail_passes:.1f} tail passes, {_fit_words(trial, targets)}; held out "
            f"{len(holdout)} pairs: {figures['tail_passes']:.1f} tail passes, "
            f"{_held_out_words(figures, len(holdout), targets)}")
        log(f"  promise: {figures['promise'] or f'none ({len(holdout)} held-out pairs give no tail bound)'}")
    if default.policy in held_out and not held_out[default.policy]["meets_targets"]:
        log("warning: the default misses the targets on the held-out prompts: calibrate on more prompts, or with "
            "a higher --confidence")
    return settings, trials


def missed_targets(trial: Trial, targets: QualityTargets) -> str | None:
    """Which targets ``trial`` misses on the fit set, and by how much, in words (None: it holds them)."""
    missed = []
    if trial.bound < targets.mean_psnr:
        missed.append(f"the mean's bound {trial.bound:.2f} dB is {targets.mean_psnr - trial.bound:.2f} dB under the "
                      f"{targets.mean_psnr:g} dB targeted (--target-psnr)")
    if trial.worst_bound < targets.worst_psnr:
        bound = trial.worst_tail_bound
        if bound is None or bound.psnr is None:
            missed.append(f"{bound.pairs if bound else 'these'} pairs give no bound for the "
                          f"{100 * targets.worst_tail:g} % tail, which must hold {targets.worst_psnr:g} dB "
                          "(--worst-psnr): calibrate on more pairs")
        else:
            missed.append(f"the {100 * targets.worst_tail:g} % tail bound {bound.psnr:.2f} dB is "
                          f"{targets.worst_psnr - bound.psnr:.2f} dB under the {targets.worst_psnr:g} dB targeted "
                          "(--worst-psnr)")
    return "; ".join(missed) or None


def _fit_words(trial: Trial, targets: QualityTargets) -> str:
    return (f"PSNR mean {trial.psnr_mean:.2f} dB (bound {trial.bound:.2f}), worst {trial.psnr_worst:.2f}"
            f"{_tail_words(trial, targets)}")


def _fit_record(trial: Trial) -> dict:
    return {"tail_passes": trial.tail_passes, "psnr_mean": trial.psnr_mean, "psnr_bound": trial.psnr_bound,
            "psnr_worst": trial.psnr_worst, "worst_tail_bound": asdict(trial.worst_tail_bound)}


def _held_out_words(figures: Mapping, pairs: int, targets: QualityTargets) -> str:
    return (f"mean {figures['psnr_mean']:.2f} dB, worst {figures['psnr_worst']:.2f}"
            f"{_below_words(figures, pairs, targets.worst_psnr)}: "
            f"{'meets' if figures['meets_targets'] else 'MISSES'} {targets.mean_psnr:g} / {targets.worst_psnr:g} dB")


def report_held_out(pipeline, chosen: dict[str, Trial], holdout: Prompts, targets: QualityTargets,
                    log: Callable[[str], None] = print,
                    reference: FloatReference | None = None) -> tuple[dict[str, dict], dict | None]:
    """Each chosen setting on ``holdout`` against its uncached images (with
    ``reference``: against the float output), as
    pipeline.sampler.cache_settings serves it: passes, PSNR mean and worst,
    the share under ``worst_psnr`` with its upper bound, the held-out set's
    own tail bound and the promise in words (what responses report). With
    ``reference`` also the pipeline's own uncached output against the float
    output, the second of the pair (None without)."""
    if not chosen and reference is None:
        return {}, None
    runs = ["uncached", *(["float"] if reference else []), *(["with each chosen setting"] if chosen else [])]
    log(f"held out: {len(holdout)} prompts, {', '.join(runs[:-1])} and {runs[-1]}")
    uncached, uncached_stats = run_prompts(pipeline, holdout, cache_policy="none")
    baseline = uncached if reference is None else reference.outputs(holdout)
    report = {policy: _held_out_figures(pipeline, holdout, trial, baseline, targets)
              for policy, trial in chosen.items()}
    if reference is None:
        return report, None
    scores = scores_against(uncached, baseline)
    return report, _scored_figures(scored_trial("none", 0.0, CacheControls(), scores, uncached_stats, targets),
                                   scores, targets)


def _held_out_figures(pipeline, holdout: Prompts, trial: Trial, baseline, targets: QualityTargets) -> dict:
    images, stats = run_prompts(pipeline, holdout, cache_policy=trial.policy, cache_threshold=trial.threshold)
    scores = scores_against(images, baseline)
    return _scored_figures(scored_trial(trial.policy, trial.threshold, trial.controls, scores, stats, targets), scores,
                           targets)


def _scored_figures(figures: Trial, scores: Sequence[float], targets: QualityTargets) -> dict:
    below = share_below(scores, targets.worst_psnr, targets.confidence)
    bound = figures.worst_tail_bound
    return {"threshold": figures.threshold if figures.policy != "none" else None,
            "tail_passes": figures.tail_passes, "psnr_mean": figures.psnr_mean, "psnr_worst": figures.psnr_worst,
            "worst_tail_bound": asdict(bound), **below.to_json(),
            "meets_targets": targets.met_by(figures.psnr_mean, below),
            "promise": None if bound.psnr is None else tail_promise(targets.worst_tail, targets.worst_psnr,
                                                                     bound.psnr, bound.confidence, bound.pairs)}


def with_task(model: CacheSettings, fitted: CacheSettings, task: str, first_task: str) -> CacheSettings:
    """A model's cache settings ``model`` with ``fitted`` (calibrate's) as those of ``task``: the model's own
    where ``task`` is its ``first_task``, the other tasks' kept."""
    if task == first_task:
        return replace(fitted, tasks=dict(model.tasks))
    return replace(model, tasks={**model.tasks, task: replace(fitted, tasks={})})


def calibration_summary(settings: CacheSettings) -> str:
    """A line on a model's cache default (fitted and held-out figures), and one for each task fitted apart."""
    return "\n".join([_summary_line(settings)] + [f"{task}: {_summary_line(task_settings)}"
                                                   for task, task_settings in settings.tasks.items()])


def _summary_line(settings: CacheSettings) -> str:
    return _cache_line(settings) + _reference_words(settings.calibration)


def _reference_words(calibration: Mapping) -> str:
    """A quantized build's calibration: what its figures are against, and the build's own uncached figures."""
    reference = calibration.get("reference")
    if reference is None:
        return ""
    quantized = precision_words(reference["precision"])
    if reference.get("misses"):
        return (f"; {quantized} uncached misses the targets against the float output on the fit set "
                f"({reference['misses']}), so cache reuse stays off")
    held_out = reference.get("uncached", {}).get("held_out")
    alone = "" if held_out is None else (f", {quantized} alone uncached: held out mean {held_out['psnr_mean']:.2f} "
                                         f"dB, worst {held_out['psnr_worst']:.2f}")
    return f"; figures against the float output ({quantized} and cache reuse together{alone})"


def _cache_line(settings: CacheSettings) -> str:
    policy = settings.default_policy
    if policy == "none":
        return "cache default: none (every step computed)"
    calibration = settings.calibration
    fitted = calibration.get("chosen", {}).get(policy)
    line = f"cache default: {policy} {settings.thresholds[policy]:g}"
    if fitted is None:
        return line + " (not calibrated)"
    line += (f"; fitted on {calibration['prompts']} pairs: {fitted['tail_passes']:.1f} tail passes, PSNR mean "
             f"{fitted['psnr_mean']:.2f} dB, worst {fitted['psnr_worst']:.2f}")
    held_out = calibration.get("held_out", {}).get(policy)
    if held_out is None and calibration.get("held_out_note"):
        return line + f"; held-out figures {calibration['held_out_note']} (responses report no expected PSNR)"
    if held_out is None:
        return line + "; no held-out report (calibrated before machgen reported one: calibrate again)"
    pairs, target = calibration["holdout_prompts"], calibration["worst_psnr"]
    line += (f"; held out {pairs} pairs: mean {held_out['psnr_mean']:.2f} dB, worst {held_out['psnr_worst']:.2f}"
             f"{_below_words(held_out, pairs, target)} ({'meets' if held_out['meets_targets'] else 'MISSES'} "
             f"{calibration['target_psnr']:g} / {target:g} dB)")
    promise = (settings.held_out_quality(policy, settings.thresholds[policy]) or {}).get("promise")
    return line + (f"; promise: {promise}" if promise else "")


def write_settings(target: Path, name: str | None, settings: CacheSettings) -> Path:
    """Store ``settings`` as the default: in a model folder's machgen.json (every
    later build takes it) or in a repository's generated manifest."""
    from machgen.builder.model_folder import SERVING_FILE

    if not (target / "model_index.json").is_file():
        folder = find_pipeline_dir(target, name)
        return replace(PipelineManifest.read(folder), cache=settings.to_json()).write(folder)
    path = target / SERVING_FILE
    card = json.loads(path.read_text()) if path.is_file() else {}
    card["cache"] = settings.to_json()
    # A model card keeps its authors' key order.
    path.write_text(json.dumps(card, indent=2) + "\n")
    return path
