"""`description.txt`: what a Kaggle competition page tells a participant (goal, files, columns, metric, format).

Generated from the task's spec and its training table, so it always matches the files: the column list gives
each feature's type, range or most common values and its share of missing values.
"""

from __future__ import annotations

import pandas as pd

_METRIC_TEXT = {
    "roc_auc": "area under the ROC curve (AUC) between the predicted probability that `{target}` is 1 and the "
    "observed value. Higher is better (1 is perfect, 0.5 is guessing).",
    "log_loss": "logarithmic loss (cross-entropy) of the predicted probability that `{target}` is 1. "
    "Lower is better (0 is perfect).",
    "log_loss_multi": "multiclass logarithmic loss (cross-entropy) of the predicted class probabilities; each "
    "row is rescaled to sum to 1 before scoring. Lower is better (0 is perfect).",
    "accuracy": "accuracy: the share of test rows whose predicted `{target}` is exactly the observed one. "
    "Higher is better.",
    "macro_f1": "macro-averaged F1 score: the F1 score of each class of `{target}`, averaged with equal weight "
    "per class. Higher is better.",
    "qwk": "quadratic weighted kappa between the predicted and the observed `{target}` (integer grades; a "
    "prediction two grades off costs four times one grade off). Higher is better (1 is perfect, 0 is chance).",
    "rmse": "root mean squared error (RMSE) between the predicted and the observed `{target}`. Lower is better.",
    "rmsle": "root mean squared logarithmic error (RMSLE): the RMSE between log(1 + prediction) and "
    "log(1 + observed `{target}`). Predictions must be >= 0. Lower is better.",
    "mae": "mean absolute error (MAE) between the predicted and the observed `{target}`. Lower is better.",
    "smape": "symmetric mean absolute percentage error (SMAPE), in percent (0 to 200): the mean of "
    "|F - A| / ((|A| + |F|) / 2) over the rows; a row where both are 0 counts as 0. Lower is better.",
    "r2": "coefficient of determination (R^2) between the predicted and the observed `{target}`. Higher is "
    "better (1 is perfect, 0 is predicting the mean).",
}


def _column_line(name: str, column: pd.Series, note: str) -> str:
    missing = column.isna().mean()
    extra = f", {missing:.0%} missing" if missing >= 0.005 else ""
    values = column.dropna()
    if pd.api.types.is_bool_dtype(column):
        kind = "true/false"
    elif pd.api.types.is_numeric_dtype(column) and len(values):
        integral = bool((values == values.round()).all())
        low, high = (int(values.min()), int(values.max())) if integral else (values.min(), values.max())
        kind = f"{'integer' if integral else 'numeric'}, {low:g} to {high:g}"
    else:
        top = values.astype(str).value_counts().sort_index(kind="stable").sort_values(ascending=False, kind="stable")
        shown = ", ".join(top.index[:4])
        more = f", ... ({len(top)} values)" if len(top) > 4 else ""
        kind = f"text: {shown}{more}"
    return f"- `{name}` ({kind}{extra}){': ' + note if note else ''}"


def describe_task(
    spec_title: str,
    about: str,
    notes: dict[str, str],
    train: pd.DataFrame,
    *,
    target: str,
    id_column: str,
    metric: str,
    data_type: str,
    n_test: int,
    sample_head: str,
) -> str:
    """The text of description.txt for a task whose training table (id, features, target) is `train`.

    It never names the package or table the data comes from: agent code that knew them could look the
    test rows' labels up (the provenance is in the benchmark's tasks.jsonl, which no workspace gets)."""
    classes = train[target].nunique()
    kind = "regression" if data_type == "regression" else ("binary" if classes == 2 else "multiclass")
    kind_text = "regression" if kind == "regression" else f"{kind} classification ({classes} classes)"
    multi = metric == "log_loss" and kind == "multiclass"
    metric_text = _METRIC_TEXT["log_loss_multi" if multi else metric].format(target=target)
    features = [c for c in train.columns if c not in (id_column, target)]
    columns = [f"- `{id_column}`: row identifier (the key of the submission)"]
    columns += [_column_line(c, train[c], notes.get(c, "")) for c in features]
    columns.append(_column_line(target, train[target], notes.get(target, "the target")))
    answer = (
        f"one probability column per class of `{target}` (named by the class), after `{id_column}`"
        if multi
        else f"`{id_column}` and `{target}` ({_submission_value(metric, target)})"
    )
    return "\n".join(
        [
            f"# {spec_title}",
            "",
            "## Overview",
            f"{about} Predict `{target}` for every row of test.csv. Task type: {kind_text}.",
            "",
            "## Files",
            f"- train.csv: {len(train):,} rows: `{id_column}`, {len(features)} features and the target `{target}`.",
            f"- test.csv: {n_test:,} rows: `{id_column}` and the same features, without `{target}`.",
            "- sample_submission.csv: a valid submission in the correct format (a trivial prediction).",
            "",
            "## Columns",
            *columns,
            "",
            "## Evaluation",
            f"Submissions are scored on the {metric_text}",
            "",
            "## Submission format",
            f"A CSV file `submission.csv` with a header and one row per id of test.csv: {answer}. For example:",
            sample_head.rstrip("\n"),
            "",
        ]
    )


def _submission_value(metric: str, target: str) -> str:
    if metric in ("roc_auc", "log_loss"):
        return f"the probability that `{target}` is 1"
    if metric in ("accuracy", "macro_f1", "qwk"):
        return "the predicted class"
    return "the predicted value"
