"""Small statistics for comparing methods over a few seeds, in the standard library only (no scipy).

- `t_quantile(q, df)`: Student's t quantile, from the regularized incomplete beta function (numerically).
- `paired_t_interval(diffs)`: mean of paired differences and its t-interval.
- `bootstrap_interval(values)`: a percentile bootstrap interval of the mean.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes' betacf)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The `q` quantile of Student's t with `df` degrees of freedom (q = 0.975, df = 2: 4.303), by bisection on
    `t_cdf` to about 1e-10."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:  # heavy tails at df = 1: widen until the quantile is bracketed
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def paired_t_interval(diffs: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of paired differences (one per seed) and its two-sided t-interval (nan
    bounds with fewer than two differences)."""
    values = [float(d) for d in diffs]
    if not values:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    t = t_quantile(0.5 + confidence / 2.0, len(values) - 1)
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def bootstrap_interval(
    values: Sequence[float],
    statistic: Callable[[Sequence[float]], float] = statistics.fmean,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(statistic, low, high): a percentile bootstrap interval of `statistic` over `values` (nan bounds with
    fewer than two). With a handful of seeds it is too narrow (it cannot see beyond the values drawn): report
    the t-interval then."""
    data = [float(v) for v in values]
    if not data:
        return math.nan, math.nan, math.nan
    point = float(statistic(data))
    if len(data) < 2:
        return point, math.nan, math.nan
    rng = random.Random(seed)
    stats = sorted(float(statistic(rng.choices(data, k=len(data)))) for _ in range(resamples))
    alpha = (1.0 - confidence) / 2.0
    return point, _percentile(stats, alpha), _percentile(stats, 1.0 - alpha)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    position = q * (len(sorted_values) - 1)
    low, high = math.floor(position), math.ceil(position)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def includes_zero(low: float, high: float) -> bool:
    """Whether an interval includes zero (an interval with nan bounds says nothing, so it counts as including)."""
    return math.isnan(low) or math.isnan(high) or low <= 0.0 <= high
