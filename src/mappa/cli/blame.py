"""`mappa blame RUN_DIR [--step N] [--latest N]`: who the coach blames for the failed episodes, and why.

A table of failed training episodes by the agent of the lowest-scored action and the kind of failure, the same
per step, then the latest failed episodes with the coach's evidence (docs/analysis.md).
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mappa.analysis.blame import KINDS, blame, blame_by_step, blame_table
from mappa.analysis.runs import load_run
from mappa.errors import MappaError


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def blame_command(run_dir: str, step: int | None = None, latest: int = 10) -> int:
    run = load_run(run_dir)
    episodes = [e for e in run.episodes if step is None or e.meta.get("step") == step]
    if step is not None and not episodes:
        raise MappaError(f"{run_dir}: no training episodes of step {step} (steps: {run.steps or 'none'})")
    rows = blame(episodes, run.code_agents)
    console = Console(highlight=False, soft_wrap=True)
    for n in run.notes:
        console.print(f"[dim]{escape(n)}[/]")
    failed = f"{len(rows)} of {len(episodes)} training episodes failed"
    console.print(failed + (f" (step {step})" if step is not None else ""))
    if not rows:
        return 0
    tab = blame_table(rows)
    kinds = [k for k in KINDS if any(k in c for c in tab.values())]
    t = Table(title="lowest-scored action's agent x kind of failure", title_justify="left")
    for col in ("agent", *kinds, "total"):
        t.add_column(col, justify="left" if col == "agent" else "right")
    for agent in [a for a in [*run.agents, "unscored"] if a in tab]:
        t.add_row(agent, *(str(tab[agent][k]) for k in kinds), str(sum(tab[agent].values())))
    console.print(t)
    per_step = blame_by_step(rows)
    t = Table(title="blamed per step", title_justify="left")
    names = [a for a in [*run.agents, "unscored"] if a in tab]
    for col in ("step", *names):
        t.add_column(col, justify="right")
    for s, c in per_step.items():
        t.add_row(str(s), *(str(c[a]) for a in names))
    console.print(t)
    for r in rows[-latest:][::-1]:
        who = f"{r.agent} turn {r.turn} ({r.score:g}/10)" if r.agent and r.score is not None else "no scored action"
        console.print(
            f"[bold]step {r.step}[/] {escape(r.episode)} [red]{r.kind}[/]: {escape(who)}; code: {escape(r.tool)}"
        )
        if r.rationale:
            console.print(f"  {escape(_clip(r.rationale, 300))}")
    return 0
