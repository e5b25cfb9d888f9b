"""The denoising loop, independent of Triton, ONNX and the model family.

It talks to components through ``run_component(name, inputs) -> outputs``
(dicts of numpy arrays or torch tensors, ensembles/tensors.py): BLS inside
Triton, ONNX Runtime or torch in-process, or a closed-form fake in unit
tests. Values stay where the components leave them: on a GPU target the
latents, predictions and kept residuals never visit host memory. The
family's conditioning object answers everything model-specific (prompt
encoding, noise, position ids, timesteps, unpacking).

The denoiser is three components that cache reuse recombines:
``denoiser_head`` (outputs ``first_block_residual`` among what the tail
needs), ``denoiser_tail`` (outputs ``noise_pred`` and ``tail_residual``, its
image output minus its image input) and ``denoiser_reuse``, which turns the
input embedding plus a kept ``blocks_residual`` into a prediction when a
step skips the blocks (see ensembles/cache.py). After the loop the latents
go through ``DECODE_STAGES``.

Batching across requests happens below this module: each in-flight request
has its own Sampler call, and the component models batch the calls of
different requests that arrive together.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from machgen.ensembles.api import GenerationRequest, parse_request
from machgen.ensembles.cache import CacheSettings, StepCache, StepPlan
from machgen.ensembles.tensors import as_numpy, as_torch, concat

RunComponent = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]
StepCallback = Callable[[int, int], None]

# The components after the loop, in order, one input and one output each:
# latents -> decoded image -> uint8 images.
DECODE_STAGES = ("vae_decoder", "postprocess")


class GenerationCancelled(Exception):
    """The caller withdrew the request; raised at the next step boundary."""

    def __init__(self, step: int, total: int):
        super().__init__(f"cancelled after {step} of {total} steps")
        self.step = step


class Conditioning(Protocol):
    """What a family provides to the sampler (see builder/families/)."""

    size_multiple: int

    def encode_prompts(self, prompts: list[str]) -> dict[str, np.ndarray]: ...

    def initial_latents(self, seed: int, height: int, width: int, num_frames: int = 1) -> Any: ...

    def scheduler(self, num_inference_steps: int, height: int, width: int, num_frames: int = 1) -> Any: ...

    def image_latents(self, image: np.ndarray, first_step: int, seed: int, scheduler: Any,
                      num_frames: int = 1) -> tuple[Any, Any]:
        """A start from ``image`` (uint8 [H, W, 3]): image-to-image's latents of
        the picture noised to ``first_step`` (``scheduler`` set to start there),
        or an image-to-video model's first frame; and the timesteps to run.
        (A family whose picture only conditions the steps, Wan's
        image-to-video, has no such method: request_conditioning instead.)"""
        ...

    def denoiser_inputs(self, latents: Any, timestep: Any, conditioning: dict[str, np.ndarray],
                        guidance_scale: float, height: int, width: int) -> dict[str, np.ndarray]: ...

    def decoder_latents(self, latents: Any, height: int, width: int) -> Any: ...

    # Optional, for what not every family has:
    # - ``frame_multiple: int`` (video): num_frames is frame_multiple k + 1;
    # - ``experts: int`` and ``expert(timestep) -> str``: a model with a
    #   low-noise expert (Wan 2.2) names the denoiser of each step by its
    #   component prefix ("denoiser" or "denoiser_2");
    # - ``decode(latents) -> uint8 [frames, H, W, 3]``: a decode other than
    #   DECODE_STAGES (a video decoded chunk by chunk);
    # - ``request_conditioning(request) -> dict``: what a request adds to
    #   every step's conditioning besides its prompts (image-to-video's
    #   picture, a video's positions at its frame rate);
    # - ``reference_frames(request) -> int``: latent frames denoised in
    #   front of the video and dropped before the decode (Wan VACE's
    #   reference images; latents [1, C, frames, h, w]);
    # - ``parse_guidance(get_input, defaults, request) -> dict``: the
    #   family's own guidance inputs (Capabilities.guidance_inputs),
    #   validated, with ``defaults`` (ServedDefaults.family_guidance) for
    #   the absent ones: ``request.guidance``;
    # - ``uses_negative_prompt(request) -> bool``: whether the negative
    #   prompt is encoded (default: request.uses_true_cfg);
    # - ``guide(prediction, latents, step, scheduler, conditioning) -> noise``:
    #   a guidance of its own over all the rows denoiser_inputs made (LTX-2:
    #   CFG, spatio-temporal and modality guidance, rescaled), in place of
    #   true CFG over (positive, negative) rows;
    # - ``request_latents(request)`` and ``unpack(latents, request)``: the
    #   initial noise and the decoder's latents of a family whose latents
    #   follow more than the size (LTX-2: the sound's length, from the frame
    #   rate), in place of initial_latents and decoder_latents;
    # - ``decode_audio(latents) -> float32 [channels, samples]`` and
    #   ``sample_rate: int``: a model that makes sound (Capabilities.audio).


@dataclass
class GenerationStats:
    """What one request cost; returned to clients as the ``stats`` output."""

    steps: int = 0
    cache_policy: str = "none"
    cache_threshold: float | None = None
    denoiser_head_calls: int = 0
    denoiser_tail_calls: int = 0
    # Rows through the tail: with true CFG a call carries two (diffusers makes two passes).
    denoiser_tail_passes: int = 0
    # True-CFG steps whose negative prediction came from the kept guidance difference.
    negative_rows_derived: int = 0
    text_cache_hits: int = 0
    text_cache_misses: int = 0
    # What was made: frames (1 for an image) and, for a video, the frame rate it plays at.
    frames: int = 1
    fps: int | None = None
    # Of the sound track, for a model that makes one.
    sample_rate: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class Generation:
    latents: Any  # float32 [1, C, h, w] (numpy or torch), ready for the VAE decoder
    stats: GenerationStats


class PromptEmbeddingCache:
    """Bounded LRU of text-encoder outputs keyed by prompt: clients resend the
    same prompts (and every true-CFG request the same negative prompt).

    Values are one prompt's rows of the conditioning arrays. Shared by the
    requests of one sampler instance; the lock covers in-process callers
    that run requests on several threads.
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
    residual through ``denoiser_reuse``), unpack; ``decode`` makes images.

    ``component_inputs`` are the input names of the components; those of
    the tail and reuse components come from the head's outputs or the
    head's inputs (for example the position ids every part uses).
    """

    def __init__(self, conditioning: Conditioning, run_component: RunComponent,
                 component_inputs: Mapping[str, Sequence[str]], cache_settings: CacheSettings = CacheSettings(),
                 prompt_cache_size: int = 256, tasks: Sequence[str] = ("text-to-image",),
                 guidance_is_cfg: bool = False, guidance_inputs: Sequence[str] = ()):
        self.conditioning = conditioning
        self.tasks = tuple(tasks)
        self.guidance_is_cfg = guidance_is_cfg
        self.guidance_inputs = tuple(guidance_inputs)
        self.experts = getattr(conditioning, "experts", 1)
        self.run_component = run_component
        self.component_inputs = {name: tuple(inputs) for name, inputs in component_inputs.items()}
        self.tail_inputs = self.component_inputs["denoiser_tail"]
        self.reuse_inputs = self.component_inputs.get("denoiser_reuse", ())
        self.cache_settings = cache_settings
        self.prompt_cache = PromptEmbeddingCache(prompt_cache_size)

    def parse_request(self, get_input: Callable[[str], np.ndarray | None],
                      defaults: Mapping[str, Any]) -> GenerationRequest:
        """One request's inputs validated against what this model serves (api.parse_request)."""
        # A video family's frames are frame_multiple k + 1; image families have no such rule.
        request = parse_request(get_input, defaults, self.conditioning.size_multiple,
                                self.cache_settings.available(), self.tasks,
                                getattr(self.conditioning, "frame_multiple", 1), self.guidance_is_cfg, self.experts,
                                self.guidance_inputs)
        if hasattr(self.conditioning, "parse_guidance"):
            guidance = self.conditioning.parse_guidance(get_input, defaults.get("family_guidance", {}), request)
            request = replace(request, guidance=guidance)
        return request

    def predict_noise(self, step: int, inputs: dict[str, np.ndarray], cache: StepCache,
                      stats: GenerationStats, denoiser: str = "denoiser") -> tuple[np.ndarray, bool]:
        """This step's prediction for the rows the cache runs, and whether the
        tail ran; ``denoiser`` is the prefix of the components to call."""
        plan = cache.plan(step)
        head_inputs = _first_rows(inputs, cache.rows(step, plan, len(inputs["hidden_states"])))
        head_outputs = None
        if plan is not StepPlan.REUSE:
            head_outputs = self.run_component(f"{denoiser}_head", head_inputs)
            stats.denoiser_head_calls += 1
            if plan is StepPlan.COMPUTE or cache.inspect(step, head_outputs):
                tail_outputs = self.run_component(f"{denoiser}_tail",
                                                  _route(self.tail_inputs, {**head_inputs, **head_outputs}))
                stats.denoiser_tail_calls += 1
                stats.denoiser_tail_passes += len(head_inputs["hidden_states"])
                cache.computed(head_outputs, tail_outputs["tail_residual"])
                return tail_outputs["noise_pred"], True
            # A row without a kept residual (a negative row that ran no tail) comes from the guidance difference.
            head_inputs = _first_rows(head_inputs, cache.kept_rows())
        cache.skipped(step)
        available = {**head_inputs,
                     "blocks_residual": cache.blocks_residual(head_outputs, len(head_inputs["hidden_states"]))}
        return self.run_component(f"{denoiser}_reuse", _route(self.reuse_inputs, available))["noise_pred"], False

    def generate(self, request: GenerationRequest, on_step: StepCallback | None = None,
                 is_cancelled: Callable[[], bool] | None = None) -> Generation:
        """The latents to decode and what they cost, for one validated request.

        ``is_cancelled`` is asked before every step; when it answers True the
        loop stops there with GenerationCancelled.
        """
        cond = self.conditioning
        policy = request.cache_policy or self.cache_settings.default_policy
        cache = StepCache(policy, request.cache_threshold, self.cache_settings)
        stats = GenerationStats(cache_policy=policy, cache_threshold=cache.threshold, frames=request.num_frames,
                                fps=request.fps)
        prompts = [request.prompt]
        uses_negative = (cond.uses_negative_prompt(request) if hasattr(cond, "uses_negative_prompt")
                         else request.uses_true_cfg)
        if uses_negative:
            prompts.append(request.negative_prompt)
        conditioning = self.prompt_cache.encode(prompts, cond.encode_prompts, stats)
        scheduler = cond.scheduler(request.num_inference_steps, request.height, request.width, request.num_frames)
        reference_frames = cond.reference_frames(request) if hasattr(cond, "reference_frames") else 0
        first_step = request.num_inference_steps - request.denoising_steps
        if request.image is not None and hasattr(cond, "image_latents"):
            latents, timesteps = cond.image_latents(request.image, first_step, request.seed, scheduler,
                                                    request.num_frames)
        elif hasattr(cond, "request_latents"):
            latents, timesteps = cond.request_latents(request), scheduler.timesteps
        else:
            latents = cond.initial_latents(request.seed, request.height, request.width,
                                           request.num_frames + reference_frames * getattr(cond, "frame_multiple", 1))
            timesteps = scheduler.timesteps
        if hasattr(cond, "request_conditioning"):
            conditioning = {**conditioning, **cond.request_conditioning(request)}
        stats.steps = len(timesteps)
        cache.start(len(timesteps), first_step, request.num_inference_steps)
        denoiser = "denoiser"
        for index, timestep in enumerate(timesteps):
            if is_cancelled is not None and is_cancelled():
                raise GenerationCancelled(index, len(timesteps))
            cfg_scale = request.true_cfg_scale
            if self.experts > 1:
                expert = cond.expert(timestep)
                if expert != denoiser:
                    # What was kept came from the other expert's blocks.
                    cache.restart()
                    denoiser = expert
                if expert != "denoiser":
                    cfg_scale = request.guidance_scale_2
            # The positive and negative passes share one call: one batch of two rows.
            inputs = cond.denoiser_inputs(latents, timestep, conditioning, request.guidance_scale,
                                          request.height, request.width)
            noise, ran_tail = self.predict_noise(index, inputs, cache, stats, denoiser)
            if hasattr(cond, "guide"):
                noise = cond.guide(noise, latents, index, scheduler, conditioning)
            elif request.uses_true_cfg:
                stats.negative_rows_derived += len(noise) == 1
                positive, negative = cache.guidance_rows(index, noise, ran_tail)
                noise = negative + cfg_scale * (positive - negative)
            noise = as_torch(noise)
            latents = scheduler.step(noise, timestep, latents.to(noise.device), return_dict=False)[0]
            if on_step is not None:
                on_step(index + 1, len(timesteps))
        if reference_frames:
            latents = latents[:, :, reference_frames:]
        stats.sample_rate = getattr(cond, "sample_rate", None)
        if hasattr(cond, "unpack"):
            return Generation(cond.unpack(latents, request), stats)
        return Generation(cond.decoder_latents(latents, request.height, request.width), stats)

    def decode(self, latents) -> np.ndarray:
        """uint8 frames [N, H, W, 3] (numpy, host memory) from ``Generation.latents``:
        one for an image, every frame of a video."""
        if hasattr(self.conditioning, "decode"):
            return self.conditioning.decode(latents)
        value = latents
        for stage in DECODE_STAGES:
            (input_name,) = self.component_inputs[stage]
            (value,) = self.run_component(stage, {input_name: value}).values()
        return as_numpy(value)

    def decode_audio(self, latents) -> np.ndarray | None:
        """The sound track float32 [channels, samples] of ``Generation.latents``
        (host memory), or None for a model that makes none."""
        if not hasattr(self.conditioning, "decode_audio"):
            return None
        return np.ascontiguousarray(as_numpy(self.conditioning.decode_audio(latents)), dtype=np.float32)


def load_sampler(pipeline: Mapping[str, Any], assets_dir: str, run_component: RunComponent) -> Sampler:
    """The sampler a generated ``pipeline.json`` describes (Triton's and in-process)."""
    from machgen.builder.registry import get_family

    family = get_family(pipeline["family"])
    conditioning = family.make_sampler(pipeline["family_settings"], assets_dir, run_component)
    components = pipeline["components"]
    return Sampler(conditioning, run_component, {name: entry["inputs"] for name, entry in components.items()},
                   cache_settings=CacheSettings.from_json(pipeline.get("cache")),
                   prompt_cache_size=int(pipeline.get("prompt_cache_size", 256)),
                   tasks=pipeline.get("tasks", ("text-to-image",)),
                   guidance_is_cfg=family.capabilities.guidance_is_cfg,
                   guidance_inputs=family.capabilities.guidance_inputs)
