"""Tabular tasks: the offline mini-DSBench's metrics, submission scoring and loading.

    root = dsbench_dir(cfg.tasks.dsbench_dir)             # built on first use (a few minutes, once)
    tasks = load_dsbench(root, "eval")                    # Task(problem=description.txt, meta=paths + metric)
    result = score_submission(tasks[0], ws / "submission.csv")
    result.valid, result.reason, result.score, result.gap, result.reference_fraction
    result.success, result.trivial        # valid and better than every trivial prediction; or why not

    score_metric("smape", [100, 0], [110, 0])            # 4.76...: percent, 0/0 counts as 0
    higher_is_better("rmsle")                              # False

A benchmark directory (see docs/dsbench.md) holds `tasks.jsonl`, `tasks/<id>/{train.csv, test.csv,
sample_submission.csv, description.txt}` and `answers/<id>/test_answer.csv`, which no workspace ever gets.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from mappa.errors import MappaError
from mappa.paths import cache_dir
from mappa.tasks.dsbench.build import DEFAULT_SEED, build_dsbench
from mappa.tasks.dsbench.fingerprints import withheld
from mappa.tasks.dsbench.metrics import METRICS, higher_is_better, relative_gap, score_metric
from mappa.tasks.dsbench.reference import TASK_FILES
from mappa.tasks.dsbench.submission import SubmissionScore, score_submission
from mappa.types import Task

__all__ = [
    "METRICS",
    "TASK_FILES",
    "SubmissionScore",
    "dsbench_dir",
    "higher_is_better",
    "load_dsbench",
    "relative_gap",
    "score_metric",
    "score_submission",
]

REQUIRED_KEYS = ("id", "split", "data_type", "metric", "target", "id_column", "baseline_score", "reference_score")
OPTIONAL_KEYS = ("n_train", "n_test", "n_features", "title", "source")


def _read_index(root: Path) -> list[dict]:
    index = root / "tasks.jsonl"
    if not index.is_file():
        raise MappaError(f"{index}: not found (build the benchmark: mappa dsbench build --out {root})")
    rows = []
    for n, line in enumerate(index.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MappaError(f"{index}:{n}: invalid JSON ({e.msg})") from None
            missing = [k for k in REQUIRED_KEYS if k not in row]
            if missing:
                raise MappaError(f"{index}:{n}: missing {', '.join(missing)}")
            rows.append(row)
    return rows


def _seal(answer_dir: Path) -> None:
    """Hidden answers are the trainer's alone (0700/0600), also in a benchmark built or copied with other modes."""
    if answer_dir.is_dir():
        os.chmod(answer_dir.parent, 0o700)
        os.chmod(answer_dir, 0o700)
        for f in answer_dir.iterdir():
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o600)


def load_dsbench(root: Path, split: Literal["train", "eval"]) -> list[Task]:
    """The tasks of one split, in id order: the problem is the task's description.txt; `meta` holds the task
    directory, the answer file (for scoring only), the metric and the baseline and reference scores."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    root = Path(root).resolve()
    tasks = []
    left_out = withheld(root)  # tasks whose table agent code can read a copy of (mappa.api.check_hidden_answers)
    for row in _read_index(root):
        if row.get("split") != split or row["id"] in left_out:
            continue
        task_dir = root / "tasks" / row["id"]
        missing = [name for name in TASK_FILES if not (task_dir / name).is_file()]
        if missing:
            raise MappaError(f"{task_dir}: missing {', '.join(missing)} (rebuild: mappa dsbench build --out {root})")
        meta = {k: row[k] for k in REQUIRED_KEYS[2:]} | {k: row.get(k) for k in OPTIONAL_KEYS}
        meta.update(task_dir=str(task_dir), answer_path=str(root / "answers" / row["id"] / "test_answer.csv"))
        problem = (task_dir / "description.txt").read_text(encoding="utf-8")
        if "\nData: table " in problem:  # written by a build whose descriptions named the source package
            raise MappaError(
                f"{task_dir / 'description.txt'}: names the table its labels come from (an earlier build); "
                f"rebuild: mappa dsbench build --out {root}"
            )
        _seal(root / "answers" / row["id"])
        tasks.append(Task(id=row["id"], problem=problem, answer="", source="dsbench", meta=meta))
    return sorted(tasks, key=lambda t: t.id)


def dsbench_dir(configured: str | None = None, progress: Callable[[int, int], None] | None = None) -> Path:
    """The benchmark directory: `configured` (tasks.dsbench_dir), else $MAPPA_DSBENCH_DIR, else
    <MAPPA_CACHE>/dsbench. Built there on first use (with the default seed), so presets work on a fresh checkout;
    without a `progress` callback a one-line warning says that the build is happening."""
    raw = configured or os.environ.get("MAPPA_DSBENCH_DIR")
    root = Path(raw).expanduser() if raw else cache_dir() / "dsbench"
    if (root / "tasks.jsonl").is_file():
        return root
    if progress is None:
        warnings.warn(
            f"mappa dsbench: building the benchmark in {root} (once; a few minutes on 2 cores)",
            RuntimeWarning,
            stacklevel=2,
        )
    build_dsbench(root, seed=DEFAULT_SEED, progress=progress)
    return root
