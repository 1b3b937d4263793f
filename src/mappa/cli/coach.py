"""`mappa coach score EPISODES.jsonl --coach ... --out SCORED.jsonl`: score recorded rollouts again, print accounting.

`--coach` is a built-in backend or a plug-in (`rewards.py:score`, a reward function, a coach class, instance or
factory; docs/your-team.md). A terminal shows a transient bar while the coach scores; a log that is not a terminal
gets a few progress lines (`mappa.progress`).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mappa.config import Config
from mappa.errors import MappaError
from mappa.progress import ProgressLines
from mappa.types import Episode, read_jsonl, write_jsonl

__all__ = ["score_command"]


def _table(title: str, scored: list[Episode], stats: dict[str, float]) -> Table:
    actions = [a for ep in scored for a in ep.actions]
    values = [a.coach.score for a in actions if a.coach is not None and a.coach.score is not None]
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("actions", f"{len(actions)}"),
        ("scored", f"{len(values)}"),
        ("mean score", f"{sum(values) / len(values):.2f}" if values else "-"),
        ("unscored", f"{stats['unscored']:g}"),
        ("truncated contexts", f"{stats['truncated_contexts']:g}"),
        ("calls", f"{stats['calls']:g}"),
        ("cache hits", f"{stats['cache_hits']:g}"),
        ("retries", f"{stats['retries']:g}"),
        ("failures", f"{stats['failures']:g}"),
        ("latency p50 / p95 (s)", f"{stats['latency_p50_s']:.2f} / {stats['latency_p95_s']:.2f}"),
        ("tokens (prompt / completion)", f"{stats['prompt_tokens']:g} / {stats['completion_tokens']:g}"),
        ("cost (USD)", f"{stats['cost_usd']:.4f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def score_command(cfg: Config, episodes: str | Path, out: str | Path) -> int:
    """Read EPISODES.jsonl, score every action with the configured coach, write SCORED.jsonl, print accounting."""
    from mappa.coach import build_coach
    from mappa.coach.replay import score_episodes

    out = Path(out)
    if out.is_dir():
        raise MappaError(f"--out {out}: is a directory; give a FILE.jsonl")
    try:  # before any coach call is paid for, not after
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MappaError(f"--out {out}: cannot create its directory ({e.strerror or e})") from None
    recorded = read_jsonl(episodes, Episode)
    if not recorded:
        raise MappaError(f"{episodes}: no episodes")
    console = Console(stderr=True)
    runner = build_coach(cfg.coach, recorded[0].workflow)
    label = f"coach {cfg.coach.backend}"
    try:
        if console.is_terminal:
            columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console, transient=True) as bar:  # the table below keeps the numbers
                task = bar.add_task("score", total=sum(len(ep.actions) for ep in recorded))
                scored = score_episodes(runner, recorded, cfg, lambda done, total: bar.update(task, completed=done))
        else:
            lines = ProgressLines(
                lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True), unit="actions"
            )
            lines.start(f"{label}: scoring")
            scored = score_episodes(runner, recorded, cfg, lines)
    finally:
        runner.close()
    write_jsonl(out, scored)
    model = f" ({runner.coach.model})" if runner.coach.model else ""
    title = f"{label}{model} on {len(scored)} episodes -> {out}"
    console.print(_table(title, scored, runner.stats()))
    return 0
