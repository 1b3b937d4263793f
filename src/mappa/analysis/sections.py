"""The report's sections as HTML fragments: tables, inline SVG figures and the notes that explain them."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from mappa.analysis.behaviour import agent_behaviour, coach_per_step, dropped, metric_series
from mappa.analysis.bias import StratumBias, coach_vs_truth, scores_by_stratum_and_step
from mappa.analysis.blame import KINDS, blame, blame_by_step, blame_table, kinds_by_step
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
from mappa.analysis.curves import Curve, Point, eval_curves, score_curves, train_curve
from mappa.analysis.hacking import HackingCheck
from mappa.analysis.plots import (
    PANEL_LEGEND_MAX,
    Plots,
    draw_boxes,
    draw_curves,
    draw_gaps,
    draw_series,
    draw_stacked,
    shared_legend,
)
from mappa.analysis.runs import STRATA, RunData, scored_actions, step_of, stratum
from mappa.config import AnalysisConfig
from mappa.metrics import Gain, accuracy_gain, wilson_interval

__all__ = ["Plots", "TITLES"]

TITLES = {
    "learning-curves": "Learning curves",
    "coach-scores": "Coach scores per agent and stratum, and the bias monitor",
    "coach-truth": "Coach vs ground truth",
    "hacking": "Reward-hacking alarm",
    "blame": "Blame",
    "behaviour": "Behaviour",
    "specialisation": "Specialisation and forgetting",
    "comparison": "Comparison",
}


# ---------------------------------------------------------------------------------------------------- helpers
def esc(x: object) -> str:
    return html.escape(str(x))


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def with_ci(value: float, ci: tuple[float, float], spec: str = ".2f", scale: float = 1.0) -> str:
    v = fmt(value * scale, spec)
    if not (math.isfinite(ci[0]) and math.isfinite(ci[1])):
        return v
    return f"{v} [{fmt(ci[0] * scale, spec)}, {fmt(ci[1] * scale, spec)}]"


def table(head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, text: Sequence[int] = ()) -> str:
    """Cells are HTML already; the first `left` columns and the `text` columns align left (numbers right)."""
    lefts = {*range(left), *(i % len(head) for i in text)}
    th = "".join(f'<th class="{"l" if i in lefts else ""}">{h}</th>' for i, h in enumerate(head))
    body = "".join(
        "<tr>" + "".join(f'<td class="{"l" if i in lefts else ""}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def figure(svg: str, name: str, caption: str) -> str:
    return (
        f'<figure class="plot" data-plot="{esc(name)}">{svg}<figcaption class="note">{caption}</figcaption></figure>'
    )


def note(text: str) -> str:
    return f'<p class="note">{text}</p>'


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
        how = "paired by task (Agresti-Min)" if g.paired else "unpaired (Newcombe)"
        out += note(
            f"Gain {esc(tags[0])} &rarr; {esc(tags[-1])}: {with_ci(g.gain, g.gain_ci, '+.1f', 100)} pp, {how}; "
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
    return (
        f"held-out accuracy {g.before:.1%} ({tags[0]}) -> {g.after:.1%} ({tags[-1]}, {g.n_after} episodes); "
        f"gain {g.gain * 100:+.1f} pp, 95% CI [{g.gain_ci[0] * 100:+.1f}, {g.gain_ci[1] * 100:+.1f}] pp ({how}): "
        f"{verdict}"
    )


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


def blame_section(run: RunData, plots: Plots, latest: int = 15) -> str:
    rows = blame(run.episodes, run.code_agents)
    if not rows:
        return note("No failed training episode (or no episodes yet).")
    tab = blame_table(rows)
    kinds = [k for k in KINDS if any(k in c for c in tab.values())]
    agents = [a for a in [*run.agents, "unscored"] if a in tab]
    body = [[esc(a), *(str(tab[a][k]) for k in kinds), str(sum(tab[a].values()))] for a in agents]
    out = "<p>Failed episodes by the agent of the lowest-scored action and the kind of failure:</p>"
    out += table(["agent", *kinds, "total"], body)
    fig, (a1, a2) = plots.figure(2)
    draw_stacked(a1, blame_by_step(rows), agents, "failed episodes per step by blamed agent")
    draw_stacked(a2, kinds_by_step(rows), kinds, "failed episodes per step by failure kind")
    out += figure(plots.svg(fig), "blame", "Failed training episodes per step.")
    detail = [
        [str(r.step), esc(r.episode), esc(r.kind), esc(f"{r.agent} turn {r.turn}" if r.agent else "-"),
         fmt(r.score, "g"), esc(r.tool), f'<div class="ev">{esc(r.rationale[:400])}</div>']
        for r in rows[-latest:][::-1]
    ]  # fmt: skip
    out += f"<p>The latest {len(detail)} failed episodes, with the coach's evidence for the lowest score:</p>"
    return out + table(
        ["step", "episode", "kind", "lowest-scored action", "score", "its code", "coach's rationale"],
        detail,
        text=(1, 2, 3, 5, 6),
    )


def behaviour(run: RunData, plots: Plots) -> str:
    if not run.episodes:
        return note("No training episodes yet.")
    ab = agent_behaviour(run.episodes, run.agents)
    out = ""
    panels = (
        ("tool_use_rate", "tool-use rate (%)", True), ("response_tokens", "response tokens (mean)", False),
        ("truncation_rate", "truncated at the token cap (%)", True), ("unscored_rate", "unscored actions (%)", True),
        ("code_error_rate", "code errors (% of runs)", True), ("timeout_rate", "sandbox timeouts (% of runs)", True),
    )  # fmt: skip
    for i in range(0, len(panels), 3):
        fig, axes = plots.figure(3)
        for ax, (key, title, percent) in zip(axes, panels[i : i + 3], strict=True):
            draw_series(ax, {a: ab[a][key] for a in run.agents}, title, percent)
        out += figure(plots.svg(fig), f"behaviour-{i // 3}", "Per agent over training steps.")
    drops = {k: v for k, v in dropped(run.metrics).items() if any(v.values())}
    steps = sorted({s for v in drops.values() for s in v})
    if drops:
        rows = [[esc(k), *(fmt(v.get(s), "g") for s in steps)] for k, v in sorted(drops.items())]
        out += "<p>Actions left out of the update (agent/reason) per step:</p>" + table(["", *map(str, steps)], rows)
    else:
        out += note("No action was left out of an update (or metrics.jsonl holds no training step).")
    coach = coach_per_step(run.metrics)
    times = {k: metric_series(run.metrics, f"time/{k}") for k in ("rollout_s", "update_s")}
    steps = sorted({s for v in [*coach.values(), *times.values()] for s in v})
    if steps:
        rows = [[esc(f"coach {k}"), *(fmt(v.get(s), "g") for s in steps)] for k, v in coach.items()]
        rows += [[esc(f"time {k}"), *(fmt(v.get(s), ".1f") for s in steps)] for k, v in times.items() if v]
        out += "<p>Coach calls, tokens and cost, and time, per step:</p>" + table(["", *map(str, steps)], rows)
    return out


def _probe_curves(rows: Sequence[dict[str, Any]], probe: str) -> dict[str, dict[int, float]]:
    """agent -> step -> value; every agent starts from the base model's value at step 0 (where it started)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r["probe"] == probe:
            out[r["agent"]][int(r["step"])] = float(r["value"])
    base = out.get("base")
    if base:
        for agent, curve in out.items():
            if agent != "base" and 0 not in curve and min(curve) > 0:
                curve[0] = sum(base.values()) / len(base)
    return dict(out)


def _base_line(ax: Any, curves: dict[str, dict[int, float]]) -> None:
    base = curves.pop("base", None)
    if base:
        ax.axhline(sum(base.values()) / len(base), ls="--", color="#555", lw=1, label="base")


def specialisation(run: RunData, plots: Plots) -> str:
    if not run.probes:
        return note(
            f"No probe results in this run (<code>{esc(run.path)}/probe.jsonl</code>). Compute them with "
            f"<code>mappa probe {esc(run.path)}</code>: per checkpoint and agent, the KL from the base model on a "
            "fixed prompt set, the NLL of a fixed general text set and of each role's prompts (and GSM8K accuracy "
            "where the model is strong enough); then rebuild this report."
        )
    probes = [p for p in ("kl_base", "general_nll", "gsm8k_accuracy") if any(r["probe"] == p for r in run.probes)]
    titles = {"kl_base": "KL from the base", "general_nll": "general-text NLL", "gsm8k_accuracy": "GSM8K accuracy"}
    out = ""
    if probes:
        fig, axes = plots.figure(len(probes))
        for ax, p in zip(axes, probes, strict=True):
            curves = _probe_curves(run.probes, p)
            _base_line(ax, curves)
            draw_series(ax, curves, titles[p], percent=p == "gsm8k_accuracy")
            ax.legend(loc="best")
        out += figure(plots.svg(fig), "probes", "Per agent over checkpoints; dashed: the base model.")
    return out + _role_table(run.probes)


def _role_table(rows: Sequence[dict[str, Any]]) -> str:
    roles = [r for r in rows if r["probe"] == "role_nll" and r.get("role")]
    if not roles:
        return ""
    last = (
        max(int(r["step"]) for r in roles if r["agent"] != "base") if any(r["agent"] != "base" for r in roles) else 0
    )
    cells = {
        (r["agent"], r["role"]): float(r["value"]) for r in roles if r["agent"] == "base" or int(r["step"]) == last
    }
    agents = sorted({a for a, _ in cells}, key=lambda a: (a == "base", a))
    names = sorted({ro for _, ro in cells})
    body = []
    for a in agents:
        row = [esc(a)]
        for ro in names:
            v, base = cells.get((a, ro)), cells.get(("base", ro))
            delta = f" ({v - base:+.3f})" if v is not None and base is not None and a != "base" else ""
            text = fmt(v, ".3f") + delta
            row.append(f"<b>{text}</b>" if a == ro else text)
        body.append(row)
    return (
        f"<p>NLL of each role's prompts under each agent's weights at step {last} (in brackets: minus the base; "
        "bold: the agent's own role; lower is better):</p>" + table(["agent \\ role", *map(esc, names)], body)
    )


def _pct(p: Point | None) -> str:
    return with_ci(p[0], p[1], ".1f", 100) if p is not None else "-"


def _gain(g: Gain | None) -> str:
    return with_ci(g.gain, g.gain_ci, "+.1f", 100) + (" (paired)" if g.paired else "") if g is not None else "-"


def comparison(runs: Sequence[RunData], plots: Plots) -> str:
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
        "Intervals are 95%: Wilson for accuracies, Agresti-Min (paired) or Newcombe for differences. "
        "<i>score</i> is the mean per-action score from the run's <i>coach</i>."
    )
    arms = compare_arms(runs)
    if len(arms) >= 2:
        out += _arms_table(arms)
    return f'<section id="comparison" data-section="comparison"><h2>{TITLES["comparison"]}</h2>{out}</section>'


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
