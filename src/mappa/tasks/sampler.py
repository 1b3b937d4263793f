"""The one task sampler: an endless, seeded, resumable stream over a task pool (`pick_tasks`), and the configured
training tasks it draws from (`train_tasks`).

Training, `mappa rollout` and the benchmarks all draw here, so a resumed run (its cursor checkpointed) draws
exactly what an uninterrupted one would.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mappa.config import Config
from mappa.errors import MappaError
from mappa.types import Task


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
