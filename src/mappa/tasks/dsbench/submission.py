"""Reading and scoring a task's `submission.csv`: a bad file is a failure with its reason, never an exception.

Checked, in order, each with a one-line reason: the file exists, is a CSV with a header, has the columns of
`sample_submission.csv`, one row per id of `test.csv` (no duplicate, missing or unknown id), no empty or NaN
prediction, numbers where numbers are due (probabilities within [0, 1] for `log_loss`, >= 0 for `rmsle`,
integers for `qwk`). Multiclass `log_loss` rows (non-negative) are rescaled to sum to 1, as Kaggle does.

Values are read as text and compared in one canonical form, so `1`, `1.0` and ` 1` are the same id or label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from mappa.tasks.dsbench.metrics import (
    LABEL_METRICS,
    reference_fraction,
    relative_gap,
    score_metric,
)
from mappa.types import Task


@dataclass(frozen=True)
class SubmissionScore:
    valid: bool
    reason: str  # why the submission is invalid; "" when valid
    metric: str
    score: float | None  # the task's metric; None when invalid
    gap: float  # DSBench's relative performance gap, 0 when invalid
    reference_fraction: float  # share of the reference model's gain over the trivial prediction, 0 when invalid


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


def read_text_csv(path: Path, what: str) -> pd.DataFrame:
    """A CSV with every cell as text (nothing turned into NaN), header names stripped."""
    if not path.is_file():
        raise SubmissionError(f"no {what} (expected {path.name} in the workspace)")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        raise SubmissionError(f"{what} is not a readable CSV ({str(e).splitlines()[0][:120]})") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    return frame


def _check_columns(frame: pd.DataFrame, expected: list[str]) -> None:
    missing = [c for c in expected if c not in frame.columns]
    extra = [c for c in frame.columns if c not in expected]
    if missing or extra:
        problems = [f"missing column(s) {', '.join(missing)}"] if missing else []
        problems += [f"unexpected column(s) {', '.join(extra)}"] if extra else []
        raise SubmissionError(f"{'; '.join(problems)} (expected: {', '.join(expected)})")
    if frame.columns.duplicated().any():
        raise SubmissionError(f"duplicate column names (expected: {', '.join(expected)})")


def _align(frame: pd.DataFrame, id_column: str, ids: list[str]) -> pd.DataFrame:
    """The submission's rows in the order of `ids`, after checking they are exactly those ids."""
    if len(frame) != len(ids):
        raise SubmissionError(f"{len(frame)} rows, expected {len(ids)} (one per id of test.csv)")
    got = frame[id_column].map(canonical)
    duplicated = got[got.duplicated()]
    if len(duplicated):
        raise SubmissionError(f"{len(duplicated)} duplicate id(s) in {id_column}, e.g. {duplicated.iloc[0]!r}")
    missing = sorted(set(ids) - set(got))
    if missing:
        unknown = sorted(set(got) - set(ids))
        raise SubmissionError(
            f"ids in {id_column} do not match test.csv: {len(missing)} missing (e.g. {missing[0]!r}), "
            f"{len(unknown)} unknown (e.g. {unknown[0]!r})"
        )
    return frame.set_index(got).loc[ids]


def _numbers(column: pd.Series, name: str) -> np.ndarray:
    text = column.str.strip()
    empty = int((text == "").sum()) + int(text.str.lower().isin(["nan", "na", "none", "null"]).sum())
    if empty:
        raise SubmissionError(f"{empty} empty or NaN prediction(s) in column {name}")
    values = pd.to_numeric(text, errors="coerce")
    bad = text[values.isna()]
    if len(bad):
        raise SubmissionError(f"non-numeric value(s) in column {name}, e.g. {bad.iloc[0][:40]!r}")
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
    bad = [v for v in labels if not v.lstrip("-").isdigit()]
    if bad:
        raise SubmissionError(f"qwk takes integer class labels; column {name} holds {bad[0][:40]!r}")
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
    expected = list(read_text_csv(Path(meta["task_dir"]) / "sample_submission.csv", "sample_submission.csv").columns)
    answers = read_text_csv(Path(meta["answer_path"]), "answer file")
    ids = answers[id_column].map(canonical).tolist()
    frame = read_text_csv(Path(submission), "submission.csv")
    _check_columns(frame, expected)
    frame = _align(frame, id_column, ids)
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


def score_submission(task: Task, submission: Path) -> SubmissionScore:
    """Score `submission` (a path to a submission.csv) against the task's answers; never raises on a bad file.

    The relative gap and the reference fraction use the task's `baseline_score` and `reference_score`."""
    metric = str(task.meta.get("metric", ""))
    try:
        y_true, y_pred, labels = read_submission(task, Path(submission))
        score = score_metric(metric, y_true, y_pred, labels=labels)
    except SubmissionError as e:
        return _invalid(metric, str(e))
    except Exception as e:  # noqa: BLE001 - a submission must never crash the caller; the reason is kept
        return _invalid(metric, f"could not be scored: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if not math.isfinite(score):
        return _invalid(metric, f"{metric} is not finite ({score})")
    baseline, reference = float(task.meta["baseline_score"]), float(task.meta["reference_score"])
    return SubmissionScore(
        True,
        "",
        metric,
        score,
        relative_gap(metric, score, baseline),
        reference_fraction(score, baseline, reference),
    )
