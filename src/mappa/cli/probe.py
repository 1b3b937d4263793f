"""`mappa probe RUN_DIR [--force] [--prompts N] [--gsm8k N]`: specialisation and forgetting per checkpoint.

Measures the base and every checkpoint of the run not yet in RUN_DIR/probe.jsonl (`mappa.analysis.probe`), with a
progress bar, then prints the newest checkpoint next to the base: each agent's KL from the base on its own role,
its NLL on the general text, on its own role and on the other roles.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mappa.analysis.probe import BASE, ProbeRow, ProbeSummary, probe_run
from mappa.cli.evaluate import action_bar


def _value(rows: list[ProbeRow], agent: str, probe: str, role: str | None) -> float:
    found = [r.value for r in rows if r.agent == agent and r.probe == probe and r.role == role]
    return found[0] if found else float("nan")


def _cell(value: float, base: float | None = None) -> str:
    if not math.isfinite(value):
        return "-"
    if base is None or not math.isfinite(base):
        return f"{value:.3f}"
    return f"{value:.3f} ({value - base:+.3f})"


def probe_table(summary: ProbeSummary) -> Table | None:
    """The newest probed checkpoint: per agent KL from the base and NLLs, each NLL with its change from the base."""
    steps = [r for r in summary.rows if r.checkpoint != BASE]
    if not steps:
        return None
    last = max(r.step for r in steps)
    rows = [r for r in summary.rows if r.step == last and r.checkpoint != BASE]
    base = [r for r in summary.rows if r.checkpoint == BASE]
    roles = sorted({r.role for r in summary.rows if r.probe == "role_nll" and r.role is not None})
    table = Table(
        title=f"probes at step {last} (NLL per token; change from the base in brackets)", title_justify="left"
    )
    for col in ("agent", "KL to base, own role", "general text NLL", "own role NLL", "other roles NLL"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for agent in dict.fromkeys(r.agent for r in rows):
        others = [r for r in roles if r != agent]
        other = [_value(rows, agent, "role_nll", r) - _value(base, BASE, "role_nll", r) for r in others]
        other = [x for x in other if math.isfinite(x)]
        table.add_row(
            agent,
            _cell(_value(rows, agent, "kl_base", agent)),
            _cell(_value(rows, agent, "general_nll", None), _value(base, BASE, "general_nll", None)),
            _cell(_value(rows, agent, "role_nll", agent), _value(base, BASE, "role_nll", agent)),
            f"({sum(other) / len(other):+.3f})" if other else "-",  # the mean change over the other roles
        )
    return table


def probe_command(run_dir: str, *, force: bool, prompts: int, gsm8k: int, gsm8k_tokens: int) -> int:
    """`mappa probe RUN_DIR`: probe the checkpoints not yet measured and print the newest next to the base."""
    console = Console(stderr=True)
    with action_bar(console, "probing checkpoints") as progress:
        summary = probe_run(
            Path(run_dir), force=force, prompts_per_role=prompts, gsm8k=gsm8k, gsm8k_tokens=gsm8k_tokens,
            progress=progress,
        )  # fmt: skip
    if summary.skipped:
        console.print(f"already probed: {', '.join(summary.skipped)} (--force to measure again)", highlight=False)
    table = probe_table(summary)
    if table is not None:
        console.print(table)
    probed = ", ".join(summary.probed) if summary.probed else "nothing new"
    console.print(f"probed {probed}; {len(summary.rows)} rows in {summary.path}", highlight=False, soft_wrap=True)
    return 0
