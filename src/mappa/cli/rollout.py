"""`mappa rollout CONFIG --episodes N --out FILE.jsonl`: play episodes with the configured coach.

Loads the configured agents, draws `--episodes` training tasks (seeded), plays them in calls of
`generation.batch_size` episodes (each call's episodes at once) with the coach scoring every action, appends one JSON line per episode to the output
as each batch finishes, and prints a summary table.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mappa.cli.confinement import print_confinement
from mappa.cli.evaluate import COLUMNS
from mappa.config import Config
from mappa.errors import MappaError
from mappa.metrics import episode_metrics
from mappa.rollout import rollout
from mappa.tasks.sampler import pick_tasks, train_tasks
from mappa.workflows import build_workflow

COACH_STATS = ("judgments", "calls", "cache_hits", "unscored", "failures")


def summary_table(metrics: dict[str, float], agents: Sequence[str], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("agent", "actions", "mean tokens", "truncated", "tool calls", "code errors", "coach score"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for agent in agents:
        m = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"rollout/{agent}/")}
        table.add_row(
            agent,
            f"{m['actions']:.0f}",
            f"{m['response_tokens']:.1f}",
            f"{m['truncation_rate']:.0%}",
            f"{m['tool_use_rate']:.0%}",
            f"{m['code_error_rate']:.0%}" if m["tool_use_rate"] > 0 else "-",
            "-" if m["scored"] == 0 else f"{m['score_mean']:.2f}",
        )
    runs, seconds = metrics["rollout/sandbox/runs"], metrics["rollout/sandbox/time_s"]
    table.caption = (
        f"success {metrics['rollout/accuracy']:.1%} of {metrics['rollout/episodes']:.0f} episodes "
        f"(answered {metrics['rollout/answered_rate']:.0%}); sandbox {runs:.0f} runs, {seconds:.1f} s total, "
        f"{seconds / max(runs, 1):.2f} s per run, {metrics['rollout/sandbox/error_rate']:.0%} errors"
    )
    table.caption_justify = "left"
    return table


def rollout_command(cfg: Config, episodes: int, out: str | Path) -> int:
    """`mappa rollout`: play `episodes` episodes of the configured workflow and write them to `out` (JSONL)."""
    if episodes < 1:
        raise MappaError(f"--episodes must be at least 1 (got {episodes})")
    out = Path(out)
    if out.exists() and out.is_dir():
        raise MappaError(f"--out {out}: is a directory; give a FILE.jsonl")
    workflow = build_workflow(cfg)
    tasks = pick_tasks(train_tasks(cfg), episodes, cfg.seed)
    # piped output (CI, logs) gets a table wide enough to read instead of rich's 80-column default
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    print_confinement(console, cfg)
    with Progress(*COLUMNS, console=console) as bar:
        overall = bar.add_task("episodes", total=len(tasks))
        batch = bar.add_task("actions of this batch", total=None)
        result = rollout(
            cfg, workflow, tasks, out,
            progress=lambda done, total: bar.update(overall, completed=done, total=total),
            batch_progress=lambda done, total: bar.update(batch, completed=done, total=total),
        )  # fmt: skip
    metrics = episode_metrics(result.episodes, workflow.agents, "rollout")
    title = f"{workflow.name} rollout: {len(result.episodes)} episodes -> {out}"
    console.print(summary_table(metrics, workflow.agents, title))
    stats = ", ".join(f"{k} {v:g}" for k, v in result.coach_stats.items() if k in COACH_STATS)
    rate = len(result.episodes) / result.seconds * 60
    console.print(f"{rate:.1f} episodes/min ({result.seconds:.0f} s); coach {cfg.coach.backend}: {stats}")
    return 0
