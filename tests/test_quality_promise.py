"""The statistics of calibration's worst-case promise (machgen/builder/quality_promise.py), checked against
closed forms that can be worked by hand, published table values and simulated coverage."""

import math
import statistics

import numpy as np
import pytest

from machgen.builder.quality_promise import (NO_BOUND, NORMAL_TOLERANCE, ORDER_STATISTIC, binomial_at_least,
                                             binomial_at_most, clopper_pearson_upper, order_statistic_rank,
                                             share_below, tail_bound, tolerance_factor)
from machgen.runtime.cache import tail_promise


def test_binomial_chances_match_their_closed_forms():
    q = 0.95
    assert binomial_at_least(64, 0.05, 1) == pytest.approx(1 - q**64, abs=1e-12)
    assert binomial_at_least(64, 0.05, 2) == pytest.approx(1 - q**64 - 64 * 0.05 * q**63, abs=1e-12)
    assert binomial_at_most(64, 0.05, 0) == pytest.approx(q**64, abs=1e-12)
    assert binomial_at_least(3, 0.5, 2) == pytest.approx(0.5, abs=1e-12)  # 3/8 + 1/8
    for count in range(0, 12):
        assert binomial_at_most(10, 0.3, count - 1) + binomial_at_least(10, 0.3, count) == pytest.approx(1, abs=1e-12)
    assert (binomial_at_least(5, 0.2, 0), binomial_at_least(5, 0.2, 6), binomial_at_most(5, 0.2, 5)) == (1, 0, 1)
    # thousands of pairs: no overflow
    assert binomial_at_least(5000, 0.05, 1) == pytest.approx(1 - q**5000, abs=1e-12)


def closed_form_rank(pairs: int, tail: float, confidence: float) -> int | None:
    """The rank by hand, up to 2: P(>= 1) = 1 - q^n, P(>= 2) = 1 - q^n - n p q^(n-1)."""
    q = 1 - tail
    at_least_one, at_least_two = 1 - q**pairs, 1 - q**pairs - pairs * tail * q ** (pairs - 1)
    if at_least_one < confidence:
        return None
    return 1 if at_least_two < confidence else 2


def test_the_order_statistic_rank_is_the_largest_with_the_confidence_asked():
    for pairs in range(1, 120):
        rank = order_statistic_rank(pairs, 0.05, 0.95)
        assert min(rank or 0, 2) == (closed_form_rank(pairs, 0.05, 0.95) or 0), pairs
    # what docs/cache-reuse.md states: 59 pairs the fewest for the minimum at 95 %, 64 give it at 96.2 %
    assert (order_statistic_rank(58, 0.05, 0.95), order_statistic_rank(59, 0.05, 0.95)) == (None, 1)
    assert order_statistic_rank(64, 0.05, 0.95) == 1 and order_statistic_rank(93, 0.05, 0.95) == 2
    assert order_statistic_rank(200, 0.05, 0.95) >= 5
    # the rank chosen holds the confidence, the next does not
    for pairs in (100, 300, 1000):
        rank = order_statistic_rank(pairs, 0.05, 0.95)
        assert binomial_at_least(pairs, 0.05, rank) >= 0.95 > binomial_at_least(pairs, 0.05, rank + 1)


def test_the_tolerance_factor_is_the_noncentral_t_approximation():
    # by hand, n = 10: z = 1.6449 both; a = 1 - 2.7055 / 18 = 0.84969, b = 2.7055 - 0.27055 = 2.43497,
    # K = (1.6449 + sqrt(2.7055 - 2.06897)) / 0.84969 = 2.8749
    assert tolerance_factor(10, 0.05, 0.95) == pytest.approx(2.8749, abs=2e-4)
    # the exact factors (noncentral t; NIST/SEMATECH e-Handbook 7.2.6.3 tables): the approximation within 1.5 %
    for pairs, exact in ((10, 2.911), (20, 2.396), (30, 2.220), (50, 2.065)):
        assert tolerance_factor(pairs, 0.05, 0.95) == pytest.approx(exact, rel=0.015), pairs
    # no confidence asked: the normal quantile itself
    assert tolerance_factor(5, 0.05, 0.5) == pytest.approx(statistics.NormalDist().inv_cdf(0.95), abs=1e-12)
    # too few pairs for the approximation: n - 1 <= z_g^2 / 2 = 1.35 at 95 %
    assert tolerance_factor(1, 0.05, 0.95) is None and tolerance_factor(2, 0.05, 0.95) is None
    assert tolerance_factor(3, 0.05, 0.95) > tolerance_factor(4, 0.05, 0.95) > tolerance_factor(58, 0.05, 0.95)


def test_each_bound_covers_the_tail_quantile_as_often_as_it_says():
    """Simulated: the bound lies at or under the true 5 % quantile in its stated share of sets."""
    rng = np.random.default_rng(0)
    sets = 20000
    normal = rng.normal(0.0, 1.0, (sets, 20))  # 20 pairs: the normal tolerance bound
    factor = tolerance_factor(20, 0.05, 0.95)
    bounds = normal.mean(axis=1) - factor * normal.std(axis=1, ddof=1)
    assert np.mean(bounds <= statistics.NormalDist().inv_cdf(0.05)) == pytest.approx(0.95, abs=0.01)
    skewed = rng.exponential(1.0, (sets, 64))  # 64 pairs, any distribution: the minimum
    covered = np.mean(skewed.min(axis=1) <= -math.log(0.95))
    assert covered == pytest.approx(binomial_at_least(64, 0.05, 1), abs=0.006)


def test_a_tail_bound_says_which_method_gave_it():
    rng = np.random.default_rng(1)
    scores = list(rng.normal(33, 3, 64))
    bound = tail_bound(scores, 0.05, 0.95)
    assert (bound.psnr, bound.method, bound.rank, bound.pairs) == (min(scores), ORDER_STATISTIC, 1, 64)
    assert bound.confidence == pytest.approx(1 - 0.95**64)
    assert "order statistic 1 of 64, 96.2 % confidence" in bound.describe(0.05)
    many = list(rng.normal(33, 3, 100))
    assert tail_bound(many, 0.05, 0.95).psnr == sorted(many)[order_statistic_rank(100, 0.05, 0.95) - 1]
    few = scores[:20]
    bound = tail_bound(few, 0.05, 0.95)
    assert bound.method == NORMAL_TOLERANCE and bound.confidence == 0.95 and bound.rank is None
    assert bound.psnr == pytest.approx(statistics.fmean(few) - tolerance_factor(20, 0.05, 0.95)
                                       * statistics.stdev(few), abs=1e-9)
    assert bound.psnr < min(few) and "normal tolerance from 20 pairs" in bound.describe(0.05)
    none = tail_bound(scores[:2], 0.05, 0.95)
    assert (none.psnr, none.method, none.value) == (None, NO_BOUND, -math.inf)


def test_the_clopper_pearson_upper_bound_inverts_the_binomial():
    for pairs in (1, 12, 64):
        assert clopper_pearson_upper(0, pairs, 0.95) == pytest.approx(1 - 0.05 ** (1 / pairs), abs=1e-9)
        assert clopper_pearson_upper(pairs - 1, pairs, 0.95) == pytest.approx(0.95 ** (1 / pairs), abs=1e-9)
        assert clopper_pearson_upper(pairs, pairs, 0.95) == 1.0
    # 1 of 10: 0.3942 (by hand: 0.6058^9 * (0.6058 + 10 * 0.3942) = 0.0500)
    assert clopper_pearson_upper(1, 10, 0.95) == pytest.approx(0.3942, abs=1e-4)
    upper = clopper_pearson_upper(3, 64, 0.95)
    assert binomial_at_most(64, upper, 3) == pytest.approx(0.05, abs=1e-9)
    assert clopper_pearson_upper(3, 64, 0.99) > upper > 3 / 64
    with pytest.raises(ValueError, match="count"):
        clopper_pearson_upper(5, 4)


def test_the_share_below_counts_strictly_under_the_target():
    below = share_below([25.0, 26.0, 27.0, 30.0], 26.0, 0.95)
    assert (below.count, below.pairs, below.fraction) == (1, 4, 0.25)
    assert below.upper_bound == clopper_pearson_upper(1, 4, 0.95)
    assert below.describe(26) == \
        f"1 of 4 under 26 dB (25.0 %, at most {100 * below.upper_bound:.1f} % at 95 % confidence)"
    assert below.to_json()["below_worst"] == 1


def test_the_promise_in_words():
    assert tail_promise(0.05, 26, 26.8, 0.9625, 64) == \
        "95 % of requests >= 26 dB (bound 26.8 dB at 96 % confidence from 64 held-out pairs)"
    # a bound under the target: what the pairs support, said as such
    assert tail_promise(0.1, 26, 24.04, 0.95, 20, "fit") == \
        "90 % of requests >= 24.0 dB at 95 % confidence from 20 fit pairs, under the 26 dB targeted"
