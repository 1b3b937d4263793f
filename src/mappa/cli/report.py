"""`mappa report RUN_DIR [RUN_DIR ...] [--out report.html] [--set analysis.k=v]`: the HTML report.

Reads the run directories' files only (nothing reruns), writes one self-contained page (RUN_DIR/report.html
for one run; report.html beside the runs for several), prints the checks that lack data, the agents that trained
on no action in some step and why, the alarms, what each run shows (its held-out gain) and, last, `report: PATH`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from mappa.analysis.report import build_report, default_out, write_report
from mappa.analysis.runs import load_runs


def report_command(run_dirs: Sequence[str], out: str | None = None, overrides: Sequence[str] = ()) -> int:
    """Build the report; alarms go to stderr, the page's path is the last line on stdout."""
    t0 = time.perf_counter()
    runs = load_runs(run_dirs)
    thresholds = [run.thresholds(overrides) for run in runs]
    report = build_report(runs, thresholds)
    path = Path(out) if out else default_out(run_dirs)
    size = write_report(report, path)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for run in runs:
        for n in run.notes:
            err.print(f"[dim]{escape(run.name)}: {escape(n)}[/]")
    for line in report.unjudged:
        err.print(f"[dim]{escape(line)}[/]")
    for line in report.untrained:
        err.print(f"[bold red]warning[/] {escape(line)}")
    for alarm in report.alarms:
        err.print(f"[bold red]alarm[/] {escape(alarm)}")
    if not report.alarms:
        err.print("no alarm (coach bias, reward hacking)")
    err.print(f"{report.figures} figures, {size / 1024:.0f} KiB, built in {time.perf_counter() - t0:.1f} s")
    for line in report.headlines:  # last: what the run shows
        err.print(f"[bold]{escape(line)}[/]")
    print(f"report: {path}")
    return 0
