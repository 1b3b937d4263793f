"""The coach-bias monitor and the coach against the rule-based check.

Bias monitor: a coach that favours one kind of task (the paper's coach scored regression work 0.5-1.8 points
above classification) pushes the agents toward it. For each agent and stratum, one least-squares model explains
every score by the richest ground truth the run has (the rule-based outcome; in data-science runs also the
submission's normalised test score), the training step (so a change common to every task, the agents improving,
is explained) and whether the action's task is in the stratum. The stratum's *gap* is that last coefficient: how
much more the coach gives it than its outcomes explain, compared with the other strata of the same split. Its
*drift* is the gap in the second half of the steps minus the first half (an interaction with the second half).

Stratum and outcome are fitted together, not the outcome first and the strata compared on what it leaves: where
a stratum's tasks succeed more often (regression more than classification), an outcome fitted alone takes up
part of that stratum's bonus as a reward for being right, and the leftover gap shrinks (a 1-point bias on a
stratum that succeeds 60% of the time against 2% was measured at 0.60 that way, and flagged in 31% of simulated
runs; fitted together, `tests/test_alarms.py`, at its true size).

Intervals are cluster-robust over tasks (the actions of an episode share its task and outcome; a task may be
played in several episodes) with t quantiles, and simultaneous over the run's comparisons (Bonferroni), so
`analysis.alarm_alpha` is the false-alarm rate of a whole run. A stratum without enough tasks is not judged:
its row says what it needs.

Coach vs ground truth: the final agent's verdict (its `ANSWER_CORRECT`, else a score at or above
`analysis.high_score`) against `Episode.correct`, as a confusion table and an agreement rate per step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mappa.analysis.runs import STRATA, final_agent, score_of, scored_actions, step_of, stratum
from mappa.analysis.stats import (
    NAN_ESTIMATE,
    Estimate,
    clustered_coefficient,
    clustered_mean,
    excludes_zero,
    least_squares_residuals,
)
from mappa.config import AnalysisConfig
from mappa.metrics import wilson_interval
from mappa.types import Episode

DRIFT_MIN_STEPS = 4  # two steps per half at least, so each half has a trend-free mean of its own


@dataclass(frozen=True)
class StratumBias:
    agent: str
    dimension: str  # "source", "data_type", "difficulty"
    stratum: str
    n: int  # scored actions
    mean_score: float
    predicted: float  # mean predicted score of the same actions from outcome, test score and step alone
    gap: Estimate  # the stratum's own term in the joint fit (mean score - predicted), points on 0-10
    drift: Estimate | None  # gap in the second half of the steps minus the first half
    alarm: str | None  # why it is flagged, else None
    tasks: int = 0  # distinct tasks (the clusters)
    judged: str | None = None  # None when judged; else what it lacks ("too little data to judge (needs ...)")


@dataclass
class ActionTable:
    """The scored actions of a run as arrays (one entry per action), what the bias statistics read."""

    agent: list[str] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    quality: list[float] = field(default_factory=list)  # normalised test score; NaN when the run has none
    step: list[int] = field(default_factory=list)
    task: list[str] = field(default_factory=list)
    strata: dict[str, list[str | None]] = field(default_factory=lambda: {d: [] for d in STRATA})


def quality_of(episode: Episode) -> float:
    """The richest ground truth beyond right/wrong: a data-science submission's share of the reference model's
    gain over a trivial prediction (clipped to [-1, 1.5] so one broken metric cannot dominate; 0 for a submission
    that is no success, invalid or no better than a trivial prediction); NaN where the workflow records none.
    Episodes recorded before the success rule count every valid submission."""
    sub = episode.meta.get("submission")
    if not isinstance(sub, dict):
        return float("nan")
    frac = sub.get("reference_fraction")
    if not sub.get("success", sub.get("valid")) or not isinstance(frac, int | float) or not math.isfinite(frac):
        return 0.0
    return float(min(1.5, max(-1.0, frac)))


def action_table(episodes: Sequence[Episode]) -> ActionTable:
    t = ActionTable()
    for e, a, s in scored_actions(episodes):
        if e.correct is None:
            continue
        t.agent.append(a.agent)
        t.score.append(s)
        t.correct.append(float(bool(e.correct)))
        t.quality.append(quality_of(e))
        t.step.append(step_of(e))
        t.task.append(e.task.id)
        for dim in STRATA:
            t.strata[dim].append(stratum(e.task, dim))
    return t


def truth_design(correct: np.ndarray, quality: np.ndarray) -> np.ndarray:
    """Columns that predict a score: intercept, outcome and normalised test score (when the run has one)."""
    cols = [np.ones_like(correct), correct]
    if np.isfinite(quality).any():
        cols.append(np.nan_to_num(quality, nan=0.0))
    return np.column_stack(cols)


def within_steps(a: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """`a` (one value or one row of columns per action) less its mean within each training step: what a fit with
    one indicator per step leaves (Frisch-Waugh-Lovell), so a change common to every task is explained, without
    a column per step (a 128-step run would fit 128 columns for every stratum)."""
    index = np.unique(steps, return_inverse=True)[1]
    sums = np.zeros((index.max() + 1, *a.shape[1:]))
    np.add.at(sums, index, a)
    counts = np.bincount(index).reshape(-1, *([1] * (a.ndim - 1)))
    return a - (sums / counts)[index]


def _needs(tasks_in: int, tasks_out: int, actions: int, th: AnalysisConfig) -> str | None:
    if tasks_in >= th.min_stratum_tasks and tasks_out >= th.min_stratum_tasks and actions >= th.min_stratum_actions:
        return None
    return (
        f"too little data to judge (needs {th.min_stratum_tasks} tasks here and in the other strata and "
        f"{th.min_stratum_actions} scored actions; has {tasks_in}, {tasks_out} and {actions})"
    )


def _drift_groups(inside: np.ndarray, steps: np.ndarray, tasks: np.ndarray, th: AnalysisConfig) -> np.ndarray | None:
    """0/1/2/3 = inside-early, inside-late, outside-early, outside-late; None when a cell lacks tasks."""
    uniq = np.unique(steps)
    if len(uniq) < DRIFT_MIN_STEPS:
        return None
    late = steps > uniq[(len(uniq) - 1) // 2]
    groups = np.where(inside, 0, 2) + late.astype(int)
    need = max(2, th.min_stratum_tasks // 2)
    if any(len(np.unique(tasks[groups == g])) < need for g in range(4)):
        return None
    return groups


@dataclass(frozen=True)
class _Candidate:
    agent: str
    dimension: str
    stratum: str
    rows: np.ndarray  # indices into the table of this agent's actions in this split
    inside: np.ndarray  # bool per row: in the stratum
    judged: str | None
    drift_groups: np.ndarray | None


def _candidates(t: ActionTable, arrays: dict[str, np.ndarray], th: AnalysisConfig) -> list[_Candidate]:
    """Every (agent, split, stratum) of a split with two strata or more, with what it can be judged on."""
    out = []
    agents = np.asarray(t.agent, dtype=object)
    for agent in dict.fromkeys(t.agent):
        for dim in STRATA:
            values = np.asarray(t.strata[dim], dtype=object)
            rows = np.flatnonzero((agents == agent) & (values != None))  # noqa: E711 - elementwise
            strata = sorted({str(v) for v in values[rows]})
            if len(strata) < 2:
                continue
            tasks, steps = arrays["task"][rows], arrays["step"][rows]
            for value in strata:
                inside = values[rows] == value
                judged = _needs(len(np.unique(tasks[inside])), len(np.unique(tasks[~inside])), int(inside.sum()), th)
                groups = _drift_groups(inside, steps, tasks, th) if judged is None else None
                out.append(_Candidate(agent, dim, value, rows, inside, judged, groups))
    return out


def _alarm(gap: Estimate, drift: Estimate | None, th: AnalysisConfig, level: float) -> str | None:
    pct = f"{100 * (1 - level):.2f}".rstrip("0").rstrip(".")
    g, (lo, hi) = gap
    if abs(g) >= th.bias_gap and excludes_zero(gap):
        return (
            f"scored {g:+.2f} points vs the other strata beyond what outcomes explain, {pct}% CI [{lo:+.2f}, "
            f"{hi:+.2f}] (threshold {th.bias_gap:g})"
        )
    if drift is not None and abs(drift[0]) >= th.bias_drift and excludes_zero(drift):
        d, (dlo, dhi) = drift
        return f"gap vs the other strata drifted {d:+.2f} points over training, {pct}% CI [{dlo:+.2f}, {dhi:+.2f}]"
    return None


INSEPARABLE = "too little data to judge (the stratum's scores cannot be told apart from its outcomes and steps)"


def _fit(
    score: np.ndarray, base: np.ndarray, c: _Candidate, steps: np.ndarray, tasks: np.ndarray, level: float
) -> tuple[Estimate, Estimate | None]:
    """(gap, drift) of one candidate from the joint fits, all within steps: score on the truth columns plus the
    stratum's indicator (and, for the drift, the indicator in the second half of the steps); df as
    `clustered_contrast` counts them."""
    inside = c.inside.astype(float)
    design = np.column_stack([base, within_steps(inside, steps)])
    df = min(len(np.unique(tasks[c.inside])), len(np.unique(tasks[~c.inside]))) - 1
    gap = clustered_coefficient(score, design, -1, tasks, df, level)
    if c.drift_groups is None:
        return gap, None
    late = within_steps(inside * (c.drift_groups % 2 == 1), steps)
    df = min(len(np.unique(tasks[c.drift_groups == g])) for g in range(4)) - 1
    return gap, clustered_coefficient(score, np.column_stack([design, late]), -1, tasks, df, level)


def bias_rows(t: ActionTable, th: AnalysisConfig) -> list[StratumBias]:
    """The bias monitor on a table of scored actions (pure: arrays in, rows out)."""
    if not t.score:
        return []
    score = np.asarray(t.score, dtype=float)
    correct, quality = np.asarray(t.correct, dtype=float), np.asarray(t.quality, dtype=float)
    arrays = {"step": np.asarray(t.step), "task": np.unique(np.asarray(t.task), return_inverse=True)[1]}
    cands = sorted(_candidates(t, arrays, th), key=lambda c: (c.agent, c.dimension, c.stratum))
    tests = sum((c.judged is None) + (c.drift_groups is not None) for c in cands)
    level = th.alarm_alpha / max(tests, 1)
    out = []
    for c in cands:
        tasks, steps = arrays["task"][c.rows], arrays["step"][c.rows]
        # within steps, the step means take the intercept's place
        y = within_steps(score[c.rows], steps)
        base = within_steps(truth_design(correct[c.rows], quality[c.rows])[:, 1:], steps)
        gap, drift, judged = NAN_ESTIMATE, None, c.judged
        if judged is None:
            gap, drift = _fit(y, base, c, steps, tasks, level)
            judged = INSEPARABLE if math.isnan(gap[0]) else None
        mean = float(score[c.rows][c.inside].mean())
        # what outcome and step alone predict: the joint fit less the stratum's term (its residuals average 0
        # inside), or where there is no such term the fit without it
        alone = float(least_squares_residuals(y, base)[1][c.inside].mean()) if judged is not None else 0.0
        predicted = mean - gap[0] if judged is None else mean - alone
        out.append(
            StratumBias(
                agent=c.agent, dimension=c.dimension, stratum=c.stratum, n=int(c.inside.sum()), mean_score=mean,
                predicted=predicted, gap=gap, drift=drift, tasks=len(np.unique(tasks[c.inside])), judged=judged,
                alarm=_alarm(gap, drift, th, level) if judged is None else None,
            )
        )  # fmt: skip
    return out


def bias_monitor(episodes: Sequence[Episode], th: AnalysisConfig) -> list[StratumBias]:
    """One row per (agent, dimension, stratum) in splits with two strata or more."""
    return bias_rows(action_table(episodes), th)


def scores_by_stratum_and_step(episodes: Sequence[Episode], agent: str, dim: str) -> dict[str, dict[int, Estimate]]:
    """stratum -> step -> the agent's mean coach score there with its interval (the bias section's curves)."""
    acc: dict[str, dict[int, list[tuple[float, str]]]] = defaultdict(lambda: defaultdict(list))
    for e, a, s in scored_actions(episodes):
        value = stratum(e.task, dim)
        if a.agent == agent and value is not None:
            acc[value][step_of(e)].append((s, e.task.id))
    return {
        v: {st: clustered_mean([s for s, _ in xs], [t for _, t in xs]) for st, xs in sorted(by.items())}
        for v, by in sorted(acc.items())
    }


# ---------------------------------------------------------------------------------------------------- vs the rules
@dataclass(frozen=True)
class CoachTruth:
    agent: str | None  # the final agent
    table: dict[tuple[bool, bool], int]  # (coach says right, rule says right) -> episodes
    agreement: float
    agreement_ci: tuple[float, float]
    per_step: dict[int, tuple[int, int]]  # step -> (agreeing, judged)
    from_verdict: int  # judgments read from ANSWER_CORRECT (the rest from the score threshold)

    @property
    def n(self) -> int:
        return sum(self.table.values())


def coach_verdict(episode: Episode, high_score: float) -> tuple[bool, bool] | None:
    """(the coach says the final answer is right, it said so with ANSWER_CORRECT); None: no judgment."""
    if not episode.actions:
        return None
    last = episode.actions[-1]
    if last.coach is not None and last.coach.answer_correct is not None:
        return last.coach.answer_correct, True
    score = score_of(last)
    if score is None or math.isnan(score):
        return None
    return score >= high_score, False


def coach_vs_truth(episodes: Sequence[Episode], th: AnalysisConfig) -> CoachTruth:
    table = {(c, r): 0 for c in (True, False) for r in (True, False)}
    per_step: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    verdicts = 0
    agents = {final_agent(e) for e in episodes if e.actions}
    for e in episodes:
        judged = coach_verdict(e, th.high_score)
        if judged is None or e.correct is None:
            continue
        says, verdict = judged
        table[(says, bool(e.correct))] += 1
        verdicts += verdict
        per_step[step_of(e)][0] += says == bool(e.correct)
        per_step[step_of(e)][1] += 1
    agree, n = table[(True, True)] + table[(False, False)], sum(table.values())
    return CoachTruth(
        agent=next(iter(agents)) if len(agents) == 1 else ("/".join(sorted(a for a in agents if a)) or None),
        table=table,
        agreement=agree / n if n else float("nan"),
        agreement_ci=wilson_interval(agree, n),
        per_step={s: (k, m) for s, (k, m) in sorted(per_step.items())},
        from_verdict=verdicts,
    )
