"""The worst-case half of calibration's quality promise, stated on a tail.

A minimum does not bound the next set's minimum: of 64 fit pairs and 12 new
ones (76 exchangeable draws) the smallest lies among the 12 with chance
12/76, so one time in six the next dozen holds a clip worse than any the fit
saw, whatever margin the fit's worst cleared. What a finite set can bound is
a quantile: "at least 1 - tail of requests get worst_psnr dB or better",
held when a lower confidence bound for the tail-quantile of the PSNRs is at
or above worst_psnr.

The bound, from n scores:

- the k-th smallest score (an order statistic) where n allows: it lies
  above the tail-quantile only when fewer than k of the n scores fall below
  that quantile, which happens with chance P(Binomial(n, tail) < k) whatever
  the scores' distribution; k is the largest rank whose confidence
  P(Binomial(n, tail) >= k) is at least the one asked (n = 64, tail 0.05:
  k = 1, the minimum, at 96.2 %; below 59 pairs no rank reaches 95 %);
- else the one-sided normal tolerance bound mean - K s, K from the
  noncentral t in its standard normal approximation, which assumes the
  PSNRs roughly normal.

On a held-out set the promise is checked by the share of its pairs under
worst_psnr, with the one-sided Clopper-Pearson (exact binomial) upper bound
of that share.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from machgen.runtime.cache import WORST_TAIL

ORDER_STATISTIC = "order statistic"
NORMAL_TOLERANCE = "normal tolerance"
NO_BOUND = "none"


def _log_binomial_pmf(pairs: int, probability: float, count: int) -> float:
    # Logarithms: math.comb of a few thousand pairs overflows a float.
    return (math.lgamma(pairs + 1) - math.lgamma(count + 1) - math.lgamma(pairs - count + 1)
            + count * math.log(probability) + (pairs - count) * math.log1p(-probability))


def binomial_at_most(pairs: int, probability: float, count: int) -> float:
    """P(Binomial(pairs, probability) <= count)."""
    if count < 0:
        return 0.0
    if count >= pairs or probability <= 0.0:
        return 1.0
    if probability >= 1.0:
        return 0.0
    return min(1.0, math.fsum(math.exp(_log_binomial_pmf(pairs, probability, i)) for i in range(count + 1)))


def binomial_at_least(pairs: int, probability: float, count: int) -> float:
    """P(Binomial(pairs, probability) >= count)."""
    if count <= 0:
        return 1.0
    if count > pairs or probability <= 0.0:
        return 0.0
    if probability >= 1.0:
        return 1.0
    # Summed from the upper tail, not 1 - P(<= count - 1): a small chance keeps its digits.
    return min(1.0, math.fsum(math.exp(_log_binomial_pmf(pairs, probability, i)) for i in range(count, pairs + 1)))


def order_statistic_rank(pairs: int, tail: float, confidence: float) -> int | None:
    """The largest rank k whose k-th smallest of ``pairs`` scores is a lower
    bound for the ``tail``-quantile at ``confidence`` or more (k with
    P(Binomial(pairs, tail) >= k) >= confidence); None where even the
    smallest score is not (1 - (1 - tail)^pairs < confidence)."""
    rank = None
    for k in range(1, pairs + 1):
        if binomial_at_least(pairs, tail, k) < confidence:
            break
        rank = k
    return rank


def tolerance_factor(pairs: int, tail: float, confidence: float) -> float | None:
    """K of the one-sided normal tolerance bound mean - K s for the
    ``tail``-quantile at ``confidence``: the noncentral-t quantile
    t'(confidence; n - 1, z_p sqrt(n)) / sqrt(n) in its standard normal
    approximation (Natrella 1963; NIST/SEMATECH e-Handbook 7.2.6.3),
    K = (z_p + sqrt(z_p^2 - a b)) / a with a = 1 - z_g^2 / (2 (n - 1)),
    b = z_p^2 - z_g^2 / n, z_p and z_g the normal quantiles of 1 - tail and
    of confidence. None for fewer than 2 pairs, or where a <= 0 (too few
    pairs for the approximation at this confidence: n - 1 <= z_g^2 / 2)."""
    if pairs < 2:
        return None
    normal = statistics.NormalDist()
    z_p, z_g = normal.inv_cdf(1 - tail), normal.inv_cdf(confidence)
    a = 1 - z_g**2 / (2 * (pairs - 1))
    if a <= 0:
        return None
    b = z_p**2 - z_g**2 / pairs
    return (z_p + math.sqrt(max(z_p**2 - a * b, 0.0))) / a


@dataclass(frozen=True)
class TailBound:
    """A lower confidence bound for the ``tail``-quantile of a set's PSNRs."""

    psnr: float | None  # dB; None: too few pairs for any bound
    method: str  # ORDER_STATISTIC, NORMAL_TOLERANCE or NO_BOUND
    confidence: float  # the order statistic's exact binomial confidence, or the one asked
    pairs: int
    rank: int | None = None  # of the order statistic

    @property
    def value(self) -> float:
        """The bound, -inf where there is none (no target holds on it)."""
        return -math.inf if self.psnr is None else self.psnr

    def describe(self, tail: float) -> str:
        """e.g. "5 % tail bound 27.95 dB (order statistic 1 of 64, 96.2 % confidence)"."""
        share = f"{100 * tail:g} % tail bound"
        if self.psnr is None:
            return f"{share}: none from {self.pairs} pairs"
        how = f"order statistic {self.rank} of {self.pairs}" if self.method == ORDER_STATISTIC \
            else f"normal tolerance from {self.pairs} pairs"
        return f"{share} {self.psnr:.2f} dB ({how}, {100 * self.confidence:.1f} % confidence)"


def tail_bound(scores: Sequence[float], tail: float = WORST_TAIL, confidence: float = 0.95) -> TailBound:
    """The lower ``confidence`` bound for the ``tail``-quantile of ``scores``:
    an order statistic where their number allows, else the normal tolerance
    bound (module docstring)."""
    pairs = len(scores)
    rank = order_statistic_rank(pairs, tail, confidence)
    if rank is not None:
        return TailBound(float(sorted(scores)[rank - 1]), ORDER_STATISTIC, binomial_at_least(pairs, tail, rank),
                         pairs, rank)
    factor = tolerance_factor(pairs, tail, confidence)
    if factor is None:
        return TailBound(None, NO_BOUND, confidence, pairs)
    return TailBound(statistics.fmean(scores) - factor * statistics.stdev(scores), NORMAL_TOLERANCE, confidence,
                     pairs)


def clopper_pearson_upper(count: int, pairs: int, confidence: float = 0.95) -> float:
    """The exact one-sided upper ``confidence`` bound for a share seen ``count``
    times in ``pairs``: the p at which P(Binomial(pairs, p) <= count) =
    1 - confidence, found by bisection (that chance falls as p grows)."""
    if not 0 <= count <= pairs or pairs < 1:
        raise ValueError(f"count: {count} of {pairs} pairs is not a count of them")
    if count == pairs:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(100):  # 2^-100: far below a float's resolution of p
        middle = (low + high) / 2
        if binomial_at_most(pairs, middle, count) > 1 - confidence:
            low = middle
        else:
            high = middle
    return high


@dataclass(frozen=True)
class ShareBelow:
    """How many of a set's PSNRs fall under a target, with the share's upper bound."""

    count: int
    pairs: int
    upper_bound: float
    confidence: float

    @property
    def fraction(self) -> float:
        return self.count / self.pairs

    def describe(self, target: float) -> str:
        """e.g. "1 of 64 under 26 dB (1.6 %, at most 7.2 % at 95 % confidence)"."""
        return (f"{self.count} of {self.pairs} under {target:g} dB ({100 * self.fraction:.1f} %, at most "
                f"{100 * self.upper_bound:.1f} % at {100 * self.confidence:g} % confidence)")

    def to_json(self) -> dict:
        return {"below_worst": self.count, "below_fraction": round(self.fraction, 4),
                "below_upper_bound": round(self.upper_bound, 4), "below_confidence": self.confidence}


def share_below(scores: Sequence[float], target: float, confidence: float = 0.95) -> ShareBelow:
    count = sum(1 for score in scores if score < target)
    return ShareBelow(count, len(scores), clopper_pearson_upper(count, len(scores), confidence), confidence)
