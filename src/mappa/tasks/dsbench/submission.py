"""Reading and scoring a task's `submission.csv`: a bad file is a failure with its reason, never an exception.

Checked, in order, each with a one-line reason: the file is a regular file of the workspace, read as an agent
file (`mappa.tasks.files`: no link followed, no FIFO or device opened, at most `max_submission_bytes`); its
header line alone (of bounded length) has the columns of `sample_submission.csv`, and only then are rows
parsed, at most one more than `test.csv` has; one row per id of `test.csv` (no duplicate, missing or unknown
id), no empty or NaN prediction, numbers where numbers are due (probabilities within [0, 1] for `log_loss`,
>= 0 for `rmsle`, integers for `qwk`). Multiclass `log_loss` rows (non-negative) are rescaled to sum to 1,
as Kaggle does.

Values are read as text and compared in one canonical form, so `1`, `1.0` and ` 1` are the same id or label.
A reason quotes nothing of the file but its header's names (cut short); a bad value is named by its row or id.

A valid submission is a **success** only when it is strictly better, by the task's metric, than every prediction
that ignores the features (`trivial_scores`: sample_submission.csv as shipped, and each constant of
`metrics.trivial_predictions` from train.csv's target, scored on the hidden answers), its predictions are not
one constant, and it is strictly better than the same predictions shuffled across rows, every one of
`PERMUTATIONS` seeded shuffles (a permutation test: predictions that carry nothing about which row is which,
noise or the test ids, pass it by chance at most once in PERMUTATIONS + 1). Ties count as no better.
"""

from __future__ import annotations

import csv
import functools
import logging
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pandas as pd

from mappa.errors import MappaError
from mappa.tasks.dsbench.metrics import (
    LABEL_METRICS,
    higher_is_better,
    reference_fraction,
    relative_gap,
    score_metric,
    trivial_predictions,
)
from mappa.tasks.files import AgentFileError, open_agent_file, shown
from mappa.types import Task

logger = logging.getLogger(__name__)

# A submission larger than this is refused before it is parsed: 1 MiB plus 128 bytes per expected cell (a
# probability written with full precision takes about 20).
MIN_SUBMISSION_BYTES = 1 << 20
BYTES_PER_CELL = 128
MIN_HEADER_BYTES = 1024  # plus four times the expected header's length
# A success must beat its own predictions shuffled across rows this many times (seeded by the task id, so a
# verdict is the same on every replay): noise passes with probability at most 1 / (PERMUTATIONS + 1).
PERMUTATIONS = 99


@dataclass(frozen=True)
class SubmissionScore:
    valid: bool
    reason: str  # why the submission is invalid; "" when valid
    metric: str
    score: float | None  # the task's metric; None when invalid
    gap: float  # DSBench's relative performance gap, 0 when invalid
    reference_fraction: float  # share of the reference model's gain over the trivial prediction, 0 when invalid
    success: bool = False  # valid and strictly better than every trivial prediction (the module docstring)
    trivial: str = ""  # why a valid submission is no success; "" for a success or an invalid submission
    trivial_score: float | None = None  # the best trivial prediction's score on the test set; None: not known


class SubmissionError(Exception):
    """A submission that cannot be scored; the message is the reason."""


def canonical(value: str) -> str:
    """One text per value: integral numbers without a decimal part ("1.0" -> "1"), other numbers by repr."""
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        return text
    if math.isfinite(number) and number.is_integer() and abs(number) < 2**53:
        return str(int(number))
    return repr(number)


def read_text_csv(path: Path, what: str, nrows: int | None = None, usecols: list[str] | None = None) -> pd.DataFrame:
    """A CSV of the task's own (trusted) files with every cell as text (nothing turned into NaN), header names
    stripped. Agent files are read with `read_agent_csv` instead."""
    if not path.is_file():
        raise SubmissionError(f"no {what} (expected {path.name} in the workspace)")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, nrows=nrows, usecols=usecols)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        raise SubmissionError(f"{what} is not a readable CSV ({str(e).splitlines()[0][:120]})") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    return frame


def max_submission_bytes(n_rows: int, n_columns: int) -> int:
    """The largest submission read for `n_rows` ids and `n_columns` columns: a generous size per cell."""
    return MIN_SUBMISSION_BYTES + (n_rows + 1) * n_columns * BYTES_PER_CELL


def _names(names: list[str]) -> str:
    """Header names for a reason: each shown on one line and cut, at most a few, then how many more."""
    listed = [repr(shown(n, 40)) if n != n.strip() or "," in n or not n else shown(n, 40) for n in names[:5]]
    return ", ".join(listed) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _check_columns(got: list[str], expected: list[str]) -> None:
    if len(set(got)) != len(got):
        raise SubmissionError(f"duplicate column names (expected: {', '.join(expected)})")
    missing = [c for c in expected if c not in got]
    extra = [c for c in got if c not in expected]
    if missing or extra:
        problems = [f"missing column(s) {_names(missing)}"] if missing else []
        problems += [f"unexpected column(s) {_names(extra)}"] if extra else []
        raise SubmissionError(f"{'; '.join(problems)} (expected: {', '.join(expected)})")


def _header(f: BinaryIO, expected: list[str]) -> None:
    """Check the header line against `expected` before any of the body is parsed."""
    limit = MIN_HEADER_BYTES + 4 * len(",".join(expected).encode())
    line = f.readline(limit + 1)
    if not line.strip():
        raise SubmissionError("submission.csv is not a readable CSV (no header line)")
    if len(line) > limit:
        raise SubmissionError(f"submission.csv's header line is longer than {limit:,} bytes")
    try:
        text = line.decode("utf-8-sig").rstrip("\r\n")
    except UnicodeDecodeError:
        raise SubmissionError("submission.csv is not a readable CSV (its header is not UTF-8)") from None
    if not text.replace("\t", " ").isprintable():
        raise SubmissionError("submission.csv is not a readable CSV (control characters in its header line)")
    try:
        got = next(csv.reader([text]), [])
    except csv.Error:
        raise SubmissionError("submission.csv is not a readable CSV (a malformed header line)") from None
    _check_columns([c.strip() for c in got], expected)


def read_agent_csv(path: Path, expected: list[str], n_rows: int) -> pd.DataFrame:
    """The agent's CSV at `path` as text cells: opened as an agent file (`mappa.tasks.files`) of a bounded size,
    its header checked against `expected` first, then at most `n_rows` + 1 rows parsed."""
    cap = max_submission_bytes(n_rows, len(expected))
    try:
        with open_agent_file(path.parent, path.name, cap) as f:
            _header(f, expected)
            f.seek(0)
            frame = pd.read_csv(f, dtype=str, keep_default_na=False, nrows=n_rows + 1, encoding="utf-8")
    except AgentFileError as e:
        missing = f"no submission.csv (expected {shown(path.name, 40)} in the workspace)"
        raise SubmissionError(missing if e.kind == "missing" else str(e)) from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:  # the C parser's messages quote no content
        raise SubmissionError(f"submission.csv is not a readable CSV ({shown(str(e).splitlines()[0], 120)})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SubmissionError(f"submission.csv is not a readable CSV ({type(e).__name__})") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    _check_columns(list(frame.columns), expected)
    return frame


def _align(frame: pd.DataFrame, id_column: str, ids: list[str]) -> pd.DataFrame:
    """The submission's rows in the order of `ids`, after checking they are exactly those ids. Reasons name rows
    (1 = the first row after the header), never the submission's values."""
    if len(frame) != len(ids):
        count = f"more than {len(ids)}" if len(frame) > len(ids) else str(len(frame))
        raise SubmissionError(f"{count} rows, expected {len(ids)} (one per id of test.csv)")
    got = frame[id_column].map(canonical).tolist()
    first: dict[str, int] = {}
    duplicated = [i for i, v in enumerate(got) if first.setdefault(v, i) != i]
    if duplicated:
        raise SubmissionError(
            f"{len(duplicated)} duplicate id(s) in {id_column}, the first at row {duplicated[0] + 1}"
        )
    known = set(ids)
    missing = known - first.keys()
    if missing:  # as many rows as ids, none twice: as many unknown ids as missing ones
        row = next(i for i, v in enumerate(got) if v not in known)
        raise SubmissionError(
            f"ids in {id_column} do not match test.csv: {len(missing)} missing, {len(missing)} unknown "
            f"(the first at row {row + 1})"
        )
    return frame.set_index(pd.Index(got)).loc[ids]


def _numbers(column: pd.Series, name: str) -> np.ndarray:
    text = column.str.strip()
    empty = int((text == "").sum()) + int(text.str.lower().isin(["nan", "na", "none", "null"]).sum())
    if empty:
        raise SubmissionError(f"{empty} empty or NaN prediction(s) in column {name}")
    values = pd.to_numeric(text, errors="coerce")
    bad = text[values.isna()]
    if len(bad):
        raise SubmissionError(f"{len(bad)} non-numeric value(s) in column {name}, e.g. for id {bad.index[0]}")
    array = values.to_numpy(dtype=float)
    if not np.isfinite(array).all():
        raise SubmissionError(f"infinite value(s) in column {name}")
    return array


def _labels(column: pd.Series, name: str) -> np.ndarray:
    text = column.map(canonical)
    empty = int(text.isin(["", "nan"]).sum())
    if empty:
        raise SubmissionError(f"{empty} empty or NaN prediction(s) in column {name}")
    return text.to_numpy(dtype=object)


def _integers(labels: np.ndarray, name: str) -> np.ndarray:
    bad = [not v.lstrip("-").isdigit() or len(v) > 18 for v in labels]
    if any(bad):
        raise SubmissionError(f"qwk takes integer class labels; column {name} holds {sum(bad)} other value(s)")
    return labels.astype(np.int64)


def _probabilities(values: np.ndarray, name: str) -> np.ndarray:
    if ((values < 0) | (values > 1)).any():
        raise SubmissionError(f"probabilities outside [0, 1] in column {name}")
    return values


def _predictions(frame: pd.DataFrame, metric: str, target: str, classes: list[str]) -> np.ndarray:
    """The prediction array `score_metric` takes: labels, numbers, or one row of probabilities per sample."""
    if metric in LABEL_METRICS:
        labels = _labels(frame[target], target)
        return _integers(labels, target) if metric == "qwk" else labels
    if classes:  # multiclass log_loss: one probability column per class
        probs = np.column_stack([_numbers(frame[c], c) for c in classes])
        if (probs < 0).any():
            raise SubmissionError("negative probabilities in the class columns")
        sums = probs.sum(axis=1)
        if (sums == 0).any():
            raise SubmissionError(f"{int((sums == 0).sum())} row(s) whose probabilities are all 0")
        return probs / sums[:, None]
    values = _numbers(frame[target], target)
    if metric == "log_loss":
        return _probabilities(values, target)
    if metric == "rmsle" and (values < 0).any():
        raise SubmissionError(f"negative prediction(s) in column {target}; rmsle takes log(1 + x)")
    return values


def read_submission(task: Task, submission: Path) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    """(y_true, y_pred, class order) of a submission, aligned on the ids; SubmissionError says what is wrong."""
    meta = task.meta
    metric, target, id_column = meta["metric"], meta["target"], meta["id_column"]
    sample = read_text_csv(Path(meta["task_dir"]) / "sample_submission.csv", "sample_submission.csv", nrows=0)
    expected = list(sample.columns)
    answers = read_text_csv(Path(meta["answer_path"]), "answer file")
    ids = answers[id_column].map(canonical).tolist()
    frame = _align(read_agent_csv(Path(submission), expected, len(ids)), id_column, ids)
    classes = [c for c in expected if c != id_column] if target not in expected else []
    y_pred = _predictions(frame, metric, target, classes)
    truth = answers[target].map(canonical).to_numpy(dtype=object)
    if metric == "qwk":
        truth = truth.astype(np.int64)
    elif metric not in LABEL_METRICS and not classes:
        truth = truth.astype(float)
    return truth, y_pred, [canonical(c) for c in classes] or None


def _invalid(metric: str, reason: str) -> SubmissionScore:
    return SubmissionScore(False, reason, metric, None, 0.0, 0.0)


def _constant(value: object, n: int, metric: str, labels: list[str] | None) -> np.ndarray:
    """One trivial prediction on all `n` rows, in the form `score_metric` takes for `metric`."""
    if isinstance(value, dict):  # multiclass probabilities: one column per class, in the submission's order
        return np.tile([float(value.get(c, 0.0)) for c in labels or sorted(value)], (n, 1))
    if metric == "qwk":
        return np.full(n, int(value), dtype=np.int64)
    if metric in LABEL_METRICS:
        return np.array([value] * n, dtype=object)
    return np.full(n, float(value))


def _train_target(task_dir: Path, metric: str, target: str, multiclass: bool) -> list:
    """train.csv's target as the answers are compared: integers (qwk), labels as text, or numbers."""
    column = read_text_csv(task_dir / "train.csv", "train.csv", usecols=[target])[target]
    values = [canonical(v) for v in column if v.strip()]
    if metric == "qwk":
        return [int(v) for v in values]
    if metric in LABEL_METRICS or multiclass:
        return values
    return [float(v) for v in values]


@functools.lru_cache(maxsize=256)
def _trivial_table(key: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """(what, score) of every trivial prediction of the task `key` names (see `trivial_scores`)."""
    task_dir, answer_path, metric, target, id_column = key[:5]
    meta = {"task_dir": task_dir, "answer_path": answer_path, "metric": metric, "target": target}
    task = Task(id="", problem="", answer="", source="dsbench", meta={**meta, "id_column": id_column})
    y_true, y_sample, labels = read_submission(task, Path(task_dir) / "sample_submission.csv")
    out = [("sample_submission.csv", score_metric(metric, y_true, y_sample, labels=labels))]
    y_train = _train_target(Path(task_dir), metric, target, multiclass=labels is not None)
    for what, value in trivial_predictions(metric, y_train).items():
        y_pred = _constant(value, len(y_true), metric, labels)
        out.append((what, score_metric(metric, y_true, y_pred, labels=labels)))
    return tuple(out)


def trivial_scores(task: Task) -> dict[str, float]:
    """What each prediction that ignores the features scores on the task's hidden answers: sample_submission.csv
    as shipped, and each constant of `trivial_predictions` from train.csv's target. All are the task's own
    files, read once per process (a changed file is read again)."""
    meta = task.meta
    task_dir = Path(meta["task_dir"])
    paths = (task_dir / "train.csv", task_dir / "sample_submission.csv", Path(meta["answer_path"]))
    stamps = tuple(str(os.stat(p).st_mtime_ns) if p.is_file() else "" for p in paths)
    key = (str(task_dir), str(meta["answer_path"]), str(meta["metric"]), str(meta["target"]), str(meta["id_column"]))
    return dict(_trivial_table((*key, *stamps)))


def _is_constant(y_pred: np.ndarray) -> bool:
    if y_pred.ndim == 2:
        return bool((y_pred == y_pred[0]).all())
    return len(set(y_pred.tolist())) <= 1


def _beats_shuffles(
    metric: str, y_true: np.ndarray, y_pred: np.ndarray, labels: list[str] | None, score: float, seed: int
) -> bool:
    """Whether `score` is strictly better than that of `y_pred` with its rows shuffled, every one of
    PERMUTATIONS times (it stops at the first shuffle that does as well)."""
    better = (lambda a, b: a > b) if higher_is_better(metric) else (lambda a, b: a < b)
    rng = np.random.default_rng(seed)
    for _ in range(PERMUTATIONS):
        shuffled = y_pred[rng.permutation(len(y_pred))]
        if not better(score, score_metric(metric, y_true, shuffled, labels=labels)):
            return False
    return True


def success_verdict(
    task: Task, score: float, y_true: np.ndarray, y_pred: np.ndarray, labels: list[str] | None
) -> tuple[str, float | None]:
    """Why a valid submission scoring `score` is no success ("" when it is one), and the best trivial score.

    The rule of the module docstring; a task whose trivial predictions cannot be scored gives no success."""
    metric = str(task.meta["metric"])
    try:
        table = trivial_scores(task)
    except (SubmissionError, MappaError, OSError, KeyError, ValueError) as e:
        logger.debug("trivial predictions could not be scored", exc_info=True)
        return f"the trivial predictions could not be scored ({type(e).__name__}): no success", None
    pick = max if higher_is_better(metric) else min
    what, best = pick(table.items(), key=lambda item: item[1])
    if _is_constant(y_pred):
        return "constant predictions: every row gets the same prediction, which ignores the features", best
    if not (score > best if higher_is_better(metric) else score < best):
        return f"{metric} {score:.6g} is no better than {what}'s {best:.6g}", best
    if not _beats_shuffles(metric, y_true, y_pred, labels, score, zlib.crc32(task.id.encode())):
        return (
            f"{metric} {score:.6g} is no better than the same predictions shuffled across rows: they carry "
            f"nothing about which row is which (a permutation test, {PERMUTATIONS} shuffles)"
        ), best
    return "", best


def score_submission(task: Task, submission: Path) -> SubmissionScore:
    """Score `submission` (a path to a submission.csv) against the task's answers; never raises on a bad file.

    The relative gap and the reference fraction use the task's `baseline_score` and `reference_score`; `success`
    and `trivial` follow the rule of the module docstring."""
    metric = str(task.meta.get("metric", ""))
    try:
        y_true, y_pred, labels = read_submission(task, Path(submission))
        score = score_metric(metric, y_true, y_pred, labels=labels)
    except (SubmissionError, MappaError) as e:  # reasons written here, quoting no file but the header
        return _invalid(metric, str(e))
    except Exception as e:  # noqa: BLE001 - a submission must never crash the caller
        # A library's message may quote the answers or the file: the reason names the error only.
        logger.debug("submission could not be scored", exc_info=True)
        return _invalid(metric, f"could not be scored ({type(e).__name__} while computing {metric})")
    if not math.isfinite(score):
        return _invalid(metric, f"{metric} is not finite ({score})")
    try:
        trivial, trivial_score = success_verdict(task, score, y_true, y_pred, labels)
    except Exception as e:  # noqa: BLE001 - as above: a verdict that cannot be reached is no success
        logger.debug("success could not be decided", exc_info=True)
        trivial, trivial_score = f"success could not be decided ({type(e).__name__})", None
    baseline, reference = float(task.meta["baseline_score"]), float(task.meta["reference_score"])
    return SubmissionScore(
        valid=True,
        reason="",
        metric=metric,
        score=score,
        gap=relative_gap(metric, score, baseline),
        reference_fraction=reference_fraction(score, baseline, reference),
        success=not trivial,
        trivial=trivial,
        trivial_score=trivial_score,
    )
