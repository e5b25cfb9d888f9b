"""The denoising loop, independent of Triton, ONNX and the model family.

It talks to components through ``run_component(name, inputs) -> outputs``
(numpy dicts): BLS inside Triton, ONNX Runtime in-process, or a closed-form
fake in unit tests. The family's conditioning object answers everything
model-specific (prompt encoding, noise, position ids, timesteps, unpacking).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from machgen.ensembles.api import GenerationRequest

RunComponent = Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]
StepCallback = Callable[[int, int], None]


class Conditioning(Protocol):
    """What a family provides to the sampler (see builder/families/)."""

    size_multiple: int

    def encode_prompts(self, prompts: list[str]) -> dict[str, np.ndarray]: ...

    def initial_latents(self, seed: int, height: int, width: int) -> Any: ...

    def scheduler(self, num_inference_steps: int, image_tokens: int) -> Any: ...

    def denoiser_inputs(self, latents: Any, timestep: Any, conditioning: dict[str, np.ndarray],
                        guidance_scale: float, height: int, width: int) -> dict[str, np.ndarray]: ...

    def decoder_latents(self, latents: Any, height: int, width: int) -> np.ndarray: ...


class Sampler:
    """Runs one request: encode, denoise with head then tail per step, unpack.

    ``tail_inputs`` are the names the tail takes; each comes from the head's
    outputs when the head produces it, otherwise from the head's inputs (for
    example the position ids both halves use).
    """

    def __init__(self, conditioning: Conditioning, run_component: RunComponent, tail_inputs: Sequence[str]):
        self.conditioning = conditioning
        self.run_component = run_component
        self.tail_inputs = tuple(tail_inputs)

    def predict_noise(self, head_inputs: dict[str, np.ndarray]) -> np.ndarray:
        head_outputs = self.run_component("denoiser_head", head_inputs)
        tail_inputs = {name: head_outputs[name] if name in head_outputs else head_inputs[name]
                       for name in self.tail_inputs}
        return self.run_component("denoiser_tail", tail_inputs)["noise_pred"]

    def generate(self, request: GenerationRequest, on_step: StepCallback | None = None) -> np.ndarray:
        """The latents to decode, [1, C, h, w], for one validated request."""
        import torch

        cond = self.conditioning
        prompts = [request.prompt]
        if request.uses_true_cfg:
            prompts.append(request.negative_prompt)
        conditioning = cond.encode_prompts(prompts)
        latents = cond.initial_latents(request.seed, request.height, request.width)
        scheduler = cond.scheduler(request.num_inference_steps, image_tokens=latents.shape[1])
        timesteps = scheduler.timesteps
        for index, timestep in enumerate(timesteps):
            # The positive and negative passes share one call: one batch of two rows.
            inputs = cond.denoiser_inputs(latents, timestep, conditioning, request.guidance_scale,
                                          request.height, request.width)
            noise = self.predict_noise(inputs)
            if request.uses_true_cfg:
                positive, negative = noise[:1], noise[1:2]
                noise = negative + request.true_cfg_scale * (positive - negative)
            latents = scheduler.step(torch.from_numpy(np.ascontiguousarray(noise)), timestep, latents,
                                     return_dict=False)[0]
            if on_step is not None:
                on_step(index + 1, len(timesteps))
        return cond.decoder_latents(latents, request.height, request.width)
