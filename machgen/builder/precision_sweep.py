"""The int8 sensitivity sweep: which of the denoiser's linear layer groups (builder/layer_groups.py) stay float
so that an int8 build (``machgen-build build --precision int8``) keeps its images within a PSNR target of the
float build's and passes the parity check against torch.

On a few pairs of the model's calibration prompts (calibrate's fit set), at the served defaults but uncached
(int8 alone is measured; cache reuse's own error is calibrate's to fit), the float build generates each pair's
image while every denoiser call's inputs are recorded. Then each group is quantized alone (every other group
float) and measured: (a) the denoiser's output on the recorded float inputs against the float graphs'
(relative RMS error of a step's output, head and tail chained, over the recorded calls), (b) each pair's image,
generated again through the same in-process pipeline (runtime/local.py), as PSNR against the float image, and
(c) how far each graph's outputs depart from float's on its recorded inputs, as a share of float's largest (the
measure of the build's parity check, which refuses an int8 file beyond INT8_RELATIVE_TOLERANCE). The groups
are ranked: one that alone departs beyond that bound first, then by (b)'s worst image, its mean, then (a).
From all int8, the worst-ranked groups are tried float one at a time until the worst image meets the target and
(c) the bound; each such set is measured on its own (images again), and a group stays float only where the set
does better with it: the groups' errors do not simply add (they partly cancel). The step's time (the denoiser
graphs on the recorded inputs, one thread) is measured float, all int8 and with each set on the way.

The target (``--int8-min-psnr``): by default 10 dB above the card's calibrated mean target (the shapes image
default's 33 dB: 43 dB), else 40 dB (10 above calibrate's default target of 30). Errors of independent sources
add as squared errors; an int8 image 10 dB above the promise adds a tenth of the squared error the promise
allows, so a model that holds its promise at exactly 33 dB holds 32.6 dB with int8 (-0.41 dB), and its worst
image at 26 dB holds 25.9 (-0.09 dB).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from machgen.builder.layer_groups import LayerGroup, denoiser_stem, group_layers
from machgen.builder.quantize import INT8_RELATIVE_TOLERANCE, linear_layers, quantize_int8
from machgen.runtime.local import LocalPipeline

# The target above a card's calibrated mean PSNR, and the target of a model without one (calibrate's default
# target of 30 dB plus the same margin): see the module's doc.
PROMISE_MARGIN_DB = 10.0
UNCALIBRATED_MIN_PSNR = 40.0


@dataclass(frozen=True)
class SweepSettings:
    """How ``machgen-build build --precision int8`` sweeps (``--precision-sweep-pairs``, ``--int8-min-psnr``)."""

    pairs: int = 4  # prompt/seed pairs of calibrate's fit set
    min_psnr: float | None = None  # worst image against float, dB; None: the card's target + 10, else 40
    steps: int | None = None  # denoising steps; None: the served default
    threads: int = 1  # ONNX Runtime threads per component (1: steadier timings on a shared machine)
    max_calls: int = 16  # recorded calls (a), (c) and the timing run on (per graph for (c)), spread evenly

    def __post_init__(self):
        if self.pairs < 1:
            raise ValueError(f"precision sweep pairs {self.pairs}: at least 1")
        if self.min_psnr is not None and not 0 < self.min_psnr < 99:
            raise ValueError(f"int8 min PSNR {self.min_psnr:g} dB: between 0 and 99")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"precision sweep steps {self.steps}: at least 1")


# machgen-build build's options of the sweep.
SWEEP_HELP = {
    "sweep": "int8: keep float the layer groups that cost the images most, measured group by group on calibration "
             "prompts (off: every denoiser linear layer int8)",
    "min_psnr": "int8 sweep: the worst image's PSNR against the float build to hold, dB (default: the card's "
                "calibrated target + 10, else 40)",
    "pairs": f"int8 sweep: prompt/seed pairs of the calibration set (default {SweepSettings.pairs}); tensorrt fp8: "
             "the pairs its layers' inputs are calibrated on",
}


def sweep_settings(precision: str | None, sweep: bool, min_psnr: float | None, pairs: int | None) -> SweepSettings:
    """The settings of build's options; refused (ValueError naming the option) with another precision or the
    sweep off, where they would be ignored."""
    given = [option for option, value in (("--int8-min-psnr", min_psnr), ("--precision-sweep-pairs", pairs))
             if value is not None]
    if given == ["--precision-sweep-pairs"] and precision == "fp8":  # the pairs its inputs are calibrated on
        given = []
    if given and (precision != "int8" or not sweep):
        raise ValueError(f"{given[0]}: applies to --precision int8 with --precision-sweep (--precision-sweep-pairs "
                         f"also to fp8; got --precision {precision or 'default'}"
                         f"{'' if sweep else ', --no-precision-sweep'})")
    try:
        return SweepSettings(pairs=pairs or SweepSettings.pairs, min_psnr=min_psnr)
    except ValueError as err:
        raise ValueError(f"{given[0] if given else '--int8-min-psnr'}: {err}") from None


@dataclass(frozen=True)
class Measured:
    """One set of float groups (the rest int8) against the float build."""

    psnr: tuple[float, ...]  # each pair's image, dB
    output_error: float  # the denoiser output's relative RMS error on the recorded calls
    # The parity check's measure (builder/export.py check_parity): over each part's recorded calls, its outputs'
    # largest departure from float's as a share of float's largest output.
    departure: float = 0.0

    @property
    def psnr_mean(self) -> float:
        return float(np.mean(self.psnr))

    @property
    def psnr_worst(self) -> float:
        return float(np.min(self.psnr))

    def to_json(self) -> dict:
        return {"psnr_mean": round(self.psnr_mean, 2), "psnr_worst": round(self.psnr_worst, 2),
                "output_error": float(f"{self.output_error:.3g}"), "departure": float(f"{self.departure:.3g}")}

    def standing(self) -> tuple:
        """Better sets compare higher: within the parity check's bound first, then the worst image, the mean."""
        return self.departure <= INT8_RELATIVE_TOLERANCE, self.psnr_worst, self.psnr_mean

    def misses(self, min_psnr: float) -> str:
        """What this set misses of the targets ("" where it holds them)."""
        missed = [f"worst {self.psnr_worst:.1f} dB < {min_psnr:g}"] if self.psnr_worst < min_psnr else []
        if self.departure > INT8_RELATIVE_TOLERANCE:
            missed.append(f"departs {100 * self.departure:.1f} % > {100 * INT8_RELATIVE_TOLERANCE:g} % (parity)")
        return ", ".join(missed)


@dataclass(frozen=True)
class GroupCost:
    group: LayerGroup
    alone: Measured  # this group int8, every other float
    swept: bool  # whether any of its layers is in a graph an uncached step runs


@dataclass
class Choice:
    """The groups kept float for ``min_psnr``, and what was measured on the way."""

    min_psnr: float
    target_reason: str
    ranked: list[GroupCost]
    kept_float: list[str]  # group names, in the order they were kept
    path: list[Measured]  # all int8, then after each group kept float
    unhelpful: dict[str, Measured] = field(default_factory=dict)  # groups tried float that did not help, so int8
    pairs: int = 0
    steps: int | None = None  # denoising steps of each generation
    compute: dict[str, float] = field(default_factory=dict)  # each group's share of a step's linear multiply-adds
    modules: dict[str, frozenset] = field(default_factory=dict)  # each denoiser part's layers' modules
    float_seconds: float | None = None  # a denoiser step, all float
    path_seconds: list[float] = field(default_factory=list)  # a step with each set of ``path``

    @property
    def step_seconds(self) -> dict[str, float]:
        if not self.path_seconds:
            return {}
        return {"float": self.float_seconds, "int8": self.path_seconds[0], "chosen": self.path_seconds[-1]}

    @property
    def final(self) -> Measured:
        return self.path[-1]

    def why(self, cost: GroupCost) -> str:
        name = cost.group.name
        if name in self.kept_float:
            before = self.path[self.kept_float.index(name)]
            return (f"float: {before.misses(self.min_psnr)} with it int8 "
                    f"({'all int8' if not self.kept_float.index(name) else 'after the groups above'})")
        if name in self.unhelpful:
            return f"int8: float did not help (worst {self.unhelpful[name].psnr_worst:.1f} dB with it float)"
        if not cost.swept:
            return "int8: in no graph an uncached step runs"
        return (f"int8: worst {self.final.psnr_worst:.1f} dB >= {self.min_psnr:g}, departs "
                f"{100 * self.final.departure:.1f} % with it int8")

    def float_modules(self, component: str) -> list[str]:
        """The module paths of ``component``'s layers that stay float."""
        return [module for cost in self._kept_in(component) for module in cost.group.modules
                if module in self.modules.get(component, ())]

    def _kept_in(self, component: str) -> list[GroupCost]:
        """The groups kept float that have layers in ``component``."""
        stem, held = denoiser_stem(component), self.modules.get(component, frozenset())
        return [cost for cost in self.ranked if cost.group.name in self.kept_float and cost.group.stem == stem
                and held.intersection(cost.group.modules)]

    def record(self, component: str) -> dict:
        """The manifest's account of the sweep for ``component`` (its precision entry's "sweep")."""
        return {"min_psnr": self.min_psnr, "target": self.target_reason, "pairs": self.pairs, "steps": self.steps,
                "cache_policy": "none", "all_int8": self.path[0].to_json(), "chosen": self.final.to_json(),
                "step_ms": {key: round(1000 * value, 3) for key, value in self.step_seconds.items()},
                "float_compute_share": round(self.float_compute, 4),
                "float_groups": {cost.group.name: self.why(cost) for cost in self._kept_in(component)}}

    def table(self) -> list[str]:
        """The sweep's table for the build log: one row per group, the worst first."""
        width = max([len("group")] + [len(cost.group.name) for cost in self.ranked])
        lines = [f"{'rank':>4}  {'group':<{width}}  {'layers':>6}  {'compute':>7}  {'out err':>8}  {'departs':>7}  "
                 f"{'PSNR mean':>9}  {'worst':>6}  precision and why"]
        for rank, cost in enumerate(self.ranked, start=1):
            alone = cost.alone
            lines.append(f"{rank:>4}  {cost.group.name:<{width}}  {len(cost.group.modules):>6}  "
                         f"{100 * self.compute.get(cost.group.name, 0.0):>6.1f}%  {100 * alone.output_error:>7.3f}%  "
                         f"{100 * alone.departure:>6.2f}%  {alone.psnr_mean:>9.2f}  {alone.psnr_worst:>6.2f}  "
                         f"{self.why(cost)}")
        return lines

    @property
    def float_compute(self) -> float:
        """The share of a step's linear multiply-adds that stays float."""
        return sum(self.compute.get(name, 0.0) for name in self.kept_float)

    def summary(self) -> list[str]:
        seconds = self.step_seconds
        lines = [f"all int8: PSNR {self.path[0].psnr_mean:.2f} dB mean, {self.path[0].psnr_worst:.2f} worst, "
                 f"output error {100 * self.path[0].output_error:.3f} %, departs "
                 f"{100 * self.path[0].departure:.2f} %"]
        times = [f", a step {1000 * value:.2f} ms" for value in self.path_seconds] or [""] * len(self.path)
        lines[0] += times[0]
        for name, measured, took in zip(self.kept_float, self.path[1:], times[1:]):
            lines.append(f"  + {name} float: PSNR {measured.psnr_mean:.2f} dB mean, {measured.psnr_worst:.2f} "
                         f"worst{took}")
        lines += [f"  - {name} float did not help: PSNR {measured.psnr_mean:.2f} dB mean, {measured.psnr_worst:.2f} "
                  "worst" for name, measured in self.unhelpful.items()]
        missed = self.final.misses(self.min_psnr)
        if missed:
            lines.append(f"target not reached ({missed}), every group tried: the best set found is chosen")
        lines.append(f"chosen: {len(self.kept_float)} of {len(self.ranked)} groups float "
                     f"({100 * self.float_compute:.1f} % of the linear compute), PSNR {self.final.psnr_mean:.2f} dB "
                     f"mean, {self.final.psnr_worst:.2f} worst (target {self.min_psnr:g}: {self.target_reason})")
        if seconds:
            lines.append("a denoiser step: " + ", ".join(f"{key} {1000 * value:.2f} ms" for key, value in
                                                          seconds.items()))
        return lines


class _SweepPipeline(LocalPipeline):
    """The in-process pipeline, recording its denoiser calls' inputs while ``recorded`` is a list, and
    reopening a component after its file changed."""

    def __init__(self, *args, **kwargs):
        self.recorded: list | None = None
        super().__init__(*args, **kwargs)

    def run_component(self, component: str, inputs: dict) -> dict:
        from machgen.contract.specs import is_denoiser
        from machgen.runtime.tensors import as_numpy

        if self.recorded is not None and is_denoiser(component):
            self.recorded.append((component, {name: np.array(as_numpy(value)) for name, value in inputs.items()}))
        return super().run_component(component, inputs)

    def reload(self, components: Sequence[str]) -> None:
        from machgen.contract.manifest import pipeline_dir
        from machgen.runtime.components import InSamplerComponents

        with self._opening:
            for component in components:
                getattr(self._sessions.pop(component, None), "close", lambda: None)()
        if any(component in self.in_sampler for component in components):
            self.in_sampler = InSamplerComponents(self.manifest.components, pipeline_dir(self.repository, self.name),
                                                  self._adapters, self._max_loaded)


def sweep_pairs(pipeline: LocalPipeline, count: int) -> list[tuple]:
    """The first ``count`` pairs of calibrate's default fit set for this model: shapes captions, moving-shapes
    ones for a video model (with a first frame where its first task starts from a picture)."""
    from machgen.builder.calibrate import FIT_PROMPTS_SEED, makes_video
    from machgen.datasets import moving_shapes, shapes

    video = makes_video(pipeline)
    if pipeline.manifest.tasks[0].startswith("image-to-"):
        if not video:
            raise ValueError(f"the precision sweep has no pictures for task {pipeline.manifest.tasks[0]}: build "
                             "with --no-precision-sweep")
        return [(prompt, seed, picture) for prompt, seed, picture, _ in
                moving_shapes.evaluation_pictures(count, seed=FIT_PROMPTS_SEED)]
    dataset = moving_shapes if video else shapes
    return [(prompt, seed) for prompt, seed, _ in dataset.evaluation_prompts(count, seed=FIT_PROMPTS_SEED)]


def served_file(pipeline: LocalPipeline, component: str) -> Path:
    """Where the repository holds ``component``'s ONNX file."""
    from machgen.contract.manifest import COMPONENT_FILES, pipeline_dir

    entry = pipeline.manifest.components[component]
    if entry.model is not None:
        return pipeline.repository / entry.model / "1" / COMPONENT_FILES["onnxruntime"]
    return pipeline_dir(pipeline.repository, pipeline.name) / str(entry.file)


class PrecisionSweep:
    """The sweep over a float repository (runtime/local.py runs it) whose denoiser components' float files are
    ``float_files`` (component -> model.onnx kept outside the repository: the trials rewrite the served ones)."""

    def __init__(self, repository: Path, name: str, float_files: Mapping[str, Path],
                 settings: SweepSettings = SweepSettings(), log: Callable[[str], None] = print):
        import onnx

        from machgen.builder.calibrate import run_prompts

        self.settings = settings
        self.log = log
        self.pipeline = _SweepPipeline(repository, name, intra_op_threads=settings.threads)
        self.float_files = dict(float_files)
        self.pairs = sweep_pairs(self.pipeline, settings.pairs)
        self.layers = {component: linear_layers(onnx.load(str(path), load_external_data=False))
                       for component, path in self.float_files.items()}
        self._served = {component: served_file(self.pipeline, component) for component in self.float_files}
        for component, layers in self.layers.items():  # the reference is the float files, whatever the folder held
            quantize_int8(self.float_files[component], exclude=[layer.node for layer in layers],
                          out=self._served[component], record=False)
        self.options: dict[str, Any] = {"cache_policy": "none"}
        if settings.steps is not None:
            self.options["num_inference_steps"] = settings.steps
        self.pipeline.recorded = []
        self.reference, _ = run_prompts(self.pipeline, self.pairs, **self.options)
        recorded, self.pipeline.recorded = self.pipeline.recorded, None
        self.chains, self.calls = _chains(self.pipeline.manifest.components, recorded, settings.max_calls)
        self.swept = [component for chain in self.chains.values() for component in chain
                      if component in self.float_files]
        self.part_calls = _spread([(component, inputs) for component, inputs in recorded if component in self.swept],
                                  settings.max_calls * len(self.swept))
        self.groups = group_layers(self.layers)
        self._group_of = {(group.stem, module): group.name for group in self.groups for module in group.modules}
        # The float nodes each swept component's served file has now.
        self._holds = {component: frozenset(layer.node for layer in self.layers[component]) for component in self.swept}
        self.reference_outputs = self._outputs()
        self.reference_parts = self._part_outputs()
        self.compute = self._compute_shares()
        self._measured: dict[frozenset, Measured] = {}
        self._seconds: dict[frozenset, float] = {}
        self._ranked: list[GroupCost] | None = None

    @property
    def group_names(self) -> frozenset:
        return frozenset(group.name for group in self.groups)

    def card_target(self) -> tuple[float, str]:
        """The default target and why (see the module's doc)."""
        promised = self.pipeline.sampler.cache_settings.calibration.get("target_psnr")
        if promised is not None:
            return float(promised) + PROMISE_MARGIN_DB, f"the card's {float(promised):g} dB + {PROMISE_MARGIN_DB:g}"
        return UNCALIBRATED_MIN_PSNR, "no calibrated target: 30 dB + 10"

    def measure(self, float_groups: frozenset) -> Measured:
        """The images and the denoiser's output with ``float_groups`` float, the rest int8."""
        from machgen.builder.calibrate import run_prompts
        from machgen.builder.evaluate import psnr

        key = frozenset(float_groups)
        if key not in self._measured:
            self._write(key)
            images, _ = run_prompts(self.pipeline, self.pairs, **self.options)
            scores = tuple(psnr(image, reference) for image, reference in zip(images, self.reference))
            self._measured[key] = Measured(scores, _relative_error(self._outputs(), self.reference_outputs),
                                           _departure(self._part_outputs(), self.reference_parts))
        return self._measured[key]

    def rank(self) -> list[GroupCost]:
        """Every group int8 alone, the most harmful first."""
        if self._ranked is None:
            costs = []
            for number, group in enumerate(self.groups, start=1):
                swept = any(self._group_of.get((group.stem, layer.module)) == group.name
                            for component in self.swept for layer in self.layers[component])
                costs.append(GroupCost(group, self.measure(self.group_names - {group.name}), swept))
                if number % 10 == 0:
                    self.log(f"precision sweep: {number}/{len(self.groups)} groups measured")
            # A group that alone breaks the parity check's bound first, then by the worst image, the mean, (a).
            self._ranked = sorted(costs, key=lambda cost: (cost.alone.departure <= INT8_RELATIVE_TOLERANCE,
                                                           cost.alone.psnr_worst, cost.alone.psnr_mean,
                                                           -cost.alone.output_error))
        return self._ranked

    def choose(self, min_psnr: float | None = None, timed: bool = True) -> Choice:
        """The fewest worst-ranked groups kept float for the worst image to reach ``min_psnr`` (default: the
        settings', else the card's target + 10 dB)."""
        min_psnr = min_psnr if min_psnr is not None else self.settings.min_psnr
        reason = "--int8-min-psnr"
        if min_psnr is None:
            min_psnr, reason = self.card_target()
        ranked = self.rank()
        kept: list[str] = []
        path = [self.measure(frozenset())]
        unhelpful: dict[str, Measured] = {}
        for cost in ranked:
            if not path[-1].misses(min_psnr):
                break
            # Kept only where it helps: the groups' errors partly cancel, so one kept float can make it worse.
            trial = self.measure(frozenset(kept + [cost.group.name]))
            if trial.standing() > path[-1].standing():
                kept.append(cost.group.name)
                path.append(trial)
            else:
                unhelpful[cost.group.name] = trial
        choice = Choice(min_psnr, reason, ranked, kept, path, unhelpful, len(self.pairs),
                        self.settings.steps or self.pipeline.manifest.defaults.num_inference_steps, self.compute,
                        {component: frozenset(layer.module for layer in layers)
                         for component, layers in self.layers.items()})
        if timed:
            choice.float_seconds = self.step_seconds(self.group_names)
            choice.path_seconds = [self.step_seconds(frozenset(kept[:count])) for count in range(len(kept) + 1)]
        return choice

    def step_seconds(self, float_groups: frozenset, repeats: int = 3) -> float:
        """A denoiser step's time (its chain's graphs) on the recorded calls, measured once per set: each call's
        fastest of ``repeats`` runs (the least disturbed by other work on the machine), averaged over the calls."""
        key = frozenset(float_groups)
        if key not in self._seconds:
            self._write(key)
            self._outputs()  # warm: first-call allocations
            fastest = []
            for chain, inputs in self.calls:
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    self._run_chain(chain, inputs)
                    times.append(time.perf_counter() - start)
                fastest.append(min(times))
            self._seconds[key] = statistics.fmean(fastest)
        return self._seconds[key]

    def close(self) -> None:
        self.pipeline.close()

    def _write(self, float_groups: frozenset) -> None:
        """The served files of the swept components with ``float_groups`` float, the rest int8."""
        changed = []
        for component in self.swept:
            stem = denoiser_stem(component)
            floats = frozenset(layer.node for layer in self.layers[component]
                               if self._group_of[(stem, layer.module)] in float_groups)
            if self._holds[component] != floats:
                quantize_int8(self.float_files[component], exclude=floats, out=self._served[component], record=False)
                self._holds[component] = floats
                changed.append(component)
        self.pipeline.reload(changed)

    def _run_chain(self, chain: Sequence[str], inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The chain's last step's first output, each step taking its inputs from the chain's and the steps'
        before it (as the sampler routes a head's outputs to its tail)."""
        values = dict(inputs)
        outputs: dict = {}
        for component in chain:
            outputs = self.pipeline.run_component(component, values)
            values.update(outputs)
        return np.asarray(next(iter(outputs.values())))

    def _outputs(self) -> list[np.ndarray]:
        return [self._run_chain(chain, inputs) for chain, inputs in self.calls]

    def _part_outputs(self) -> list[dict]:
        return [{name: np.asarray(value) for name, value in self.pipeline.run_component(component, inputs).items()}
                for component, inputs in self.part_calls]

    def _compute_shares(self) -> dict[str, float]:
        """Each group's share of the linear layers' multiply-adds in a step: its weight elements times the rows
        its layers' inputs had in each chain's first recorded call (the float graphs run once with those inputs
        as outputs too; two denoisers, as Wan 2.2's experts, one step of each)."""
        import tempfile

        import onnx
        import onnxruntime as ort

        firsts = {chain: inputs for chain, inputs in reversed(self.calls)}
        macs: dict[str, float] = {}
        with tempfile.TemporaryDirectory(prefix="machgen-sweep-") as scratch:
            for chain, inputs in firsts.items():
                values = dict(inputs)
                for component in chain:
                    model = onnx.load(str(self.float_files[component]))
                    layers = self.layers[component]
                    outputs = [tensor.name for tensor in model.graph.output]
                    for name in dict.fromkeys(layer.input for layer in layers):
                        if name not in outputs:
                            model.graph.output.append(onnx.ValueInfoProto(name=name))
                    path = Path(scratch) / f"{component}.onnx"
                    onnx.save_model(model, str(path), save_as_external_data=True, location=f"{component}.data")
                    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                    names = [output.name for output in session.get_outputs()]
                    feed = {tensor.name: np.asarray(values[tensor.name]) for tensor in session.get_inputs()}
                    results = dict(zip(names, session.run(names, feed)))
                    values.update({name: results[name] for name in outputs})
                    stem = denoiser_stem(component)
                    for layer in layers:
                        rows = results[layer.input].size // max(results[layer.input].shape[-1], 1)
                        group = self._group_of[(stem, layer.module)]
                        macs[group] = macs.get(group, 0.0) + float(rows) * layer.parameters
        total = sum(macs.values()) or 1.0
        return {group: value / total for group, value in macs.items()}


def _chains(components: Mapping[str, Any], recorded: Sequence[tuple[str, dict]],
            max_calls: int) -> tuple[dict[str, tuple[str, ...]], list[tuple[tuple[str, ...], dict]]]:
    """The denoiser chains the recorded calls ran (a manifest chain's steps, else a component alone) by first
    component, and up to ``max_calls`` of their first calls' inputs, evenly spread."""
    chains = {entry.steps[0]: tuple(entry.steps) for entry in components.values() if entry.steps}
    inside = {component for chain in chains.values() for component in chain[1:]}
    calls = _spread([(chains.get(component, (component,)), inputs) for component, inputs in recorded
                     if component not in inside], max_calls)
    used = {chain[0]: chain for chain, _ in calls}
    if not used:
        raise ValueError("the precision sweep recorded no denoiser call")
    return used, calls


def _spread(calls: list, count: int) -> list:
    """At most ``count`` of ``calls``, evenly spread over them."""
    if len(calls) <= count:
        return calls
    return [calls[int(index)] for index in np.linspace(0, len(calls) - 1, count)]


def _departure(outputs: Sequence[dict], reference: Sequence[dict]) -> float:
    """The largest departure of any output of a call from float's, as a share of the call's largest float output
    (the parity check's measure), over the calls."""
    worst = 0.0
    for got, want in zip(outputs, reference):
        largest = max((float(np.max(np.abs(value))) for value in want.values() if value.size), default=0.0)
        if largest:
            worst = max(worst, max(float(np.max(np.abs(got[name].astype(np.float64) - value.astype(np.float64))))
                                   for name, value in want.items() if value.size) / largest)
    return worst


def _relative_error(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    error = sum(float(np.sum((a.astype(np.float64) - b.astype(np.float64)) ** 2)) for a, b in zip(outputs, reference))
    size = sum(float(np.sum(b.astype(np.float64) ** 2)) for b in reference)
    return float(np.sqrt(error / size)) if size else 0.0


def sweep_build(name: str, files: Mapping[str, str], exported: Mapping[str, Path], float_files: Mapping[str, Path],
                assets: Mapping[str, Path], scratch: Path, settings: SweepSettings,
                log: Callable[[str], None] = print) -> Choice:
    """The sweep inside a build: the repository written float into ``scratch`` (``files`` as rendered, the
    ``exported`` files with the denoisers' ``float_files``), swept, its table and choice logged."""
    from machgen.builder.repository import write_repository

    repository = scratch / "precision-sweep"
    write_repository(repository, name, dict(files), {**exported, **float_files}, dict(assets))
    start = time.perf_counter()
    sweep = PrecisionSweep(repository, name, float_files, settings, log)
    try:
        log(f"precision sweep: {len(sweep.groups)} layer groups of {', '.join(float_files)}, {len(sweep.pairs)} "
            f"pairs of the calibration prompts, uncached; each group int8 alone, the rest float")
        choice = sweep.choose()
    finally:
        sweep.close()
    for line in choice.table() + choice.summary():
        log(line)
    log(f"precision sweep: {time.perf_counter() - start:.1f} s")
    return choice
