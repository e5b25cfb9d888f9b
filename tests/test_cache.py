"""Cache policies: the pure decisions, and the sampler reusing residuals
with the closed-form point-mass denoiser of test_sampler."""

import threading
from dataclasses import replace

import numpy as np
import pytest

from machgen.contract.specs import CACHE_POLICY_NAMES
from machgen.runtime.cache import (
    CACHE_POLICIES,
    FIRST_BLOCK_RESIDUAL,
    BlocksResidualRecorder,
    CacheControls,
    CacheSettings,
    FirstBlockCache,
    FirstBlockCacheConfig,
    FirstBlockCacheState,
    MagCacheConfig,
    MagCache,
    MagCacheState,
    StepCache,
    StepPlan,
    first_block_cache_computes,
    magcache_computes,
    magnitude_ratios,
    negative_row_due,
)
from point_mass import PointMassDenoiser, request, sampler

CONTROLS = CacheControls(warmup_steps=3, final_steps=1, max_consecutive_skips=2)
BOTH = {"fbcache": CONTROLS, "magcache": CONTROLS}


def test_controls_force_warmup_final_and_a_skip_cap():
    forced = [CONTROLS.must_compute(step, 10, consecutive_skips=0) for step in range(10)]
    assert forced == [True] * 3 + [False] * 6 + [True]
    assert CONTROLS.must_compute(5, 10, consecutive_skips=2)


def test_fbcache_skips_while_the_first_block_barely_changes():
    config = FirstBlockCacheConfig(threshold=0.1, controls=CONTROLS)
    state = FirstBlockCacheState(reference_residual=np.full((1, 4, 2), 2.0))
    assert not first_block_cache_computes(config, state, 5, 10, np.full((1, 4, 2), 2.1))  # 5 % change
    assert first_block_cache_computes(config, state, 5, 10, np.full((1, 4, 2), 2.3))  # 15 %
    assert first_block_cache_computes(config, state, 1, 10, np.full((1, 4, 2), 2.0))  # warm-up
    state.reset()
    assert first_block_cache_computes(config, state, 5, 10, np.full((1, 4, 2), 2.0))  # nothing kept yet


def test_magcache_accumulates_the_calibrated_error():
    config = MagCacheConfig(threshold=0.15, magnitude_ratios=(1.0,) * 4 + (0.9,) * 6, controls=CONTROLS)
    state = MagCacheState(has_residual=True)
    # one skip: |1 - 0.9| = 0.1 <= 0.15; a second: 0.1 + |1 - 0.81| = 0.29 > 0.15
    assert not magcache_computes(config, state, 5, 10)
    state.accumulated_ratio, state.accumulated_error = 0.9, 0.1
    assert magcache_computes(config, state, 6, 10)
    assert magcache_computes(config, MagCacheState(), 5, 10)  # nothing kept yet


def test_magcache_ratios_resample_to_other_step_counts():
    config = MagCacheConfig(magnitude_ratios=(1.0, 0.5, 0.25))
    assert [config.ratio(step, 5) for step in range(5)] == [1.0, 0.5, 0.5, 0.25, 0.25]
    assert config.ratio(2, 3) == 0.25


def test_the_runtime_has_a_policy_class_for_each_name_the_api_takes():
    assert tuple(CACHE_POLICIES) == CACHE_POLICY_NAMES
    assert all(policy.name == name for name, policy in CACHE_POLICIES.items())
    # A policy's default threshold is its Config's; MagCache is served only with calibrated ratios.
    assert dict(CacheSettings().thresholds) == {"fbcache": 0.2, "magcache": 0.1}
    assert CacheSettings().available() == ("none", "fbcache")
    assert CacheSettings(magnitude_ratios=(1.0, 0.9)).available() == CACHE_POLICY_NAMES


def test_fbcache_through_the_policy_interface():
    settings = CacheSettings(controls={"fbcache": CONTROLS})
    policy = FirstBlockCache.configured(None, settings)
    assert (policy.threshold, policy.controls) == (0.2, CONTROLS)
    assert FirstBlockCache.configured(0.5, settings).threshold == 0.5
    assert policy.plan(5, 10) is StepPlan.INSPECT and policy.kept_rows() == 0
    head = {FIRST_BLOCK_RESIDUAL: np.full((2, 4, 2), 2.0)}
    policy.computed(head, np.ones((2, 4, 2)))
    assert policy.kept_rows() == 2
    assert not policy.inspect(5, 10, {FIRST_BLOCK_RESIDUAL: np.full((1, 4, 2), 2.1)})
    policy.skipped(5, 10)
    assert policy.state.consecutive_skips == 1
    np.testing.assert_array_equal(policy.blocks_residual({FIRST_BLOCK_RESIDUAL: np.full((1, 4, 2), 2.1)}, 1),
                                  np.full((1, 4, 2), 3.1))  # this step's first block, the kept tail
    policy.state.reset()
    assert policy.kept_rows() == 0 and policy.inspect(5, 10, head)


def test_magcache_through_the_policy_interface():
    settings = CacheSettings(magnitude_ratios=(1.0,) * 4 + (0.9,) * 6, controls={"magcache": CONTROLS})
    policy = MagCache.configured(0.15, settings)
    assert policy.plan(5, 10) is StepPlan.COMPUTE  # nothing kept yet
    policy.computed({FIRST_BLOCK_RESIDUAL: np.full((1, 3), 1.0)}, np.full((1, 3), 2.0))
    assert policy.plan(5, 10) is StepPlan.REUSE and policy.kept_rows() == 1
    policy.skipped(5, 10)
    np.testing.assert_allclose(policy.blocks_residual(None, 1), np.full((1, 3), 2.7))  # scaled by the ratio 0.9
    assert policy.plan(6, 10) is StepPlan.COMPUTE  # 0.1 + |1 - 0.81| > 0.15
    policy.state.reset()
    assert policy.kept_rows() == 0 and not policy.state.has_residual


@pytest.fixture
def generate(runtime_factory):
    def run(settings, req, fake=None):
        fake = fake or PointMassDenoiser(channels=4)
        return fake, sampler(runtime_factory(fake), fake, cache_settings=settings, prompt_cache_size=0).generate(req)

    return run


def calibrated_settings(generate, steps: int) -> CacheSettings:
    """MagCache ratios recorded from an uncached run, as ``calibrate`` does."""
    recorder = BlocksResidualRecorder(PointMassDenoiser(channels=4))
    generate(CacheSettings(controls=BOTH), request(num_inference_steps=steps), fake=recorder)
    assert len(recorder.residuals) == steps
    return CacheSettings(magnitude_ratios=tuple(magnitude_ratios(recorder.residuals)), controls=BOTH)


def test_policy_none_runs_every_tail(generate):
    fake, result = generate(CacheSettings(), request(num_inference_steps=10))
    stats = result.stats
    assert (stats.steps, stats.denoiser_head_calls, stats.denoiser_tail_calls, stats.denoiser_tail_passes) == \
        (10, 10, 10, 10)
    assert not [c for c in fake.calls if c[0] == "denoiser_reuse"]


def test_magcache_reuse_is_exact_on_the_point_mass(generate):
    """Residuals shrink by exactly sigma_next / sigma here, so the calibrated
    ratios rescale a kept residual into the true one: skipping costs nothing."""
    settings = calibrated_settings(generate, 10)
    _, uncached = generate(settings, request(num_inference_steps=10))
    fake, cached = generate(settings, request(num_inference_steps=10, cache_policy="magcache",
                                              cache_threshold=10.0))
    np.testing.assert_allclose(cached.latents, uncached.latents, atol=1e-5)
    # computed: warm-up 0-2, then every third step (two skips at most), and the last
    assert cached.stats.denoiser_tail_calls == 6 and cached.stats.denoiser_head_calls == 6
    assert fake.calls.count(("denoiser_reuse", 1)) == 4
    assert (cached.stats.cache_policy, cached.stats.cache_threshold) == ("magcache", 10.0)


def test_fbcache_runs_the_head_every_step_and_skips_tails(generate):
    settings = CacheSettings(controls=BOTH)
    _, uncached = generate(settings, request(num_inference_steps=10))
    fake, exact = generate(settings, request(num_inference_steps=10, cache_policy="fbcache", cache_threshold=0.0))
    np.testing.assert_array_equal(exact.latents, uncached.latents)
    fake, cached = generate(settings, request(num_inference_steps=10, cache_policy="fbcache",
                                              cache_threshold=10.0))
    assert (cached.stats.denoiser_head_calls, cached.stats.denoiser_tail_calls) == (10, 6)
    assert fake.calls.count(("denoiser_reuse", 1)) == 4
    # reusing the tail of an earlier step is approximate: the result moves, a little
    difference = np.abs(cached.latents - uncached.latents).max()
    assert 0 < difference < 0.1 * np.abs(uncached.latents).max()


def test_cfg_rows_count_as_two_tail_passes(generate):
    _, result = generate(CacheSettings(), request(num_inference_steps=4, negative_prompt="x", true_cfg_scale=2.0))
    assert (result.stats.denoiser_tail_calls, result.stats.denoiser_tail_passes) == (4, 8)


def test_negative_row_runs_every_interval_outside_warmup_and_final_steps():
    controls = CacheControls(warmup_steps=3, final_steps=1, negative_interval=3)
    last, due = -1, []
    for step in range(10):
        due.append(negative_row_due(controls, step, 10, last))
        last = step if due[-1] else last
    assert due == [True, True, True, False, False, True, False, False, True, True]
    assert all(negative_row_due(CacheControls(negative_interval=1), step, 10, 0) for step in range(10))


def cfg_request(**overrides):
    return request(num_inference_steps=10, negative_prompt="a blue bird", true_cfg_scale=3.0, **overrides)


def test_a_derived_negative_is_the_positive_plus_the_kept_difference():
    cache = StepCache("magcache", None, CacheSettings(controls={"magcache": CacheControls(negative_interval=2)}))
    cache.start(10)
    positive, negative = cache.guidance_rows(0, np.array([[1.0, 2.0], [4.0, 0.0]]), ran_tail=True, rows=2)
    np.testing.assert_array_equal(negative, [4.0, 0.0])
    positive, negative = cache.guidance_rows(1, np.array([[2.0, 2.0]]), ran_tail=True, rows=2)
    np.testing.assert_array_equal(negative, [5.0, 0.0])
    # Two rows from reused residuals are used as they are, and do not replace the kept difference.
    cache.guidance_rows(2, np.array([[0.0, 0.0], [9.0, 9.0]]), ran_tail=False, rows=2)
    np.testing.assert_array_equal(cache.guidance_rows(3, np.array([[0.0, 0.0]]), ran_tail=True, rows=2)[1],
                                  [3.0, -2.0])


@pytest.mark.parametrize("policy", ["fbcache", "magcache"])
def test_negative_row_runs_every_interval(generate, policy):
    controls = CacheControls(warmup_steps=3, final_steps=0, max_consecutive_skips=0, negative_interval=3)
    settings = CacheSettings(magnitude_ratios=(1.0,) * 10, controls={policy: controls})
    _, uncached = generate(settings, cfg_request())
    # Threshold 0 and no skips allowed: every step runs the tail, only the negative row is thinned out.
    fake, cached = generate(settings, cfg_request(cache_policy=policy, cache_threshold=0.0))
    assert [rows for name, rows in fake.calls if name == "denoiser_tail"] == [2, 2, 2, 1, 1, 2, 1, 1, 2, 1]
    assert (cached.stats.denoiser_tail_passes, cached.stats.negative_rows_derived) == (15, 5)
    assert np.abs(cached.latents - uncached.latents).max() > 1e-3
    # On the point mass a last step that runs both rows lands exactly on the guided target, whatever came before.
    with_final = CacheSettings(magnitude_ratios=(1.0,) * 10, controls={policy: replace(controls, final_steps=1)})
    _, landed = generate(with_final, cfg_request(cache_policy=policy, cache_threshold=0.0))
    assert landed.stats.negative_rows_derived == 4
    np.testing.assert_allclose(landed.latents, uncached.latents, atol=1e-5)
    every_step = CacheSettings(magnitude_ratios=(1.0,) * 10, controls={policy: replace(controls, negative_interval=1)})
    _, exact = generate(every_step, cfg_request(cache_policy=policy, cache_threshold=0.0))
    np.testing.assert_array_equal(exact.latents, uncached.latents)
    assert exact.stats.negative_rows_derived == 0


def test_a_familys_own_guidance_formula_keeps_the_guidance_row_reuse(runtime_factory):
    """Guidance is the family's strategy, and the cache thins out its rows whatever the formula: here a
    norm-rescaled CFG (the guided prediction scaled back to the prompt row's norm)."""
    from machgen.runtime.family import ClassifierFreeGuidance

    class RescaledCfg(ClassifierFreeGuidance):
        def combine(self, prediction, state, latents):
            guided = super().combine(prediction, state, latents)
            return guided * (np.linalg.norm(np.asarray(prediction[:1])) / np.linalg.norm(np.asarray(guided)))

    fake = PointMassDenoiser(channels=4)
    runtime = runtime_factory(fake)
    runtime.guidance = lambda request: RescaledCfg(request.true_cfg_scale)
    controls = CacheControls(warmup_steps=3, final_steps=0, max_consecutive_skips=0, negative_interval=3)
    settings = CacheSettings(magnitude_ratios=(1.0,) * 10, controls={"fbcache": controls})
    result = sampler(runtime, fake, cache_settings=settings, prompt_cache_size=0).generate(
        cfg_request(cache_policy="fbcache", cache_threshold=0.0))
    assert [rows for name, rows in fake.calls if name == "denoiser_tail"] == [2, 2, 2, 1, 1, 2, 1, 1, 2, 1]
    assert (result.stats.denoiser_tail_passes, result.stats.negative_rows_derived) == (15, 5)
    plain = sampler(runtime_factory(fake), fake, cache_settings=settings, prompt_cache_size=0).generate(
        cfg_request(cache_policy="fbcache", cache_threshold=0.0))
    assert np.abs(np.asarray(result.latents) - np.asarray(plain.latents)).max() > 1e-3  # the formula was used


def test_skipped_steps_derive_the_negative_row(generate):
    settings = calibrated_settings(generate, 10)
    settings = CacheSettings(magnitude_ratios=settings.magnitude_ratios,
                             controls={"magcache": replace(CONTROLS, negative_interval=2)})
    fake, cached = generate(settings, cfg_request(cache_policy="magcache", cache_threshold=10.0))
    reuse_rows = [rows for name, rows in fake.calls if name == "denoiser_reuse"]
    assert reuse_rows and set(reuse_rows) == {1}
    assert cached.stats.negative_rows_derived >= len(reuse_rows)


def test_prompt_embeddings_are_cached_by_prompt(runtime_factory):
    fake = PointMassDenoiser(channels=4)
    cached = sampler(runtime_factory(fake), fake, prompt_cache_size=2)
    first = cached.generate(request(negative_prompt="blurry", true_cfg_scale=2.0))
    again = cached.generate(request(negative_prompt="blurry", true_cfg_scale=2.0))
    np.testing.assert_array_equal(first.latents, again.latents)
    assert (first.stats.text_cache_hits, first.stats.text_cache_misses) == (0, 2)
    assert (again.stats.text_cache_hits, again.stats.text_cache_misses) == (2, 0)
    assert sum(name.startswith("text_encoder") for name, _ in fake.calls) == 2  # one batched call per encoder
    cached.generate(request(prompt="a green dog"))  # capacity 2: evicts the oldest, "a red cat"
    assert cached.generate(request()).stats.text_cache_misses == 1


def test_concurrent_requests_keep_their_own_cache_state(generate, runtime_factory):
    settings = calibrated_settings(generate, 8)
    fake = PointMassDenoiser(channels=4)
    shared = sampler(runtime_factory(fake), fake, cache_settings=settings)
    requests = [request(num_inference_steps=8, cache_policy=policy, cache_threshold=10.0, seed=seed)
                for policy, seed in (("fbcache", 1), ("magcache", 2), ("none", 3), ("fbcache", 4))]
    alone = [shared.generate(r).latents for r in requests]
    together: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(requests))

    def run(index):
        barrier.wait()
        together[index] = shared.generate(requests[index]).latents

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, latents in enumerate(alone):
        np.testing.assert_array_equal(together[index], latents)


def test_magcache_follows_the_schedule_when_a_request_starts_part_way():
    # Image-to-image at strength 0.6 of 20 steps runs steps 8-19: their calibrated ratios, not those of 0-11.
    calibrated = tuple(1.0 - 0.01 * step for step in range(20))
    settings = CacheSettings(magnitude_ratios=calibrated)
    cache = StepCache("magcache", 0.1, settings)
    cache.start(12, first_step=8, schedule_steps=20)
    assert [cache.config.ratio(step, 12) for step in range(12)] == list(calibrated[8:])
    cache.start(20)  # started again for the whole schedule: the calibrated ratios
    assert cache.config.magnitude_ratios == calibrated
