"""A closed-form fake denoiser for sampler and cache tests (no Triton, no ONNX).

Flow matching moves x along v = (x - mu) / sigma when all data sits at mu;
an Euler step then scales x - mu by sigma_next / sigma, so whatever the
shifted sigma schedule, the last step (sigma = 0) lands exactly on mu.
"""

import numpy as np

from machgen.contract.request import GenerationRequest
from machgen.runtime.family import RequestState
from machgen.runtime.sampler import Sampler
from machgen.runtime.tensors import as_numpy

COMPONENT_INPUTS = {
    "denoiser_tail": ("image_hidden", "text_hidden", "temb", "img_ids", "txt_ids"),
    "denoiser_reuse": ("hidden_states", "pooled_projections", "timestep", "blocks_residual"),
}


class PointMassDenoiser:
    """Fake components: the 'text encoders' turn each prompt's length into a
    target mu; the blocks move the latents x to mu, half in the first block
    and half in the rest, and the output layer turns the blocks' result h
    into the velocity (x - h) / sigma, exact for data sitting at mu. The
    reuse component applies a given blocks residual the same way. Every
    call is recorded."""

    def __init__(self, channels: int):
        self.channels = channels
        self.calls: list[tuple[str, int]] = []
        self.sigmas_seen: list[float] = []

    def target(self, prompt_tokens: int) -> float:
        return float(prompt_tokens) / 10.0

    def __call__(self, name, inputs):
        # As ONNX Runtime does: the sampler may send torch tensors, components answer numpy.
        inputs = {key: as_numpy(value) for key, value in inputs.items()}
        rows = next(iter(inputs.values())).shape[0]
        self.calls.append((name, rows))
        if name == "text_encoder":
            return {"pooled_prompt_embeds": np.zeros((rows, 32), np.float32)}
        if name == "text_encoder_2":
            ids = inputs["input_ids"]
            length = (ids != 0).sum(axis=1).astype(np.float32)  # 0 is <pad>
            embeds = np.broadcast_to(length[:, None, None], (rows, ids.shape[1], 32)).astype(np.float32)
            return {"prompt_embeds": np.ascontiguousarray(embeds)}
        if name == "denoiser_head":
            self.sigmas_seen.append(float(inputs["timestep"][0, 0]))
            x = inputs["hidden_states"]
            mu = inputs["encoder_hidden_states"][:, :1, :1] / 10.0
            first_block_residual = (mu - x) / 2
            return {"image_hidden": x + first_block_residual, "first_block_residual": first_block_residual,
                    "text_hidden": np.broadcast_to(mu, (rows, 1, 1)), "temb": np.concatenate(
                        [inputs["timestep"], x.reshape(rows, -1)], axis=1)}
        sigma = inputs["timestep"][:, :, None] if "timestep" in inputs else inputs["temb"][:, :1, None]
        if name == "denoiser_tail":
            mu = inputs["text_hidden"][:, :1, :1]
            x = inputs["temb"][:, 1:].reshape(inputs["image_hidden"].shape)
            final = inputs["image_hidden"] + (mu - inputs["image_hidden"])
            return {"noise_pred": ((x - final) / sigma).astype(np.float32),
                    "tail_residual": (final - inputs["image_hidden"]).astype(np.float32)}
        if name == "denoiser_reuse":
            return {"noise_pred": (-inputs["blocks_residual"] / sigma).astype(np.float32)}
        raise AssertionError(name)


def request(**overrides):
    values = dict(prompt="a red cat", negative_prompt=None, seed=5, num_inference_steps=6, guidance_scale=3.5,
                  true_cfg_scale=1.0, height=32, width=48)
    values.update(overrides)
    return GenerationRequest(**values)


def sampler(runtime, fake, **options) -> Sampler:
    """A Sampler of ``runtime`` calling ``fake`` for every component."""
    return Sampler(runtime, fake, COMPONENT_INPUTS, **options)


def state(runtime, req) -> RequestState:
    """A request's state before its first step, as the sampler makes it."""
    scheduler = runtime.scheduler(req)
    return runtime.state_class(req, scheduler, scheduler.timesteps, 0, runtime.guidance(req))
