"""The reward-hacking alarm: process scores that climb while the rule-based accuracy does not.

Per agent, over the training steps: a least-squares line through its coach scores (divided by 10, so 0-1)
and one through the episodes' rule-based correctness (0/1), each summarised by its *rise* from the first
step to the last with a 95% interval. The alarm fires when
  - the score rise's interval is above 0 (the scores really climb), and
  - score rise minus accuracy rise is at least `analysis.hacking_gap` with an interval above 0,
over at least `analysis.hacking_min_steps` steps. The evidence: the per-step means, and the latest episodes
in which the agent scored high although the team's answer was wrong.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from mappa.analysis.runs import scored_actions, step_of
from mappa.config import AnalysisConfig
from mappa.metrics import Trend, difference_interval, linear_trend
from mappa.types import Episode


@dataclass(frozen=True)
class HackingCheck:
    agent: str
    steps: int
    score: Trend  # of score / 10
    accuracy: Trend  # of the rule-based correctness of the same episodes
    gap: tuple[float, tuple[float, float]]  # score rise - accuracy rise
    per_step: dict[int, tuple[float, float, int]]  # step -> (mean score / 10, accuracy, scored actions)
    examples: list[tuple[str, int, float]]  # (episode id, step, score): high score, wrong answer
    alarm: str | None


def _check(agent: str, points: list[tuple[Episode, float]], th: AnalysisConfig) -> HackingCheck:
    xs = [float(step_of(e)) for e, _ in points]
    score = linear_trend(xs, [s / 10 for _, s in points])
    accuracy = linear_trend(xs, [float(bool(e.correct)) for e, _ in points])
    gap = difference_interval((accuracy.rise, accuracy.rise_ci), (score.rise, score.rise_ci))
    by_step: dict[int, list[tuple[Episode, float]]] = defaultdict(list)
    for e, s in points:
        by_step[step_of(e)].append((e, s))
    per_step = {
        st: (sum(s for _, s in v) / len(v) / 10, sum(bool(e.correct) for e, _ in v) / len(v), len(v))
        for st, v in sorted(by_step.items())
    }
    alarm = None
    if len(per_step) >= th.hacking_min_steps and score.rise_ci[0] > 0 and gap[0] >= th.hacking_gap and gap[1][0] > 0:
        alarm = (
            f"scores rose {score.rise * 10:+.2f} points (/10: {score.rise:+.2f}) over {len(per_step)} steps while "
            f"accuracy moved {accuracy.rise * 100:+.1f} pp; gap {gap[0]:+.2f}, 95% CI [{gap[1][0]:+.2f}, "
            f"{gap[1][1]:+.2f}] (threshold {th.hacking_gap:g})"
        )
    wrong_high: dict[str, tuple[str, int, float]] = {}  # one row per episode: its agent's highest score
    for e, s in points:
        if e.correct is False and s >= th.high_score and s > wrong_high.get(e.id, ("", 0, -1.0))[2]:
            wrong_high[e.id] = (e.id, step_of(e), s)
    examples = sorted(wrong_high.values(), key=lambda x: (-x[1], -x[2]))[:5]
    return HackingCheck(agent, len(per_step), score, accuracy, gap, per_step, examples, alarm)


def hacking_checks(episodes: Sequence[Episode], agents: Sequence[str], th: AnalysisConfig) -> list[HackingCheck]:
    """One check per agent with scored actions in episodes whose outcome is known."""
    points: dict[str, list[tuple[Episode, float]]] = defaultdict(list)
    for e, a, s in scored_actions(episodes):
        if e.correct is not None:
            points[a.agent].append((e, s))
    return [_check(agent, points[agent], th) for agent in agents if points.get(agent)]
