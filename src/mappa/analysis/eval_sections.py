"""Report sections on evaluation: the learning curves, the one-line headline, and the comparison of runs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from mappa.analysis.compare import (
    ONE_SEED_WARNING,
    Arm,
    ArmGain,
    compare_arms,
    compare_runs,
    over_seeds_text,
    per_seed_accuracy,
    per_task_text,
)
from mappa.analysis.curves import Point, eval_curves, score_curves, train_curve
from mappa.analysis.fragments import esc, figure, fmt, note, table, with_ci
from mappa.analysis.plots import PANEL_LEGEND_MAX, Plots, draw_curves, draw_series, shared_legend
from mappa.analysis.runs import RunData, scored_actions, step_of
from mappa.metrics import Gain, accuracy_gain, answered, wilson_interval


def _no_data(ax: Any, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#888")


# ---------------------------------------------------------------------------------------------------- sections
def learning_curves(run: RunData, plots: Plots) -> str:
    ev, tr, sc = eval_curves(run), train_curve(run.episodes), score_curves(run.episodes)
    if not (ev or tr or sc):
        return note("No evaluation and no finished training step yet.")
    fig, (a1, a2, a3) = plots.figure(3)
    draw_curves(a1, ev, "held-out accuracy (%)", "accuracy %", percent=True) if ev else _no_data(a1)
    draw_curves(a2, {"train": tr}, "train success (%)", "success %", percent=True) if tr else _no_data(a2)
    draw_curves(a3, sc, "mean coach score per agent", "score (0-10)") if sc else _no_data(a3, "no scores")
    out = figure(plots.svg(fig), "learning-curves", "Points with 95% intervals (Wilson for accuracies).")
    rows = []
    for tag, episodes in run.evals.items():
        k, n = sum(bool(e.correct) for e in episodes), len(episodes)
        acc = k / n if n else float("nan")
        rows.append(
            [esc(tag), str(run.eval_steps.get(tag, 0)), str(n), with_ci(acc, wilson_interval(k, n), ".1f", 100)]
        )
    if rows:
        out += table(["evaluation", "step", "episodes", "accuracy % [95% CI]"], rows)
    tags = list(run.evals)
    if len(tags) >= 2:
        g = accuracy_gain(run.evals[tags[0]], run.evals[tags[-1]])
        out += note(
            f"Gain {esc(tags[0])} &rarr; {esc(tags[-1])}: {with_ci(g.gain, g.gain_ci, '+.1f', 100)} pp, {g.method}; "
            + ("beyond noise." if g.significant else "the interval includes 0: not told apart from noise.")
        )
    return out


def headline(run: RunData) -> str | None:
    """What the run shows, in one line: the held-out accuracy before and after, the gain and what it means."""
    tags = list(run.evals)
    if len(tags) < 2:
        return None
    g = accuracy_gain(run.evals[tags[0]], run.evals[tags[-1]])
    how = "paired by task" if g.paired else "unpaired"
    verdict = (
        "beyond noise"
        if g.significant
        else "within noise: the interval includes 0, so this run cannot tell the gain apart from chance"
    )
    a = accuracy_gain(run.evals[tags[0]], run.evals[tags[-1]], answered)
    return (
        f"held-out accuracy {g.before:.1%} ({tags[0]}) -> {g.after:.1%} ({tags[-1]}, {g.n_after} episodes); "
        f"gain {g.gain * 100:+.1f} pp, 95% CI [{g.gain_ci[0] * 100:+.1f}, {g.gain_ci[1] * 100:+.1f}] pp ({how}): "
        f"{verdict}. Episodes ending with a final answer, right or wrong: {a.before:.0%} -> {a.after:.0%} "
        f"({a.gain * 100:+.1f} pp [{a.gain_ci[0] * 100:+.1f}, {a.gain_ci[1] * 100:+.1f}]"
        f"{', beyond noise' if a.significant else ''})"
    )


def _pct(p: Point | None) -> str:
    return with_ci(p[0], p[1], ".1f", 100) if p is not None else "-"


def _gain(g: Gain | None) -> str:
    return with_ci(g.gain, g.gain_ci, "+.1f", 100) + (" (paired)" if g.paired else "") if g is not None else "-"


def comparison_body(runs: Sequence[RunData], plots: Plots) -> str:
    """The comparison of several runs: their curves overlaid, a table of each against the first, and the arms."""
    summaries = compare_runs(runs)
    fig, (a1, a2, a3) = plots.figure(3)
    draw_curves(a1, {r.name: eval_curves(r).get("all", {}) for r in runs}, "held-out accuracy (%)", "%", True)
    draw_curves(a2, {r.name: train_curve(r.episodes) for r in runs}, "train success (%)", "%", True)
    pooled: dict[str, dict[int, float]] = {}
    for r in runs:
        per_step: dict[int, list[float]] = defaultdict(list)
        for e, _, s in scored_actions(r.episodes):
            per_step[step_of(e)].append(s)
        pooled[r.name] = {k: sum(v) / len(v) for k, v in sorted(per_step.items())}
    draw_series(a3, pooled, "mean coach score, all agents")
    if len(runs) > PANEL_LEGEND_MAX:
        shared_legend(fig, a1)
    out = figure(plots.svg(fig), "comparison", "Runs overlaid, with 95% intervals.")
    rows = [
        [esc(s.name), esc(s.coach), str(s.steps), _pct(s.start), _pct(s.final), _gain(s.gain), _pct(s.train),
         fmt(s.score), _gain(s.vs_first), esc(s.differs or "-")]
        for s in summaries
    ]  # fmt: skip
    head = ["run", "coach", "steps", "first eval %", "last eval %", "gain pp", "last train %", "score"]
    out += table([*head, "vs first run pp", "differs"], rows, text=[1, 9]) + note(
        "Intervals are 95% and count tasks, not samples: Wilson for accuracies, paired by task or Newcombe for "
        "differences. "
        "<i>score</i> is the mean per-action score from the run's <i>coach</i>."
    )
    arms = compare_arms(runs)
    if len(arms) >= 2:
        out += _arms_table(arms)
    return out


def _arms_table(arms: Sequence[tuple[Arm, ArmGain | None]]) -> str:
    """Arms (runs that differ only in the seed) against the first: over seeds first, per task second."""
    rows = []
    for i, (arm, gain) in enumerate(arms):
        acc = per_seed_accuracy(arm.finals())
        mean = fmt(100 * sum(acc.values()) / len(acc), ".1f") if acc else "-"
        over, task = ("reference", "reference") if i == 0 else ("-", "-")
        if gain is not None:
            over, task = over_seeds_text(gain), per_task_text(gain)
        seeds = ", ".join(map(str, acc)) or "-"
        rows.append([esc(arm.name), esc(arm.coach), seeds, mean, esc(over), esc(task), esc(arm.differs or "-")])
    head = ["arm", "coach", "seeds", "last eval %, seed mean", "vs first arm, over seeds", "vs first arm, per task"]
    out = "<p>Arms: runs that differ only in the seed.</p>" + table([*head, "differs"], rows, text=[1, 2, 4, 5, 6])
    out += note(
        "Over seeds: one paired gain per seed, then a Student t interval on seeds - 1 degrees of freedom (Welch "
        "when the arms ran different seeds): it holds the variation between training seeds. Per task: every "
        "task x seed episode pooled as if independent, which leaves that variation out."
    )
    if any(g is not None and g.one_seed for _, g in arms):
        out += f'<div class="alarm">{esc(ONE_SEED_WARNING)}</div>'
    return out
