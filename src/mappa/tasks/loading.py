"""Task sets by name: the sources a config names, loaded for one split, the training split without any held-out
problem (`load_tasks`), and where each source keeps its answers (`answer_locations`). Re-exported by `mappa.tasks`."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from mappa.config import TasksConfig
from mappa.errors import MappaError
from mappa.paths import cache_dir, data_dir
from mappa.tasks.arithmetic import arithmetic_tasks
from mappa.tasks.math import HELD_OUT_SOURCES, MATH_SOURCES, near_duplicate, normalise_problem, published_draw
from mappa.tasks.sources import external_locations, is_external, load_external
from mappa.types import Task

SOURCES = ("arithmetic", *MATH_SOURCES, "dsbench")
FORMS = "'jsonl:PATH', 'hf:NAME[:SPLIT]', or a loader 'module:name' / 'file.py:name'"


def answer_locations(cfg: TasksConfig) -> list[Path]:
    """Where the configured sources keep their answers on disk (nothing for generated tasks): what agent
    code must never reach. Paths only; nothing is built or read. A loader's data is not known here: the
    sandbox shows agent code only an allowlist of the host, so it is hidden unless it lies in that allowlist."""
    names = {*cfg.train, *cfg.eval}
    out: list[Path] = [p for name in dict.fromkeys([*cfg.train, *cfg.eval]) for p in external_locations(name)]
    if "dsbench" in names:
        raw = cfg.dsbench_dir or os.environ.get("MAPPA_DSBENCH_DIR")
        out.append(Path(raw).expanduser() if raw else cache_dir() / "dsbench")
    if names & set(MATH_SOURCES):
        raw = cfg.data_dir or os.environ.get("MAPPA_DATA_DIR")
        out.append(Path(raw).expanduser() if raw else Path.cwd().parent / "shared" / "data" / "math")
    return out


def load_source(name: str, cfg: TasksConfig, split: Literal["train", "eval"], seed: int) -> list[Task]:
    """All tasks of one source, in file order (arithmetic: generated for `split`; an external source: its rows
    for `split`)."""
    if is_external(name):
        return load_external(name, split, seed)
    if name == "arithmetic":
        n = cfg.arithmetic_train_size if split == "train" else cfg.arithmetic_eval_size
        return arithmetic_tasks(n, cfg.arithmetic_levels, split, seed, cfg.arithmetic_eval_size)
    if name == "dsbench":  # imported here: the tabular stack (pandas, scikit-learn) only when asked for
        from mappa.tasks.tabular import dsbench_dir, load_dsbench

        return load_dsbench(dsbench_dir(cfg.dsbench_dir), split)
    if name not in MATH_SOURCES:
        raise MappaError(f"tasks.{split}: unknown task source {name!r} (built-in: {', '.join(SOURCES)}; or {FORMS})")
    return MATH_SOURCES[name](data_dir(cfg.data_dir))


def _from_files(name: str) -> bool:
    """A source whose train and eval sets may overlap: the math files, and anything from outside the package."""
    return name in MATH_SOURCES or is_external(name)


def load_tasks(names: Sequence[str], cfg: TasksConfig, split: Literal["train", "eval"], seed: int) -> list[Task]:
    """The tasks of `names` for `split`, deduplicated, with a seeded draw of `cfg.train_size`/`cfg.eval_size`.

    Training pools of math and external sources lose every problem that also appears (by normalised text) in an
    evaluation source: the configured `cfg.eval` math and external sources, and with a math training source the
    paper's held-out sets (aime2025, aime_eval32, amc_eval32). A draw uses `random.Random(seed).sample` of what is
    left. With `cfg.train_draw: paper` the training draw is the published code's instead (`published_draw` over the
    sources' rows in file order, before anything is removed: the paper's 512 of the 933 AIME problems with seed 42),
    and a configured evaluation problem among the drawn ones is an error rather than a smaller draw.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not names:
        raise MappaError(f"tasks.{split}: no task sources configured")
    raw = [task for name in names for task in load_source(name, cfg, split, seed)]
    size = cfg.train_size if split == "train" else cfg.eval_size
    paper = split == "train" and cfg.train_draw == "paper" and size is not None
    if paper:
        _check_size(size, len(raw), split, names)
        raw = [raw[i] for i in published_draw(len(raw), size, seed)]
    pool: list[Task] = []
    seen: set[str] = set()
    for task in raw:
        key = normalise_problem(task.problem)
        if key not in seen:  # the same problem listed twice (amc and amc_eval32) counts once
            seen.add(key)
            pool.append(task)
    if split == "train" and any(_from_files(n) for n in names):
        pool = _without_eval_problems(pool, names, cfg, seed, refuse=paper)
    if size is not None and not paper:
        _check_size(size, len(pool), split, names)
        pool = random.Random(seed).sample(pool, size)
    return pool


def _check_size(size: int, available: int, split: str, names: Sequence[str]) -> None:
    if size > available:
        raise MappaError(f"tasks.{split}_size: {size} requested but {list(names)} has only {available} tasks")


def _without_eval_problems(
    pool: list[Task], names: Sequence[str], cfg: TasksConfig, seed: int, *, refuse: bool
) -> list[Task]:
    """`pool` without the problems of the evaluation sources (with a math source, the paper's held-out sets too);
    `refuse`: a drawn pool that must stay whole, where one is a MappaError naming the sources (only the configured
    evaluation sources count then: the published draw held out only what its run evaluated on)."""
    held_out: dict[str, list[tuple[str, str]]] = {}  # opening -> (normalised eval problem, its source)
    paper = HELD_OUT_SOURCES if any(n in MATH_SOURCES for n in names) and not refuse else ()
    for name in dict.fromkeys([*cfg.eval, *paper]):
        if _from_files(name):  # arithmetic and dsbench keep train/eval apart themselves
            for t in load_source(name, cfg, "eval", seed):
                key = normalise_problem(t.problem)
                held_out.setdefault(key[:48], []).append((key, name))
    kept, hits = [], {}
    for t in pool:
        key = normalise_problem(t.problem)
        found = next((src for other, src in held_out.get(key[:48], ()) if _same(key, other)), None)
        if found is None:
            kept.append(t)
        else:
            hits[found] = hits.get(found, 0) + 1
    if refuse and hits:
        where = ", ".join(f"{n} of {src}" for src, n in hits.items())
        raise MappaError(
            f"tasks.train_draw: paper: {sum(hits.values())} of the {len(pool)} drawn training problems are "
            f"evaluation problems ({where}); the published draw is kept whole, so evaluate on other sets (the "
            "paper's: aime2025, amc_eval32) or use train_draw: mappa"
        )
    if not kept:
        raise MappaError(
            f"tasks.train: {list(names)} has no problems left after removing evaluation problems (a file "
            "used for both train and eval: give two files, or rows a split field)"
        )
    return kept


def _same(key: str, other: str) -> bool:
    return key == other or near_duplicate(key, other)
