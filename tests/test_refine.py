"""A request's trajectory (its latents after chosen steps), a refine that goes on from one of them at that step
(``start_step``, ``start_latents``) and an early stop (``stop_step``), on the tiny Flux: against the parent run
and against diffusers' own loop with the prompt switched at the step."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PIPELINE_NAME

PARENT, OTHER = "a red circle", "a blue square"
SEED = 11


@pytest.fixture(scope="module")
def local(built_repository):
    from machgen.runtime.local import LocalPipeline

    repository, _ = built_repository
    return LocalPipeline(repository, PIPELINE_NAME)


@pytest.fixture(scope="module")
def defaults(local):
    return local.manifest.defaults.to_json()


@pytest.fixture(scope="module")
def parent(local, defaults):
    """The parent run: its image, and its latents after every step."""
    steps = defaults["num_inference_steps"]
    generated = local.generate_all(PARENT, seed=SEED, cache_policy="none", trajectory_steps=list(range(1, steps + 1)))
    assert generated.trajectory.shape[0] == steps and generated.stats.start_step == 0
    return generated


def _diffusers_call(defaults) -> dict:
    return {"height": defaults["height"], "width": defaults["width"],
            "num_inference_steps": defaults["num_inference_steps"], "guidance_scale": defaults["guidance_scale"],
            "max_sequence_length": defaults["max_sequence_length"], "output_type": "np"}


def diffusers_switching_prompt(pipe, defaults, step: int) -> np.ndarray:
    """diffusers' FluxPipeline for PARENT whose transformer sees OTHER's embeddings (T5's and CLIP's pooled) from
    step ``step`` on (a forward pre-hook: the pipeline's step-end callback cannot change the pooled ones)."""
    import torch

    embeds, pooled, _ = pipe.encode_prompt(OTHER, prompt_2=None, max_sequence_length=defaults["max_sequence_length"])
    calls = []

    def switch(module, args, kwargs):
        calls.append(1)
        if len(calls) > step:
            kwargs.update(encoder_hidden_states=embeds, pooled_projections=pooled)
        return args, kwargs

    handle = pipe.transformer.register_forward_pre_hook(switch, with_kwargs=True)
    try:
        out = pipe(PARENT, generator=torch.Generator().manual_seed(SEED), **_diffusers_call(defaults)).images
    finally:
        handle.remove()
    assert len(calls) == defaults["num_inference_steps"]
    return (out[0] * 255).round().astype(np.int16)


def diffusers_predicted_clean(pipe, defaults, step: int) -> np.ndarray:
    """What diffusers' FluxPipeline for PARENT would show after ``step`` steps: the clean latents its prediction at
    that step points to (x - sigma v; the transformer's timestep is sigma), decoded as the pipeline decodes."""
    import torch

    seen = []

    def keep(module, args, kwargs, output):
        seen.append((kwargs["hidden_states"], kwargs["timestep"], output[0]))

    handle = pipe.transformer.register_forward_hook(keep, with_kwargs=True)
    try:
        pipe(PARENT, generator=torch.Generator().manual_seed(SEED), **_diffusers_call(defaults))
    finally:
        handle.remove()
    latents, sigma, velocity = seen[step - 1]
    clean = latents - sigma.view(-1, 1, 1) * velocity
    clean = pipe._unpack_latents(clean, defaults["height"], defaults["width"], pipe.vae_scale_factor)
    clean = clean / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    with torch.no_grad():
        image = pipe.vae.decode(clean, return_dict=False)[0]
    return (pipe.image_processor.postprocess(image, output_type="np")[0] * 255).round().astype(np.int16)


def _difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(np.asarray(a).astype(np.int16).reshape(b.shape) - b.astype(np.int16)).max())


def test_a_refine_with_the_parents_prompt_gives_the_parents_image(local, defaults, parent, tiny_flux_pipeline):
    steps = defaults["num_inference_steps"]
    for step in range(steps):
        # From step 0, the latents are the parent's seed's noise; the refine's own seed plays no part.
        start = parent.trajectory[step - 1] if step else diffusers_noise(tiny_flux_pipeline, defaults)
        refined = local.generate_all(PARENT, seed=SEED + 1, cache_policy="none", start_step=step, start_latents=start)
        assert refined.stats.steps == steps - step and refined.stats.start_step == step
        assert _difference(refined.images, parent.images) <= 1, f"from step {step}"


def diffusers_noise(pipe, defaults) -> np.ndarray:
    """The parent's starting latents as diffusers' FluxPipeline draws them for its seed (packed), flat."""
    import torch

    noise, _ = pipe.prepare_latents(1, pipe.transformer.config.in_channels // 4, defaults["height"],
                                    defaults["width"], torch.float32, "cpu", torch.Generator().manual_seed(SEED))
    return noise.numpy().reshape(-1)


@pytest.mark.parametrize("step", [1, 2])
def test_a_refine_with_a_new_prompt_equals_diffusers_switching_the_prompt_at_that_step(
        local, defaults, parent, tiny_flux_pipeline, step):
    refined = local.generate_all(OTHER, seed=SEED, cache_policy="none", start_step=step,
                                 start_latents=parent.trajectory[step - 1])
    expected = diffusers_switching_prompt(tiny_flux_pipeline, defaults, step)
    assert _difference(refined.images[0], expected) <= 2
    # The switch shows beyond the tolerance (the tiny model's random weights heed a prompt little: the parent's
    # image differs from it by 5 or more).
    assert _difference(parent.images[0], expected) > 2


@pytest.mark.parametrize("step", [1, 3])
def test_a_stop_step_gives_the_clean_image_its_prediction_points_to(local, defaults, parent, tiny_flux_pipeline,
                                                                      step):
    stopped = local.generate_all(PARENT, seed=SEED, cache_policy="none", stop_step=step, trajectory_steps=[step])
    assert stopped.stats.steps == step
    np.testing.assert_array_equal(stopped.trajectory[0], parent.trajectory[step - 1])
    expected = diffusers_predicted_clean(tiny_flux_pipeline, defaults, step)
    assert _difference(stopped.images[0], expected) <= 2
    assert _difference(stopped.images[0], parent.images[0]) > 0


@pytest.mark.parametrize("options, field", [
    ({"start_step": 1}, "start_latents"),
    ({"start_latents": np.zeros(8, np.float32)}, "start_step"),
    ({"start_step": 1, "start_latents": np.zeros(8, np.float32)}, "start_latents"),  # not this request's size
    ({"start_step": 1, "start_latents": np.full(4096, np.nan, np.float32)}, "start_latents"),
    ({"start_step": 4, "start_latents": np.zeros(4096, np.float32)}, "start_step"),  # past the last step
    ({"stop_step": 0}, "stop_step"),
    ({"stop_step": 5}, "stop_step"),
    ({"trajectory_steps": [0]}, "trajectory_steps"),
    ({"trajectory_steps": [2], "stop_step": 1}, "trajectory_steps"),
    ({"trajectory_steps": [1], "start_step": 1, "start_latents": np.zeros(4096, np.float32)}, "trajectory_steps"),
    ({"stop_step": 1, "start_step": 1, "start_latents": np.zeros(4096, np.float32)}, "stop_step"),
])
def test_bad_trajectory_inputs_are_refused_naming_the_field(local, defaults, options, field):
    from machgen.contract.validation import InvalidArgument

    assert defaults["num_inference_steps"] == 4  # the steps the cases name
    with pytest.raises(InvalidArgument) as refused:
        local.generate_all(PARENT, seed=SEED, **options)
    assert refused.value.field == field, str(refused.value)


@pytest.mark.integration
def test_served_trajectory_refine_and_early_stop(triton_server, local, parent):
    from machgen.client import GenerationError, MachgenClient

    with MachgenClient(triton_server.grpc_url) as client:
        served = client.generate_all(PIPELINE_NAME, PARENT, seed=SEED, cache_policy="none", trajectory_steps=[2, 3])
        assert served.trajectory.shape == (2, parent.trajectory.shape[1])
        np.testing.assert_allclose(served.trajectory, parent.trajectory[1:3], atol=1e-4)
        assert _difference(served.images, parent.images) <= 1
        progress = []
        refined = client.generate_all(PIPELINE_NAME, OTHER, seed=SEED, cache_policy="none", start_step=2,
                                      start_latents=served.trajectory[0], on_progress=progress.append)
        assert [(report.step, report.total) for report in progress] == [(1, 2), (2, 2)]
        assert refined.stats["steps"] == 2 and refined.stats["start_step"] == 2
        expected = local.generate_all(OTHER, seed=SEED, cache_policy="none", start_step=2,
                                      start_latents=parent.trajectory[1])
        assert _difference(refined.images, expected.images) <= 1
        same = client.generate(PIPELINE_NAME, PARENT, seed=SEED, cache_policy="none", start_step=3,
                               start_latents=served.trajectory[1])
        assert _difference(same, served.images) <= 1
        stopped = client.generate_all(PIPELINE_NAME, PARENT, seed=SEED, cache_policy="none", stop_step=1)
        assert stopped.stats["steps"] == 1 and stopped.trajectory is None
        with pytest.raises(GenerationError) as refused:
            client.generate(PIPELINE_NAME, PARENT, start_step=1, start_latents=np.zeros(5, np.float32))
        assert refused.value.status == "StatusCode.INVALID_ARGUMENT" and "'start_latents'" in str(refused.value)
