"""What a set of episodes did, as namespaced numbers; and how sure a change in accuracy is.

`episode_metrics` is the one summary that training rollouts, `mappa rollout` and evaluation all log, under
their own prefix (`train/`, `rollout/`, `eval/`):

    <prefix>/accuracy, answered_rate, episodes, stopped_rate     all episodes pooled
    <prefix>/<source>/accuracy, <source>/episodes                per task source (e.g. eval/aime2025/accuracy)
    <prefix>/sandbox/runs, time_s, error_rate, timeout_rate       the code tool
    <prefix>/<agent>/actions, actions_per_episode, response_tokens, truncation_rate,
                     tool_use_rate, code_error_rate, scored, score_mean
    <prefix>/tabular/success_rate, valid_rate, gap, reference_fraction, episodes     tabular tasks (ds_pipeline)
    <prefix>/tabular/<data_type>/...  the same, plus <agent>/score_mean, per task type (classification, regression)

On tabular tasks `accuracy` is the success rate: `Episode.correct` is a success, a valid submission strictly
better than every trivial prediction (docs/dsbench.md). The tabular figures read `Episode.meta["submission"]`: the
share of successes (`success_rate`, the same number as the accuracy of these episodes), the share of valid
submissions (`valid_rate`, the paper's "success", which a copy of sample_submission.csv reaches), and DSBench's
relative gap and the share of the reference model's gain reached, both averaged with 0 for a missing or invalid
submission (the fair metric: a failed run counts as no better than a trivial prediction, never left out).
Episodes recorded before the success rule carry no `success`: `success_rate` is left out where any lacks it.

`accuracy_gain` compares two evaluations: Wilson 95% intervals for each accuracy, and for the difference
  - paired, when both evaluations hold the same episodes (same tasks, same sample count): the Agresti-Min
    interval (Wald on the discordant pairs with 0.5 added to each cell, Agresti & Min 2005), which uses that
    most tasks come out the same both times and, unlike Newcombe's paired method, does not shrink to zero
    width when no episode changed;
  - unpaired otherwise: Newcombe's hybrid-score interval (method 10, Newcombe 1998) from the two Wilson
    intervals.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mappa.types import Episode

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def _share(k: float, n: int) -> float:
    return k / n if n else 0.0


def _agent_metrics(episodes: Sequence[Episode], agent: str, prefix: str) -> dict[str, float]:
    mine = [a for e in episodes for a in e.actions if a.agent == agent]
    ran = [a.exec_result for a in mine if a.exec_result is not None]
    scores = [a.coach.score for a in mine if a.coach is not None and a.coach.score is not None]
    k = len(mine)
    return {
        f"{prefix}/{agent}/actions": float(k),
        f"{prefix}/{agent}/actions_per_episode": _share(k, len(episodes)),
        f"{prefix}/{agent}/response_tokens": _share(sum(len(a.response_ids) for a in mine), k),
        f"{prefix}/{agent}/truncation_rate": _share(sum(a.truncated for a in mine), k),
        f"{prefix}/{agent}/tool_use_rate": _share(len(ran), k),
        f"{prefix}/{agent}/code_error_rate": _share(sum(not r.ok for r in ran), len(ran)),
        f"{prefix}/{agent}/scored": float(len(scores)),
        f"{prefix}/{agent}/score_mean": sum(scores) / len(scores) if scores else float("nan"),
    }


def episode_metrics(episodes: Sequence[Episode], agents: Sequence[str], prefix: str = "rollout") -> dict[str, float]:
    """The summary above; rates over an empty set are 0, a mean score without any score is NaN."""
    n = len(episodes)
    runs = [a.exec_result for e in episodes for a in e.actions if a.exec_result is not None]
    out: dict[str, float] = {
        f"{prefix}/accuracy": _share(sum(bool(e.correct) for e in episodes), n),
        f"{prefix}/answered_rate": _share(sum(e.final_answer is not None for e in episodes), n),
        f"{prefix}/episodes": float(n),
        f"{prefix}/stopped_rate": _share(sum("error" in e.meta for e in episodes), n),
        f"{prefix}/sandbox/runs": float(len(runs)),
        f"{prefix}/sandbox/time_s": sum(r.duration_s for r in runs),
        f"{prefix}/sandbox/error_rate": _share(sum(not r.ok for r in runs), len(runs)),
        f"{prefix}/sandbox/timeout_rate": _share(sum(r.timed_out for r in runs), len(runs)),
    }
    for source in sorted({e.task.source for e in episodes}):
        mine = [e for e in episodes if e.task.source == source]
        out[f"{prefix}/{source}/accuracy"] = _share(sum(bool(e.correct) for e in mine), len(mine))
        out[f"{prefix}/{source}/episodes"] = float(len(mine))
    for agent in agents:
        out.update(_agent_metrics(episodes, agent, prefix))
    out.update(_tabular_metrics(episodes, agents, prefix))
    return out


# The paper's data-science figures (`Episode.meta["submission"]["paper"]`): a failed run holds its fallback
# (accuracy 0.5, F1 0, the trivial prediction's RMSE), so nothing is dropped (docs/dsbench.md).
PAPER_FIGURES = ("accuracy", "f1", "rmse_range_pct", "rmse_iqr_pct")


def paper_means(figures: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each paper figure over the episodes that have it; NaN entries (a target without spread) are
    left out of their mean."""
    out = {}
    for key in PAPER_FIGURES:
        values = [float(f[key]) for f in figures if key in f and not math.isnan(float(f[key]))]
        if values:
            out[key] = sum(values) / len(values)
    return out


def _tabular_summary(episodes: Sequence[Episode], head: str) -> dict[str, float]:
    subs = [e.meta["submission"] for e in episodes]
    n = len(subs)

    def fair_mean(key: str) -> float:  # 0 for an invalid submission
        return _share(sum(float(s[key]) if s["valid"] else 0.0 for s in subs), n)

    paper = paper_means([s["paper"] for s in subs if s.get("paper")])
    judged = all("success" in s for s in subs)
    success = {f"{head}/success_rate": _share(sum(bool(s["success"]) for s in subs), n)} if judged else {}
    return {
        **success,
        f"{head}/valid_rate": _share(sum(bool(s["valid"]) for s in subs), n),
        f"{head}/gap": fair_mean("gap"),
        f"{head}/reference_fraction": fair_mean("reference_fraction"),
        f"{head}/episodes": float(n),
        **{f"{head}/paper/{k}": v for k, v in paper.items()},
    }


def _tabular_metrics(episodes: Sequence[Episode], agents: Sequence[str], prefix: str) -> dict[str, float]:
    """Submission figures of the episodes on tabular tasks (those with `meta["submission"]`), pooled and per
    `Task.meta["data_type"]`, with each agent's mean coach score per type (method.md §6: watch the coach's bias)."""
    tabular = [e for e in episodes if "submission" in e.meta]
    if not tabular:
        return {}
    out = _tabular_summary(tabular, f"{prefix}/tabular")
    for data_type in sorted({str(e.task.meta.get("data_type", "unknown")) for e in tabular}):
        mine = [e for e in tabular if str(e.task.meta.get("data_type", "unknown")) == data_type]
        head = f"{prefix}/tabular/{data_type}"
        out.update(_tabular_summary(mine, head))
        for agent in agents:
            scores = [
                a.coach.score for e in mine for a in e.actions
                if a.agent == agent and a.coach is not None and a.coach.score is not None
            ]  # fmt: skip
            out[f"{head}/{agent}/score_mean"] = sum(scores) / len(scores) if scores else float("nan")
    return out


def sources(metrics: dict[str, float], prefix: str) -> list[str]:
    """The task sources an `episode_metrics` dict holds a per-source accuracy for, in order."""
    head = f"{prefix}/"
    return sorted(
        k[len(head) : -len("/accuracy")]
        for k in metrics
        if k.startswith(head) and k.endswith("/accuracy") and k.count("/") == 2
    )


# ---------------------------------------------------------------------------------------------------- intervals
def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n; (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Gain:
    """Accuracy after minus accuracy before, with 95% intervals; `n` episodes in each evaluation."""

    n_before: int
    n_after: int
    before: float
    before_ci: tuple[float, float]
    after: float
    after_ci: tuple[float, float]
    gain: float
    gain_ci: tuple[float, float]
    paired: bool  # the interval pairs episodes by task (Agresti-Min); else unpaired (Newcombe)
    improved: int = 0  # paired only: episodes wrong before and right after
    worsened: int = 0  # paired only: episodes right before and wrong after

    @property
    def significant(self) -> bool:
        """The interval excludes 0: a gain (or loss) the number of held-out episodes can tell from noise."""
        return self.gain_ci[0] > 0 or self.gain_ci[1] < 0


def newcombe_interval(p1: float, ci1: tuple[float, float], p2: float, ci2: tuple[float, float]) -> tuple[float, float]:
    """Newcombe's hybrid-score interval for p1 - p2 of independent samples, from their Wilson intervals."""
    (l1, u1), (l2, u2) = ci1, ci2
    return p1 - p2 - math.hypot(p1 - l1, u2 - p2), p1 - p2 + math.hypot(u1 - p1, p2 - l2)


def agresti_min_interval(improved: int, worsened: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Interval for a paired difference of proportions from its discordant counts (0.5 added to each cell)."""
    m = n + 2
    up, down = (improved + 0.5) / m, (worsened + 0.5) / m
    half = z * math.sqrt(max(0.0, up + down - (up - down) ** 2) / m)
    return max(-1.0, up - down - half), min(1.0, up - down + half)


def correct(episode: Episode) -> bool:
    """The episode's final answer matched the reference."""
    return bool(episode.correct)


def answered(episode: Episode) -> bool:
    """The episode ended with a final answer, right or wrong (the format the final agent is asked for)."""
    return episode.final_answer is not None


def _pairs(
    before: Sequence[Episode], after: Sequence[Episode], hit: Callable[[Episode], bool]
) -> list[tuple[bool, bool]] | None:
    """(before, after) `hit` per episode, matched by task id and sample number; None if they differ."""
    if len(before) != len(after):
        return None

    def keyed(episodes: Sequence[Episode]) -> dict[tuple[str, int], bool]:
        seen: Counter[str] = Counter()
        out = {}
        for e in episodes:
            out[(e.task.id, seen[e.task.id])] = hit(e)
            seen[e.task.id] += 1
        return out

    b, a = keyed(before), keyed(after)
    return [(b[k], a[k]) for k in b] if b.keys() == a.keys() else None


def accuracy_gain(
    before: Sequence[Episode], after: Sequence[Episode], hit: Callable[[Episode], bool] = correct
) -> Gain:
    """The change in accuracy from `before` to `after` (two evaluations), with Wilson and Newcombe (unpaired) or
    Agresti-Min (paired) intervals; `hit` counts another outcome instead (e.g. `answered`)."""
    k1, n1 = sum(hit(e) for e in after), len(after)
    k2, n2 = sum(hit(e) for e in before), len(before)
    p1, p2 = _share(k1, n1), _share(k2, n2)
    ci1, ci2 = wilson_interval(k1, n1), wilson_interval(k2, n2)
    pairs = _pairs(before, after, hit)
    improved = sum(a and not b for b, a in pairs or ())
    worsened = sum(b and not a for b, a in pairs or ())
    if pairs:
        gain_ci = agresti_min_interval(improved, worsened, len(pairs))
    else:
        gain_ci = newcombe_interval(p1, ci1, p2, ci2)
    return Gain(
        n_before=n2,
        n_after=n1,
        before=p2,
        before_ci=ci2,
        after=p1,
        after_ci=ci1,
        gain=p1 - p2,
        gain_ci=gain_ci,
        paired=bool(pairs),
        improved=improved,
        worsened=worsened,
    )


# ---------------------------------------------------------------------------------------------------- means, trends
def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, tuple[float, float]]:
    """The mean of `values` with its normal 95% interval (sample standard deviation); NaNs when too few values."""
    n = len(values)
    if n == 0:
        return float("nan"), (float("nan"), float("nan"))
    mean = sum(values) / n
    if n < 2:
        return mean, (float("nan"), float("nan"))
    half = z * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, (mean - half, mean + half)


def difference_interval(
    a: tuple[float, tuple[float, float]], b: tuple[float, tuple[float, float]]
) -> tuple[float, tuple[float, float]]:
    """b - a of two independent normal estimates `(value, (low, high))`, the half-widths added in quadrature."""
    (va, (la, ha)), (vb, (lb, hb)) = a, b
    half = math.hypot((ha - la) / 2, (hb - lb) / 2)
    return vb - va, (vb - va - half, vb - va + half)


@dataclass(frozen=True)
class Trend:
    """A least-squares line through (x, y): `rise` is the fitted change from the first x to the last."""

    n: int
    slope: float
    rise: float
    rise_ci: tuple[float, float]  # normal 95% interval from the slope's standard error


def linear_trend(xs: Sequence[float], ys: Sequence[float], z: float = Z95) -> Trend:
    """Ordinary least squares of y on x; rise = slope * (max x - min x); NaN interval when x does not vary."""
    n = len(xs)
    nan = float("nan")
    if n < 3 or len(set(xs)) < 2:
        return Trend(n, nan, nan, (nan, nan))
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    se = math.sqrt(resid / (n - 2) / sxx)
    span = max(xs) - min(xs)
    rise = slope * span
    return Trend(n, slope, rise, (rise - z * se * span, rise + z * se * span))
