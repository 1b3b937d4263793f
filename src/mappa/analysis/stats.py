"""Small-sample statistics for the report's alarms: pure functions on numpy arrays.

The observations of a run are not independent: the actions of one episode share its task and its outcome, and
one task may be played in several episodes. Every interval here is therefore computed over *clusters* (tasks)
with a t quantile on (clusters - 1) degrees of freedom. A trend over the steps is a line through one point per
step, and neighbouring steps are not independent either (the policy changes a little from one step to the next,
so what the coach makes of it does too): `serial_trend` gives its interval a width that holds when the points
are serially correlated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from scipy.special import stdtrit
from scipy.stats import nct as noncentral_t
from scipy.stats import t as student_t

Estimate = tuple[float, tuple[float, float]]  # value, interval
NAN_ESTIMATE: Estimate = (float("nan"), (float("nan"), float("nan")))


def t_half(se: float, df: int, alpha: float) -> float:
    """Half-width of a two-sided (1 - alpha) interval for an estimate with standard error `se`."""
    if df < 1 or not math.isfinite(se):
        return float("nan")
    return float(stdtrit(df, 1 - alpha / 2)) * se  # Student's t quantile


def least_squares_residuals(y: np.ndarray, design: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fitted, residuals) of y on the design's columns; collinear columns (e.g. an outcome that never varies)
    are handled by the minimum-norm solution, so the fit stays defined."""
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    fitted = design @ coef
    return fitted, y - fitted


def clustered_contrast(
    values: np.ndarray, groups: np.ndarray, coefs: Sequence[float], clusters: np.ndarray, alpha: float
) -> tuple[Estimate, int]:
    """sum_g coefs[g] * mean(values in group g), with a cluster-robust (CR1) interval and a t quantile.

    groups: an integer per value (0..len(coefs)-1; -1 leaves it out); clusters: an integer per value (the
    task). Degrees of freedom: the fewest clusters of any group with a non-zero coefficient, minus 1, so a
    small stratum is judged with its own few tasks however many the rest has. Returns (estimate, df)."""
    keep = groups >= 0
    values, groups, clusters = values[keep], groups[keep], clusters[keep]
    counts = np.bincount(groups, minlength=len(coefs)).astype(float)
    if any(c != 0 and counts[g] == 0 for g, c in enumerate(coefs)):
        return NAN_ESTIMATE, 0
    means = np.bincount(groups, weights=values, minlength=len(coefs)) / np.maximum(counts, 1)
    c = np.asarray(coefs, dtype=float)
    estimate = float(c @ means)
    # each value's share of the estimate's error: its coefficient / its group's size times its deviation
    share = c[groups] / counts[groups] * (values - means[groups])
    _, cluster_index = np.unique(clusters, return_inverse=True)
    per_cluster = np.bincount(cluster_index, weights=share)
    g = len(per_cluster)
    df = min(len(np.unique(clusters[groups == k])) for k in range(len(coefs)) if c[k] != 0) - 1
    if g < 2 or df < 1:
        return (estimate, (float("nan"), float("nan"))), max(df, 0)
    se = math.sqrt(float(per_cluster @ per_cluster) * g / (g - 1))
    half = t_half(se, df, alpha)
    return (estimate, (estimate - half, estimate + half)), df


def clustered_coefficient(
    y: np.ndarray, design: np.ndarray, column: int, clusters: np.ndarray, df: int, alpha: float
) -> Estimate:
    """Coefficient `column` of the least-squares fit of y on all the design's columns together, with a cluster-
    robust (CR1) interval over `clusters` and a t quantile on `df` degrees of freedom.

    Computed as Frisch-Waugh-Lovell has it: the column less what the other columns explain (r), then r.y / r.r,
    each cluster contributing sum(r * residual) to the error. NaN when the other columns explain the column
    (nearly) whole: the data cannot tell its effect from theirs."""
    x = design[:, column]
    _, r = least_squares_residuals(x, np.delete(design, column, axis=1))
    rr = float(r @ r)
    if rr <= 1e-9 * max(float(x @ x), 1.0):
        return NAN_ESTIMATE
    _, resid = least_squares_residuals(y, design)
    coef = float(r @ y) / rr
    per_cluster = np.bincount(np.unique(clusters, return_inverse=True)[1], weights=r * resid)
    g = len(per_cluster)
    if g < 2 or df < 1:
        return coef, (float("nan"), float("nan"))
    half = t_half(math.sqrt(float(per_cluster @ per_cluster) * g / (g - 1)) / rr, df, alpha)
    return coef, (coef - half, coef + half)


def clustered_mean(values: Sequence[float], clusters: Sequence[str], alpha: float = 0.05) -> Estimate:
    """The mean of `values` with a t interval clustered by `clusters` (e.g. the actions of one step, clustered
    by task); NaN interval with fewer than two clusters."""
    if not values:
        return NAN_ESTIMATE
    index = np.unique(np.asarray(clusters), return_inverse=True)[1]
    v = np.asarray(values, dtype=float)
    return clustered_contrast(v, np.zeros(len(v), dtype=int), (1.0,), index, alpha)[0]


def trend_through_points(xs: Sequence[float], ys: Sequence[float], alpha: float) -> Estimate:
    """The rise (fitted change from the first x to the last) of a least-squares line through a few points, with
    a t interval on (points - 2) degrees of freedom: each point is one step's mean, so the steps, not the
    actions inside them, are the independent observations."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    n = len(x)
    if n < 3 or np.ptp(x) == 0:
        return NAN_ESTIMATE
    xc = x - x.mean()
    sxx = float(xc @ xc)
    slope = float(xc @ (y - y.mean())) / sxx
    resid = y - y.mean() - slope * xc
    se = math.sqrt(float(resid @ resid) / (n - 2) / sxx)
    span = float(np.ptp(x))
    half = t_half(se * span, n - 2, alpha)
    return slope * span, (slope * span - half, slope * span + half)


RHO_MAX = 0.9  # the most autocorrelation the null simulation assumes: beyond it no line through a run is a trend
NULL_DRAWS = 20_000  # simulated null series per critical value: ~330 beyond it at the 1.7% of three agents


def _hac_t(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slope, its HAC standard error, residuals) of the least-squares line through each row of y at x.

    Bartlett kernel with bandwidth = the number of points (every lag; Kiefer, Vogelsang & Bunzel 2000), which
    comes to 2/n * sum_t S_t^2 for S_t the partial sums of (x - mean x) * residual: the long-run variance
    without choosing a lag, at the price of a heavier-tailed statistic, whose quantiles `_null_quantile` draws."""
    xc = x - x.mean()
    sxx = float(xc @ xc)
    yc = y - y.mean(axis=-1, keepdims=True)
    slope = yc @ xc / sxx
    resid = yc - slope[..., None] * xc
    partial = np.cumsum(resid * xc, axis=-1)
    se = np.sqrt(2.0 * (partial * partial).sum(axis=-1) / len(x)) / sxx
    return slope, se, resid


@lru_cache(maxsize=512)
def _null_quantile(x: tuple[float, ...], rho: float, alpha: float) -> float:
    """The (1 - alpha) quantile of |slope / HAC se| on trendless Gaussian AR(1) series (coefficient rho) at
    these x, from NULL_DRAWS series of a fixed seed, so one run's report reads the same every time."""
    rng = np.random.default_rng(20260101)
    n = len(x)
    noise = rng.normal(size=(NULL_DRAWS, n))
    series = np.empty_like(noise)
    series[:, 0] = noise[:, 0]
    scale = math.sqrt(1 - rho * rho)
    for k in range(1, n):
        series[:, k] = rho * series[:, k - 1] + scale * noise[:, k]
    slope, se, _ = _hac_t(np.asarray(x), series)
    return float(np.quantile(np.abs(slope / se), 1 - alpha))


def serial_rho(resid: np.ndarray) -> float:
    """How serially correlated a trend's residuals may be: their first-order autocorrelation, bias-corrected, plus
    one standard error (an 84% upper bound), rounded up to 0.05 within [0, RHO_MAX].

    On n residuals of a fitted line the plain estimate falls short by about (2 + 5 rho) / n (-2/n with no
    correlation, -4.7/n at rho 0.5, measured on simulated series), so that is added back. Short series still
    estimate rho loosely, and an underestimate makes the interval too narrow, so the bound errs wide: on simulated
    null runs of 20 steps with strong step shocks (AR 0.7) the alarm fired on 8.5-9% of 200 runs without the
    standard error, on 5.5-6.5% with it (docs/analysis.md, "Error rates")."""
    n, ss = len(resid), float(resid @ resid)
    raw = float(resid[1:] @ resid[:-1]) / ss if ss > 0 else 0.0
    corrected = raw + (2 + 5 * max(raw, 0.0)) / n
    bound = corrected + math.sqrt(max(0.0, 1 - min(corrected, 1.0) ** 2) / n)
    return min(RHO_MAX, max(0.0, math.ceil(round(bound / 0.05, 9)) * 0.05))


def serial_trend(xs: Sequence[float], ys: Sequence[float], alpha: float) -> Estimate:
    """The rise (fitted change from the first x to the last) of a least-squares line through points in order
    of x (one per training step), with a (1 - alpha) interval that holds when neighbouring points are correlated.

    The slope's standard error is Newey-West's with the Bartlett kernel and a bandwidth of all n points (no lag
    to choose: the fixed-b rule b = 1); its critical value is the quantile of the same statistic on simulated
    trendless AR(1) series whose coefficient bounds the residuals' autocorrelation from above (`serial_rho`).
    With no correlation this is exact for Gaussian points; under correlation the simulated quantile grows with
    it. NaN interval with fewer than 3 points; a zero-width one when they lie on a line."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    n = len(x)
    if n < 3 or np.ptp(x) == 0:
        return NAN_ESTIMATE
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    slopes, ses, resids = _hac_t(x, y[None, :])
    slope, se, resid = float(slopes[0]), float(ses[0]), resids[0]
    span = float(np.ptp(x))
    rise = slope * span
    if not se > 0:
        return rise, (rise, rise)
    crit = _null_quantile(tuple(x.tolist()), serial_rho(resid), round(alpha, 12))
    half = crit * se * span
    return rise, (rise - half, rise + half)


def difference(a: Estimate, b: Estimate) -> Estimate:
    """a - b of two independent estimates, their half-widths added in quadrature."""
    (va, (la, ha)), (vb, (lb, hb)) = a, b
    half = math.hypot((ha - la) / 2, (hb - lb) / 2)
    return va - vb, (va - vb - half, va - vb + half)


def excludes_zero(est: Estimate) -> bool:
    lo, hi = est[1]
    return bool(lo > 0 or hi < 0)


def t_interval(values: Sequence[float], alpha: float = 0.05) -> Estimate:
    """The mean of a few independent values (e.g. one paired gain per seed) with a Student t interval on
    (values - 1) degrees of freedom; NaN interval with fewer than two values, since one value has no spread."""
    v = np.asarray(values, dtype=float)
    if len(v) == 0:
        return NAN_ESTIMATE
    mean = float(v.mean())
    if len(v) < 2:
        return mean, (float("nan"), float("nan"))
    half = float(student_t.ppf(1 - alpha / 2, len(v) - 1)) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return mean, (mean - half, mean + half)


def welch_interval(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> Estimate:
    """mean(b) - mean(a) of two independent sets of values (e.g. per-seed accuracies of two arms trained on
    different seeds), with Welch's t interval; NaN interval unless each set has two values."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) == 0 or len(y) == 0:
        return NAN_ESTIMATE
    diff = float(y.mean() - x.mean())
    if len(x) < 2 or len(y) < 2:
        return diff, (float("nan"), float("nan"))
    vx, vy = float(x.var(ddof=1)) / len(x), float(y.var(ddof=1)) / len(y)
    if vx + vy == 0:
        return diff, (diff, diff)
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    half = float(student_t.ppf(1 - alpha / 2, df)) * math.sqrt(vx + vy)
    return diff, (diff - half, diff + half)


def paired_t_power(gap: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Probability that a two-sided paired t test over `n` units (seeds) rejects 'no difference' when the true
    mean difference is `gap` and one unit's difference has standard deviation `sd` (noncentral t)."""
    if n < 2 or sd <= 0:
        return float("nan")
    df = n - 1
    crit = float(student_t.ppf(1 - alpha / 2, df))
    nc = gap / (sd / math.sqrt(n))
    return float(noncentral_t.sf(crit, df, nc) + noncentral_t.cdf(-crit, df, nc))
