"""Learning curves of one run, each point with its 95% interval.

eval accuracy     per held-out evaluation (start, every `eval_every`, final), pooled and per task source,
                  with Wilson intervals from the evaluation's episode file
train success     the rule-based accuracy of each step's training rollouts (Wilson)
agent score       each agent's mean coach score per step (t interval clustered by task: the actions of one
                  episode, and the episodes of one task, are not independent)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from mappa.analysis.runs import RunData, scored_actions, step_of
from mappa.analysis.stats import clustered_mean
from mappa.metrics import wilson_interval
from mappa.types import Episode

Point = tuple[float, tuple[float, float], int]  # value, 95% interval, episodes (or actions)
Curve = dict[int, Point]  # step -> point


def accuracy_point(episodes: Sequence[Episode]) -> Point:
    k, n = sum(bool(e.correct) for e in episodes), len(episodes)
    return (k / n if n else float("nan")), wilson_interval(k, n), n


def eval_curves(run: RunData) -> dict[str, Curve]:
    """ "all" and each task source -> eval step -> accuracy."""
    out: dict[str, Curve] = defaultdict(dict)
    for tag, episodes in run.evals.items():
        step = run.eval_steps.get(tag, 0)
        out["all"][step] = accuracy_point(episodes)
        sources = sorted({e.task.source for e in episodes})
        if len(sources) > 1:
            for source in sources:
                out[source][step] = accuracy_point([e for e in episodes if e.task.source == source])
    return dict(out)


def train_curve(episodes: Sequence[Episode]) -> Curve:
    by_step: dict[int, list[Episode]] = defaultdict(list)
    for e in episodes:
        by_step[step_of(e)].append(e)
    return {s: accuracy_point(eps) for s, eps in sorted(by_step.items())}


def score_curves(episodes: Sequence[Episode]) -> dict[str, Curve]:
    """agent -> step -> mean coach score (0-10)."""
    acc: dict[str, dict[int, list[tuple[float, str]]]] = defaultdict(lambda: defaultdict(list))
    for e, a, s in scored_actions(episodes):
        acc[a.agent][step_of(e)].append((s, e.task.id))
    out = {}
    for agent, by_step in acc.items():
        out[agent] = {}
        for step, xs in sorted(by_step.items()):
            mean, ci = clustered_mean([s for s, _ in xs], [t for _, t in xs])
            out[agent][step] = (mean, ci, len(xs))
    return out


def final_eval(run: RunData) -> tuple[str, list[Episode]] | None:
    """The last evaluation of the run (normally "final"; the latest one of a run that did not finish)."""
    if not run.evals:
        return None
    tag = "final" if "final" in run.evals else max(run.evals, key=lambda t: run.eval_steps.get(t, 0))
    return tag, run.evals[tag]
