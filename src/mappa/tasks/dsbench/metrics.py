"""The metrics DSBench mixes, one implementation each, plus the trivial and perfect scores behind its gap.

    score_metric("rmse", [1, 2, 3], [1, 2, 4])          # 0.577...
    score_metric("roc_auc", [0, 1, 1], [0.2, 0.9, 0.4])  # y_pred: the positive class's probability
    relative_gap("rmse", score=0.5, baseline=1.0)         # 0.5: half the way from trivial to perfect

scikit-learn computes every metric it has; SMAPE (not in scikit-learn) is Kaggle's: in percent, with a
0/0 term counted as 0. For `roc_auc` and binary `log_loss` `y_pred` is the probability of the positive
class (the greater label, 1 for 0/1 targets); for multiclass `log_loss` it is one row of probabilities per
sample, its columns in the order of `labels` (default: the sorted labels of `y_true`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sklearn import metrics as skm

from mappa.errors import MappaError


def smape(y_true: Any, y_pred: Any) -> float:
    """Symmetric mean absolute percentage error in percent (0..200), as Kaggle scores it: 0/0 counts as 0."""
    a = np.asarray(y_true, dtype=float)
    f = np.asarray(y_pred, dtype=float)
    denom = (np.abs(a) + np.abs(f)) / 2.0
    diff = np.abs(f - a)
    terms = np.divide(diff, denom, out=np.zeros_like(diff), where=denom != 0)
    return float(100.0 * terms.mean())


def _log_loss(y_true: Any, y_pred: Any, labels: Sequence[Any] | None) -> float:
    y_pred = np.asarray(y_pred, dtype=float)
    if y_pred.ndim == 1:
        return skm.log_loss(y_true, y_pred, labels=labels)
    order = list(labels) if labels is not None else sorted(set(np.asarray(y_true).tolist()))
    # scikit-learn reads the columns in sorted label order, whatever `labels` says: sort the columns to match
    columns = sorted(range(len(order)), key=lambda i: order[i])
    return skm.log_loss(y_true, y_pred[:, columns], labels=[order[i] for i in columns])


# name -> (function(y_true, y_pred, labels), higher is better, perfect score)
_METRICS: dict[str, tuple[Callable[..., float], bool, float]] = {
    "roc_auc": (lambda t, p, _: skm.roc_auc_score(t, p), True, 1.0),
    "rmsle": (lambda t, p, _: skm.root_mean_squared_log_error(t, p), False, 0.0),
    "rmse": (lambda t, p, _: skm.root_mean_squared_error(t, p), False, 0.0),
    "accuracy": (lambda t, p, _: skm.accuracy_score(t, p), True, 1.0),
    "mae": (lambda t, p, _: skm.mean_absolute_error(t, p), False, 0.0),
    "smape": (lambda t, p, _: smape(t, p), False, 0.0),
    "log_loss": (_log_loss, False, 0.0),
    "macro_f1": (lambda t, p, _: skm.f1_score(t, p, average="macro"), True, 1.0),
    "r2": (lambda t, p, _: skm.r2_score(t, p), True, 1.0),
    "qwk": (lambda t, p, _: skm.cohen_kappa_score(t, p, weights="quadratic"), True, 1.0),
}
METRICS: tuple[str, ...] = tuple(_METRICS)
CLASSIFICATION_METRICS = ("roc_auc", "accuracy", "log_loss", "macro_f1", "qwk")
REGRESSION_METRICS = ("rmsle", "rmse", "mae", "smape", "r2")
PROBABILITY_METRICS = ("roc_auc", "log_loss")  # the submission holds probabilities, not labels
LABEL_METRICS = ("accuracy", "macro_f1", "qwk")  # the submission holds class labels


def _entry(name: str) -> tuple[Callable[..., float], bool, float]:
    if name not in _METRICS:
        raise MappaError(f"unknown metric {name!r} (known: {', '.join(METRICS)})")
    return _METRICS[name]


def score_metric(name: str, y_true: Any, y_pred: Any, labels: Sequence[Any] | None = None) -> float:
    """The metric `name` of predictions `y_pred` against `y_true` (see the module docstring for the shapes).

    `labels`: the class order of the columns of a multiclass `log_loss` prediction; ignored otherwise.
    """
    fn = _entry(name)[0]
    if len(y_true) != len(y_pred):
        raise ValueError(f"{name}: {len(y_true)} true values but {len(y_pred)} predictions")
    return float(fn(y_true, y_pred, labels))


def higher_is_better(name: str) -> bool:
    return _entry(name)[1]


def perfect_score(name: str) -> float:
    """The score of a perfect prediction (DSBench's g)."""
    return _entry(name)[2]


def relative_gap(name: str, score: float, baseline: float) -> float:
    """DSBench's relative performance gap max(0, (p - b) / (g - b)), with g the perfect score: 0 is no better than
    the trivial prediction, 1 is perfect. A baseline that is already perfect gives 1 for a perfect score, else 0."""
    perfect = perfect_score(name)
    if perfect == baseline:
        return 1.0 if score == perfect else 0.0
    return max(0.0, (score - baseline) / (perfect - baseline))


def reference_fraction(score: float, baseline: float, reference: float) -> float:
    """How much of the reference model's improvement over the trivial prediction a score reaches:
    max(0, (p - b) / (r - b)); 1 matches the reference, above 1 beats it. 0 when the reference is no better."""
    if reference == baseline:
        return 0.0
    return max(0.0, (score - baseline) / (reference - baseline))


def trivial_prediction(name: str, y_train: Sequence[Any]) -> Any:
    """What a submission that ignores the features predicts for every row (DSBench's b is its score).

    Labels: the most frequent training class (ties: the smallest); probabilities: the training class shares
    (a dict label -> share for multiclass `log_loss`, the positive share otherwise); regression: the training
    mean (rmse, r2), median (mae, smape) or the mean on the log scale (rmsle)."""
    _entry(name)
    if name in LABEL_METRICS:
        values, counts = np.unique(np.asarray(y_train), return_counts=True)
        return values[int(np.argmax(counts))].item()
    if name in PROBABILITY_METRICS:
        values, counts = np.unique(np.asarray(y_train), return_counts=True)
        shares = counts / counts.sum()
        if name == "log_loss" and len(values) > 2:
            return {v.item(): float(s) for v, s in zip(values, shares, strict=True)}
        return float(shares[-1])
    y = np.asarray(y_train, dtype=float)
    if name in ("mae", "smape"):
        return float(np.median(y))
    if name == "rmsle":
        return float(np.expm1(np.log1p(y).mean()))
    return float(y.mean())


def trivial_predictions(name: str, y_train: Sequence[Any]) -> dict[str, Any]:
    """Every prediction that ignores the features which a success must beat (docs/dsbench.md), by what it is.

    Classification: the majority class (ties: the smallest), as a label, or as a probability of 1 for it (the
    positive class's probability, or one 0/1 value per class for multiclass `log_loss`), and for probability
    metrics the training class shares. Regression: the training mean and median, and for `rmsle` also the
    mean on the log scale. `trivial_prediction` (what `sample_submission.csv` holds) is always among them."""
    _entry(name)
    if name in CLASSIFICATION_METRICS:
        values, counts = np.unique(np.asarray(y_train), return_counts=True)
        majority = values[int(np.argmax(counts))].item()
        if name in LABEL_METRICS:
            return {"the majority class": majority}
        if name == "log_loss" and len(values) > 2:
            one_hot = {v.item(): float(v.item() == majority) for v in values}
            return {"the majority class": one_hot, "the training class shares": trivial_prediction(name, y_train)}
        positive = values[-1].item()  # the greater label, as `trivial_prediction` and roc_auc read it
        return {
            "the majority class": float(majority == positive),
            "the training class shares": trivial_prediction(name, y_train),
        }
    y = np.asarray(y_train, dtype=float)
    out = {"the training mean": float(y.mean()), "the training median": float(np.median(y))}
    if name == "rmsle":
        out["the training mean on the log scale"] = trivial_prediction(name, y_train)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The paper's data-science figures (method.md section 5), to set beside DSBench's gap: accuracy and F1 for
# classification, RMSE as a percentage of the target's range and of its interquartile range for regression.
# "Fair": a failed run (no valid submission) counts with a fallback value instead of being left out.

FAIR_ACCURACY_FALLBACK = 0.5  # chance accuracy, the paper's fallback
FAIR_F1_FALLBACK = 0.0  # a run that predicts nothing finds none of the positive class
# RMSE's fallback is the trivial prediction's (the training mean on every row), in % of range and IQR: a failed
# run counts as no better than ignoring the features, as DSBench's gap counts it (`fallback_figures`).


def _label_key(label: Any) -> tuple[int, float, str]:
    """Labels in numeric order where they are numbers ("10" after "9"), else by text."""
    try:
        return 0, float(label), ""
    except (TypeError, ValueError):
        return 1, 0.0, str(label)


def predicted_labels(metric: str, y_pred: Any, classes: Sequence[Any]) -> np.ndarray:
    """One class label per row from a submission: labels as they are; a binary probability of the positive
    class (the greater label, as `roc_auc` reads it) at 0.5; a row of class probabilities (columns in the order
    of `classes`) by its largest entry."""
    values = np.asarray(y_pred)
    if metric in LABEL_METRICS:
        return values
    ordered = sorted(classes, key=_label_key)
    if values.ndim == 2:
        return np.asarray(list(classes), dtype=object)[values.argmax(axis=1)]
    return np.where(values.astype(float) >= 0.5, ordered[-1], ordered[0])


def classification_figures(y_true: Sequence[Any], labels: Sequence[Any], classes: Sequence[Any]) -> dict[str, float]:
    """Accuracy and F1 of predicted `labels`: with two classes the F1 of the positive one (the greater label:
    the task's class of interest, recoded to 1 by the build), else the macro F1 over `classes`."""
    truth, pred = np.asarray(y_true, dtype=object), np.asarray(labels, dtype=object)
    ordered = sorted(classes, key=_label_key)
    if len(ordered) == 2:
        f1 = skm.f1_score(truth, pred, labels=[ordered[-1]], average="macro", zero_division=0.0)
    else:
        f1 = skm.f1_score(truth, pred, labels=ordered, average="macro", zero_division=0.0)
    return {"accuracy": float(skm.accuracy_score(truth, pred)), "f1": float(f1)}


def regression_figures(y_true: Any, y_pred: Any, y_train: Any) -> dict[str, float]:
    """RMSE in % of the training target's range and of its IQR (the spread the coach's rubric also reads);
    NaN where that spread is 0."""
    rmse = float(np.sqrt(np.mean((np.asarray(y_pred, dtype=float) - np.asarray(y_true, dtype=float)) ** 2)))
    train = np.asarray(y_train, dtype=float)
    spread = {"range": float(train.max() - train.min()), "iqr": float(np.subtract(*np.percentile(train, [75, 25])))}
    return {f"rmse_{k}_pct": 100.0 * rmse / v if v > 0 else float("nan") for k, v in spread.items()}


def paper_figures(
    metric: str, y_true: Any, y_pred: Any, y_train: Any, labels: Sequence[Any] | None = None
) -> dict[str, float]:
    """The paper's figures of one valid submission (`y_true`, `y_pred` as `score_metric` takes them; `labels`:
    the class order of multiclass probability columns): classification or regression by the task's metric."""
    _entry(metric)
    if metric in CLASSIFICATION_METRICS:
        truth = [str(v) for v in _as_labels(y_true)]
        classes = [str(c) for c in (labels or sorted({*truth, *map(str, _as_labels(y_train))}, key=_label_key))]
        pred = [str(v) for v in _as_labels(predicted_labels(metric, y_pred, classes))]
        return classification_figures(truth, pred, classes)
    return regression_figures(y_true, y_pred, y_train)


def fallback_figures(metric: str, y_true: Any, y_train: Any) -> dict[str, float]:
    """The figures a failed run counts with: chance accuracy, F1 0, and the trivial prediction's RMSE."""
    _entry(metric)
    if metric in CLASSIFICATION_METRICS:
        return {"accuracy": FAIR_ACCURACY_FALLBACK, "f1": FAIR_F1_FALLBACK}
    trivial = np.full(len(y_true), float(np.mean(np.asarray(y_train, dtype=float))))
    return regression_figures(y_true, trivial, y_train)


def _as_labels(values: Any) -> list[Any]:
    """Labels compared as text: integral numbers without a decimal part (1.0 and "1" are one class)."""
    out = []
    for v in np.asarray(values, dtype=object).tolist():
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        out.append(v)
    return out
