"""Episodes of a run to trace (`mappa trace`): load them, pick one, find the coach's blame trail.

For a failed episode the lowest-scored action is the coach's blame trail (method.md section 6); the
command that prints an episode agent by agent lives in `mappa.cli.trace`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mappa.errors import MappaError
from mappa.training.tracking import require_run_dir
from mappa.types import Action, Episode, read_jsonl


def load_episodes(run_dir: str | Path, step: int | None = None) -> list[Episode]:
    """Episodes of a run (training rollouts), optionally of one step only."""
    run_dir = require_run_dir(run_dir)
    path = run_dir / "episodes.jsonl"
    if not path.is_file():
        raise MappaError(f"{run_dir}: no episodes.jsonl yet (has the run finished a step?)")
    episodes = read_jsonl(path, Episode)
    if step is not None:
        episodes = [e for e in episodes if e.meta.get("step") == step]
        if not episodes:
            raise MappaError(f"{path}: no episodes of step {step}")
    return episodes


def pick_episode(episodes: Sequence[Episode], episode_id: str | None) -> Episode:
    """The episode with `episode_id`, else the latest failed one, else the latest."""
    if not episodes:
        raise MappaError("no episodes to trace")
    if episode_id is not None:
        for e in reversed(episodes):
            if e.id == episode_id:
                return e
        raise MappaError(f"episode {episode_id!r} not found among {len(episodes)} episodes")
    failed = [e for e in episodes if e.correct is False]
    return (failed or list(episodes))[-1]


def lowest_scored(episode: Episode) -> Action | None:
    scored = [a for a in episode.actions if a.coach is not None and a.coach.score is not None]
    return min(scored, key=lambda a: a.coach.score) if scored else None  # type: ignore[union-attr]
