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

`accuracy_gain` compares two evaluations. The unit of evidence is the task, not the episode: the samples of one
task share its difficulty and, after training, whatever the training did to it, so 4 samples of a task are not 4
tasks. Each task counts once, by its share of right samples, and every interval is computed over tasks:
  - each accuracy: Wilson's interval at the tasks' effective sample count p(1-p) / var, var being the
    task-clustered variance of the mean share (at most the number of episodes; the number of tasks where the
    shares do not vary); with one sample per task it is Wilson's own interval;
  - the gain, paired, when both evaluations hold the same tasks (any number of samples each): from the per-task
    differences in share right, with Agresti-Min's adjustment (half a task that improved, half a task that
    worsened and one that stayed added, Agresti & Min 2005, so that no change at all still leaves a width) and a
    Student t quantile on tasks - 1 degrees of freedom (few tasks are few clusters). With one sample per task it
    is Agresti-Min's interval with t in place of z;
  - the gain, unpaired otherwise: Newcombe's hybrid-score interval (method 10, Newcombe 1998) from the two
    clustered Wilson intervals. Tasks in one evaluation only make the two accuracies over different task sets;
    pairing only the shared tasks would give an interval for a gain other than the one reported, so the
    comparison is then unpaired over all the tasks of each.
"""

from __future__ import annotations

import math
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
def wilson_interval(k: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n; (0, 1) when n is 0. Counts may be effective ones
    (real-valued, `clustered_wilson`)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Gain:
    """Accuracy after minus accuracy before, with 95% intervals over tasks; `n` episodes in each evaluation. An
    accuracy is the mean over tasks of each task's share of right samples: the share of right episodes when every
    task has the same number of samples, as in every evaluation."""

    n_before: int
    n_after: int
    before: float
    before_ci: tuple[float, float]
    after: float
    after_ci: tuple[float, float]
    gain: float
    gain_ci: tuple[float, float]
    paired: bool  # the interval pairs the evaluations task by task; else unpaired (Newcombe)
    improved: int = 0  # paired only: tasks with a higher share right after (episodes, with one sample per task)
    worsened: int = 0  # paired only: tasks with a lower share right after
    tasks: int = 0  # the tasks the gain's interval rests on (paired: in both; unpaired: in either)

    @property
    def significant(self) -> bool:
        """The interval excludes 0: a gain (or loss) the number of held-out tasks can tell from noise."""
        return self.gain_ci[0] > 0 or self.gain_ci[1] < 0

    @property
    def method(self) -> str:
        """How the gain's interval was computed, in words for a report line."""
        if self.paired:
            return f"paired by task, t on {self.tasks} per-task differences"
        return f"unpaired, Newcombe over {self.tasks} tasks"


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


def paired_task_interval(differences: Sequence[float]) -> tuple[float, float]:
    """95% interval for the mean of per-task differences in share right (each in [-1, 1]): Agresti-Min's
    adjustment on the tasks (half a task at +1, half at -1, one at 0 added) with a t quantile on tasks - 1 degrees
    of freedom; (-1, 1) with fewer than two tasks. With one sample per task it is `agresti_min_interval` with t."""
    from scipy.special import stdtrit  # half a second to import: only when a gain is computed

    n = len(differences)
    if n < 2:
        return -1.0, 1.0
    m = n + 2
    centre = sum(differences) / m
    var = max(0.0, (sum(d * d for d in differences) + 1.0) / m - centre**2)
    half = float(stdtrit(n - 1, 0.975)) * math.sqrt(var / m)
    return max(-1.0, centre - half), min(1.0, centre + half)


def clustered_wilson(shares: Sequence[float], episodes: int) -> tuple[float, float]:
    """Wilson interval for the mean of per-task shares (`episodes` samples in all) at the effective sample count
    p(1-p) / var, var the variance of the mean over tasks (at most `episodes`; the number of tasks where the
    shares do not vary, every one 0 or 1 say, and so hold no trace of how alike a task's samples are)."""
    t = len(shares)
    if t == 0:
        return 0.0, 1.0
    p = sum(shares) / t
    var = sum((s - p) ** 2 for s in shares) / (t * t)
    n_eff = float(t) if var <= 0 or p * (1 - p) <= 0 else min(float(episodes), p * (1 - p) / var)
    return wilson_interval(p * n_eff, n_eff)


def correct(episode: Episode) -> bool:
    """The episode's final answer matched the reference."""
    return bool(episode.correct)


def answered(episode: Episode) -> bool:
    """The episode ended with a final answer, right or wrong (the format the final agent is asked for)."""
    return episode.final_answer is not None


def task_shares(episodes: Sequence[Episode], hit: Callable[[Episode], bool] = correct) -> dict[str, float]:
    """Task id -> the share of its episodes that `hit`, tasks in order of first appearance."""
    counts: dict[str, list[int]] = {}
    for e in episodes:
        c = counts.setdefault(e.task.id, [0, 0])
        c[0] += bool(hit(e))
        c[1] += 1
    return {t: k / n for t, (k, n) in counts.items()}


def clustered_accuracy(
    episodes: Sequence[Episode], hit: Callable[[Episode], bool] = correct
) -> tuple[float, tuple[float, float], int]:
    """(mean over tasks of the share that `hit`, its task-clustered Wilson 95% interval, tasks)."""
    shares = list(task_shares(episodes, hit).values())
    return (sum(shares) / len(shares) if shares else 0.0), clustered_wilson(shares, len(episodes)), len(shares)


def accuracy_gain(
    before: Sequence[Episode], after: Sequence[Episode], hit: Callable[[Episode], bool] = correct
) -> Gain:
    """The change in accuracy from `before` to `after` (two evaluations), with intervals over tasks (module
    docstring): paired by task when both hold the same tasks, else unpaired; `hit` counts another outcome
    instead (e.g. `answered`)."""
    sb, sa = task_shares(before, hit), task_shares(after, hit)
    p2, ci2, _ = clustered_accuracy(before, hit)
    p1, ci1, _ = clustered_accuracy(after, hit)
    paired = bool(sb) and sb.keys() == sa.keys()
    diffs = [sa[t] - sb[t] for t in sb] if paired else []
    return Gain(
        n_before=len(before),
        n_after=len(after),
        before=p2,
        before_ci=ci2,
        after=p1,
        after_ci=ci1,
        gain=p1 - p2,
        gain_ci=paired_task_interval(diffs) if paired else newcombe_interval(p1, ci1, p2, ci2),
        paired=paired,
        improved=sum(d > 0 for d in diffs),
        worsened=sum(d < 0 for d in diffs),
        tasks=len(sb) if paired else len(sb.keys() | sa.keys()),
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
