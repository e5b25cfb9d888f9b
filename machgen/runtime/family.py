"""The run-time half of a model family: what the sampler asks of it.

A family's ``runtime.py`` subclasses ``FamilyRuntime`` and overrides the
hooks its pipeline needs; every hook has a default, and the sampler only
calls them (it never asks what a family has). A request's own values travel
in a ``RequestState`` (a family that needs more fields subclasses it and
names it in ``state_class``), never on the runtime object, which serves all
requests in flight at once.

Guidance is a strategy the family picks per request (``Guidance``): which
prompt each row of a denoiser call is conditioned on, and how the rows'
predictions combine. The cache sees the rows, so any strategy keeps its
reuse of the rows after the first (FasterCache's CFG reuse).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

from machgen.contract.request import GenerationRequest
from machgen.families.registry import Family
from machgen.runtime.tensors import as_numpy

RunComponent = Callable[[str, Mapping[str, Any]], dict[str, Any]]
# The denoiser's component prefix: "denoiser" (its _head, _tail and _reuse components).
DENOISER = "denoiser"


class Guidance:
    """How one step's rows combine into its prediction. The base runs one
    row, the prompt's, and takes its prediction as it is."""

    # The prompt each row is conditioned on (0: the prompt, 1: the negative
    # prompt), the prompt's row first.
    prompt_rows: tuple[int, ...] = (0,)

    @property
    def rows(self) -> int:
        return len(self.prompt_rows)

    @property
    def uses_negative_prompt(self) -> bool:
        return 1 in self.prompt_rows

    def combine(self, prediction: Any, state: "RequestState", latents: Any) -> Any:
        """The step's prediction from every row's ([rows, ...], the prompt's first)."""
        return prediction


class ClassifierFreeGuidance(Guidance):
    """negative + scale (positive - negative), over a prompt row and a negative-prompt row."""

    prompt_rows = (0, 1)

    def __init__(self, scale: float):
        self.scale = scale

    def scale_at(self, state: "RequestState") -> float:
        return self.scale

    def combine(self, prediction: Any, state: "RequestState", latents: Any) -> Any:
        positive, negative = prediction[:1], prediction[1:2]
        return negative + self.scale_at(state) * (positive - negative)


@dataclass
class RequestState:
    """One request on its way through the loop (besides its latents)."""

    request: GenerationRequest
    scheduler: Any
    timesteps: Sequence[Any]  # the steps this request runs
    first_step: int  # the index of timesteps[0] in the schedule (image-to-image starts part-way)
    guidance: Guidance
    # The denoiser's per-row inputs that hold for every step: the prompt
    # embeddings in the guidance's row order, and what the family adds.
    conditioning: dict[str, Any] = field(default_factory=dict)
    denoiser: str = DENOISER  # the component prefix of the denoiser of the current step
    step: int = 0  # the index in ``timesteps`` of the current step


class FamilyRuntime:
    """What the sampler asks of a family, with a default for every hook.

    Built once per served model from its manifest: ``settings`` are the
    family settings the builder recorded, ``assets_dir`` holds what it
    copied (tokenizers, scheduler config), ``run_component(name, inputs)``
    runs a component wherever it is served.
    """

    # The registered family this runtime serves (its capabilities and API inputs).
    family: ClassVar[Family]
    state_class: ClassVar[type[RequestState]] = RequestState

    def __init__(self, settings: Mapping[str, Any], assets_dir: str, run_component: RunComponent):
        self.settings = settings
        self.assets_dir = assets_dir
        self.run_component = run_component
        self._tokenizer_lock = threading.Lock()
        # Threads start on first use, at most one per call in flight.
        self._calls = ThreadPoolExecutor(max_workers=8, thread_name_prefix="component-call")

    def run_components(self, calls: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """``run_component(name, inputs)`` of every entry of ``calls`` at once
        (the outputs by name): components that do not wait on each other, such
        as a pipeline's text encoders, each served by its own model, overlap
        instead of queueing one behind the other."""
        if len(calls) < 2:
            return {name: self.run_component(name, inputs) for name, inputs in calls.items()}
        futures = {name: self._calls.submit(self.run_component, name, inputs) for name, inputs in calls.items()}
        return {name: future.result() for name, future in futures.items()}

    # --- what the builder copied beside the manifest (FamilyExport.sampler_assets)
    def load_tokenizer(self, folder: str, class_name: str) -> Any:
        """The transformers tokenizer ``class_name`` saved in the assets' ``folder``."""
        import transformers

        return getattr(transformers, class_name).from_pretrained(os.path.join(self.assets_dir, folder))

    def tokenize(self, tokenizer: Any, prompts: list[str], **options: Any) -> Any:
        """``tokenizer(prompts, **options)``, one request thread at a time: a
        fast tokenizer keeps its padding and truncation on one shared Rust
        object, and a call that changes them while another thread encodes
        fails ("Already borrowed")."""
        with self._tokenizer_lock:
            return tokenizer(prompts, **options)

    def load_scheduler_config(self) -> dict[str, Any]:
        with open(os.path.join(self.assets_dir, "scheduler", "scheduler_config.json")) as f:
            return json.load(f)

    # --- what requests may ask
    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this."""
        return int(self.settings["size_multiple"])

    @property
    def frame_multiple(self) -> int:
        """A video's frames are frame_multiple k + 1 (1: any count)."""
        return int(self.settings.get("temporal_factor", 1))

    @property
    def sample_rate(self) -> int | None:
        """Of the sound track, for a model that makes one."""
        return None

    # --- per request, before the loop
    def guidance(self, request: GenerationRequest) -> Guidance:
        """The request's guidance: classifier-free with the negative prompt
        when its scale is over 1 (FluxPipeline's true CFG, WanPipeline's CFG)."""
        return ClassifierFreeGuidance(request.true_cfg_scale) if request.uses_true_cfg else Guidance()

    def encode_prompts(self, prompts: list[str]) -> dict[str, Any]:
        """The text encoders' outputs for ``prompts``, one row each."""
        raise NotImplementedError

    def scheduler(self, request: GenerationRequest) -> Any:
        """A fresh scheduler with the request's schedule set, its begin index at
        the first step the request runs (num_inference_steps - denoising_steps)."""
        raise NotImplementedError

    def initial_latents(self, state: RequestState) -> Any:
        """The latents the loop starts from: the seed's noise, or a picture's
        latents noised to the first step."""
        raise NotImplementedError

    def request_conditioning(self, state: RequestState) -> dict[str, Any]:
        """Per-row denoiser inputs the request adds to its prompts' for every
        step (a picture's latents, positions at a frame rate)."""
        return {}

    # --- per step
    def denoiser(self, state: RequestState, timestep: Any) -> str:
        """The component prefix of the denoiser for ``timestep``."""
        return DENOISER

    def denoiser_inputs(self, state: RequestState, latents: Any, timestep: Any) -> dict[str, Any]:
        """The ``denoiser_head`` inputs of one step, one row per guidance row."""
        raise NotImplementedError

    def predicted_clean(self, state: RequestState, latents: Any, noise: Any, timestep: Any) -> Any:
        """The clean latents a step's (guided) prediction points to, in the
        loop's layout: for a flow-matching model x0 = x_t - sigma_t v, with
        sigma_t = timestep / num_train_timesteps (the schedulers here set
        their timesteps so). For previews only."""
        sigma = float(timestep) / float(state.scheduler.config.num_train_timesteps)
        return latents - sigma * noise

    # --- after the loop
    def finish(self, state: RequestState, latents: Any) -> Any:
        """What the decoders take from the final latents."""
        return latents

    def decode(self, latents: Any) -> Any:
        """uint8 frames [N, H, W, 3] (numpy) of ``finish``'s latents."""
        raise NotImplementedError

    def decode_audio(self, latents: Any) -> Any:
        """The sound track [channels, samples] of ``finish``'s latents, or None."""
        return None

    def preview_latents(self, latents: Any) -> Any:
        """``finish``'s latents as a preview projection takes them (what the
        image or video decoder takes, one row): [C, F, h, w], F 1 for an image."""
        pictures = as_numpy(latents)[0]
        return pictures[:, None] if pictures.ndim == 3 else pictures


def flow_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
               max_shift: float = 1.15) -> float:
    """The timestep shift ``mu`` of a flow-matching schedule with dynamic
    shifting: linear in the token count, ``base_shift`` at ``base_seq_len``
    tokens and ``max_shift`` at ``max_seq_len`` (the value, and the order of
    its float operations, of the calculate_shift in diffusers' Flux and LTX
    pipelines). Here because importing a diffusers pipeline module to get it
    costs every sampler process about 1.3 s of start-up and 60 MB (it imports transformers' models)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def decode_image(run_component: RunComponent, latents: Any) -> Any:
    """An image model's decode: ``vae_decoder`` then ``postprocess`` (uint8 [1, H, W, 3])."""
    image = run_component("vae_decoder", {"latents": latents})["image"]
    return as_numpy(run_component("postprocess", {"image": image})["images"])


def gather_rows(values: Mapping[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    """``values``' rows in the order ``rows`` lists them (a row may repeat)."""
    if list(rows) == list(range(len(next(iter(values.values()))))):
        return dict(values)
    return {name: value[list(rows)] for name, value in values.items()}
