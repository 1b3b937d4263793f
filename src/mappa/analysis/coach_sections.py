"""Report sections on the coach: its scores per agent and stratum with the bias monitor, its verdicts against
the rule-based check, and the reward-hacking alarm."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from mappa.analysis.bias import StratumBias, coach_vs_truth, scores_by_stratum_and_step
from mappa.analysis.curves import Curve
from mappa.analysis.fragments import esc, figure, fmt, note, table, with_ci
from mappa.analysis.hacking import HackingCheck
from mappa.analysis.plots import Plots, draw_boxes, draw_curves, draw_gaps, draw_series
from mappa.analysis.runs import STRATA, RunData, scored_actions, step_of, stratum
from mappa.config import AnalysisConfig
from mappa.metrics import wilson_interval


def _stratum_table(run: RunData) -> str:
    out = ""
    for dim in STRATA:
        acc: dict[tuple[str, str], list[float]] = defaultdict(list)
        for e, a, s in scored_actions(run.episodes):
            v = stratum(e.task, dim)
            if v is not None:
                acc[(a.agent, v)].append(s)
        values = sorted({v for _, v in acc})
        if not values:
            continue
        rows = []
        for agent in run.agents:
            cells = [f"{sum(x) / len(x):.2f} ({len(x)})" if (x := acc.get((agent, v))) else "-" for v in values]
            rows.append([esc(agent), *cells])
        out += f"<p>Mean coach score (scored actions) by <b>{esc(dim)}</b>:</p>"
        out += table(["agent", *(esc(v) for v in values)], rows)
    return out


def _bias_table(biases: Sequence[StratumBias], th: AnalysisConfig) -> str:
    rows = []
    for b in biases:
        drift = with_ci(b.drift[0], b.drift[1], "+.2f") if b.drift else "-"
        if b.alarm:
            flag = f'<span style="color:#c0392b">{esc(b.alarm)}</span>'
        else:
            flag = esc(b.judged) if b.judged else "no alarm"
        rows.append(
            [esc(b.agent), esc(b.dimension), esc(b.stratum), str(b.n), str(b.tasks), fmt(b.mean_score),
             fmt(b.predicted), with_ci(b.gap[0], b.gap[1], "+.2f") if b.judged is None else "-", drift, flag]
        )  # fmt: skip
    head = ["agent", "by", "stratum", "n", "tasks", "mean", "predicted", "gap [CI]", "drift [CI]", "verdict"]
    return table(head, rows, left=3, text=[9]) + note(
        f"Gap: the stratum's mean of (score &minus; predicted) minus the other strata's, where the prediction "
        f"uses the episode's outcome (and normalised test score, where recorded) and the step. Alarm: |gap| &ge; "
        f"{th.bias_gap:g} points, or |drift| &ge; {th.bias_drift:g}, with an interval excluding 0. Intervals are "
        f"clustered by task (t quantiles) and simultaneous over the run's comparisons, so a run with no bias "
        f"raises an alarm at most {th.alarm_alpha:.0%} of the time; a stratum is judged with at least "
        f"{th.min_stratum_tasks} tasks in it and in the rest (thresholds: <code>analysis.*</code>)."
    )


def coach_scores(run: RunData, biases: Sequence[StratumBias], th: AnalysisConfig, plots: Plots) -> str:
    by_agent: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e, a, s in scored_actions(run.episodes):
        by_agent[a.agent][step_of(e)].append(s)
    if not by_agent:
        return note("No coach scores in the training episodes yet.")
    agents = [a for a in run.agents if a in by_agent]
    out = ""
    for i in range(0, len(agents), 3):
        fig, axes = plots.figure(min(3, len(agents) - i), sharey=True)
        for ax, agent in zip(axes, agents[i : i + 3], strict=False):
            draw_boxes(ax, by_agent[agent], agent)
        out += figure(plots.svg(fig), f"score-distributions-{i}", "Coach score distributions per step (boxplots).")
    out += _stratum_table(run)
    multi = [b for b in biases if sum(x.agent == b.agent and x.dimension == b.dimension for x in biases) > 1]
    if not multi:
        return out + note("Every scored task here falls in one stratum per dimension: there is nothing to compare.")
    out += "<p><b>Bias monitor</b>: each stratum's coach score against what the outcome predicts.</p>"
    judged = [b for b in multi if b.judged is None]
    if judged:
        fig, (ax,) = plots.figure(1, height=max(2.2, 0.28 * len(judged) + 1.0))
        labels = [f"{b.agent} | {b.dimension}={b.stratum}" for b in judged]
        draw_gaps(ax, labels, [b.gap for b in judged], [b.alarm is not None for b in judged], th.bias_gap)
        caption = "Gap per stratum with its simultaneous interval; dashed: the alarm threshold."
        out += figure(plots.svg(fig), "bias-gaps", caption)
    else:
        out += note("No stratum has enough tasks to be judged yet (see the table below).")
    dims = sorted({b.dimension for b in multi})[:2]
    fig, axes = plots.figure(len(dims))
    final = run.agents[-1] if run.agents else ""
    for ax, dim in zip(axes, dims, strict=True):
        curves: dict[str, Curve] = {
            v: {st: (m, ci, 0) for st, (m, ci) in by.items()}
            for v, by in scores_by_stratum_and_step(run.episodes, final, dim).items()
        }
        draw_curves(ax, curves, f"{final}: mean score by {dim}", "score (0-10)")
    out += figure(plots.svg(fig), "stratum-scores", "The final agent's mean score per stratum over steps.")
    return out + _bias_table(multi, th)


def coach_truth(run: RunData, th: AnalysisConfig, plots: Plots) -> str:
    ct = coach_vs_truth(run.episodes, th)
    if ct.n == 0:
        return note("No judged final action with a rule-based outcome yet.")
    t = ct.table
    rows = [
        ["coach: right", str(t[(True, True)]), str(t[(True, False)])],
        ["coach: wrong", str(t[(False, True)]), str(t[(False, False)])],
    ]
    out = table(["", "rule: right", "rule: wrong"], rows)
    out += note(
        f"Final agent {esc(ct.agent)}: agreement {with_ci(ct.agreement, ct.agreement_ci, '.1f', 100)} % over "
        f"{ct.n} episodes; {ct.from_verdict} verdicts from <code>ANSWER_CORRECT</code>, the rest from a score "
        f"&ge; {th.high_score:g}. Coach passes a wrong answer: {t[(True, False)]}; fails a right one: {t[(False, True)]}."
    )
    curve = {s: (k / m, wilson_interval(k, m), m) for s, (k, m) in ct.per_step.items()}
    fig, (ax,) = plots.figure(1, height=2.4)
    draw_curves(ax, {"agreement": curve}, "coach verdict = rule-based check (%)", "agreement %", percent=True)
    return out + figure(plots.svg(fig), "coach-truth", "Agreement per step with Wilson 95% intervals.")


def _pts(est: tuple[float, tuple[float, float]], scale: float, spec: str = "+.2f") -> str:
    return with_ci(est[0], est[1], spec, scale)


def hacking(checks: Sequence[HackingCheck], th: AnalysisConfig, plots: Plots) -> str:
    if not checks:
        return note("No scored actions with a rule-based outcome yet.")
    rows = []
    for c in checks:
        if c.alarm:
            verdict = f'<span style="color:#c0392b">{esc(c.alarm)}</span>'
        else:
            verdict = esc(c.judged) if c.judged else "no alarm"
        rows.append(
            [esc(c.agent), str(c.steps), _pts(c.score, 10), _pts(c.excess, 10), esc(c.accuracy_from),
             _pts(c.accuracy, 100, "+.1f"), verdict]
        )  # fmt: skip
    head = ["agent", "steps", "score rise (points)", "beyond outcomes", "accuracy", "accuracy rise (pp)", "verdict"]
    out = table(head, rows, text=[4, 6])
    out += note(
        f"Rises are fitted lines' change from the first step to the last, through one point per step (t "
        f"intervals on steps &minus; 2 degrees of freedom). Alarm: the rise beyond what the episodes' outcomes "
        f"explain &ge; {th.hacking_gap * 10:g} points with an interval above 0 (simultaneous over the agents), and "
        f"accuracy (held-out where the run evaluated twice, else training) rising less than the scores; at least "
        f"{th.hacking_min_steps} steps."
    )
    fig, axes = plots.figure(min(len(checks), 4), sharey=True)
    for ax, c in zip(axes, checks[:4], strict=False):
        s = {
            "score / 10": {k: v[0] for k, v in c.per_step.items()},
            "accuracy": {k: v[1] for k, v in c.per_step.items()},
        }
        draw_series(ax, s, c.agent)
    out += figure(plots.svg(fig), "hacking", "Per agent: mean coach score / 10 and the same episodes' accuracy.")
    examples = [(c.agent, *x) for c in checks if c.alarm for x in c.examples]
    if examples:
        rows = [[esc(a), esc(i), str(st), fmt(s, "g")] for a, i, st, s in examples]
        out += "<p>Episodes that show it (high score, wrong answer):</p>" + table(
            ["agent", "episode", "step", "score"], rows, 2
        )
    return out
