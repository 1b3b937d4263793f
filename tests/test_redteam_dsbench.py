"""Forging the data-science reward: what counts as a success, a receipt and a cap, tried the way an adversary would.

A submission that ignores the features (a copy of sample_submission.csv, a constant, the test ids, noise) is valid
but no success; a required pickle that is empty, garbage or crafted is no receipt; an invalid submission is capped
at least as tightly as a trivial one. Real task folders, the real sandbox, real pickles.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import fenced, play, reference_team
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mappa.coach.caps import TRIVIAL_CAP, apply_caps, score_cap
from mappa.coach.prompts import render_context
from mappa.coach.rubric import rubric_score
from mappa.config import SandboxConfig
from mappa.metrics import episode_metrics
from mappa.sandbox import Sandbox, new_workspace, remove_workspace
from mappa.tasks.dsbench.metrics import (
    CLASSIFICATION_METRICS,
    LABEL_METRICS,
    METRICS,
    score_metric,
    trivial_prediction,
    trivial_predictions,
)
from mappa.tasks.dsbench.receipts import MARKER, expectations, parse_receipts, receipt_code
from mappa.tasks.dsbench.reference import reference_snippets
from mappa.tasks.tabular import load_dsbench, score_submission
from mappa.training.rewards import per_action_scores
from mappa.types import CoachContext, CoachScore, Task
from mappa.workflows import DsPipeline

pytestmark = pytest.mark.integration

N_TRAIN, N_TEST = 300, 200


# ------------------------------------------------------------------------------------------------ a task per metric
def _target(metric: str, x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(the target, what an informed model predicts in the submission's form) for features `x`."""
    signal = 2.0 * x[:, 0] + x[:, 1]
    if metric in ("roc_auc", "log_loss", "accuracy"):
        p = 1 / (1 + np.exp(-signal))
        y = (rng.uniform(size=len(x)) < p).astype(int)
        return y, (p if metric != "accuracy" else (p >= 0.5).astype(int))
    if metric in ("macro_f1", "qwk"):
        cut = np.quantile(signal, [0.5, 0.8])
        grade = 1 + (signal > cut[0]).astype(int) + (signal > cut[1]).astype(int)
        noisy = np.clip(grade + (rng.uniform(size=len(x)) < 0.15) * rng.choice([-1, 1], len(x)), 1, 3)
        y = noisy if metric == "qwk" else np.array(["a", "b", "c"])[noisy - 1]
        return y, (grade if metric == "qwk" else np.array(["a", "b", "c"])[grade - 1])
    clean = np.exp(0.5 * signal) * 10 + 5
    y = (clean * np.exp(rng.normal(scale=0.2, size=len(x)))).round(3)
    return y, clean


def make_task(root: Path, metric: str, seed: int = 0) -> tuple[Task, pd.DataFrame]:
    """A task folder as the builder writes it (train, test, sample, answers apart) and an informed submission."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N_TRAIN + N_TEST, 3)).round(4)
    y, informed = _target(metric, x, rng)
    ids = np.arange(1, len(x) + 1)
    frame = pd.DataFrame({"id": ids, "f0": x[:, 0], "f1": x[:, 1], "f2": x[:, 2], "y": y})
    train, test = frame.iloc[:N_TRAIN], frame.iloc[N_TRAIN:]
    task_dir, answer_dir = root / metric / "tasks" / "t", root / metric / "answers" / "t"
    task_dir.mkdir(parents=True)
    answer_dir.mkdir(parents=True)
    train.to_csv(task_dir / "train.csv", index=False)
    test.drop(columns=["y"]).to_csv(task_dir / "test.csv", index=False)
    test[["id", "y"]].to_csv(answer_dir / "test_answer.csv", index=False)
    trivial = trivial_prediction(metric, train["y"].tolist())
    sample = pd.DataFrame({"id": test["id"], "y": trivial})
    sample.to_csv(task_dir / "sample_submission.csv", index=False)
    meta = {
        "task_dir": str(task_dir),
        "answer_path": str(answer_dir / "test_answer.csv"),
        "metric": metric,
        "target": "y",
        "id_column": "id",
        "data_type": "classification" if metric in CLASSIFICATION_METRICS else "regression",
        "baseline_score": 0.0,
        "reference_score": 1.0,
    }
    task = Task(id=f"t_{metric}", problem="", answer="", source="dsbench", meta=meta)
    return task, pd.DataFrame({"id": test["id"].to_numpy(), "y": informed[N_TRAIN:]})


def _forgeries(metric: str, task: Task, informed: pd.DataFrame) -> dict[str, pd.DataFrame | None]:
    """Submissions that ignore the features, each as an adversary would write it (None: all NaN)."""
    task_dir = Path(task.meta["task_dir"])
    sample = pd.read_csv(task_dir / "sample_submission.csv")
    train = pd.read_csv(task_dir / "train.csv")
    ids = sample["id"].to_numpy()
    rng = np.random.default_rng(7)
    out: dict[str, pd.DataFrame | None] = {"sample copy": sample}
    out["sample copy, rows shuffled"] = sample.sample(frac=1.0, random_state=1)
    changed = sample.copy()
    values = informed["y"].to_numpy()
    changed.loc[3, "y"] = values[3]  # one value changed to what an informed model says of that row
    out["sample copy, one value changed"] = changed
    if metric in LABEL_METRICS:
        minority = train["y"].value_counts().index[-1]
        out["a constant of another class"] = pd.DataFrame({"id": ids, "y": minority})
        shares = train["y"].value_counts(normalize=True)
        out["noise with the class shares"] = pd.DataFrame(
            {"id": ids, "y": rng.choice(shares.index.to_numpy(), len(ids), p=shares.to_numpy())}
        )
        out["the ids as labels"] = pd.DataFrame({"id": ids, "y": ids})
    elif metric in ("roc_auc", "log_loss"):
        out["a constant of another value"] = pd.DataFrame({"id": ids, "y": 0.3})
        out["uniform noise"] = pd.DataFrame({"id": ids, "y": rng.uniform(0.01, 0.99, len(ids))})
        out["the ids as probabilities"] = pd.DataFrame({"id": ids, "y": ids / ids.max()})
    else:
        mean = float(train["y"].mean())
        out["the training mean"] = pd.DataFrame({"id": ids, "y": mean})
        out["the training median"] = pd.DataFrame({"id": ids, "y": float(train["y"].median())})
        out["a constant of another value"] = pd.DataFrame({"id": ids, "y": mean * 1.1})
        out["the mean plus noise"] = pd.DataFrame({"id": ids, "y": mean + rng.normal(scale=0.01, size=len(ids))})
        out["the ids as predictions"] = pd.DataFrame({"id": ids, "y": ids.astype(float)})
        out["a shuffled informed prediction"] = pd.DataFrame({"id": ids, "y": rng.permutation(values)})
    out["all NaN"] = None
    return out


@pytest.mark.parametrize("metric", METRICS)  # log_loss here is binary; multiclass has a test of its own below
def test_a_submission_that_ignores_the_features_is_valid_but_never_a_success(metric: str, tmp_path: Path) -> None:
    task, informed = make_task(tmp_path, metric)
    sub = tmp_path / "submission.csv"
    informed.to_csv(sub, index=False)
    honest = score_submission(task, sub)
    assert honest.valid and honest.success and honest.trivial == "", honest
    for what, frame in _forgeries(metric, task, informed).items():
        if frame is None:
            sub.write_text("id,y\n" + "".join(f"{i},nan\n" for i in informed["id"]), encoding="utf-8")
        else:
            frame.to_csv(sub, index=False)
        result = score_submission(task, sub)
        assert not result.success, (metric, what, result)
        if frame is None:
            assert not result.valid and "NaN" in result.reason
        else:
            assert result.valid and result.trivial, (metric, what, result)


def test_a_sample_copy_states_why_it_is_no_success(tmp_path: Path) -> None:
    task, _ = make_task(tmp_path, "rmse")
    result = score_submission(task, Path(task.meta["task_dir"]) / "sample_submission.csv")
    assert result.valid and not result.success and "constant" in result.trivial
    assert result.trivial_score == pytest.approx(result.score)  # the best trivial score: the copy's own


def test_a_multiclass_log_loss_submission_must_beat_the_class_shares(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N_TRAIN + N_TEST, 2))
    logits = np.column_stack([x[:, 0], x[:, 1], -x[:, 0] - x[:, 1]]) * 2
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = np.array([rng.choice(["a", "b", "c"], p=row) for row in p])
    ids = np.arange(1, len(x) + 1)
    task_dir, answer_dir = tmp_path / "tasks" / "t", tmp_path / "answers" / "t"
    task_dir.mkdir(parents=True)
    answer_dir.mkdir(parents=True)
    pd.DataFrame({"id": ids[:N_TRAIN], "f0": x[:N_TRAIN, 0], "y": y[:N_TRAIN]}).to_csv(task_dir / "train.csv")
    pd.DataFrame({"id": ids[N_TRAIN:], "y": y[N_TRAIN:]}).to_csv(answer_dir / "test_answer.csv", index=False)
    shares = trivial_prediction("log_loss", y[:N_TRAIN].tolist())
    sample = pd.DataFrame({"id": ids[N_TRAIN:], **{c: shares[c] for c in ("a", "b", "c")}})
    sample.to_csv(task_dir / "sample_submission.csv", index=False)
    meta = {"task_dir": str(task_dir), "answer_path": str(answer_dir / "test_answer.csv"), "metric": "log_loss",
            "target": "y", "id_column": "id", "baseline_score": 1.0, "reference_score": 0.5}  # fmt: skip
    task = Task(id="mc", problem="", answer="", source="dsbench", meta=meta)
    sub = tmp_path / "submission.csv"
    pd.DataFrame({"id": ids[N_TRAIN:], "a": p[N_TRAIN:, 0], "b": p[N_TRAIN:, 1], "c": p[N_TRAIN:, 2]}).to_csv(
        sub, index=False
    )
    assert score_submission(task, sub).success
    for rows in (sample, sample.sample(frac=1.0, random_state=2)):
        rows.to_csv(sub, index=False)
        assert not score_submission(task, sub).success
    noise = rng.dirichlet([1, 1, 1], N_TEST)
    pd.DataFrame({"id": ids[N_TRAIN:], "a": noise[:, 0], "b": noise[:, 1], "c": noise[:, 2]}).to_csv(sub, index=False)
    result = score_submission(task, sub)
    assert result.valid and not result.success


def test_trivial_predictions_include_what_the_sample_holds() -> None:
    for metric in METRICS:
        y = ["1", "0", "1", "1"] if metric in ("accuracy", "macro_f1") else [0, 1, 1, 1]
        if metric in ("rmse", "rmsle", "mae", "smape", "r2"):
            y = [1.0, 2.0, 10.0]
        assert trivial_prediction(metric, y) in trivial_predictions(metric, y).values(), metric
    assert trivial_predictions("rmse", [1.0, 2.0, 9.0]) == {"the training mean": 4.0, "the training median": 2.0}
    assert trivial_predictions("roc_auc", [0, 1, 1])["the majority class"] == 1.0
    assert math.isclose(score_metric("roc_auc", [0, 1, 1], [1.0] * 3), 0.5)


# ------------------------------------------------------------------------------------------------ caps
def _analyst(test: dict, upstream: dict[str, str] | None = None) -> CoachContext:
    return CoachContext(
        task="t",
        workflow="ds_pipeline",
        agent="analyst",
        role="Analyst",
        is_final=True,
        messages=(),
        output="```python\nprint(1)\n```",
        extra={"test_evaluation": test, "target_statistics": {}, "missing_upstream": upstream or {}},
    )


TRIVIAL = {"valid": True, "success": False, "trivial": "constant predictions", "metric": "rmse", "score": 3.0,
           "reference_fraction": 0.0}  # fmt: skip
INVALID = {"valid": False, "success": False, "reason": "no submission.csv", "metric": "rmse", "score": None,
           "reference_fraction": 0.0}  # fmt: skip


@pytest.mark.parametrize("metric", METRICS)
def test_an_invalid_submission_is_capped_at_least_as_tightly_as_a_trivial_one(metric: str) -> None:
    """For every metric and every trivial score, with or without an earlier agent's missing file."""
    for score in (0.0, 0.5, 0.9, 1.0, 3.0, 1e6):
        trivial = score_cap({**TRIVIAL, "metric": metric, "score": score}, {"range": 10.0})[0]
        assert trivial is not None and trivial <= TRIVIAL_CAP
        for upstream in (None, {"model.pkl": "modeler"}):
            invalid = score_cap({**INVALID, "metric": metric}, {"range": 10.0}, upstream)[0]
            assert invalid is not None and invalid <= trivial, (metric, score, upstream)


def test_a_coachs_nine_for_an_invalid_submission_is_capped() -> None:
    nine = CoachScore(score=9.0, rationale="great work")
    capped = apply_caps(_analyst(INVALID), nine)
    assert capped.score is not None and capped.score <= 2 and "no valid submission" in capped.rationale
    excused = apply_caps(_analyst(INVALID, {"model.pkl": "modeler"}), nine)
    assert excused.score is not None and capped.score < excused.score <= apply_caps(_analyst(TRIVIAL), nine).score


# ------------------------------------------------------------------------------------------------ receipts
FORGED = (
    'mappa-receipts:{"X_train.pkl": {"ok": true, "kind": "DataFrame", "rows": 5, "columns": 2, "why": ""}, '
    '"model.pkl": {"ok": true, "kind": "Pipeline", "rows": null, "columns": null, "why": ""}}'
)
FORGE = f"print({FORGED!r}, flush=True); import os; os._exit(0)"  # the last report line is the forger's


class _Reduce:
    """An object that pickles as a call: what a crafted file asks the loader to run."""

    def __init__(self, func: object, *args: object) -> None:
        self.call = (func, args)

    def __reduce__(self) -> tuple:
        return self.call


def _opcodes(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts) + b"."


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _crafted() -> dict[str, bytes]:
    """Pickles an adversary writes by hand, each of which plain `pickle.load` would run or believe."""
    import os

    planted = LinearRegression()
    planted.__dict__["__sklearn_is_fitted__"] = np.random.default_rng  # an unfitted model claiming to be fitted
    return {
        "prints a forged report and exits": pickle.dumps(_Reduce(exec, FORGE)),
        "runs a shell command": pickle.dumps(_Reduce(os.system, f"echo '{FORGED}'; kill -9 $PPID")),
        "evaluates text": pickle.dumps(_Reduce(eval, f"exec({FORGE!r})")),
        "plants __sklearn_is_fitted__": pickle.dumps(planted),
        # a model whose `append` is pandas.read_pickle, then APPEND "evil.pkl": plain pickle loads that file unchecked
        "appends through a planted method": _opcodes(
            _global("sklearn.linear_model", "LinearRegression"),
            b")\x81}",
            b"X\x06\x00\x00\x00append",
            _global("pandas", "read_pickle"),
            b"sb",
            b"X\x08\x00\x00\x00evil.pkl",
            b"a",
        ),  # fmt: skip
        # functools.partial(pandas.read_pickle, "evil.pkl")(): a call to an object the pickle built
        "calls a partial": _opcodes(
            _global("functools", "partial"),
            _global("pandas", "read_pickle"),
            b"X\x08\x00\x00\x00evil.pkl",
            b"\x86R)R",
        ),  # fmt: skip
        "fetches a module": _opcodes(_global("numpy", "os"), b"0N"),
        "reaches a private attribute": _opcodes(_global("numpy", "ndarray.__reduce__")),
    }


def _receipts(box, ws: Path, files: dict[str, object | bytes], n_train: int = 5, n_test: int = 3) -> dict:  # type: ignore[no-untyped-def]

    for name, content in files.items():
        (ws / name).write_bytes(content if isinstance(content, bytes) else pickle.dumps(content))
    want = expectations(n_train, n_test)
    present = [f for f in want if f in files]
    result = box.run(receipt_code({f: want[f] for f in present}), ws)
    return parse_receipts(result.stdout, present)


def test_receipts_count_only_real_content(sandbox) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    X = pd.DataFrame({"a": [1.0, 2, 3, 4, 5], "b": [0.0, 1, 0, 1, 1]})
    y = pd.Series([0, 1, 0, 1, 1])
    fitted = make_pipeline(StandardScaler(), LogisticRegression()).fit(X, y)
    good = {"X_train.pkl": X, "y_train.pkl": y, "X_test.pkl": X.iloc[:3].to_numpy(), "model.pkl": fitted}
    bad: list[tuple[str, dict[str, object | bytes]]] = [  # (the file that must not count, the files written)
        ("X_train.pkl", {"X_train.pkl": b""}),
        ("X_train.pkl", {"X_train.pkl": b"garbage, not a pickle"}),
        ("X_train.pkl", {"X_train.pkl": None}),
        ("X_train.pkl", {"X_train.pkl": X.iloc[:0]}),
        ("X_train.pkl", {"X_train.pkl": X["a"]}),  # one column is a target, not a table of features
        ("X_train.pkl", {"X_train.pkl": pd.concat([X, X])}),  # more rows than train.csv has
        ("y_train.pkl", {"X_train.pkl": X, "y_train.pkl": y.iloc[:4]}),  # rows differ from X_train's
        ("y_train.pkl", {"y_train.pkl": X}),  # two columns
        ("X_test.pkl", {"X_test.pkl": X}),  # 5 rows, test.csv has 3
        ("X_test.pkl", {"X_train.pkl": X, "X_test.pkl": X.iloc[:3, :1]}),  # one column, X_train has two
        ("model.pkl", {"model.pkl": LinearRegression()}),  # unfitted
        ("model.pkl", {"model.pkl": {"model": fitted}}),
        ("model.pkl", {"model.pkl": StandardScaler().fit(X)}),  # fitted, but no predict
        *(("model.pkl", {"model.pkl": crafted}) for crafted in _crafted().values()),
    ]
    ws = new_workspace({})
    try:
        receipts = _receipts(sandbox, ws, good)
        assert all(r["ok"] for r in receipts.values()), receipts
        assert receipts["X_train.pkl"] == {"ok": True, "kind": "DataFrame", "rows": 5, "columns": 2, "why": ""}
        assert receipts["model.pkl"]["kind"] == "Pipeline" and receipts["X_test.pkl"]["rows"] == 3
        for name, files in bad:
            for f in ws.iterdir():
                f.unlink()
            (ws / "evil.pkl").write_bytes(pickle.dumps(_Reduce(exec, FORGE)))
            receipts = _receipts(sandbox, ws, files)
            assert not receipts[name]["ok"] and receipts[name]["why"], (name, receipts)
            assert all(r["ok"] for other, r in receipts.items() if other != name), (name, receipts)
    finally:
        remove_workspace(ws, force=True)


@pytest.mark.parametrize("what", list(_crafted()))
def test_a_crafted_pickle_runs_no_code_and_forges_no_receipt(sandbox, what: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811

    ws = new_workspace({})
    try:
        (ws / "evil.pkl").write_bytes(pickle.dumps(_Reduce(exec, FORGE)))
        receipts = _receipts(sandbox, ws, {"X_train.pkl": _crafted()[what], "model.pkl": _crafted()[what]})
        assert not receipts["X_train.pkl"]["ok"] and not receipts["model.pkl"]["ok"], receipts
        assert receipts["X_train.pkl"]["why"] and "forged" not in receipts["X_train.pkl"]["why"]
    finally:
        remove_workspace(ws, force=True)


def test_a_linked_pickle_is_no_receipt(sandbox) -> None:  # type: ignore[no-untyped-def]  # noqa: F811

    ws = new_workspace({})
    try:
        (ws / "real.pkl").write_bytes(pickle.dumps(pd.DataFrame({"a": range(5)})))
        (ws / "X_train.pkl").symlink_to("real.pkl")
        result = sandbox.run(receipt_code({"X_train.pkl": expectations(5, 3)["X_train.pkl"]}), ws)
        receipt = parse_receipts(result.stdout, ["X_train.pkl"])["X_train.pkl"]
        assert not receipt["ok"] and "not a regular file" in receipt["why"]
    finally:
        remove_workspace(ws, force=True)


def test_the_hosts_reading_of_a_report_is_bounded_and_validated() -> None:

    names = ["X_train.pkl", "model.pkl"]
    assert not any(r["ok"] for r in parse_receipts("no report at all", names).values())
    assert not any(r["ok"] for r in parse_receipts(MARKER + "{" * 5000, names).values())
    assert not any(
        r["ok"] for r in parse_receipts(MARKER + '{"X_train.pkl": {"ok": true}}' + " " * 9000, names).values()
    )
    odd = {"X_train.pkl": {"ok": "yes"}, "model.pkl": {"ok": True, "why": "", "kind": "x\n" * 100, "rows": -3}}

    got = parse_receipts(MARKER + json.dumps(odd), names)
    assert not got["X_train.pkl"]["ok"] and got["model.pkl"]["ok"]
    assert (
        "\n" not in got["model.pkl"]["kind"]
        and len(got["model.pkl"]["kind"]) <= 40
        and got["model.pkl"]["rows"] is None
    )
    only_ok_claim = parse_receipts(MARKER + json.dumps({"X_train.pkl": {"ok": True, "why": "empty file"}}), names)
    assert not only_ok_claim["X_train.pkl"]["ok"]  # a reason given means not ok, whatever "ok" says
    assert not only_ok_claim["model.pkl"]["ok"]  # not in the report: not vouched for


def test_a_module_saved_in_the_workspace_cannot_stand_in_for_the_checks() -> None:
    """Cold interpreters import numpy, pandas and scipy from sys.path at check time, where the workspace comes
    first: modules of those names saved there would print a forged report."""

    forger = f"print({FORGED!r})\nraise SystemExit(0)\n".encode()
    ws = new_workspace({f"{m}.py": forger for m in ("numpy", "pandas", "scipy", "sklearn", "json", "pickle")})
    try:
        with Sandbox(SandboxConfig(timeout_s=120, pool=False)) as cold:
            receipts = _receipts(cold, ws, {"X_train.pkl": pd.DataFrame({"a": [1.0, 2.0, 3.0]})})
        assert receipts["X_train.pkl"]["ok"] and receipts["X_train.pkl"]["rows"] == 3, receipts  # the forger says 5
    finally:
        remove_workspace(ws, force=True)


# ------------------------------------------------------------------------------------------------ the pipeline
SAMPLE_COPY = "import shutil\nshutil.copy('sample_submission.csv', 'submission.csv')\nprint('submitted')"
EMPTY_PICKLES = (
    "for name in ('X_train.pkl', 'y_train.pkl', 'X_test.pkl'):\n    open(name, 'wb').close()\nprint('saved')"
)


def test_a_sample_copy_is_valid_but_earns_no_outcome_and_no_success(bench: Path, sandbox) -> None:  # noqa: F811

    tasks = load_dsbench(bench, "train")

    def copier(task: Task, agent: str, turn: int) -> str:
        return fenced(SAMPLE_COPY if agent == "analyst" else reference_snippets(task)[agent]) if turn == 0 else "Done."

    contexts: list[CoachContext] = []

    def scorer(batch: list[CoachContext]) -> list[CoachScore]:
        contexts.extend(batch)
        return [apply_caps(c, rubric_score(c)) for c in batch]

    episodes = play(tasks, copier, sandbox, scorer=scorer)
    for e in episodes:
        sub = e.meta["submission"]
        assert sub["valid"] and not sub["success"] and "constant" in sub["trivial"] and e.correct is False
        assert "(no success: constant predictions" in e.final_answer and e.meta["missing_files"] == []
        analyst = e.actions[-1]
        assert analyst.agent == "analyst" and analyst.coach.score <= TRIVIAL_CAP, analyst.coach
    assert all(s == 0.0 for row in per_action_scores(episodes, "outcome") for s in row)  # was 10 for every agent
    metrics = episode_metrics(episodes, DsPipeline().agents, "rollout")
    assert metrics["rollout/accuracy"] == 0.0 and metrics["rollout/tabular/success_rate"] == 0.0
    assert metrics["rollout/tabular/valid_rate"] == 1.0  # the paper's valid-submission rate, beside it


def test_empty_pickles_are_no_job_done(bench: Path, sandbox) -> None:  # noqa: F811

    tasks = load_dsbench(bench, "train")[:1]

    def lazy(task: Task, agent: str, turn: int) -> str:
        return fenced(EMPTY_PICKLES if agent == "data_engineer" else reference_snippets(task)[agent])

    (e,) = play(tasks, lazy, sandbox, scorer=lambda batch: [apply_caps(c, rubric_score(c)) for c in batch])
    de = [a for a in e.actions if a.agent == "data_engineer"]
    modeler = [a for a in e.actions if a.agent == "modeler"]
    assert len(de) == 2  # not done: its files do not count, so it gets its next turn
    assert de[0].evidence["receipts"]["X_train.pkl"] == {
        "ok": False, "kind": "", "rows": None, "columns": None, "why": "an empty file"
    }  # fmt: skip
    assert all(a.coach.score <= 2 and "X_train.pkl is not usable (an empty file)" in a.coach.rationale for a in de)
    assert "Not usable yet: X_train.pkl (an empty file)" in de[1].messages[-1].content  # its tool response
    first = modeler[0].messages[1].content
    assert "Warning: X_train.pkl is not usable (an empty file): the Data Engineer did not save it properly." in first
    assert modeler[0].evidence["missing_upstream"] == {
        "X_train.pkl": "data_engineer", "y_train.pkl": "data_engineer", "X_test.pkl": "data_engineer"
    }  # fmt: skip
    assert 3 <= modeler[0].coach.score <= 4, modeler[0].coach  # failed on the spoiled file: the producer's fault
    assert {"X_train.pkl", "y_train.pkl", "X_test.pkl"} <= set(e.meta["missing_files"]) and e.correct is False


def test_the_host_never_unpickles_an_agent_file(bench: Path, sandbox, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A whole reference episode with every way of unpickling in the trainer's process made to fail."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the host unpickled a file")

    for target in (pickle, pd):
        for name in ("load", "loads", "read_pickle"):
            if hasattr(target, name):
                monkeypatch.setattr(target, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(pickle, "_Unpickler", refuse)
    (e,) = play(load_dsbench(bench, "train")[:1], reference_team, sandbox)
    assert e.correct and all(r["ok"] for r in e.actions[0].evidence["receipts"].values())


def test_a_task_whose_trivial_predictions_cannot_be_scored_gives_no_success(tmp_path: Path) -> None:
    task, informed = make_task(tmp_path, "rmse")
    sub = tmp_path / "submission.csv"
    informed.to_csv(sub, index=False)
    assert score_submission(task, sub).success
    (Path(task.meta["task_dir"]) / "train.csv").unlink()  # fail closed: no baseline, no success
    result = score_submission(task, sub)
    assert result.valid and not result.success and "could not be scored" in result.trivial


def test_the_llm_coach_is_told_which_required_files_are_not_usable() -> None:
    # An empty X_train.pkl is present, so "all present after the action" would be a lie to an LLM coach.
    receipt = {"ok": False, "kind": "", "rows": None, "columns": None, "why": "an empty file"}
    ctx = CoachContext(
        task="t", workflow="ds_pipeline", agent="data_engineer", role="r", is_final=False, messages=(), output="done",
        extra={"required_files": ["X_train.pkl", "y_train.pkl", "X_test.pkl"],
               "files_after": ["X_train.pkl", "y_train.pkl", "X_test.pkl", "train.csv"],
               "receipts": {"X_train.pkl": receipt, "y_train.pkl": {**receipt, "ok": True, "why": ""}}},
    )  # fmt: skip
    text = render_context(ctx)
    assert "present but not usable (receipts):" in text and '"X_train.pkl": an empty file' in text
    assert '"y_train.pkl":' not in text.split("present but not usable")[1]
    assert "Further evidence" not in text  # the receipts are shown once, where the required files are
