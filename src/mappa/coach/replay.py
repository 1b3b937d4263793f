"""`mappa coach score EPISODES.jsonl --coach ... --out SCORED.jsonl`: score recorded rollouts again.

Replaying lets you compare coaches (backends, models, templates) on identical rollouts at no
generation cost, and re-scoring with the same coach costs zero calls thanks to the cache. The
contexts are rebuilt by the episode's workflow exactly as during the rollout (the role is the
system prompt the agent actually got), so a replay hits the judgments cached while training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mappa.config import Config, GenerationConfig, WorkflowConfig
from mappa.errors import MappaError
from mappa.types import CoachContext, Episode, read_jsonl, write_jsonl


def episode_contexts(
    episode: Episode, workflow: Any, gen: GenerationConfig, *, outcome: bool = False
) -> list[CoachContext]:
    """One CoachContext per action of a recorded episode, as its workflow built them live."""
    specs = {s.name: s for s in workflow.specs}
    out = []
    for action in episode.actions:
        if action.agent not in specs:
            raise MappaError(f"episode {episode.id}: agent {action.agent!r} is not part of workflow {workflow.name!r}")
        ctx = workflow.context(specs[action.agent], episode.task, action, gen)
        if action.messages and action.messages[0].role == "system":
            ctx = ctx.model_copy(update={"role": action.messages[0].content})
        if outcome:
            # Only the outcome baseline reads this; AI coaches never see the episode's result.
            ctx = ctx.model_copy(update={"extra": {**ctx.extra, "episode_correct": episode.correct}})
        out.append(ctx)
    return out


def score_episodes(runner: Any, episodes: Sequence[Episode], workflow_cfg: WorkflowConfig, gen: GenerationConfig,
                   *, progress: bool = True) -> list[Episode]:  # fmt: skip
    """Episodes with every action's `coach` replaced by `runner`'s judgment (one batched, cached pass)."""
    from mappa.workflows import build_workflow

    workflows: dict[str, Any] = {}
    contexts: list[CoachContext] = []
    for ep in episodes:
        if ep.workflow not in workflows:
            workflows[ep.workflow] = build_workflow(workflow_cfg.model_copy(update={"name": ep.workflow}))
        contexts.extend(episode_contexts(ep, workflows[ep.workflow], gen, outcome=runner.coach.name == "outcome"))
    scores = runner.score_many(contexts, progress=progress)
    out, k = [], 0
    for ep in episodes:
        actions = []
        for a in ep.actions:
            actions.append(a.model_copy(update={"coach": scores[k]}))
            k += 1
        out.append(ep.model_copy(update={"actions": tuple(actions)}))
    return out


def score_command(cfg: Config, episodes: str | Path, out: str | Path) -> int:
    """Read EPISODES.jsonl, score every action with the configured coach, write SCORED.jsonl, print accounting."""
    from rich.console import Console
    from rich.table import Table

    from mappa.coach import build_coach

    out = Path(out)
    if out.is_dir():
        raise MappaError(f"--out {out}: is a directory; give a FILE.jsonl")
    recorded = read_jsonl(episodes, Episode)
    console = Console(stderr=True)
    if not recorded:
        raise MappaError(f"{episodes}: no episodes")
    workflow = recorded[0].workflow
    runner = build_coach(cfg.coach, workflow)
    try:
        scored = score_episodes(runner, recorded, cfg.workflow, cfg.generation)
    finally:
        runner.close()
    write_jsonl(out, scored)
    stats = runner.stats()
    actions = [a for ep in scored for a in ep.actions]
    values = [a.coach.score for a in actions if a.coach is not None and a.coach.score is not None]
    table = Table(title=f"coach {cfg.coach.backend} ({runner.coach.model}) on {len(scored)} episodes -> {out}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("actions", f"{len(actions)}"),
        ("scored", f"{len(values)}"),
        ("mean score", f"{sum(values) / len(values):.2f}" if values else "-"),
        ("unscored", f"{stats['unscored']:g}"),
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
    console.print(table)
    return 0
