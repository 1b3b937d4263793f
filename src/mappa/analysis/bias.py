"""The coach-bias monitor and the coach against the rule-based check.

Bias monitor: a coach that favours one kind of task (the paper's coach scored regression work 0.5-1.8 points
above classification) pushes the agents toward it. For each agent the rule-based outcome predicts a score:
the agent's mean coach score over all episodes with the same outcome (right or wrong). A stratum's *gap* is
its mean of (score - predicted): how much more (or less) the coach gives that stratum than its outcomes
explain. It raises an alarm when the gap is at least `analysis.bias_gap` points with a 95% interval that
excludes 0, or when it moves by `analysis.bias_drift` from the first half of the steps to the second.

Coach vs ground truth: the final agent's verdict (its `ANSWER_CORRECT`, else a score at or above
`analysis.high_score`) against `Episode.correct`, as a confusion table and an agreement rate per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from mappa.analysis.runs import STRATA, final_agent, score_of, scored_actions, step_of, stratum
from mappa.config import AnalysisConfig
from mappa.metrics import difference_interval, mean_interval, wilson_interval
from mappa.types import Episode

Estimate = tuple[float, tuple[float, float]]  # value, 95% interval


@dataclass(frozen=True)
class StratumBias:
    agent: str
    dimension: str  # "source", "data_type", "difficulty"
    stratum: str
    n: int  # scored actions
    mean_score: float
    predicted: float  # mean of the outcome-predicted scores of the same actions
    gap: Estimate  # mean(score - predicted), points on 0-10
    drift: Estimate | None  # gap in the second half of the steps minus the first half
    alarm: str | None  # why it is flagged, else None


def _predictions(rows: list[tuple[str, bool, float]]) -> dict[tuple[str, bool], float]:
    """Mean score per (agent, outcome): what the rule-based outcome alone predicts."""
    acc: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for agent, correct, score in rows:
        acc[(agent, correct)].append(score)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def _alarm(est: StratumBias, th: AnalysisConfig) -> str | None:
    if est.n < th.min_stratum_actions:
        return None
    gap, (lo, hi) = est.gap
    if abs(gap) >= th.bias_gap and (lo > 0 or hi < 0):
        return f"scored {gap:+.2f} points vs its outcomes, 95% CI [{lo:+.2f}, {hi:+.2f}] (threshold {th.bias_gap:g})"
    if est.drift is not None:
        d, (dlo, dhi) = est.drift
        if abs(d) >= th.bias_drift and (dlo > 0 or dhi < 0):
            return f"gap drifted {d:+.2f} points over training, 95% CI [{dlo:+.2f}, {dhi:+.2f}]"
    return None


def _drift(items: list[tuple[int, float]]) -> Estimate | None:
    """Late-half mean residual minus early-half (split at the median step); None without both halves."""
    steps = sorted({s for s, _ in items})
    if len(steps) < 2:
        return None
    cut = steps[(len(steps) - 1) // 2]
    early, late = [r for s, r in items if s <= cut], [r for s, r in items if s > cut]
    if len(early) < 2 or len(late) < 2:
        return None
    return difference_interval(mean_interval(early), mean_interval(late))


def bias_monitor(episodes: Sequence[Episode], th: AnalysisConfig) -> list[StratumBias]:
    """One row per (agent, dimension, stratum) present; only dimensions with two strata or more can be biased."""
    rows = [(e, a, s) for e, a, s in scored_actions(episodes) if e.correct is not None]
    predict = _predictions([(a.agent, bool(e.correct), s) for e, a, s in rows])
    groups: dict[tuple[str, str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for e, a, s in rows:
        for dim in STRATA:
            value = stratum(e.task, dim)
            if value is not None:
                groups[(a.agent, dim, value)].append((step_of(e), s, predict[(a.agent, bool(e.correct))]))
    per_dim: dict[tuple[str, str], int] = defaultdict(int)
    for agent, dim, _ in groups:
        per_dim[(agent, dim)] += 1
    out = []
    for (agent, dim, value), items in sorted(groups.items()):
        resid = [s - p for _, s, p in items]
        est = StratumBias(
            agent=agent, dimension=dim, stratum=value, n=len(items),
            mean_score=sum(s for _, s, _ in items) / len(items), predicted=sum(p for *_, p in items) / len(items),
            gap=mean_interval(resid), drift=_drift([(st, s - p) for st, s, p in items]), alarm=None,
        )  # fmt: skip
        if per_dim[(agent, dim)] >= 2:
            est = dataclasses.replace(est, alarm=_alarm(est, th))
        out.append(est)
    return out


def scores_by_stratum_and_step(episodes: Sequence[Episode], agent: str, dim: str) -> dict[str, dict[int, Estimate]]:
    """stratum -> step -> the agent's mean coach score there with its interval (the bias section's curves)."""
    acc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e, a, s in scored_actions(episodes):
        value = stratum(e.task, dim)
        if a.agent == agent and value is not None:
            acc[value][step_of(e)].append(s)
    return {v: {st: mean_interval(xs) for st, xs in sorted(by.items())} for v, by in sorted(acc.items())}


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
