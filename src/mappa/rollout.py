"""Rollouts: play episodes of a workflow (`run_episodes`) and the `mappa rollout` command.

    mappa rollout configs/demo.yaml --episodes 16 --out episodes.jsonl

loads the configured agents, draws `--episodes` training tasks (seeded), plays them in lockstep batches of
`generation.batch_size` with the configured coach scoring every action, appends one JSON line per episode
to the output as each batch finishes, and prints a summary table.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mappa.config import Config, GenerationConfig
from mappa.errors import MappaError
from mappa.types import Episode, Task, write_jsonl
from mappa.workflows import Scorer, Workflow, build_workflow


def run_episodes(
    workflow: Workflow,
    policy: Any,
    tasks: Sequence[Task],
    *,
    sandbox: Any,
    gen: GenerationConfig,
    scorer: Scorer | None = None,
    show_coach_feedback: bool = False,
    progress: bool | Progress = True,
) -> list[Episode]:
    """One episode per task (repeat a task for several samples), all played in lockstep; task order kept.

    `scorer` (e.g. a `CoachRunner`) is called once per stage with the stage's CoachContexts; its scores are
    attached to the Actions. `progress`: True for a bar of its own, or a rich Progress to add a task to.
    """
    if not tasks:
        return []
    return workflow.run(
        policy,
        tasks,
        sandbox=sandbox,
        gen=gen,
        scorer=scorer,
        show_coach_feedback=show_coach_feedback,
        progress=progress,
    )


def pick_tasks(tasks: Sequence[Task], n: int, seed: int) -> list[Task]:
    """`n` tasks drawn without replacement (seeded); when `n` exceeds the pool, whole shuffled passes repeat."""
    rng = random.Random(seed)
    out: list[Task] = []
    while len(out) < n:
        out.extend(rng.sample(list(tasks), min(len(tasks), n - len(out))))
    return out


def summarize(episodes: Sequence[Episode], agents: Sequence[str]) -> dict[str, float]:
    """Rollout metrics, namespaced: success rate, and per agent tokens, truncation, tool use, code errors, score."""
    n = max(len(episodes), 1)
    results = [a.exec_result for e in episodes for a in e.actions if a.exec_result is not None]
    out: dict[str, float] = {
        "rollout/episodes": float(len(episodes)),
        "rollout/success_rate": sum(bool(e.correct) for e in episodes) / n,
        "rollout/answered_rate": sum(e.final_answer is not None for e in episodes) / n,
        "rollout/error_rate": sum("error" in e.meta for e in episodes) / n,
        "sandbox/calls": float(len(results)),
        "sandbox/time_s": sum(r.duration_s for r in results),
        "sandbox/error_rate": sum(not r.ok for r in results) / max(len(results), 1),
        "sandbox/timeout_rate": sum(r.timed_out for r in results) / max(len(results), 1),
    }
    for agent in agents:
        mine = [a for e in episodes for a in e.actions if a.agent == agent]
        k = max(len(mine), 1)
        ran = [a.exec_result for a in mine if a.exec_result is not None]
        scores = [a.coach.score for a in mine if a.coach is not None and a.coach.score is not None]
        out[f"agent/{agent}/actions"] = float(len(mine))
        out[f"agent/{agent}/response_tokens"] = sum(len(a.response_ids) for a in mine) / k
        out[f"agent/{agent}/truncation_rate"] = sum(a.truncated for a in mine) / k
        out[f"agent/{agent}/tool_call_rate"] = len(ran) / k
        out[f"agent/{agent}/code_error_rate"] = sum(not r.ok for r in ran) / max(len(ran), 1)
        out[f"agent/{agent}/scored"] = float(len(scores))
        out[f"agent/{agent}/score_mean"] = sum(scores) / len(scores) if scores else float("nan")
    return out


def summary_table(metrics: dict[str, float], agents: Sequence[str], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("agent", "actions", "mean tokens", "truncated", "tool calls", "code errors", "coach score"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for agent in agents:
        m = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"agent/{agent}/")}
        score = "-" if m["scored"] == 0 else f"{m['score_mean']:.2f}"
        table.add_row(
            agent,
            f"{m['actions']:.0f}",
            f"{m['response_tokens']:.1f}",
            f"{m['truncation_rate']:.0%}",
            f"{m['tool_call_rate']:.0%}",
            f"{m['code_error_rate']:.0%}" if m["tool_call_rate"] > 0 else "-",
            score,
        )
    calls = metrics["sandbox/calls"]
    table.caption = (
        f"success {metrics['rollout/success_rate']:.1%} of {metrics['rollout/episodes']:.0f} episodes "
        f"(answered {metrics['rollout/answered_rate']:.0%}); sandbox {calls:.0f} runs, "
        f"{metrics['sandbox/time_s']:.1f} s total, {metrics['sandbox/time_s'] / max(calls, 1):.2f} s per run, "
        f"{metrics['sandbox/error_rate']:.0%} errors"
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
    workflow = build_workflow(cfg.workflow)  # before loading anything: a bad name fails fast
    pool = load_tasks_or_fail(cfg)
    tasks = pick_tasks(pool, episodes, cfg.seed)

    import torch

    from mappa.coach import build_coach
    from mappa.policy import Policy
    from mappa.sandbox import Sandbox

    # piped output (CI, logs) gets a table wide enough to read instead of rich's 80-column default
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    torch.manual_seed(cfg.seed)  # sampling draws from the global generator: one seed, one rollout
    with console.status(f"loading {cfg.model.name} for {', '.join(workflow.agents)}"):
        policy = Policy.from_config(cfg.model, workflow.agents, seed=cfg.seed)
    coach = build_coach(cfg.coach, workflow.name, policy)
    sandbox = Sandbox(cfg.sandbox)
    done: list[Episode] = []
    start = time.perf_counter()
    try:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        ) as bar:
            overall = bar.add_task("episodes", total=len(tasks))
            for lo in range(0, len(tasks), cfg.generation.batch_size):
                batch = run_episodes(
                    workflow,
                    policy,
                    tasks[lo : lo + cfg.generation.batch_size],
                    sandbox=sandbox,
                    gen=cfg.generation,
                    scorer=coach,
                    show_coach_feedback=cfg.workflow.show_coach_feedback,
                    progress=bar,
                )
                batch = coach.finish_episodes(batch)  # outcome-only: every action gets the episode's 10/0
                write_jsonl(out, batch, append=lo > 0)  # whole lines per batch: a killed run keeps its batches
                done.extend(batch)
                bar.advance(overall, len(batch))
    finally:
        sandbox.close()
        coach.close()
    elapsed = time.perf_counter() - start
    metrics = summarize(done, workflow.agents)
    console.print(summary_table(metrics, workflow.agents, f"{workflow.name} rollout: {len(done)} episodes -> {out}"))
    coach_stats = coach.stats()
    console.print(
        f"{len(done) / elapsed * 60:.1f} episodes/min ({elapsed:.0f} s); coach {cfg.coach.backend}: "
        + ", ".join(
            f"{k} {v:g}"
            for k, v in coach_stats.items()
            if k in ("judgments", "calls", "cache_hits", "unscored", "failures")
        )
    )
    return 0


def load_tasks_or_fail(cfg: Config) -> list[Task]:
    from mappa.tasks import load_tasks

    tasks = load_tasks(cfg.tasks.train, cfg.tasks, "train", cfg.seed)
    if not tasks:
        raise MappaError(f"tasks.train: no tasks from {cfg.tasks.train}")
    return tasks
