"""`mappa compare RUN_A RUN_B ... [--json FILE]`: final metrics of several runs with 95% intervals.

Each row: steps, first and last held-out accuracy (Wilson), the run's own gain, the last step's train success
and mean coach score, and the last evaluation minus the first run's (paired by task when both evaluated the
same tasks); `differs` names the settings in which a run departs from the first.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mappa.analysis.compare import RunSummary, compare_runs
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
    for col in ("run", "steps", "first eval", "last eval", "gain pp", "last train", "score", "vs first pp", "differs"):
        t.add_column(col, justify="left" if col in ("run", "differs") else "right")
    for s in summaries:
        score = "-" if s.score is None else f"{s.score:.2f}"
        t.add_row(
            s.name, str(s.steps), _pct(s.start), _pct(s.final), _gain(s.gain), _pct(s.train), score,
            _gain(s.vs_first), s.differs or "-",
        )  # fmt: skip
    return t


def compare_command(run_dirs: Sequence[str], json_out: str | None = None) -> int:
    summaries = compare_runs(load_runs(run_dirs))
    # piped (a script, a log file): wide enough that the rows do not wrap
    Console(highlight=False, width=None if sys.stdout.isatty() else 220).print(compare_table(summaries))
    if json_out:
        rows = [dataclasses.asdict(s) for s in summaries]
        Path(json_out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        print(f"json: {json_out}")
    return 0
