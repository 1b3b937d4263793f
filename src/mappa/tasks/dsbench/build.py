"""Build the mini-DSBench directory: tables from the catalogue -> Kaggle-shaped task folders -> reference scores.

    result = build_dsbench(Path("dsbench"), seed=42)       # about 72 tasks, a few minutes on 2 cores
    result.tasks[0]["reference_score"], result.refused       # rows of tasks.jsonl; (id, reason) of dropped tasks

Per task, seeded by (seed, task id) so that adding a task changes no other:
1. the table, with identifiers and leaking columns dropped, rows without a target dropped, classes with fewer
   than MIN_CLASS_ROWS rows dropped, a binary target recoded to 0/1, and a seeded sample of `max_rows` rows when
   the table is larger (the reference team then fits within the sandbox's default limits);
2. a train/test split (30% test; stratified by class, or by whole groups such as days when the spec names one),
   ids numbered train first; train.csv, test.csv (no target), sample_submission.csv (the trivial prediction),
   description.txt, and answers/<id>/test_answer.csv outside the task folder;
3. the reference team (`reference.py`) solves it through the sandbox (warm pool, the default limits but a
   BUILD_TIMEOUT_S wall clock); its score is the task's `reference_score`, and a task it cannot solve, or whose
   submission is no success (no better than every trivial prediction, `submission.py`), is refused (listed in
   build.json).
Finally 8 tasks (fewer for a partial build), stratified by data type, form the eval split, and fingerprints.json
holds each task's content fingerprint (fingerprints.py), by which runs find copies of its table that agent code
could read.

The files hold no timings or paths, so two builds with one seed are identical byte for byte. Whether a task is
refused must not depend on how busy the machine is, hence the build's longer wall clock: on a shared CPU a
3-second fit can take 15. The catalogue keeps to tasks whose reference snippets take a few CPU seconds each, so
they also fit the default 10 s limit (bench/bench_dsbench.py measures it). The build writes
into a hidden folder beside `out` and moves it into place when done: an interrupted build leaves no half task.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from sklearn.model_selection import GroupShuffleSplit, train_test_split

from mappa.config import SandboxConfig
from mappa.errors import MappaError
from mappa.sandbox import Sandbox
from mappa.tasks.dsbench.catalogue import SPECS, TaskSpec, load_frame, package_versions
from mappa.tasks.dsbench.describe import describe_task
from mappa.tasks.dsbench.fingerprints import write_fingerprints
from mappa.tasks.dsbench.metrics import trivial_prediction
from mappa.tasks.dsbench.reference import run_reference
from mappa.tasks.dsbench.submission import canonical, score_submission
from mappa.types import Task

DEFAULT_SEED = 42
TEST_FRACTION = 0.3
EVAL_TASKS = 8  # of the full build (the paper's 64 train / 8 eval)
FULL_SIZE = 72
MIN_CLASS_ROWS = 10
BUILD_TIMEOUT_S = 60.0  # the paper preset's per-snippet limit; the default (10 s) holds on an idle machine


@dataclass
class Prepared:
    """One task written to the staging folder, waiting for its reference run."""

    spec: TaskSpec
    task: Task
    row: dict
    sandbox_s: float = 0.0
    refused: str = ""


@dataclass(frozen=True)
class BuildResult:
    root: Path
    tasks: list[dict]  # the rows of tasks.jsonl
    refused: list[tuple[str, str]]  # (task id, why)
    sandbox_s: dict[str, float] = field(default_factory=dict)  # task id -> reference team's sandbox time


def select_specs(only: Sequence[str] | None) -> list[TaskSpec]:
    """The catalogue's tasks, or those named in `only` (MappaError for an unknown id)."""
    by_id = {s.id: s for s in SPECS}
    if not only:
        return sorted(SPECS, key=lambda s: s.id)
    unknown = [name for name in only if name not in by_id]
    if unknown:
        raise MappaError(f"unknown mini-DSBench task(s) {', '.join(unknown)} (see: mappa dsbench list)")
    return sorted((by_id[name] for name in dict.fromkeys(only)), key=lambda s: s.id)


def task_seed(seed: int, task_id: str) -> int:
    return zlib.crc32(f"{seed}:{task_id}".encode()) & 0x7FFFFFFF


def clean_table(spec: TaskSpec, seed: int) -> pd.DataFrame:
    """The spec's table ready to split: see step 1 of the module docstring."""
    frame = load_frame(spec)
    frame = frame.drop(columns=list(spec.drop)).dropna(subset=[spec.target])
    if spec.positive is not None:
        frame[spec.target] = (frame[spec.target].astype(str) == str(spec.positive)).astype("int64")
    if spec.data_type == "classification":
        if pd.api.types.is_float_dtype(frame[spec.target]) and (frame[spec.target] % 1 == 0).all():
            frame[spec.target] = frame[spec.target].astype("int64")  # grades read as 2.0 because of missing values
        counts = frame[spec.target].value_counts()
        frame = frame[frame[spec.target].isin(counts[counts >= MIN_CLASS_ROWS].index)]
    if len(frame) > spec.max_rows:
        frame = frame.sample(n=spec.max_rows, random_state=task_seed(seed, spec.id))
    return frame.reset_index(drop=True)


def split_table(spec: TaskSpec, frame: pd.DataFrame, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    rs = task_seed(seed, spec.id)
    if spec.group:
        splitter = GroupShuffleSplit(n_splits=1, test_size=TEST_FRACTION, random_state=rs)
        train_idx, test_idx = next(splitter.split(frame, groups=frame[spec.group]))
        train = frame.iloc[train_idx].sample(frac=1.0, random_state=rs)
        test = frame.iloc[test_idx].sample(frac=1.0, random_state=rs)
    else:
        stratify = frame[spec.target] if spec.data_type == "classification" else None
        train, test = train_test_split(frame, test_size=TEST_FRACTION, random_state=rs, stratify=stratify)
    if spec.group and not spec.keep_group:  # a group key such as a person id is no feature
        train, test = train.drop(columns=[spec.group]), test.drop(columns=[spec.group])
    return train.reset_index(drop=True), test.reset_index(drop=True)


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    frame.to_csv(path, index=False, lineterminator="\n")


def _sample_submission(spec: TaskSpec, ids: pd.Series, y_train: pd.Series) -> pd.DataFrame:
    value = trivial_prediction(spec.metric, y_train.tolist())
    if isinstance(value, dict):  # multiclass log_loss: one column per class, named by the class
        columns = {canonical(str(label)): round(share, 6) for label, share in sorted(value.items(), key=str)}
        return pd.DataFrame({spec.id_column: ids, **{c: [v] * len(ids) for c, v in columns.items()}})
    if isinstance(value, float):
        value = round(value, 6)
    return pd.DataFrame({spec.id_column: ids, spec.target: [value] * len(ids)})


def prepare_task(spec: TaskSpec, staging: Path, seed: int) -> Prepared:
    """Write the task's folder and answers under `staging`; the reference run comes later."""
    train, test = split_table(spec, clean_table(spec, seed), seed)
    id_column = spec.id_column
    features = [c for c in train.columns if c != spec.target]
    if id_column in features:  # a catalogue mistake: the table's own identifier must be dropped by the spec
        raise MappaError(f"mini-DSBench task {spec.id}: the table has a column {id_column!r}; drop it in the spec")
    train.insert(0, id_column, range(1, len(train) + 1))
    test.insert(0, id_column, range(len(train) + 1, len(train) + len(test) + 1))
    task_dir, answer_dir = staging / "tasks" / spec.id, staging / "answers" / spec.id
    task_dir.mkdir(parents=True)
    # The hidden answers are the trainer's alone: 0700 folders and 0600 files, unreadable to a sandbox uid.
    answer_dir.parent.mkdir(mode=0o700, exist_ok=True)
    answer_dir.mkdir(mode=0o700)
    _write_csv(train[[id_column, *features, spec.target]], task_dir / "train.csv")
    _write_csv(test[[id_column, *features]], task_dir / "test.csv")
    _write_csv(test[[id_column, spec.target]], answer_dir / "test_answer.csv")
    os.chmod(answer_dir / "test_answer.csv", 0o600)
    sample = _sample_submission(spec, test[id_column], train[spec.target])
    _write_csv(sample, task_dir / "sample_submission.csv")
    head = (task_dir / "sample_submission.csv").read_text(encoding="utf-8").splitlines()[:4]
    text = describe_task(
        spec.title,
        spec.about,
        dict(spec.notes),
        train[[id_column, *features, spec.target]],
        target=spec.target,
        id_column=id_column,
        metric=spec.metric,
        data_type=spec.data_type,
        n_test=len(test),
        sample_head="\n".join(head),
    )
    (task_dir / "description.txt").write_text(text, encoding="utf-8")
    meta = {
        "task_dir": str(task_dir),
        "answer_path": str(answer_dir / "test_answer.csv"),
        "data_type": spec.data_type,
        "metric": spec.metric,
        "target": spec.target,
        "id_column": id_column,
        "baseline_score": 0.0,
        "reference_score": 0.0,
    }
    task = Task(id=spec.id, problem=text, answer="", source="dsbench", meta=meta)
    baseline = score_submission(task, task_dir / "sample_submission.csv")
    if not baseline.valid:  # a bug in the builder, not in the data
        raise RuntimeError(f"{spec.id}: the sample submission does not score: {baseline.reason}")
    row = {
        "id": spec.id,
        "split": "",
        "data_type": spec.data_type,
        "metric": spec.metric,
        "target": spec.target,
        "id_column": id_column,
        "source": f"{spec.source}:{spec.table}",
        "baseline_score": round(baseline.score, 6),
        "reference_score": None,
        "n_train": len(train),
        "n_test": len(test),
        "n_features": len(features),
        "title": spec.title,
    }
    return Prepared(spec, task.model_copy(update={"meta": {**meta, "baseline_score": row["baseline_score"]}}), row)


def solve_with_reference(sandbox: Sandbox, item: Prepared) -> None:
    """Run the reference team on one prepared task; set its reference score, or why the task is refused."""
    run = run_reference(sandbox, item.task)
    item.sandbox_s = run.sandbox_s
    if run.infra_error:  # not the task's fault: refusing it would make the build depend on the machine
        raise MappaError(f"mini-DSBench build: {item.spec.id}: {run.failure}; nothing was refused, build again")
    if run.score is None:
        item.refused = run.failure
        return
    if not run.score.valid:
        item.refused = f"invalid reference submission: {run.score.reason}"
        return
    if not run.score.success:  # a task whose reference is no success could not tell a model from a constant
        item.refused = f"the reference is no success: {run.score.trivial}"
        return
    item.row["reference_score"] = round(run.score.score, 6)


def assign_splits(rows: list[dict], seed: int) -> None:
    """Mark EVAL_TASKS rows (proportionally fewer for a partial build) as eval, stratified by data type."""
    n_eval = EVAL_TASKS if len(rows) >= FULL_SIZE else max(1, round(len(rows) * EVAL_TASKS / FULL_SIZE))
    by_type: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["id"]):
        by_type.setdefault(row["data_type"], []).append(row)
    exact = {t: n_eval * len(group) / len(rows) for t, group in by_type.items()}
    quota = {t: int(q) for t, q in exact.items()}
    for t in sorted(exact, key=lambda t: (-(exact[t] - quota[t]), t))[: n_eval - sum(quota.values())]:
        quota[t] += 1  # largest remainders first
    rng = random.Random(seed)
    for t in sorted(by_type):
        chosen = {r["id"] for r in rng.sample(by_type[t], quota[t])}
        for row in by_type[t]:
            row["split"] = "eval" if row["id"] in chosen else "train"


def _staging_for(out: Path) -> Path:
    """A fresh hidden folder beside `out`; `out` itself must be absent, empty or an earlier build."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "build.json").is_file())):
        raise MappaError(f"{out}: exists and is not a mini-DSBench directory (choose a new or empty directory)")
    staging = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _finish(out: Path, staging: Path, prepared: list[Prepared], seed: int) -> BuildResult:
    accepted = [p for p in prepared if not p.refused]
    refused = [(p.spec.id, p.refused) for p in prepared if p.refused]
    for task_id, _ in refused:
        shutil.rmtree(staging / "tasks" / task_id)
        shutil.rmtree(staging / "answers" / task_id)
    rows = [p.row for p in accepted]
    if rows:
        assign_splits(rows, seed)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (staging / "tasks.jsonl").write_text(lines, encoding="utf-8")
    info = {
        "seed": seed,
        "test_fraction": TEST_FRACTION,
        "tasks": len(rows),
        "splits": {s: sum(r["split"] == s for r in rows) for s in ("train", "eval")},
        "refused": [{"id": i, "reason": why} for i, why in refused],
        "packages": package_versions([p.spec for p in prepared]),
    }
    (staging / "build.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    write_fingerprints(staging)  # to find copies of the tables among what agent code can read (fingerprints.py)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return BuildResult(out, rows, refused, {p.spec.id: round(p.sandbox_s, 3) for p in prepared})


def build_dsbench(
    out: Path,
    seed: int = DEFAULT_SEED,
    only: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    sandbox: Sandbox | None = None,
) -> BuildResult:
    """Write the benchmark to `out` (replacing an earlier build there); see the module docstring.

    `only`: build just these task ids (tests, quick looks). `progress(done, total)`: one step per task written and
    one per task solved. `sandbox`: where the reference team runs, `sandbox.cfg.concurrency` tasks at a time (default:
    a warm pool at the default limits with a BUILD_TIMEOUT_S wall clock, closed at the end).
    """
    out = Path(out).expanduser().resolve()
    specs = select_specs(only)
    staging = _staging_for(out)
    total = 2 * len(specs)
    try:
        prepared = []
        for spec in specs:
            prepared.append(prepare_task(spec, staging, seed))
            if progress is not None:
                progress(len(prepared), total)
        own = sandbox is None
        sandbox = sandbox or Sandbox(SandboxConfig(timeout_s=BUILD_TIMEOUT_S))
        try:
            with ThreadPoolExecutor(sandbox.cfg.concurrency) as pool:
                futures = [pool.submit(solve_with_reference, sandbox, item) for item in prepared]
                for n, future in enumerate(futures, 1):
                    future.result()
                    if progress is not None:
                        progress(len(prepared) + n, total)
        finally:
            if own:
                sandbox.close()
        return _finish(out, staging, prepared, seed)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
