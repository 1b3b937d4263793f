"""Rollouts: draw tasks (`pick_tasks`, the one task sampler) and the run behind `mappa rollout` (`rollout`),
which plays them with the configured coach and writes episodes to JSONL as each batch finishes.

Sampling is seeded per call (`workflow.run(..., seed=s)`), never through the process's global RNG, so a
rollout depends on the weights, the tasks and its seed, not on whatever ran before it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mappa.config import Config
from mappa.errors import MappaError
from mappa.protocols import ProgressFn, Runtime, Workflow
from mappa.types import Episode, Task, write_jsonl


def pick_tasks(tasks: Sequence[Task], n: int, seed: int, start: int = 0, stratify_by: str = "") -> list[Task]:
    """Tasks `start .. start+n` of an endless stream of seeded permutations of `tasks`, one per pass.

    Every task comes once per pass before any repeats; a training run reads the stream in order with a
    checkpointed cursor (`start`), so a resumed run draws exactly what an uninterrupted one would.
    `stratify_by` (a `Task.meta` key, e.g. "data_type") spreads each stratum evenly over the pass, so any run
    of consecutive draws holds each stratum in proportion, within one task.
    """
    if not tasks:
        raise MappaError("no tasks to draw from")
    out: list[Task] = []
    order: list[int] = []
    current = -1
    for i in range(start, start + n):
        passes, idx = divmod(i, len(tasks))
        if passes != current:
            order = _permutation(tasks, random.Random(seed * 1_000_003 + passes), stratify_by)
            current = passes
        out.append(tasks[order[idx]])
    return out


def _permutation(tasks: Sequence[Task], rng: random.Random, stratify_by: str) -> list[int]:
    order = list(range(len(tasks)))
    rng.shuffle(order)
    if not stratify_by:
        return order
    strata: dict[str, list[int]] = {}
    for i in order:
        if stratify_by not in tasks[i].meta:
            raise MappaError(f"train.stratify_by: task {tasks[i].id!r} has no meta[{stratify_by!r}]")
        strata.setdefault(str(tasks[i].meta[stratify_by]), []).append(i)
    # Systematic interleave: the k-th of a stratum's m tasks sits at (k + 1/2) / m of the pass; ties go to the
    # strata in a seeded order.
    rank = {name: r for r, name in enumerate(rng.sample(sorted(strata), len(strata)))}
    slots = [
        ((k + 0.5) / len(members), rank[name], i) for name, members in strata.items() for k, i in enumerate(members)
    ]
    return [i for _, _, i in sorted(slots)]


def train_tasks(cfg: Config) -> list[Task]:
    """The configured training tasks; none is a one-line MappaError."""
    from mappa.tasks import load_tasks

    tasks = load_tasks(cfg.tasks.train, cfg.tasks, "train", cfg.seed)
    if not tasks:
        raise MappaError(f"tasks.train: no training tasks from {cfg.tasks.train}")
    return tasks


@dataclass
class RolloutResult:
    episodes: list[Episode]
    seconds: float
    coach_stats: dict[str, float]


def rollout(
    cfg: Config,
    workflow: Workflow,
    tasks: Sequence[Task],
    out: Path,
    *,
    progress: ProgressFn | None = None,
    batch_progress: ProgressFn | None = None,
) -> RolloutResult:
    """Play `tasks` in batches of `generation.batch_size` with the configured coach; append each batch to `out`.

    Whole lines per batch: a killed run keeps the batches it finished. `progress(episodes done, total)` after
    each batch, `batch_progress(actions done, total)` within one. Batch k samples from seed `cfg.seed + k`.
    """
    from mappa.coach import build_coach
    from mappa.policy import Policy
    from mappa.sandbox import Sandbox

    policy = Policy.from_config(cfg.model, workflow.agents, seed=cfg.seed)
    coach = build_coach(cfg.coach, workflow.name, policy)
    sandbox = Sandbox(cfg.sandbox)
    done: list[Episode] = []
    size = cfg.generation.batch_size
    start = time.perf_counter()
    try:
        for k, lo in enumerate(range(0, len(tasks), size)):
            rt = Runtime(policy, sandbox, scorer=coach)
            batch = workflow.run(tasks[lo : lo + size], rt, seed=cfg.seed + k, progress=batch_progress)
            write_jsonl(out, batch, append=lo > 0)
            done.extend(batch)
            if progress is not None:
                progress(len(done), len(tasks))
    finally:
        sandbox.close()
        coach.close()
    return RolloutResult(done, time.perf_counter() - start, coach.stats())
