"""`mappa coach score EPISODES.jsonl --coach ... --out SCORED.jsonl`: score recorded rollouts again, print accounting."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mappa.config import Config
from mappa.errors import MappaError
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
    columns = (TextColumn(f"coach ({cfg.coach.backend})"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True) as bar:  # the table below keeps the numbers
            task = bar.add_task("score", total=sum(len(ep.actions) for ep in recorded))
            scored = score_episodes(runner, recorded, cfg, lambda done, total: bar.update(task, completed=done))
    finally:
        runner.close()
    write_jsonl(out, scored)
    title = f"coach {cfg.coach.backend} ({runner.coach.model}) on {len(scored)} episodes -> {out}"
    console.print(_table(title, scored, runner.stats()))
    return 0
