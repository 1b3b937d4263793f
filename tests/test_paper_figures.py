"""The paper's data-science figures beside DSBench's gap: accuracy and F1, RMSE in % of the target's range and
IQR, each "fair" (a failed run counts with its fallback), recorded per episode by the ds_pipeline workflow and
printed by `mappa eval`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from helpers import FORGETFUL_ENGINEER, fenced, play, reference_team
from rich.console import Console

from mappa.cli.evaluate import tabular_table
from mappa.metrics import episode_metrics, paper_means
from mappa.tasks.dsbench.metrics import (
    FAIR_ACCURACY_FALLBACK,
    FAIR_F1_FALLBACK,
    classification_figures,
    fallback_figures,
    paper_figures,
    predicted_labels,
    regression_figures,
)
from mappa.tasks.dsbench.reference import reference_snippets
from mappa.tasks.tabular import load_dsbench
from mappa.types import Task


def test_binary_f1_is_the_positive_class_and_probabilities_are_cut_at_one_half() -> None:
    truth = ["0", "0", "0", "1", "1"]
    labels = predicted_labels("roc_auc", [0.1, 0.7, 0.2, 0.9, 0.4], ["0", "1"])
    assert labels.tolist() == ["0", "1", "0", "1", "0"]
    out = classification_figures(truth, labels, ["0", "1"])
    assert out["accuracy"] == pytest.approx(0.6)
    assert out["f1"] == pytest.approx(0.5)  # positive class: precision 1/2, recall 1/2
    # predicting the majority class everywhere: high accuracy, F1 0 (the paper's "high accuracy, very low F1")
    assert classification_figures(truth, ["0"] * 5, ["0", "1"]) == {"accuracy": 0.6, "f1": 0.0}


def test_multiclass_probabilities_take_the_largest_column_and_f1_is_macro() -> None:
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.2, 0.5, 0.3]])
    labels = predicted_labels("log_loss", probs, ["b", "a", "c"])  # columns in the submission's class order
    assert labels.tolist() == ["b", "c", "a"]
    out = paper_figures("log_loss", np.array(["b", "c", "c"], dtype=object), probs, ["a", "b", "c"], ["b", "a", "c"])
    assert out["accuracy"] == pytest.approx(2 / 3)
    assert out["f1"] == pytest.approx((0 + 1 + 2 / 3) / 3)  # a: 0, b: 1, c: precision 1, recall 1/2


def test_label_submissions_and_numeric_labels_compare_as_one_class() -> None:
    out = paper_figures("accuracy", np.array(["1", "0", "1"], dtype=object), np.array(["1", "1", "1"]), ["0", "1"])
    assert out == {"accuracy": pytest.approx(2 / 3), "f1": pytest.approx(0.8)}
    out = paper_figures("roc_auc", np.array([1.0, 0.0]), np.array([0.8, 0.3]), ["0", "1"])
    assert out == {"accuracy": 1.0, "f1": 1.0}  # float truth 1.0 is the training label "1"


def test_rmse_is_a_percentage_of_the_training_targets_range_and_iqr() -> None:
    y_train = [0.0, 10.0, 20.0, 30.0, 40.0]  # range 40, IQR 30 - 10 = 20
    out = regression_figures([1.0, 2.0], [3.0, 4.0], y_train)  # RMSE 2
    assert out == {"rmse_range_pct": pytest.approx(5.0), "rmse_iqr_pct": pytest.approx(10.0)}
    assert all(math.isnan(v) for v in regression_figures([1.0], [2.0], [3.0, 3.0]).values())


def test_failed_runs_count_with_their_fallbacks() -> None:
    assert fallback_figures("roc_auc", ["0", "1"], ["0", "1"]) == {
        "accuracy": FAIR_ACCURACY_FALLBACK,
        "f1": FAIR_F1_FALLBACK,
    }
    # regression: the trivial prediction (the training mean, 20) on every test row
    out = fallback_figures("rmse", [20.0, 24.0], [0.0, 10.0, 20.0, 30.0, 40.0])
    assert out["rmse_range_pct"] == pytest.approx(100 * math.sqrt(8) / 40)
    ran = {"accuracy": 0.9, "f1": 0.7}
    failed = fallback_figures("accuracy", ["0"], ["0", "1"])
    assert paper_means([ran, failed]) == {"accuracy": pytest.approx(0.7), "f1": pytest.approx(0.35)}
    assert paper_means([{"rmse_range_pct": 5.0, "rmse_iqr_pct": float("nan")}]) == {"rmse_range_pct": 5.0}


def test_episodes_record_the_figures_and_eval_prints_them(bench: Path, sandbox) -> None:  # noqa: F811
    tasks = load_dsbench(bench, "train")
    episodes = play(tasks, reference_team, sandbox)
    kinds = {e.task.meta["data_type"]: e.meta["submission"]["paper"] for e in episodes}
    assert set(kinds["classification"]) == {"accuracy", "f1"} and kinds["classification"]["accuracy"] > 0.6
    assert set(kinds["regression"]) == {"rmse_range_pct", "rmse_iqr_pct"}
    assert 0 < kinds["regression"]["rmse_range_pct"] < 25 < kinds["regression"]["rmse_iqr_pct"]

    def forgetful(task: Task, agent: str, turn: int) -> str:
        if agent == "data_engineer":
            return fenced(FORGETFUL_ENGINEER) if turn == 0 else "I saved the training data."
        return fenced(reference_snippets(task)[agent])

    (failed,) = play(tasks[:1], forgetful, sandbox)
    assert failed.meta["submission"]["valid"] is False
    assert failed.meta["submission"]["paper"] == {"accuracy": 0.5, "f1": 0.0}
    console = Console(record=True, width=160)
    metrics = episode_metrics(
        [*episodes, failed], ("data_engineer", "modeler", "analyst"), "eval"
    )  # what `mappa train` and `mappa eval` print
    pooled = paper_means([e.meta["submission"]["paper"] for e in [*episodes, failed]])
    assert metrics["eval/tabular/paper/accuracy"] == pytest.approx(pooled["accuracy"])
    classified = [e for e in [*episodes, failed] if e.task.meta["data_type"] == "classification"]
    f1s = [e.meta["submission"]["paper"]["f1"] for e in classified]
    assert 0.0 in f1s  # the failed run counts with F1 0, never dropped
    assert metrics["eval/tabular/classification/paper/f1"] == pytest.approx(sum(f1s) / len(f1s))
    console.print(tabular_table(metrics))
    text = console.export_text()
    assert "classification" in text and "regression" in text and "RMSE % range" in text
