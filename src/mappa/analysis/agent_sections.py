"""Report sections on what the agents do: blame for the failures, behaviour over steps, and specialisation
and forgetting from the probes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from mappa.analysis.behaviour import agent_behaviour, coach_per_step, dropped, metric_series
from mappa.analysis.blame import KINDS, blame, blame_by_step, blame_table, kinds_by_step
from mappa.analysis.fragments import esc, figure, fmt, note, table
from mappa.analysis.plots import Plots, draw_series, draw_stacked
from mappa.analysis.runs import RunData


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
