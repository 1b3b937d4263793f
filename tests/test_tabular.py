"""The mini-DSBench's metrics and submission scoring (`mappa.tasks.tabular`), on hand-made task folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn import metrics as skm

from mappa.errors import MappaError
from mappa.tasks.dsbench.metrics import perfect_score, reference_fraction, trivial_prediction
from mappa.tasks.tabular import (
    METRICS,
    dsbench_dir,
    higher_is_better,
    load_dsbench,
    relative_gap,
    score_metric,
    score_submission,
)
from mappa.types import Task


# ------------------------------------------------------------------------------------------------ metrics
def _smape_by_hand(a: list[float], f: list[float]) -> float:
    terms = [0.0 if x == y == 0 else abs(y - x) / ((abs(x) + abs(y)) / 2) for x, y in zip(a, f, strict=True)]
    return 100 * sum(terms) / len(terms)


def _random_case(name: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """Random inputs for `name` and what scikit-learn (or the textbook formula) says of them."""
    n = 200
    if name == "roc_auc":
        t, p = rng.integers(0, 2, n), rng.random(n)
        return t, p, skm.roc_auc_score(t, p)
    if name == "log_loss":
        t, p = rng.integers(0, 2, n), rng.uniform(0.01, 0.99, n)
        return t, p, skm.log_loss(t, p)
    if name in ("accuracy", "macro_f1"):
        t, p = rng.choice(["a", "b", "c"], n), rng.choice(["a", "b", "c"], n)
        expected = skm.accuracy_score(t, p) if name == "accuracy" else skm.f1_score(t, p, average="macro")
        return t, p, expected
    if name == "qwk":
        t, p = rng.integers(0, 6, n), rng.integers(0, 6, n)
        return t, p, skm.cohen_kappa_score(t, p, weights="quadratic")
    t, p = rng.gamma(2.0, 10.0, n), rng.gamma(2.0, 10.0, n)
    expected = {
        "rmse": lambda: skm.root_mean_squared_error(t, p),
        "rmsle": lambda: skm.root_mean_squared_log_error(t, p),
        "mae": lambda: skm.mean_absolute_error(t, p),
        "r2": lambda: skm.r2_score(t, p),
        "smape": lambda: _smape_by_hand(t.tolist(), p.tolist()),
    }[name]()
    return t, p, expected


@pytest.mark.parametrize("name", METRICS)
def test_score_metric_equals_scikit_learn_on_random_inputs(name: str) -> None:
    rng = np.random.default_rng(sum(map(ord, name)))
    for _ in range(5):
        y_true, y_pred, expected = _random_case(name, rng)
        assert score_metric(name, y_true, y_pred) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_multiclass_log_loss_takes_rows_in_the_order_of_labels() -> None:
    rng = np.random.default_rng(0)
    y = rng.choice(["x", "y", "z"], 100)
    proba = rng.dirichlet([1, 1, 1], 100)
    assert score_metric("log_loss", y, proba) == pytest.approx(skm.log_loss(y, proba, labels=["x", "y", "z"]))
    flipped = proba[:, ::-1]
    assert score_metric("log_loss", y, flipped, labels=["z", "y", "x"]) == pytest.approx(skm.log_loss(y, proba))


def test_smape_by_hand_in_percent_with_zero_over_zero_as_zero() -> None:
    # |110-100| / 105 = 0.095238..., 0/0 -> 0, |0-50| / 25 = 2  -> mean 0.698412... -> 69.84%
    assert score_metric("smape", [100, 0, 50], [110, 0, 0]) == pytest.approx(100 * (10 / 105 + 0 + 2) / 3)
    assert score_metric("smape", [0, 0], [0, 0]) == 0.0
    assert score_metric("smape", [5], [-5]) == pytest.approx(200.0)


def test_rmsle_by_hand() -> None:
    e1 = math.e - 1  # log1p(e - 1) = 1
    assert score_metric("rmsle", [0, e1], [e1, e1]) == pytest.approx(math.sqrt(0.5))
    assert score_metric("rmsle", [3, 7], [3, 7]) == 0.0


def test_direction_perfect_scores_and_the_relative_gap() -> None:
    assert {m for m in METRICS if higher_is_better(m)} == {"roc_auc", "accuracy", "macro_f1", "r2", "qwk"}
    for name in METRICS:
        assert relative_gap(name, perfect_score(name), 0.3) == pytest.approx(1.0)
    assert relative_gap("rmse", 0.5, 1.0) == pytest.approx(0.5)
    assert relative_gap("accuracy", 0.4, 0.5) == 0.0  # worse than trivial: clipped at 0
    assert relative_gap("roc_auc", 0.75, 0.5) == pytest.approx(0.5)
    assert reference_fraction(0.75, 0.5, 1.0) == pytest.approx(0.5)
    assert reference_fraction(3.0, 4.0, 2.0) == pytest.approx(0.5)  # lower is better: same formula
    assert reference_fraction(1.0, 4.0, 2.0) == pytest.approx(1.5)  # beats the reference


def test_trivial_predictions() -> None:
    assert trivial_prediction("accuracy", ["b", "a", "b"]) == "b"
    assert trivial_prediction("roc_auc", [0, 1, 1, 1]) == pytest.approx(0.75)
    assert trivial_prediction("log_loss", ["a", "b", "c", "c"]) == {"a": 0.25, "b": 0.25, "c": 0.5}
    assert trivial_prediction("mae", [1, 2, 10]) == 2.0
    assert trivial_prediction("rmse", [1, 2, 9]) == 4.0
    assert trivial_prediction("rmsle", [0, math.e**2 - 1]) == pytest.approx(math.e - 1)


def test_unknown_metric_is_a_user_error() -> None:
    with pytest.raises(MappaError, match="unknown metric 'auc'"):
        score_metric("auc", [1], [1])
    with pytest.raises(ValueError, match="3 true values but 2"):
        score_metric("rmse", [1, 2, 3], [1, 2])


# ------------------------------------------------------------------------------------------------ submissions
def make_task(
    root: Path, metric: str, truth: list, sample: dict[str, list], baseline: float, reference: float
) -> Task:
    """A task folder with answers (ids 11..) and a sample submission, as the builder writes them."""
    task_dir, answer_dir = root / "tasks" / "t", root / "answers" / "t"
    task_dir.mkdir(parents=True)
    answer_dir.mkdir(parents=True)
    ids = list(range(11, 11 + len(truth)))
    pd.DataFrame({"id": ids, "y": truth}).to_csv(answer_dir / "test_answer.csv", index=False)
    pd.DataFrame({"id": ids, **sample}).to_csv(task_dir / "sample_submission.csv", index=False)
    meta = {
        "task_dir": str(task_dir),
        "answer_path": str(answer_dir / "test_answer.csv"),
        "metric": metric,
        "target": "y",
        "id_column": "id",
        "data_type": "regression" if metric in ("rmse", "rmsle", "mae", "smape", "r2") else "classification",
        "baseline_score": baseline,
        "reference_score": reference,
    }
    return Task(id="t", problem="", answer="", source="dsbench", meta=meta)


@pytest.fixture
def rmsle_task(tmp_path: Path) -> Task:
    return make_task(tmp_path, "rmsle", [1.0, 3.0, 7.0, 15.0], {"y": [5.0] * 4}, baseline=1.0, reference=0.2)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_valid_submission_in_any_row_order_with_ids_written_as_floats(rmsle_task: Task, tmp_path: Path) -> None:
    sub = _write(tmp_path / "submission.csv", "y,id\n15,14.0\n1,11\n3, 12\n7.0,13\n")
    result = score_submission(rmsle_task, sub)
    assert result.valid and result.reason == "" and result.metric == "rmsle"
    assert result.score == 0.0 and result.gap == 1.0 and result.reference_fraction == pytest.approx(1.25)
    half = _write(tmp_path / "half.csv", "id,y\n11,0\n12,3\n13,7\n14,15\n")  # one row off by log(2)
    scored = score_submission(rmsle_task, half)
    assert scored.score == pytest.approx(math.sqrt(math.log(2) ** 2 / 4))
    assert scored.gap == pytest.approx(1 - scored.score)  # baseline 1.0, perfect 0


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "no submission.csv"),
        ("", "not a readable CSV"),
        ("\x00\x01\x02garbage\n\xff", "not a readable CSV"),
        ("id,prediction\n11,1\n12,1\n13,1\n14,1\n", "missing column(s) y; unexpected column(s) prediction"),
        ("id,y,extra\n11,1,0\n12,1,0\n13,1,0\n14,1,0\n", "unexpected column(s) extra"),
        ("id,y\n11,1\n12,1\n13,1\n", "3 rows, expected 4"),
        ("id,y\n11,1\n12,1\n13,1\n14,1\n15,1\n16,1\n", "more than 4 rows, expected 4"),  # parsing stops at 5
        ("id,y\n11,1\n11,1\n13,1\n14,1\n", "duplicate id"),
        ("id,y\n11,1\n12,1\n13,1\n99,1\n", "1 missing, 1 unknown (the first at row 4)"),  # never a value
        ("id,y\n11,1\n12,NaN\n13,1\n14,1\n", "1 empty or NaN"),
        ("id,y\n11,1\n12,\n13,1\n14,1\n", "1 empty or NaN"),
        ("id,y\n11,1\n12,abc\n13,1\n14,1\n", "1 non-numeric value(s) in column y, e.g. for id 12"),
        ("id,y\n11,1\n12,inf\n13,1\n14,1\n", "infinite"),
        ("id,y\n11,1\n12,-2\n13,1\n14,1\n", "negative prediction(s)"),
    ],
)
def test_invalid_submissions_give_a_reason_and_never_raise(
    rmsle_task: Task, tmp_path: Path, content: str | None, reason: str
) -> None:
    path = tmp_path / "submission.csv"
    if content is not None:
        path.write_bytes(content.encode("latin-1"))
    result = score_submission(rmsle_task, path)
    assert not result.valid and result.score is None and result.gap == 0.0 and result.reference_fraction == 0.0
    assert reason in result.reason


def test_a_task_with_broken_metadata_is_a_failure_not_a_crash(rmsle_task: Task, tmp_path: Path) -> None:
    sub = _write(tmp_path / "submission.csv", "id,y\n11,1\n12,3\n13,7\n14,15\n")
    broken = rmsle_task.model_copy(update={"meta": {**rmsle_task.meta, "metric": "nope"}})
    result = score_submission(broken, sub)
    assert not result.valid and "unknown metric" in result.reason


def test_probability_and_label_submissions(tmp_path: Path) -> None:
    auc = make_task(tmp_path / "a", "roc_auc", [0, 1, 1, 0], {"y": [0.5] * 4}, baseline=0.5, reference=0.9)
    sub = _write(tmp_path / "auc.csv", "id,y\n11,0.1\n12,0.8\n13,0.7\n14,0.75\n")
    assert score_submission(auc, sub).score == pytest.approx(skm.roc_auc_score([0, 1, 1, 0], [0.1, 0.8, 0.7, 0.75]))
    loss = make_task(tmp_path / "b", "log_loss", [0, 1, 1, 0], {"y": [0.5] * 4}, baseline=0.69, reference=0.3)
    bad = _write(tmp_path / "loss.csv", "id,y\n11,0.1\n12,1.8\n13,0.7\n14,0.75\n")
    assert "outside [0, 1]" in score_submission(loss, bad).reason
    qwk = make_task(tmp_path / "c", "qwk", [1, 2, 3, 10], {"y": [2] * 4}, baseline=0.0, reference=0.5)
    good = _write(tmp_path / "qwk.csv", "id,y\n11,1.0\n12,2\n13,3\n14,10\n")
    assert score_submission(qwk, good).score == pytest.approx(1.0)  # 10 sorts after 3: integers, not text
    graded = _write(tmp_path / "qwk2.csv", "id,y\n11,1\n12,2.5\n13,3\n14,10\n")
    assert "integer class labels" in score_submission(qwk, graded).reason
    acc = make_task(tmp_path / "d", "accuracy", ["NA", "EU", "EU", "None"], {"y": ["EU"] * 4}, 0.5, 0.75)
    labels = _write(tmp_path / "acc.csv", "id,y\n11,NA\n12,EU\n13,EU\n14,EU\n")  # "NA" is a label, not missing
    assert score_submission(acc, labels).score == pytest.approx(0.75)


def test_multiclass_log_loss_submission_is_rescaled_and_checked(tmp_path: Path) -> None:
    sample = {"a": [0.3] * 3, "b": [0.3] * 3, "c": [0.4] * 3}
    task = make_task(tmp_path, "log_loss", ["a", "c", "b"], sample, baseline=1.09, reference=0.5)
    sub = _write(tmp_path / "s.csv", "id,c,b,a\n11,1,1,2\n12,2,1,1\n13,0,3,1\n")
    expected = skm.log_loss(["a", "c", "b"], [[0.5, 0.25, 0.25], [0.25, 0.25, 0.5], [0.25, 0.75, 0]])
    assert score_submission(task, sub).score == pytest.approx(expected)
    zero = _write(tmp_path / "z.csv", "id,a,b,c\n11,0,0,0\n12,0.2,0.3,0.5\n13,0.2,0.3,0.5\n")
    assert "probabilities are all 0" in score_submission(task, zero).reason
    negative = _write(tmp_path / "n.csv", "id,a,b,c\n11,-1,1,1\n12,0.2,0.3,0.5\n13,0.2,0.3,0.5\n")
    assert "negative probabilities" in score_submission(task, negative).reason


# ------------------------------------------------------------------------------------------------ loading
def _index_row(task_id: str, split: str) -> dict:
    return {
        "id": task_id,
        "split": split,
        "data_type": "regression",
        "metric": "rmse",
        "target": "y",
        "id_column": "id",
        "source": "test:table",
        "baseline_score": 2.0,
        "reference_score": 1.0,
        "n_train": 3,
        "n_test": 2,
        "n_features": 1,
        "title": "T",
    }


def _bench(root: Path, rows: list[dict]) -> Path:
    for row in rows:
        d = root / "tasks" / row["id"]
        d.mkdir(parents=True)
        for name in ("train.csv", "test.csv", "sample_submission.csv"):
            (d / name).write_text("id\n", encoding="utf-8")
        (d / "description.txt").write_text(f"# {row['id']}\n", encoding="utf-8")
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def test_load_dsbench_reads_one_split_with_paths_in_meta(tmp_path: Path) -> None:
    root = _bench(tmp_path / "b", [_index_row("z", "train"), _index_row("a", "train"), _index_row("e", "eval")])
    train = load_dsbench(root, "train")
    assert [t.id for t in train] == ["a", "z"]
    assert train[0].problem == "# a\n" and train[0].source == "dsbench" and train[0].answer == ""
    assert train[0].meta["task_dir"] == str(root.resolve() / "tasks" / "a")
    assert train[0].meta["answer_path"] == str(root.resolve() / "answers" / "a" / "test_answer.csv")
    assert train[0].meta["metric"] == "rmse" and train[0].meta["reference_score"] == 1.0
    assert [t.id for t in load_dsbench(root, "eval")] == ["e"]


def test_load_dsbench_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(MappaError, match="tasks.jsonl: not found .*mappa dsbench build"):
        load_dsbench(tmp_path, "train")
    root = _bench(tmp_path / "b", [_index_row("a", "train")])
    (root / "tasks" / "a" / "test.csv").unlink()
    with pytest.raises(MappaError, match="missing test.csv"):
        load_dsbench(root, "train")
    (root / "tasks.jsonl").write_text("{oops\n", encoding="utf-8")
    with pytest.raises(MappaError, match="tasks.jsonl:1: invalid JSON"):
        load_dsbench(root, "train")
    (root / "tasks.jsonl").write_text('{"id": "a", "split": "train"}\n', encoding="utf-8")
    with pytest.raises(MappaError, match="tasks.jsonl:1: missing data_type, metric, target"):
        load_dsbench(root, "train")


def test_dsbench_dir_prefers_the_config_then_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configured = _bench(tmp_path / "c", [_index_row("a", "train")])
    from_env = _bench(tmp_path / "e", [_index_row("a", "train")])
    monkeypatch.setenv("MAPPA_DSBENCH_DIR", str(from_env))
    assert dsbench_dir(str(configured)) == configured
    assert dsbench_dir(None) == from_env
