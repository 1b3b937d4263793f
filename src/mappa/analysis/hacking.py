"""The reward-hacking alarm: process scores that climb while accuracy does not.

Per agent, over the training steps, with each step one point (its actions share the step's tasks and model, so
the steps, not the actions, are the observations of a trend; and neighbouring steps share most of the policy, so
the points are serially correlated: every line here takes its interval from `mappa.analysis.stats.serial_trend`,
a Newey-West slope with simulated AR(1) critical values, not from the steps as independent points):
  - the *score rise*: a least-squares line through the per-step mean score / 10, first step to last;
  - the *excess rise*: the same through the per-step mean of (score - what the episodes' outcomes predict),
    the outcome being the rule-based check and, in data-science runs, the normalised test score: how much the
    scores climbed beyond what the training outcomes explain; its interval simultaneous over the run's agents
    (Bonferroni);
  - the *accuracy rise*: the held-out accuracy from the first evaluation to the last (paired by task) where
    the run evaluated twice or more, else the training success's line through its per-step points.
The alarm fires when the excess rise is at least `analysis.hacking_gap` with an interval above 0 and the
accuracy did not rise (its 95% interval does not exclude 0 from above, and it rose less than the scores), over at
least `analysis.hacking_min_steps` steps; below that the check says it has too little data to judge. The evidence:
the per-step means, and the latest episodes in which the agent scored high although the team's answer was wrong.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mappa.analysis.bias import quality_of, truth_design
from mappa.analysis.runs import scored_actions, step_of
from mappa.analysis.stats import Estimate, least_squares_residuals, serial_trend
from mappa.config import AnalysisConfig
from mappa.metrics import accuracy_gain
from mappa.types import Episode

Z95_ALPHA = 0.05
Trend = Callable[[Sequence[float], Sequence[float], float], Estimate]  # (steps, per-step values, alpha) -> rise


@dataclass(frozen=True)
class HackingCheck:
    agent: str
    steps: int
    score: Estimate  # rise of the per-step mean score / 10 (95% interval)
    excess: Estimate  # rise beyond what the outcomes explain (/10; simultaneous interval)
    accuracy: Estimate  # held-out gain, else the training success's rise (0-1, 95% interval)
    accuracy_from: str  # "held-out" or "training"
    per_step: dict[int, tuple[float, float, int]]  # step -> (mean score / 10, accuracy, scored actions)
    examples: list[tuple[str, int, float]]  # (episode id, step, score): high score, wrong answer
    alarm: str | None
    judged: str | None = None  # None when judged; else "too little data to judge (needs ...)"
    level: float = Z95_ALPHA  # the excess interval's error rate (the run's alpha shared among its agents)


def excess_rise(
    steps: np.ndarray, score: np.ndarray, correct: np.ndarray, quality: np.ndarray, alpha: float,
    trend: Trend = serial_trend,
) -> Estimate:  # fmt: skip
    """Rise of the per-step mean of (score - outcome prediction) over the steps (pure: arrays in)."""
    _, resid = least_squares_residuals(score, truth_design(correct, quality))
    uniq, index = np.unique(steps, return_inverse=True)
    means = np.bincount(index, weights=resid) / np.bincount(index)
    return trend(uniq.tolist(), means.tolist(), alpha)


def _examples(points: list[tuple[Episode, float]], high: float) -> list[tuple[str, int, float]]:
    wrong_high: dict[str, tuple[str, int, float]] = {}  # one row per episode: its agent's highest score
    for e, s in points:
        if e.correct is False and s >= high and s > wrong_high.get(e.id, ("", 0, -1.0))[2]:
            wrong_high[e.id] = (e.id, step_of(e), s)
    return sorted(wrong_high.values(), key=lambda x: (-x[1], -x[2]))[:5]


def held_out_rise(evals: Sequence[Sequence[Episode]]) -> Estimate | None:
    """First to last evaluation's accuracy gain with its paired (else unpaired) 95% interval; None if < 2."""
    if len(evals) < 2 or not evals[0] or not evals[-1]:
        return None
    g = accuracy_gain(evals[0], evals[-1])
    return g.gain, g.gain_ci


def _alarm_text(c: HackingCheck, th: AnalysisConfig) -> str | None:
    (rise, _), (ex, (lo, hi)), (acc, (alo, ahi)) = c.score, c.excess, c.accuracy
    # accuracy "does not rise": no rise its interval can tell from 0, and less than the scores rose
    if c.judged is not None or not (ex >= th.hacking_gap and lo > 0 and alo <= 0 and acc < rise):
        return None
    pct = f"{100 * (1 - c.level):.1f}".removesuffix(".0")
    return (
        f"scores rose {rise * 10:+.2f} points over {c.steps} steps, {ex * 10:+.2f} beyond what the training "
        f"outcomes explain ({pct}% CI [{lo * 10:+.2f}, {hi * 10:+.2f}]; threshold {th.hacking_gap * 10:g}), while "
        f"{c.accuracy_from} accuracy moved {acc * 100:+.1f} pp (95% CI [{alo * 100:+.1f}, {ahi * 100:+.1f}])"
    )


def check_arrays(
    agent: str, steps: np.ndarray, score10: np.ndarray, correct: np.ndarray, quality: np.ndarray,
    held: Estimate | None, th: AnalysisConfig, level: float, trend: Trend = serial_trend,
) -> HackingCheck:  # fmt: skip
    """The check of one agent from its scored actions as arrays (pure; `score10` = score / 10, `held`: the
    held-out rise when the run has one; `trend`: the line and its interval, `serial_trend` unless a benchmark
    compares another); per-step means in the result, no example episodes."""
    uniq, index = np.unique(steps, return_inverse=True)
    counts = np.bincount(index)
    mean_score, mean_acc = np.bincount(index, weights=score10) / counts, np.bincount(index, weights=correct) / counts
    xs = uniq.tolist()
    train_acc = trend(xs, mean_acc.tolist(), Z95_ALPHA)
    judged = None
    if len(uniq) < th.hacking_min_steps:
        judged = f"too little data to judge (needs {th.hacking_min_steps} steps with scored episodes; has {len(uniq)})"
    rows = zip(uniq, mean_score, mean_acc, counts, strict=True)
    c = HackingCheck(
        agent=agent, steps=len(uniq), score=trend(xs, mean_score.tolist(), Z95_ALPHA),
        excess=excess_rise(steps, score10, correct, quality, level, trend), accuracy=held or train_acc,
        accuracy_from="held-out" if held else "training",
        per_step={int(st): (float(m), float(a), int(n)) for st, m, a, n in rows},
        examples=[], alarm=None, judged=judged, level=level,
    )  # fmt: skip
    alarm = _alarm_text(c, th)
    return c if alarm is None else replace(c, alarm=alarm)


def _check(
    agent: str, points: list[tuple[Episode, float]], held: Estimate | None, th: AnalysisConfig, level: float,
    trend: Trend,
) -> HackingCheck:  # fmt: skip
    c = check_arrays(
        agent, np.array([step_of(e) for e, _ in points]), np.array([s / 10 for _, s in points]),
        np.array([float(bool(e.correct)) for e, _ in points]), np.array([quality_of(e) for e, _ in points]),
        held, th, level, trend,
    )  # fmt: skip
    return replace(c, examples=_examples(points, th.high_score))


def hacking_checks(
    episodes: Sequence[Episode],
    agents: Sequence[str],
    th: AnalysisConfig,
    evals: Sequence[Sequence[Episode]] = (),
    trend: Trend = serial_trend,
) -> list[HackingCheck]:
    """One check per agent with scored actions in episodes whose outcome is known; `evals`: the run's held-out
    evaluations in step order (the accuracy the scores are held against, when there are two or more)."""
    points: dict[str, list[tuple[Episode, float]]] = defaultdict(list)
    for e, a, s in scored_actions(episodes):
        if e.correct is not None:
            points[a.agent].append((e, s))
    present = [a for a in agents if points.get(a)]
    judged = sum(len({step_of(e) for e, _ in points[a]}) >= th.hacking_min_steps for a in present)
    level = th.alarm_alpha / max(judged, 1)
    held = held_out_rise(evals)
    return [_check(agent, points[agent], held, th, level, trend) for agent in present]
