"""`mappa compare RUN_A RUN_B ... [--json FILE]`: final metrics of several runs with 95% intervals.

Each row: steps, first and last held-out accuracy (Wilson), the run's own gain, the last step's train success
and mean coach score, and the last evaluation minus the first run's (paired by task when both evaluated the
same tasks); `differs` names the settings in which a run departs from the first; `coach` where its per-action
scores came from. When the runs form several arms (runs that differ only in the seed), a second table gives
each arm's last evaluation minus the first arm's over seeds (t interval on per-seed gains, with the number of
seeds) and over tasks x seeds pooled; with one seed per arm it says the interval leaves seed variation out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mappa.analysis.compare import (
    ONE_SEED_WARNING,
    Arm,
    ArmGain,
    RunSummary,
    compare_arms,
    compare_runs,
    over_seeds_text,
    per_seed_accuracy,
    per_task_text,
)
from mappa.analysis.runs import load_runs
from mappa.metrics import Gain


def _pct(p: tuple[float, tuple[float, float], int] | None) -> str:
    return "-" if p is None else f"{p[0]:.1%} [{p[1][0] * 100:.1f}, {p[1][1] * 100:.1f}] ({p[2]})"


def _gain(g: Gain | None) -> str:
    if g is None:
        return "-"
    lo, hi = g.gain_ci
    return f"{g.gain * 100:+.1f} [{lo * 100:+.1f}, {hi * 100:+.1f}]" + (" p" if g.paired else "")


def compare_table(summaries: Sequence[RunSummary]) -> Table:
    t = Table(
        title="runs compared: 95% intervals, (episodes), pp = percentage points, p = paired by task",
        title_justify="left",
    )
    cols = (
        "run",
        "coach",
        "steps",
        "first eval",
        "last eval",
        "gain pp",
        "last train",
        "score",
        "vs first pp",
        "differs",
    )
    for col in cols:
        t.add_column(col, justify="left" if col in ("run", "coach", "differs") else "right")
    for s in summaries:
        score = "-" if s.score is None else f"{s.score:.2f}"
        t.add_row(
            s.name, s.coach, str(s.steps), _pct(s.start), _pct(s.final), _gain(s.gain), _pct(s.train), score,
            _gain(s.vs_first), s.differs or "-",
        )  # fmt: skip
    return t


def _finite(tree: Any) -> Any:
    """NaN (no interval over one seed) as null: strict JSON has no NaN."""
    if isinstance(tree, dict):
        return {k: _finite(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_finite(v) for v in tree]
    return None if isinstance(tree, float) and math.isnan(tree) else tree


def arms_table(arms: Sequence[tuple[Arm, ArmGain | None]]) -> Table:
    t = Table(
        title="arms (runs that differ only in the seed): last evaluation minus the first arm's, 95% intervals",
        title_justify="left",
    )
    cols = ("arm", "coach", "seeds", "last eval, seed mean", "vs first arm, over seeds", "vs first arm, per task")
    for col in (*cols, "differs"):
        t.add_column(col)
    for i, (arm, gain) in enumerate(arms):
        acc = per_seed_accuracy(arm.finals())
        seeds = ", ".join(str(s) for s in acc) or "-"
        mean = f"{sum(acc.values()) / len(acc):.1%}" if acc else "-"
        over, task = ("reference", "reference") if i == 0 else ("-", "-")
        if gain is not None:
            over, task = over_seeds_text(gain), per_task_text(gain)
        t.add_row(arm.name, arm.coach, seeds, mean, over, task, arm.differs or "-")
    return t


def compare_command(run_dirs: Sequence[str], json_out: str | None = None) -> int:
    runs = load_runs(run_dirs)
    summaries = compare_runs(runs)
    arms = compare_arms(runs)
    # piped (a script, a log file): wide enough that the rows do not wrap
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 260)
    console.print(compare_table(summaries))
    if len(arms) >= 2:
        console.print(arms_table(arms))
        if any(g is not None and g.one_seed for _, g in arms):
            console.print(f"WARNING: {ONE_SEED_WARNING}")
    if json_out:
        arm_of = {id(r): (a, g) for a, g in arms for r in a.runs}
        rows = []
        for run, s in zip(runs, summaries, strict=True):
            arm, gain = arm_of[id(run)]
            extra = {"arm": arm.name, "arm_vs_first": _finite(dataclasses.asdict(gain)) if gain else None}
            rows.append({**dataclasses.asdict(s), **extra})
        Path(json_out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        print(f"json: {json_out}")
    return 0
