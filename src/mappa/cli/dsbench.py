"""`mappa dsbench build --out DIR [--seed N] [--only ID ...]` and `mappa dsbench list [--dir DIR]`.

`build` writes the offline mini-DSBench (docs/dsbench.md) with a progress bar, then one table: tasks per split
and data type, and every refused task with its reason. `list` shows the catalogue, or a built benchmark's tasks
with their baseline and reference scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mappa.cli.evaluate import COLUMNS
from mappa.sandbox import describe_confinement


def build_command(out: str, *, seed: int, only: Sequence[str] = ()) -> int:
    """Build the benchmark in `out`; exit 0 when at least one task was built."""
    from mappa.tasks.dsbench.build import build_dsbench

    console = Console(stderr=True)
    console.print(describe_confinement("auto"), highlight=False, soft_wrap=True)
    with Progress(*COLUMNS, console=console, transient=True) as bar:
        job = bar.add_task("writing tasks, then solving them with the reference team", total=None)
        result = build_dsbench(
            Path(out), seed=seed, only=list(only) or None, progress=lambda d, t: bar.update(job, completed=d, total=t)
        )
    table = Table(title=f"mini-DSBench in {result.root}", title_justify="left")
    for col in ("split", "classification", "regression", "total"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for split in ("train", "eval"):
        rows = [r for r in result.tasks if r["split"] == split]
        kinds = [sum(r["data_type"] == k for r in rows) for k in ("classification", "regression")]
        table.add_row(split, *map(str, kinds), str(len(rows)))
    times = sorted(result.sandbox_s[r["id"]] for r in result.tasks)
    median = times[len(times) // 2] if times else 0.0
    table.caption = f"reference team: median {median:.1f} s of sandbox time per task; seed {seed}"
    table.caption_justify = "left"
    Console().print(table)
    for task_id, why in result.refused:
        console.print(f"refused {task_id}: {why}", highlight=False, soft_wrap=True)
    return 0 if result.tasks else 1


def list_command(directory: str | None = None) -> int:
    """Print the catalogue, or with `directory` the built tasks and their scores."""
    console = Console()
    if directory is None:
        from mappa.tasks.dsbench.catalogue import SOURCES, SPECS

        table = Table(title=f"mini-DSBench catalogue: {len(SPECS)} tasks", title_justify="left")
        for col in ("id", "type", "metric", "target", "source", "licence"):
            table.add_column(col)
        for spec in sorted(SPECS, key=lambda s: s.id):
            licence = SOURCES[spec.source].licence
            table.add_row(spec.id, spec.data_type, spec.metric, spec.target, f"{spec.source}:{spec.table}", licence)
        console.print(table)
        return 0
    from mappa.tasks.tabular import load_dsbench

    table = Table(title=f"mini-DSBench tasks in {directory}", title_justify="left")
    for col in ("id", "split", "type", "metric", "baseline", "reference", "train", "test"):
        table.add_column(col, justify="left" if col in ("id", "split", "type", "metric") else "right")
    for split in ("train", "eval"):
        for task in load_dsbench(Path(directory), split):
            m = task.meta
            table.add_row(
                task.id,
                split,
                m["data_type"],
                m["metric"],
                f"{m['baseline_score']:.4g}",
                f"{m['reference_score']:.4g}",
                str(m["n_train"]),
                str(m["n_test"]),
            )
    console.print(table)
    return 0
