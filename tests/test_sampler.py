"""The sampler against the closed-form point-mass denoiser (tests/point_mass.py)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from machgen.runtime.sampler import GenerationCancelled
from point_mass import PointMassDenoiser, request, sampler, state


def run(runtime_factory, req):
    fake = PointMassDenoiser(channels=4)
    cond = runtime_factory(fake)
    latents = sampler(cond, fake).generate(req).latents
    return fake, cond, latents


def test_lands_exactly_on_the_point_mass(runtime_factory):
    fake, cond, latents = run(runtime_factory, request())
    tokens = (np.asarray(cond.tokenizer_2("a red cat").input_ids) != 0).sum()
    assert latents.shape == (1, 4, 16, 24)
    np.testing.assert_allclose(latents, fake.target(tokens), atol=1e-5)
    # one head and one tail call per step, one row each, plus the two encoders once (at once: in either order)
    assert fake.calls.count(("denoiser_head", 1)) == 6 and fake.calls.count(("denoiser_tail", 1)) == 6
    assert sorted(c for c in fake.calls if c[0].startswith("text")) == [("text_encoder", 1), ("text_encoder_2", 1)]


def test_independent_components_run_at_once():
    """FamilyRuntime.run_components: each of a pipeline's text encoders is its own served model, so they
    overlap; each call meets the other at a barrier, which only calls running at once can pass."""
    import threading

    from machgen.runtime.family import FamilyRuntime

    met = threading.Barrier(2, timeout=10)

    def run_component(name, inputs):
        met.wait()
        return {"out": inputs["x"] * 2}

    runtime = FamilyRuntime({}, "", run_component)
    outputs = runtime.run_components({"text_encoder": {"x": 1}, "text_encoder_2": {"x": 5}})
    assert outputs == {"text_encoder": {"out": 2}, "text_encoder_2": {"out": 10}}


def test_true_cfg_extrapolates_from_the_negative_prompt(runtime_factory):
    req = request(negative_prompt="a blue dog at the top", true_cfg_scale=3.0)
    fake, cond, latents = run(runtime_factory, req)
    pos = fake.target((np.asarray(cond.tokenizer_2(req.prompt).input_ids) != 0).sum())
    neg = fake.target((np.asarray(cond.tokenizer_2(req.negative_prompt).input_ids) != 0).sum())
    # velocities combine linearly, so the path ends on neg + s (pos - neg)
    np.testing.assert_allclose(latents, neg + 3.0 * (pos - neg), atol=1e-4)
    assert fake.calls.count(("denoiser_head", 2)) == 6


def test_negative_prompt_without_scale_runs_no_second_pass(runtime_factory):
    fake, _, _ = run(runtime_factory, request(negative_prompt="blurry", true_cfg_scale=1.0))
    assert ("denoiser_head", 2) not in fake.calls


def test_noise_and_timesteps_are_those_of_flux_pipeline(runtime_factory, tiny_flux_pipeline):
    fake = PointMassDenoiser(channels=4)
    cond = runtime_factory(fake)
    req = request()
    ours = cond.initial_latents(state(cond, req))
    theirs, image_ids = tiny_flux_pipeline.prepare_latents(
        1, 4, req.height, req.width, torch.float32, "cpu", torch.Generator("cpu").manual_seed(req.seed))
    assert torch.equal(ours, theirs)
    np.testing.assert_array_equal(cond.image_ids(req.height, req.width)[0], image_ids.numpy())

    reference = tiny_flux_pipeline.scheduler
    mu = calculate_shift(theirs.shape[1], reference.config.base_image_seq_len, reference.config.max_image_seq_len,
                         reference.config.base_shift, reference.config.max_shift)
    sigmas = np.linspace(1.0, 1 / req.num_inference_steps, req.num_inference_steps)
    expected, _ = retrieve_timesteps(reference, req.num_inference_steps, "cpu", sigmas=sigmas, mu=mu)
    assert torch.equal(cond.scheduler(req).timesteps, expected)

    sampler(cond, fake).generate(req)
    np.testing.assert_allclose(fake.sigmas_seen, (expected / 1000).numpy(), rtol=1e-6)


def test_unpacking_matches_flux_pipeline(runtime_factory, tiny_flux_pipeline):
    cond = runtime_factory(PointMassDenoiser(channels=4))
    packed = torch.randn(1, 8 * 12, 16)
    ours = cond.finish(state(cond, request(height=32, width=48)), packed)
    theirs = tiny_flux_pipeline._unpack_latents(packed, 32, 48, tiny_flux_pipeline.vae_scale_factor)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_progress_is_reported_per_step(runtime_factory):
    fake = PointMassDenoiser(channels=4)
    steps = []
    sampler(runtime_factory(fake), fake).generate(request(num_inference_steps=3),
                                                  on_step=lambda i, n: steps.append((i, n)))
    assert steps == [(1, 3), (2, 3), (3, 3)]


def test_a_cancelled_request_stops_at_the_next_step_boundary(runtime_factory):
    fake = PointMassDenoiser(channels=4)
    steps = []
    with pytest.raises(GenerationCancelled) as raised:
        sampler(runtime_factory(fake), fake).generate(
            request(num_inference_steps=10), on_step=lambda i, n: steps.append(i), is_cancelled=lambda: len(steps) == 3)
    assert raised.value.step == 3
    assert [name for name, _ in fake.calls].count("denoiser_tail") == 3


def test_a_sampler_imports_diffusers_schedulers_without_dynamo_and_can_still_compile():
    """The sampler's start (runtime/diffusers_import.py): diffusers without torch._dynamo, its scheduler and
    noise as with it, and torch.compile still there for what a process compiles later."""
    probe = (
        "import sys, torch\n"
        "from machgen.runtime.diffusers_import import import_diffusers_without_dynamo\n"
        "assert import_diffusers_without_dynamo()\n"
        "assert not import_diffusers_without_dynamo()  # once per process\n"
        "from machgen.families.flux.runtime import FluxRuntime\n"
        "from diffusers import FlowMatchEulerDiscreteScheduler\n"
        "from diffusers.utils.torch_utils import randn_tensor\n"
        "assert 'torch._dynamo' not in sys.modules, 'diffusers imported dynamo'\n"
        "scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)\n"
        "scheduler.set_timesteps(4)\n"
        "noise = randn_tensor((2, 3), generator=torch.Generator().manual_seed(7))\n"
        "print(scheduler.timesteps.tolist(), noise.flatten().tolist())\n"
        "double = torch.compile(lambda x: x * 2, backend='eager')\n"
        "assert double(torch.ones(2)).tolist() == [2.0, 2.0] and 'torch._dynamo' in sys.modules\n")
    plain = ("import torch\nfrom diffusers import FlowMatchEulerDiscreteScheduler\n"
             "from diffusers.utils.torch_utils import randn_tensor\n"
             "scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)\nscheduler.set_timesteps(4)\n"
             "noise = randn_tensor((2, 3), generator=torch.Generator().manual_seed(7))\n"
             "print(scheduler.timesteps.tolist(), noise.flatten().tolist())\n")
    hidden, loaded = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
                      for code in (probe, plain))
    assert hidden.returncode == 0, hidden.stderr[-2000:]
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert hidden.stdout == loaded.stdout
