"""Reuse of denoiser work across steps: which steps may skip the tail.

The denoiser is a head (embeddings and the first block) and a tail (every
other block). A step either runs both, and the blocks' residuals (output
minus input) are kept, or skips the tail and adds a kept residual to this
step's input embedding instead (``denoiser_reuse``). Policies decide which,
as diffusers' cache hooks do: each is a class (CachePolicy, registered in
CACHE_POLICIES by the name a request gives) with a frozen Config, a State
with ``reset()`` that lives for one request only (what it kept), and pure
decision functions of (config, state, step, signal); StepCache calls them
through CachePolicy alone. Only numpy is imported; the values kept are
whatever the components return (numpy arrays, or torch tensors left on
their GPU: runtime/tensors.py).

- ``none``      every step runs the tail.
- ``fbcache``   First-Block Cache: runs the head every step; skips the tail
  while the first block's residual has changed by less than ``threshold``
  (relative L1) since the last step that ran the tail, reusing the tail's
  residual on top of this step's first block.
- ``magcache``  MagCache: the blocks residual's magnitude ratio between
  consecutive steps is a property of the model, calibrated once per step
  count (``machgen-build calibrate``); skip while the error accumulated from
  those ratios, sum over skipped steps of |1 - product of ratios|, stays
  under ``threshold``. Decided before any call, so a skipped step runs
  neither head nor tail and reuses the residual of all blocks, scaled by
  the product of the ratios since it was kept.

Shared controls (per policy, fitted by calibration) keep the steps that
matter most computed: the first ``warmup_steps`` (they fix the composition),
the last ``final_steps`` (they fix the detail) and at most
``max_consecutive_skips`` in a row. With guidance they also thin out the
rows after the prompt's (the negative prompt's under classifier-free
guidance; every extra pass of a family's own guidance): outside warm-up and
the final steps they run at most every ``negative_interval`` steps, and in
between each one's prediction is this step's prompt row plus the difference
(that row minus the prompt's) kept from the last step that ran them all,
which drifts far more slowly than either prediction (FasterCache's CFG
reuse).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from machgen.contract.specs import is_denoiser
from machgen.runtime.tensors import as_numpy, concat, mean_abs

# The share of requests calibration's worst-case promise leaves out when a calibration records none (one made
# before the tail promise): builder/quality_promise.py.
WORST_TAIL = 0.05
# The head's output the cache keeps: the first block's residual (its image output minus its image input).
FIRST_BLOCK_RESIDUAL = "first_block_residual"


@dataclass(frozen=True)
class CacheControls:
    warmup_steps: int = 4
    final_steps: int = 1
    max_consecutive_skips: int = 2
    negative_interval: int = 1  # 1: the guidance rows run whenever the prompt's row does

    def must_compute(self, step: int, total_steps: int, consecutive_skips: int) -> bool:
        return (step < self.warmup_steps or step >= total_steps - self.final_steps
                or consecutive_skips >= self.max_consecutive_skips)


def negative_row_due(controls: CacheControls, step: int, total_steps: int, last_negative_step: int) -> bool:
    """Whether a guided step runs its guidance rows rather than
    deriving it from the kept guidance difference."""
    return (controls.negative_interval <= 1 or step < controls.warmup_steps
            or step >= total_steps - controls.final_steps or step - last_negative_step >= controls.negative_interval)


def relative_l1(current: np.ndarray, reference: np.ndarray) -> float:
    """Mean |current - reference| over mean |reference| (numpy arrays or torch tensors)."""
    return mean_abs(current - reference) / max(mean_abs(reference), 1e-12)


class StepPlan(enum.Enum):
    COMPUTE = "compute"  # run head and tail
    INSPECT = "inspect"  # run the head, then ask ``inspect`` whether the tail runs
    REUSE = "reuse"  # run neither: the kept blocks residual stands in for all blocks


class CachePolicy:
    """One request's step-reuse policy: its frozen ``config`` (``calibrated``:
    the model's, before a request adapts it), its ``state`` (what it kept;
    ``reset()`` forgets it), the decisions StepCache asks of it (pure
    functions of config, state, step and signal) and what it keeps after a
    step. Each subclass is a policy a request names (``name``, in
    CACHE_POLICIES)."""

    name: ClassVar[str]
    Config: ClassVar[type]
    State: ClassVar[type]

    def __init__(self, config: Any):
        self.calibrated = self.config = config
        self.state = self.State()

    @classmethod
    def configured(cls, threshold: float | None, settings: "CacheSettings") -> "CachePolicy":
        """The policy at a model's settings, at ``threshold`` (None: the calibrated one)."""
        return cls(cls.Config(threshold=settings.threshold_for(cls.name, threshold),
                              controls=settings.controls_for(cls.name)))

    @classmethod
    def servable(cls, settings: "CacheSettings") -> bool:
        """Whether a model with ``settings`` can serve the policy."""
        return True

    @property
    def threshold(self) -> float | None:
        return self.config.threshold

    @property
    def controls(self) -> CacheControls:
        return self.config.controls

    def start(self, total_steps: int, first_step: int, schedule_steps: int | None) -> None:
        """A new request: steps ``first_step`` on of a schedule of ``schedule_steps``."""
        self.config = self.calibrated

    def plan(self, step: int, total_steps: int) -> StepPlan:
        """What ``step`` of ``total_steps`` runs, decided before any call."""
        raise NotImplementedError

    def inspect(self, step: int, total_steps: int, head_outputs: Mapping[str, Any]) -> bool:
        """For a step planned INSPECT: whether the tail runs, from this step's head outputs."""
        raise NotImplementedError

    def kept_rows(self) -> int:
        """Rows of the kept residual: a skipped step reuses at most these."""
        raise NotImplementedError

    def computed(self, head_outputs: Mapping[str, Any], tail_residual: Any) -> None:
        """The step ran the tail: keep what later steps reuse."""
        raise NotImplementedError

    def skipped(self, step: int, total_steps: int) -> None:
        """The step reused the kept residual."""
        raise NotImplementedError

    def blocks_residual(self, head_outputs: Mapping[str, Any] | None, rows: int) -> Any:
        """What replaces every block for the first ``rows`` rows of a skipped step."""
        raise NotImplementedError


# -------------------------------------------------------------------- none
@dataclass(frozen=True)
class NoCacheConfig:
    threshold: None = None
    controls: CacheControls = CacheControls()


@dataclass
class NoCacheState:
    def reset(self) -> None:
        pass


class NoCache(CachePolicy):
    """Every step runs the tail."""

    name, Config, State = "none", NoCacheConfig, NoCacheState

    @classmethod
    def configured(cls, threshold: float | None, settings: "CacheSettings") -> "NoCache":
        return cls(NoCacheConfig())  # nothing to tune: a threshold sent with it is ignored

    def plan(self, step: int, total_steps: int) -> StepPlan:
        return StepPlan.COMPUTE

    def kept_rows(self) -> int:
        return 0

    def computed(self, head_outputs: Mapping[str, Any], tail_residual: Any) -> None:
        pass


# ------------------------------------------------------------------ fbcache
@dataclass(frozen=True)
class FirstBlockCacheConfig:
    threshold: float = 0.2  # relative L1 change of the first block's residual below which the tail is skipped
    controls: CacheControls = CacheControls()


@dataclass
class FirstBlockCacheState:
    reference_residual: np.ndarray | None = None  # head residual at the last step that ran the tail
    consecutive_skips: int = 0
    tail_residual: np.ndarray | None = None  # the blocks after the first, at the last step that ran the tail

    def reset(self) -> None:
        self.reference_residual = self.tail_residual = None
        self.consecutive_skips = 0


def first_block_cache_computes(config: FirstBlockCacheConfig, state: FirstBlockCacheState, step: int,
                               total_steps: int, head_residual: np.ndarray) -> bool:
    if state.reference_residual is None or config.controls.must_compute(step, total_steps,
                                                                        state.consecutive_skips):
        return True
    rows = min(len(head_residual), len(state.reference_residual))  # the guidance rows may not have run
    return relative_l1(head_residual[:rows], state.reference_residual[:rows]) >= config.threshold


class FirstBlockCache(CachePolicy):
    """Runs the head every step; a skipped step keeps this step's first block and reuses the tail's residual."""

    name, Config, State = "fbcache", FirstBlockCacheConfig, FirstBlockCacheState

    def plan(self, step: int, total_steps: int) -> StepPlan:
        return StepPlan.INSPECT

    def inspect(self, step: int, total_steps: int, head_outputs: Mapping[str, Any]) -> bool:
        return first_block_cache_computes(self.config, self.state, step, total_steps,
                                          head_outputs[FIRST_BLOCK_RESIDUAL])

    def kept_rows(self) -> int:
        return 0 if self.state.tail_residual is None else len(self.state.tail_residual)

    def computed(self, head_outputs: Mapping[str, Any], tail_residual: Any) -> None:
        self.state.tail_residual = tail_residual
        self.state.reference_residual = head_outputs[FIRST_BLOCK_RESIDUAL]
        self.state.consecutive_skips = 0

    def skipped(self, step: int, total_steps: int) -> None:
        self.state.consecutive_skips += 1

    def blocks_residual(self, head_outputs: Mapping[str, Any] | None, rows: int) -> Any:
        return head_outputs[FIRST_BLOCK_RESIDUAL][:rows] + self.state.tail_residual[:rows]


# ----------------------------------------------------------------- magcache
@dataclass(frozen=True)
class MagCacheConfig:
    threshold: float = 0.1  # accumulated magnitude error up to which steps are skipped
    # Calibrated mean ||blocks residual(step)|| / ||blocks residual(step - 1)||, one per step.
    magnitude_ratios: tuple[float, ...] = ()
    controls: CacheControls = CacheControls()

    def ratio(self, step: int, total_steps: int) -> float:
        """The calibrated ratio for ``step`` of ``total_steps``, nearest-resampled
        when the request's step count differs from the calibration's."""
        ratios = self.magnitude_ratios
        if not ratios:
            return 1.0
        return ratios[min(len(ratios) - 1, int(step * (len(ratios) - 1) / max(total_steps - 1, 1) + 0.5))]


@dataclass
class MagCacheState:
    accumulated_ratio: float = 1.0
    accumulated_error: float = 0.0
    consecutive_skips: int = 0
    has_residual: bool = False
    full_residual: np.ndarray | None = None  # every block's, at the last step that ran the tail

    def reset(self) -> None:
        self.accumulated_ratio, self.accumulated_error = 1.0, 0.0
        self.consecutive_skips, self.has_residual, self.full_residual = 0, False, None


def magcache_error_if_skipped(config: MagCacheConfig, state: MagCacheState, step: int,
                              total_steps: int) -> tuple[float, float]:
    """(accumulated ratio, accumulated error) should ``step`` skip the tail."""
    ratio = state.accumulated_ratio * config.ratio(step, total_steps)
    return ratio, state.accumulated_error + abs(1.0 - ratio)


def magcache_computes(config: MagCacheConfig, state: MagCacheState, step: int, total_steps: int) -> bool:
    if not state.has_residual or config.controls.must_compute(step, total_steps, state.consecutive_skips):
        return True
    return magcache_error_if_skipped(config, state, step, total_steps)[1] > config.threshold


class MagCache(CachePolicy):
    """Decides from the calibrated ratios before any call: a skipped step runs neither head nor tail and reuses
    the residual of all blocks."""

    name, Config, State = "magcache", MagCacheConfig, MagCacheState

    @classmethod
    def configured(cls, threshold: float | None, settings: "CacheSettings") -> "MagCache":
        return cls(MagCacheConfig(threshold=settings.threshold_for(cls.name, threshold),
                                  magnitude_ratios=settings.magnitude_ratios, controls=settings.controls_for(cls.name)))

    @classmethod
    def servable(cls, settings: "CacheSettings") -> bool:
        # Without calibrated ratios it would skip blindly.
        return bool(settings.magnitude_ratios)

    def start(self, total_steps: int, first_step: int, schedule_steps: int | None) -> None:
        super().start(total_steps, first_step, schedule_steps)
        if first_step or schedule_steps not in (None, total_steps):
            # The calibrated ratios follow the schedule, not the request's own step count.
            schedule = schedule_steps or total_steps
            ratios = tuple(self.calibrated.ratio(first_step + step, schedule) for step in range(total_steps))
            self.config = replace(self.calibrated, magnitude_ratios=ratios)

    def plan(self, step: int, total_steps: int) -> StepPlan:
        return StepPlan.COMPUTE if magcache_computes(self.config, self.state, step, total_steps) else StepPlan.REUSE

    def kept_rows(self) -> int:
        return 0 if self.state.full_residual is None else len(self.state.full_residual)

    def computed(self, head_outputs: Mapping[str, Any], tail_residual: Any) -> None:
        self.state.reset()
        self.state.full_residual = head_outputs[FIRST_BLOCK_RESIDUAL] + tail_residual
        self.state.has_residual = True

    def skipped(self, step: int, total_steps: int) -> None:
        self.state.consecutive_skips += 1
        self.state.accumulated_ratio, self.state.accumulated_error = magcache_error_if_skipped(
            self.config, self.state, step, total_steps)

    def blocks_residual(self, head_outputs: Mapping[str, Any] | None, rows: int) -> Any:
        # Scaled by the calibrated magnitude drift since it was kept: measured
        # on the shapes model, +0.9 dB mean PSNR at the same skips.
        return self.state.full_residual[:rows] * self.state.accumulated_ratio


# The policies a request may name, by name: contract.specs.CACHE_POLICY_NAMES, in its order (a test).
CACHE_POLICIES: dict[str, type[CachePolicy]] = {policy.name: policy for policy in (NoCache, FirstBlockCache, MagCache)}


# ------------------------------------------------------------ per request
class StepCache:
    """One request's cache: its policy (CACHE_POLICIES) and the guidance rows' kept differences.

    Per step the sampler asks ``plan(step)``; for INSPECT it runs the head
    and asks ``inspect(step, head_outputs)``; then it reports ``computed``
    (the tail ran) or ``skipped``, and for a skipped step adds
    ``blocks_residual(head_outputs, rows)`` to the input embedding.
    """

    def __init__(self, policy: str, threshold: float | None, settings: "CacheSettings"):
        self.policy = CACHE_POLICIES[policy].configured(threshold, settings)
        self.total_steps = 0
        # Guided steps: every other row's prediction minus the prompt's, at the last step that ran them all.
        self.guidance_difference: np.ndarray | None = None
        self.last_negative_step = -1

    @property
    def config(self) -> Any:
        return self.policy.config

    @property
    def state(self) -> Any:
        return self.policy.state

    @property
    def controls(self) -> CacheControls:
        return self.policy.controls

    @property
    def threshold(self) -> float | None:
        return self.policy.threshold

    def start(self, total_steps: int, first_step: int = 0, schedule_steps: int | None = None) -> None:
        """A new request of ``total_steps``: steps ``first_step`` on of a
        schedule of ``schedule_steps`` (image-to-image starts part-way)."""
        self.total_steps = total_steps
        self.policy.start(total_steps, first_step, schedule_steps)
        self.restart()

    def restart(self) -> None:
        """Forget what was kept (residuals, guidance difference): the next
        step computes. For a switch to another denoiser (Wan 2.2's experts)."""
        self.guidance_difference = None
        self.last_negative_step = -1
        self.policy.state.reset()

    def rows(self, step: int, plan: "StepPlan", rows: int) -> int:
        """How many of a step's rows (the prompt's first, then the guidance rows)
        to run: a skipped step never runs the guidance rows once their
        differences are kept."""
        if rows == 1 or self.controls.negative_interval <= 1 or self.guidance_difference is None:
            return rows
        if plan is StepPlan.REUSE:
            return 1
        return rows if negative_row_due(self.controls, step, self.total_steps, self.last_negative_step) else 1

    def guidance_rows(self, step: int, prediction: Any, ran_tail: bool, rows: int) -> Any:
        """Every one of a guided step's ``rows`` (the prompt's first): those the
        step ran, and for a step that ran only the first, the others as the
        first plus the differences kept from the last step that ran them all."""
        if rows == 1:
            return prediction
        if len(prediction) < rows:
            return concat([prediction[:1], prediction[:1] + self.guidance_difference])
        if ran_tail:
            self.guidance_difference = prediction[1:rows] - prediction[:1]
            self.last_negative_step = step
        return prediction

    def plan(self, step: int) -> StepPlan:
        return self.policy.plan(step, self.total_steps)

    def inspect(self, step: int, head_outputs: Mapping[str, np.ndarray]) -> bool:
        """Whether the tail runs, from this step's head outputs (a step planned INSPECT)."""
        return self.policy.inspect(step, self.total_steps, head_outputs)

    def kept_rows(self) -> int:
        """Rows of the kept residual: a skipped step reuses at most these."""
        return self.policy.kept_rows()

    def computed(self, head_outputs: Mapping[str, np.ndarray], tail_residual: np.ndarray) -> None:
        self.policy.computed(head_outputs, tail_residual)

    def skipped(self, step: int) -> None:
        self.policy.skipped(step, self.total_steps)

    def blocks_residual(self, head_outputs: Mapping[str, np.ndarray] | None, rows: int) -> np.ndarray:
        """What replaces every block for the first ``rows`` rows of a skipped
        step: fbcache keeps this step's first block and reuses the rest;
        magcache reuses all."""
        return self.policy.blocks_residual(head_outputs, rows)


@dataclass(frozen=True)
class CacheSettings:
    """A served model's cache defaults (the ``cache`` section of pipeline.json,
    written by ``machgen-build calibrate``)."""

    default_policy: str = "none"
    thresholds: Mapping[str, float] = field(default_factory=lambda: {
        name: policy.Config().threshold for name, policy in CACHE_POLICIES.items()
        if policy.Config().threshold is not None})
    magnitude_ratios: tuple[float, ...] = ()
    controls: Mapping[str, CacheControls] = field(default_factory=dict)  # per policy; absent: the defaults
    # Provenance of the defaults (target PSNR, prompts, measured figures, the task they were fitted on);
    # the held-out figures are what responses report as expected.
    calibration: Mapping[str, Any] = field(default_factory=dict)
    # Settings fitted on requests of another task of the model, by task (``image-to-video``: clips started from
    # a picture, which the picture pins, so they hold their quality over more skipped steps); a request of a task
    # not here takes the settings above.
    tasks: Mapping[str, "CacheSettings"] = field(default_factory=dict)

    def for_task(self, task: str) -> "CacheSettings":
        """The settings a request of ``task`` runs with."""
        return self.tasks.get(task, self)

    @property
    def calibrated_from_pictures(self) -> bool:
        """Whether calibration fitted these settings on requests that start from a picture."""
        return str(self.calibration.get("task", "")).startswith("image-to-")

    def threshold_for(self, policy: str, requested: float | None) -> float:
        return float(self.thresholds[policy]) if requested is None else requested

    def controls_for(self, policy: str) -> CacheControls:
        return self.controls.get(policy, CacheControls())

    def held_out_quality(self, policy: str, threshold: float | None) -> Mapping[str, Any] | None:
        """What calibration measured for this setting on prompts it was not
        fitted on (``psnr_mean``, ``psnr_worst`` the observed minimum, against
        uncached, dB) and, where the record allows, its tail promise:
        ``psnr_tail_bound`` (dB) and ``promise`` (in words); None for a
        setting it did not choose. Policy none on a quantized build
        calibrated against the float output: the build's own uncached
        figures against it (what precision alone costs); on a float build
        none is the reference itself, and has none."""
        if policy == NoCache.name:
            figures = self.calibration.get("reference", {}).get("uncached", {}).get("held_out")
        else:
            figures = self.calibration.get("held_out", {}).get(policy)
            if figures is not None and (threshold is None or not np.isclose(figures["threshold"], threshold)):
                figures = None
        if figures is None:
            return None
        return {"psnr_mean": figures["psnr_mean"], "psnr_worst": figures["psnr_worst"], **self._tail_promise(figures)}

    def _tail_promise(self, figures: Mapping[str, Any]) -> dict[str, Any]:
        calibration = self.calibration
        tail = calibration.get("worst_tail", WORST_TAIL)
        confidence, pairs = calibration.get("confidence", 0.95), calibration.get("holdout_prompts")
        recorded = figures.get("worst_tail_bound")
        if recorded is not None:
            bound, confidence, pairs = recorded["psnr"], recorded["confidence"], recorded["pairs"]
        elif pairs and 1 - (1 - tail) ** pairs >= confidence:
            # Recorded before the tail promise (a worst-image margin): the held-out minimum is the smallest order
            # statistic, a lower bound for the tail's quantile at confidence 1 - (1 - tail)^pairs
            # (builder/quality_promise.py).
            bound, confidence = figures["psnr_worst"], 1 - (1 - tail) ** pairs
        else:
            return {}
        if bound is None or calibration.get("worst_psnr") is None:
            return {}
        return {"psnr_tail_bound": bound,
                "promise": tail_promise(tail, calibration["worst_psnr"], bound, confidence, pairs)}

    def available(self) -> tuple[str, ...]:
        """The policies a request may name on this model."""
        return tuple(name for name, policy in CACHE_POLICIES.items() if policy.servable(self))

    def to_json(self) -> dict[str, Any]:
        data = {"default_policy": self.default_policy, "thresholds": dict(self.thresholds),
                "magnitude_ratios": list(self.magnitude_ratios),
                "controls": {policy: asdict(controls) for policy, controls in self.controls.items()},
                "calibration": dict(self.calibration)}
        if self.tasks:
            data["tasks"] = {task: settings.to_json() for task, settings in self.tasks.items()}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "CacheSettings":
        if not data:
            return cls()
        return cls(default_policy=data["default_policy"], thresholds=dict(data["thresholds"]),
                   magnitude_ratios=tuple(data.get("magnitude_ratios", ())),
                   controls={policy: CacheControls(**values) for policy, values in data.get("controls", {}).items()},
                   calibration=data.get("calibration", {}),
                   tasks={task: cls.from_json(settings) for task, settings in data.get("tasks", {}).items()})


def tail_promise(tail: float, target: float, bound: float, confidence: float, pairs: int,
                 pair_kind: str = "held-out") -> str:
    """The worst-case promise in words, e.g. "95 % of requests >= 26 dB (bound 26.8 dB at 96 % confidence from
    64 held-out pairs)": ``bound`` is a lower ``confidence`` bound for the ``tail``-quantile of the PSNRs of
    ``pairs`` pairs; under ``target`` it is what the pairs support, and the sentence says so."""
    share, evidence = f"{100 * (1 - tail):g} % of requests", f"{100 * confidence:.0f} % confidence from {pairs} " \
                                                            f"{pair_kind} pairs"
    if bound >= target:
        return f"{share} >= {target:g} dB (bound {bound:.1f} dB at {evidence})"
    return f"{share} >= {bound:.1f} dB at {evidence}, under the {target:g} dB targeted"


def magnitude_ratios(tail_residuals: Sequence[np.ndarray]) -> list[float]:
    """Per-step mean over tokens of ||residual(step)|| / ||residual(step - 1)||
    (1.0 for the first step), as MagCache calibrates."""
    ratios = [1.0]
    for previous, current in zip(tail_residuals, tail_residuals[1:]):
        norms = np.linalg.norm(current, axis=-1) / (np.linalg.norm(previous, axis=-1) + 1e-8)
        ratios.append(float(norms.mean()))
    return ratios


class BlocksResidualRecorder:
    """Wraps a ``run_component`` and keeps, for every step that ran the tail,
    the residual of all blocks (first block's plus the tail's): what
    ``magnitude_ratios`` is calibrated from. Every denoiser counts (Wan 2.2's
    two experts: ``denoiser_*`` and ``denoiser_2_*``), so there is a ratio
    per step of the whole schedule."""

    def __init__(self, run_component):
        self.run_component = run_component
        self.residuals: list[np.ndarray] = []
        self._first_block: np.ndarray | None = None

    def __call__(self, name: str, inputs: dict) -> dict:
        outputs = self.run_component(name, inputs)
        prefix, _, part = name.rpartition("_")
        if is_denoiser(prefix) and part == "head":
            self._first_block = outputs[FIRST_BLOCK_RESIDUAL]
        elif is_denoiser(prefix) and part == "tail":
            self.residuals.append(as_numpy(self._first_block + outputs["tail_residual"]))
        return outputs
