"""The sampler against a closed-form fake denoiser (no Triton, no ONNX).

Flow matching moves x along v = (x - mu) / sigma when all data sits at mu;
an Euler step then scales x - mu by sigma_next / sigma, so whatever the
shifted sigma schedule, the last step (sigma = 0) lands exactly on mu.
"""

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from machgen.builder.registry import get_family
from machgen.ensembles.api import GenerationRequest
from machgen.ensembles.sampler import Sampler

TAIL_INPUTS = ("image_hidden", "text_hidden", "temb", "img_ids", "txt_ids")


class PointMassDenoiser:
    """Fake components: the 'text encoders' turn each prompt's length into a
    target mu; the head passes latents through; the tail returns the exact
    velocity towards that row's mu. Every call is recorded."""

    def __init__(self, channels: int):
        self.channels = channels
        self.calls: list[tuple[str, int]] = []
        self.sigmas_seen: list[float] = []

    def target(self, prompt_tokens: int) -> float:
        return float(prompt_tokens) / 10.0

    def __call__(self, name, inputs):
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
            mu = inputs["encoder_hidden_states"][:, :1, :1] / 10.0
            return {"image_hidden": inputs["hidden_states"], "text_hidden": np.broadcast_to(mu, (rows, 1, 1)),
                    "temb": inputs["timestep"]}
        if name == "denoiser_tail":
            mu = inputs["text_hidden"][:, :1, :1]
            sigma = inputs["temb"][:, :, None]
            return {"noise_pred": ((inputs["image_hidden"] - mu) / sigma).astype(np.float32)}
        raise AssertionError(name)


@pytest.fixture(scope="module")
def conditioning_factory(built_repository):
    import json

    repository, _ = built_repository
    sampler_dir = repository / "flux_sampler" / "1"
    settings = json.loads((sampler_dir / "pipeline.json").read_text())["family_settings"]
    return lambda run: get_family("flux").make_sampler(settings, str(sampler_dir), run)


def request(**overrides):
    values = dict(prompt="a red cat", negative_prompt=None, seed=5, num_inference_steps=6, guidance_scale=3.5,
                  true_cfg_scale=1.0, height=32, width=48)
    values.update(overrides)
    return GenerationRequest(**values)


def run(conditioning_factory, req):
    fake = PointMassDenoiser(channels=4)
    cond = conditioning_factory(fake)
    latents = Sampler(cond, fake, TAIL_INPUTS).generate(req)
    return fake, cond, latents


def test_lands_exactly_on_the_point_mass(conditioning_factory):
    fake, cond, latents = run(conditioning_factory, request())
    tokens = (np.asarray(cond.tokenizer_2("a red cat").input_ids) != 0).sum()
    assert latents.shape == (1, 4, 16, 24)
    np.testing.assert_allclose(latents, fake.target(tokens), atol=1e-5)
    # one head and one tail call per step, one row each, plus the two encoders once
    assert fake.calls.count(("denoiser_head", 1)) == 6 and fake.calls.count(("denoiser_tail", 1)) == 6
    assert [c for c in fake.calls if c[0].startswith("text")] == [("text_encoder", 1), ("text_encoder_2", 1)]


def test_true_cfg_extrapolates_from_the_negative_prompt(conditioning_factory):
    req = request(negative_prompt="a blue dog at the top", true_cfg_scale=3.0)
    fake, cond, latents = run(conditioning_factory, req)
    pos = fake.target((np.asarray(cond.tokenizer_2(req.prompt).input_ids) != 0).sum())
    neg = fake.target((np.asarray(cond.tokenizer_2(req.negative_prompt).input_ids) != 0).sum())
    # velocities combine linearly, so the path ends on neg + s (pos - neg)
    np.testing.assert_allclose(latents, neg + 3.0 * (pos - neg), atol=1e-4)
    assert fake.calls.count(("denoiser_head", 2)) == 6


def test_negative_prompt_without_scale_runs_no_second_pass(conditioning_factory):
    fake, _, _ = run(conditioning_factory, request(negative_prompt="blurry", true_cfg_scale=1.0))
    assert ("denoiser_head", 2) not in fake.calls


def test_noise_and_timesteps_are_those_of_flux_pipeline(conditioning_factory, tiny_flux_pipeline):
    fake = PointMassDenoiser(channels=4)
    cond = conditioning_factory(fake)
    req = request()
    ours = cond.initial_latents(req.seed, req.height, req.width)
    theirs, image_ids = tiny_flux_pipeline.prepare_latents(
        1, 4, req.height, req.width, torch.float32, "cpu", torch.Generator("cpu").manual_seed(req.seed))
    assert torch.equal(ours, theirs)
    np.testing.assert_array_equal(cond.image_ids(req.height, req.width)[0], image_ids.numpy())

    scheduler = cond.scheduler(req.num_inference_steps, image_tokens=theirs.shape[1])
    reference = tiny_flux_pipeline.scheduler
    mu = calculate_shift(theirs.shape[1], reference.config.base_image_seq_len, reference.config.max_image_seq_len,
                         reference.config.base_shift, reference.config.max_shift)
    sigmas = np.linspace(1.0, 1 / req.num_inference_steps, req.num_inference_steps)
    expected, _ = retrieve_timesteps(reference, req.num_inference_steps, "cpu", sigmas=sigmas, mu=mu)
    assert torch.equal(scheduler.timesteps, expected)

    Sampler(cond, fake, TAIL_INPUTS).generate(req)
    np.testing.assert_allclose(fake.sigmas_seen, (expected / 1000).numpy(), rtol=1e-6)


def test_unpacking_matches_flux_pipeline(conditioning_factory, tiny_flux_pipeline):
    cond = conditioning_factory(PointMassDenoiser(channels=4))
    packed = torch.randn(1, 8 * 12, 16)
    ours = cond.decoder_latents(packed, 32, 48)
    theirs = tiny_flux_pipeline._unpack_latents(packed, 32, 48, tiny_flux_pipeline.vae_scale_factor)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_progress_is_reported_per_step(conditioning_factory):
    fake = PointMassDenoiser(channels=4)
    steps = []
    Sampler(conditioning_factory(fake), fake, TAIL_INPUTS).generate(request(num_inference_steps=3),
                                                                    on_step=lambda i, n: steps.append((i, n)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
