"""The denoising loop, independent of Triton, ONNX and the model family.

It talks to components through ``run_component(name, inputs) -> outputs``
(dicts of numpy arrays or torch tensors, runtime/tensors.py): BLS inside
Triton, ONNX Runtime or torch in-process, or a closed-form fake in unit
tests. Values stay where the components leave them: on a GPU target the
latents, predictions and kept residuals never visit host memory. The
family's runtime (runtime/family.py) answers everything model-specific
(prompt encoding, noise, positions, timesteps, guidance, decoding).

The denoiser is three components that cache reuse recombines:
``denoiser_head`` (outputs ``first_block_residual`` among what the tail
needs), ``denoiser_tail`` (outputs ``noise_pred`` and ``tail_residual``, its
image output minus its image input) and ``denoiser_reuse``, which turns the
input embedding plus a kept ``blocks_residual`` into a prediction when a
step skips the blocks (see runtime/cache.py). A family may switch between
denoisers (Wan 2.2's experts: ``denoiser_2_*``); what was kept is forgotten
at the switch. Served, a step that runs head and tail calls ``denoiser``
(the prefix itself: a Triton ensemble of the two) where the components
include it.

Batching across requests happens below this module: each in-flight request
has its own ``generate`` call (one thread each in the served sampler), and
the component models batch the calls of different requests that arrive
together.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from machgen.contract.adapters import (
    ADAPTER_NAMES_INPUT,
    ADAPTER_SCALES_INPUT,
    MAX_ADAPTERS_PER_REQUEST,
    installed_adapters,
    served_adapters,
)
from machgen.contract.manifest import PipelineManifest, load_object
from machgen.contract.request import GenerationRequest, parse_request
from machgen.contract.validation import InvalidArgument
from machgen.runtime.cache import CacheSettings, StepCache, StepPlan
from machgen.runtime.family import FamilyRuntime, RunComponent, gather_rows
from machgen.runtime.tensors import as_numpy, as_torch, concat

StepCallback = Callable[[int, int], None]
# (step, the predicted clean latents as FamilyRuntime.preview_latents gives them: [C, F, h, w])
PreviewCallback = Callable[[int, Any], None]


class GenerationCancelled(Exception):
    """The caller withdrew the request; raised at the next step boundary."""

    def __init__(self, step: int, total: int):
        super().__init__(f"cancelled after {step} of {total} steps")
        self.step = step


@dataclass
class GenerationStats:
    """What one request cost; returned to clients as the ``stats`` output."""

    steps: int = 0
    # Where in the schedule of num_inference_steps they were: steps start_step + 1 to start_step + steps (a refine
    # or image-to-image starts part-way; a stop_step ends early).
    start_step: int = 0
    cache_policy: str = "none"
    cache_threshold: float | None = None
    denoiser_head_calls: int = 0
    denoiser_tail_calls: int = 0
    # Rows through the tail: a guided call carries one per pass diffusers makes (two with CFG).
    denoiser_tail_passes: int = 0
    # Guided steps whose guidance rows (the negative prompt's) came from the kept differences.
    negative_rows_derived: int = 0
    text_cache_hits: int = 0
    text_cache_misses: int = 0
    # What was made: frames (1 for an image) and, for a video, the frame rate it plays at.
    frames: int = 1
    fps: int | None = None
    # Of the sound track, for a model that makes one.
    sample_rate: int | None = None
    # The LoRA adapters the request ran with: name -> scale.
    adapters: dict[str, float] = field(default_factory=dict)
    # The cache setting's quality as calibration measured it on held-out prompts, against the uncached output:
    # mean and worst-image (the observed minimum) PSNR, dB; the tail promise, a lower confidence bound (dB) for the
    # PSNR that all but a small share of requests reach, and in words ("95 % of requests >= 26 dB (bound 26.8 dB at
    # 96 % confidence from 64 held-out pairs)"). None where the setting is not a calibrated one, or with adapters;
    # for policy none, a quantized build's own uncached figures against the float output (a float build: None).
    expected_psnr: float | None = None
    expected_psnr_worst: float | None = None
    expected_psnr_tail_bound: float | None = None
    expected_psnr_promise: str | None = None
    # Served: the request's priority, the seconds its denoiser calls waited at the step gate for their turns, and
    # the seconds they ran (what its owner was charged).
    priority: str = "interactive"
    waited_seconds: float = 0.0
    denoiser_seconds: float = 0.0
    # Served: of denoiser_tail_passes, those the sampler ran on its own sessions while the request ran alone
    # (ServingOptions.lone_steps_in_sampler); the others went to the denoiser's Triton models.
    passes_in_sampler: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class Generation:
    latents: Any  # what the family's decode takes (FamilyRuntime.finish)
    stats: GenerationStats
    # The latents after each of the request's trajectory_steps: float32 [steps, values], or None.
    trajectory: np.ndarray | None = None


class PromptEmbeddingCache:
    """Bounded LRU of text-encoder outputs keyed by prompt: clients resend the
    same prompts (and every true-CFG request the same negative prompt).

    Values are one prompt's rows of the conditioning arrays. Shared by the
    requests of one sampler, each on its own thread.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, prompts: list[str], encode: Callable[[list[str]], dict[str, np.ndarray]],
               stats: GenerationStats) -> dict[str, np.ndarray]:
        with self._lock:
            cached = {p: self._entries[p] for p in prompts if p in self._entries}
            for prompt in cached:
                self._entries.move_to_end(prompt)
        missing = list(dict.fromkeys(p for p in prompts if p not in cached))
        stats.text_cache_hits += len(prompts) - sum(prompts.count(p) for p in missing)
        stats.text_cache_misses += sum(prompts.count(p) for p in missing)
        if missing:
            encoded = encode(missing)
            for row, prompt in enumerate(missing):
                cached[prompt] = {name: value[row:row + 1] for name, value in encoded.items()}
            if self.capacity:
                with self._lock:
                    for prompt in missing:
                        self._entries[prompt] = cached[prompt]
                        self._entries.move_to_end(prompt)
                    while len(self._entries) > self.capacity:
                        self._entries.popitem(last=False)
        names = cached[prompts[0]].keys()
        return {name: concat([cached[p][name] for p in prompts]) for name in names}


def _first_rows(arrays: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    return {name: value[:rows] for name, value in arrays.items()}


def _route(names: Sequence[str], available: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: available[name] for name in names}


class Sampler:
    """Runs one request: encode, denoise (per step: head and tail, or a kept
    residual through ``denoiser_reuse``), finish; ``decode`` makes frames.

    ``component_inputs`` are the input names of the components; those of
    the tail and reuse components come from the head's outputs or the
    head's inputs (for example the position ids every part uses).
    """

    def __init__(self, runtime: FamilyRuntime, run_component: RunComponent,
                 component_inputs: Mapping[str, Sequence[str]], cache_settings: CacheSettings = CacheSettings(),
                 prompt_cache_size: int = 256, adapters: Callable[[], Collection[str]] | None = None):
        """``adapters()``: the names of the LoRA adapters the model has now (None: it serves none)."""
        self.runtime = runtime
        self.adapters = adapters
        # The denoiser's components take each row's adapters (a model built with them).
        self.takes_adapters = any(ADAPTER_NAMES_INPUT in inputs for name, inputs in component_inputs.items()
                                  if name.endswith("_head"))
        self.run_component = run_component
        self.component_inputs = {name: tuple(inputs) for name, inputs in component_inputs.items()}
        self.cache_settings = cache_settings
        self.prompt_cache = PromptEmbeddingCache(prompt_cache_size)

    def parse_request(self, get_input: Callable[[str], np.ndarray | None], defaults) -> GenerationRequest:
        """One request's inputs validated against what this model serves (contract.request.parse_request)."""
        family = self.runtime.family
        task_settings = [self.cache_settings, *self.cache_settings.tasks.values()]
        request = parse_request(get_input, defaults, size_multiple=self.runtime.size_multiple,
                                capabilities=family.capabilities,
                                cache_policies=tuple(dict.fromkeys(policy for settings in task_settings
                                                                   for policy in settings.available())),
                                frame_multiple=self.runtime.frame_multiple, family_inputs=family.inputs,
                                settings=self.runtime.settings, adapters=self.adapters)
        # Each task serves the policies its own settings can run (MagCache only where its ratios were fitted).
        task = request_task(request, family.capabilities.tasks)
        served = self.cache_settings.for_task(task).available()
        if request.cache_policy is not None and request.cache_policy not in served:
            raise InvalidArgument("cache_policy", f"{request.cache_policy!r} is not served for {task or 'this task'}"
                                                  f" (it serves {', '.join(served)})")
        return request

    def _inputs_of(self, denoiser: str, part: str) -> tuple[str, ...]:
        # A second denoiser (Wan 2.2's low-noise expert) takes the first one's inputs.
        return self.component_inputs.get(f"{denoiser}_{part}") or self.component_inputs[f"denoiser_{part}"]

    def predict_noise(self, step: int, inputs: dict[str, Any], cache: StepCache, stats: "GenerationStats",
                      denoiser: str = "denoiser") -> tuple[Any, bool]:
        """This step's prediction for the rows the cache runs, and whether the
        tail ran; ``denoiser`` is the prefix of the components to call."""
        plan = cache.plan(step)
        head_inputs = _first_rows(inputs, cache.rows(step, plan, len(inputs["hidden_states"])))
        head_outputs = None
        if plan is StepPlan.COMPUTE and denoiser in self.component_inputs:
            # The served chain of head and tail: one call, the head's outputs passed on inside the server.
            outputs = self.run_component(denoiser, head_inputs)
            stats.denoiser_head_calls += 1
            return self._tail_ran(outputs, outputs, len(head_inputs["hidden_states"]), cache, stats)
        if plan is not StepPlan.REUSE:
            head_outputs = self.run_component(f"{denoiser}_head", head_inputs)
            stats.denoiser_head_calls += 1
            if plan is StepPlan.COMPUTE or cache.inspect(step, head_outputs):
                tail_outputs = self.run_component(
                    f"{denoiser}_tail", _route(self._inputs_of(denoiser, "tail"), {**head_inputs, **head_outputs}))
                return self._tail_ran(head_outputs, tail_outputs, len(head_inputs["hidden_states"]), cache, stats)
            # A row without a kept residual (a guidance row that ran no tail) comes from the guidance difference.
            head_inputs = _first_rows(head_inputs, cache.kept_rows())
        cache.skipped(step)
        available = {**head_inputs,
                     "blocks_residual": cache.blocks_residual(head_outputs, len(head_inputs["hidden_states"]))}
        return self.run_component(f"{denoiser}_reuse",
                                  _route(self._inputs_of(denoiser, "reuse"), available))["noise_pred"], False

    @staticmethod
    def _tail_ran(head_outputs: Mapping[str, Any], tail_outputs: Mapping[str, Any], rows: int, cache: StepCache,
                  stats: "GenerationStats") -> tuple[Any, bool]:
        stats.denoiser_tail_calls += 1
        stats.denoiser_tail_passes += rows
        cache.computed(head_outputs, tail_outputs["tail_residual"])
        return tail_outputs["noise_pred"], True

    def generate(self, request: GenerationRequest, on_step: StepCallback | None = None,
                 is_cancelled: Callable[[], bool] | None = None, on_preview: PreviewCallback | None = None,
                 preview_interval: int = 0) -> Generation:
        """The latents to decode and what they cost, for one validated request.

        ``on_step(step, total)`` is called after every step. ``is_cancelled``
        is asked before every step; when it answers True the loop stops there
        with GenerationCancelled. Every ``preview_interval`` steps (0: never),
        but not after the last, ``on_preview`` gets the clean latents the
        step's prediction points to, just before that step's ``on_step``.
        """
        runtime = self.runtime
        settings = self.cache_settings.for_task(request_task(request, runtime.family.capabilities.tasks))
        policy = request.cache_policy or settings.default_policy
        cache = StepCache(policy, request.cache_threshold, settings)
        expected = (settings.held_out_quality(policy, cache.threshold) or {}
                    if measured_by_calibration(request, settings) else {})
        stats = GenerationStats(cache_policy=policy, cache_threshold=cache.threshold, frames=request.num_frames,
                                fps=request.fps, sample_rate=runtime.sample_rate, adapters=dict(request.adapters),
                                expected_psnr=expected.get("psnr_mean"),
                                expected_psnr_worst=expected.get("psnr_worst"),
                                expected_psnr_tail_bound=expected.get("psnr_tail_bound"),
                                expected_psnr_promise=expected.get("promise"))
        guidance = runtime.guidance(request)
        prompts = [request.prompt] + ([request.negative_prompt] if guidance.uses_negative_prompt else [])
        embeddings = self.prompt_cache.encode(prompts, runtime.encode_prompts, stats)
        scheduler = runtime.scheduler(request)
        first_step = request.first_step
        scheduler.set_begin_index(first_step)  # image-to-image and a refine start into the schedule
        state = runtime.state_class(request=request, scheduler=scheduler,
                                    timesteps=scheduler.timesteps[first_step:request.last_step],
                                    first_step=first_step, guidance=guidance,
                                    conditioning=gather_rows(embeddings, guidance.prompt_rows))
        latents = runtime.initial_latents(state)
        if request.start_latents is not None:
            latents = _given_latents(latents, request.start_latents)
        state.conditioning.update(runtime.request_conditioning(state))
        stats.steps, stats.start_step = len(state.timesteps), first_step
        kept = set(request.trajectory_steps)
        trajectory = []
        cache.start(len(state.timesteps), first_step, request.num_inference_steps)
        # The request's adapters, the same every step (read-only: each call slices or copies its rows).
        adapter_inputs = adapter_rows(request.adapters, guidance.rows) if self.takes_adapters else {}
        for index, timestep in enumerate(state.timesteps):
            if is_cancelled is not None and is_cancelled():
                raise GenerationCancelled(index, len(state.timesteps))
            state.step = index
            denoiser = runtime.denoiser(state, timestep)
            if denoiser != state.denoiser:
                # What was kept came from the other denoiser's blocks.
                cache.restart()
                state.denoiser = denoiser
            # Every guidance row of a step shares one call: one batch of rows.
            inputs = {**runtime.denoiser_inputs(state, latents, timestep), **adapter_inputs}
            noise, ran_tail = self.predict_noise(index, inputs, cache, stats, denoiser)
            stats.negative_rows_derived += len(noise) < guidance.rows
            noise = guidance.combine(cache.guidance_rows(index, noise, ran_tail, guidance.rows), state, latents)
            noise = as_torch(noise)
            latents = latents.to(noise.device)
            done = index + 1
            preview_due = (on_preview is not None and preview_interval > 0 and done % preview_interval == 0
                           and done < len(state.timesteps))
            # Stopped early, the result is where this last step's prediction points.
            stops_early = done == len(state.timesteps) and request.last_step < request.num_inference_steps
            clean = runtime.predicted_clean(state, latents, noise, timestep) if preview_due or stops_early else None
            latents = scheduler.step(noise, timestep, latents, return_dict=False)[0]
            if first_step + done in kept:
                trajectory.append(np.ascontiguousarray(as_numpy(latents), dtype=np.float32).reshape(-1))
            if stops_early:
                latents = clean
            elif clean is not None:  # before on_step: a step's progress report can carry its preview
                on_preview(done, runtime.preview_latents(runtime.finish(state, clean)))
            if on_step is not None:
                on_step(done, len(state.timesteps))
        return Generation(runtime.finish(state, latents), stats, np.stack(trajectory) if trajectory else None)

    def decode(self, latents) -> np.ndarray:
        """uint8 frames [N, H, W, 3] (numpy, host memory) from ``Generation.latents``:
        one for an image, every frame of a video."""
        return as_numpy(self.runtime.decode(latents))

    def decode_audio(self, latents) -> np.ndarray | None:
        """The sound track float32 [channels, samples] of ``Generation.latents``
        (host memory), or None for a model that makes none."""
        audio = self.runtime.decode_audio(latents)
        return None if audio is None else np.ascontiguousarray(as_numpy(audio), dtype=np.float32)


def _given_latents(initial: Any, values: np.ndarray) -> Any:
    """A refine's start_latents in the shape, dtype and device of the latents the request would start from."""
    initial = as_torch(initial)
    if values.size != initial.numel():
        raise InvalidArgument("start_latents", f"{values.size} values, but this request's latents hold "
                                               f"{initial.numel()} (a trajectory row of a request of the same model, "
                                               f"size and frames)")
    return as_torch(values.reshape(tuple(initial.shape))).to(device=initial.device, dtype=initial.dtype, copy=True)


def adapter_rows(adapters: Sequence[tuple[str, float]], rows: int) -> dict[str, np.ndarray]:
    """A denoiser call's per-row adapters (contract.adapters.selection_inputs):
    every guidance row of a request carries the request's adapters."""
    names = np.full((rows, MAX_ADAPTERS_PER_REQUEST), b"", dtype=np.object_)
    scales = np.zeros((rows, MAX_ADAPTERS_PER_REQUEST), np.float32)
    for index, (name, scale) in enumerate(adapters):
        names[:, index] = name.encode("utf-8")
        scales[:, index] = scale
    return {ADAPTER_NAMES_INPUT: names, ADAPTER_SCALES_INPUT: scales}


def request_task(request: GenerationRequest, tasks: Sequence[str]) -> str:
    """Which of its model's ``tasks`` a request runs: one from a picture where it gives one, else from text."""
    prefix = "image-to-" if request.image is not None else "text-to-"
    return next((task for task in tasks if task.startswith(prefix)), "")


def measured_by_calibration(request: GenerationRequest, settings: CacheSettings) -> bool:
    """Whether a request is of the kind calibration measured for ``settings`` (those of its task): from noise
    to the last step, without adapters, and from a picture exactly where the settings were fitted on pictures
    (a clip the picture pins holds its quality far better: the trained video default holds 45.8 dB there against
    37.6 for text at one setting). What it measured does not speak for one that runs adapters or part of the
    schedule (a refine, an explore's early part, image-to-image's strength)."""
    return (not request.adapters and (request.image is not None) == settings.calibrated_from_pictures
            and request.reference_images is None and request.start_latents is None and request.first_step == 0
            and request.last_step == request.num_inference_steps)


def load_sampler(manifest: PipelineManifest, assets_dir: str, run_component: RunComponent,
                 chains: bool = False) -> Sampler:
    """The sampler a repository's manifest describes (served and in-process). With ``chains`` it calls the
    manifest's chains (Triton ensembles of a denoiser's head and tail) for a step that runs both: served,
    that saves a round trip; in-process there is none to save, and each part is called by its name."""
    runtime = load_object(manifest.runtime)(manifest.family_settings, assets_dir, run_component)
    root, _ = served_adapters(manifest.adapters, assets_dir)
    components = {name: entry.inputs for name, entry in manifest.components.items() if chains or not entry.steps}
    return Sampler(runtime, run_component, components,
                   cache_settings=CacheSettings.from_json(manifest.cache), prompt_cache_size=manifest.prompt_cache_size,
                   adapters=None if root is None else lambda: installed_adapters(root))
