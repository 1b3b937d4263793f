"""The scripted reference team: real code for Data Engineer -> Modeler -> Analyst, written without a model.

    snippets = reference_snippets(task)   # {"data_engineer": code, "modeler": code, "analyst": code}

Each snippet is plain Python run in the episode's workspace (the working directory), in that order:
the Data Engineer reads train.csv/test.csv and saves X_train.pkl, y_train.pkl, X_test.pkl; the Modeler fits
scikit-learn's HistGradientBoosting with its default settings (a fixed random_state; a log1p target for
rmsle) and saves model.pkl; the Analyst predicts the test rows and writes submission.csv in the format of
sample_submission.csv. The build runs it on every task through the sandbox (the reference score) and drops
tasks it cannot solve; the ds_pipeline workflow's tests use it as a scripted policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mappa.sandbox import Sandbox, new_workspace, remove_workspace
from mappa.tasks.dsbench.submission import SubmissionScore, score_submission
from mappa.types import ExecResult, Task

AGENTS = ("data_engineer", "modeler", "analyst")
TASK_FILES = ("train.csv", "test.csv", "sample_submission.csv", "description.txt")  # all a workspace gets

_DATA_ENGINEER = """\
import pickle

import pandas as pd

TARGET, ID = {target!r}, {id_column!r}
train = pd.read_csv("train.csv")
test = pd.read_csv("test.csv")
y_train = train.pop(TARGET)
X_train = train.drop(columns=[ID])
X_test = test.drop(columns=[ID])[X_train.columns]
# Text columns become categories over one vocabulary (train + test), so a code means the same on both sides;
# beyond the 255 bins the model has for a categorical feature, they become ordinal codes instead.
for col in X_train.columns:
    if pd.api.types.is_numeric_dtype(X_train[col]):
        continue
    vocab = sorted(set(X_train[col].dropna().astype(str)) | set(X_test[col].dropna().astype(str)))
    for frame in (X_train, X_test):
        text = frame[col].astype(str).where(frame[col].notna())
        frame[col] = text.astype(pd.CategoricalDtype(vocab))
        if len(vocab) > 250:
            frame[col] = frame[col].cat.codes.astype(float).where(frame[col].notna())
for name, obj in [("X_train", X_train), ("y_train", y_train), ("X_test", X_test)]:
    with open(f"{{name}}.pkl", "wb") as f:
        pickle.dump(obj, f)
print("X_train", X_train.shape, "X_test", X_test.shape, "categorical:", int((X_train.dtypes == "category").sum()))
"""

_MODELER = """\
import pickle

import numpy as np
from sklearn.compose import TransformedTargetRegressor
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

with open("X_train.pkl", "rb") as f:
    X_train = pickle.load(f)
with open("y_train.pkl", "rb") as f:
    y_train = pickle.load(f)
DATA_TYPE, METRIC = {data_type!r}, {metric!r}
if DATA_TYPE == "classification":
    model = HistGradientBoostingClassifier(random_state=0)
else:
    model = HistGradientBoostingRegressor(random_state=0)
    if METRIC == "rmsle":  # fit on the scale the metric measures
        model = TransformedTargetRegressor(regressor=model, func=np.log1p, inverse_func=np.expm1)
model.fit(X_train, y_train)
with open("model.pkl", "wb") as f:
    pickle.dump(model, f)
print("training score", round(model.score(X_train, y_train), 4))
"""

_ANALYST = """\
import pickle

import numpy as np
import pandas as pd

TARGET, ID, METRIC = {target!r}, {id_column!r}, {metric!r}
with open("model.pkl", "rb") as f:
    model = pickle.load(f)
with open("X_test.pkl", "rb") as f:
    X_test = pickle.load(f)
ids = pd.read_csv("test.csv")[ID]
columns = list(pd.read_csv("sample_submission.csv", nrows=1).columns)
if METRIC == "log_loss" and TARGET not in columns:  # multiclass: one probability column per class
    proba = pd.DataFrame(model.predict_proba(X_test), columns=[str(c) for c in model.classes_])
    submission = proba.reindex(columns=columns[1:], fill_value=0.0)
elif METRIC in ("roc_auc", "log_loss"):  # the probability of the positive class (the greater label)
    submission = pd.DataFrame({{TARGET: model.predict_proba(X_test)[:, -1]}})
else:
    prediction = model.predict(X_test)
    if METRIC == "rmsle":
        prediction = np.clip(prediction, 0, None)
    submission = pd.DataFrame({{TARGET: prediction}})
submission.insert(0, ID, ids.to_numpy())
submission.to_csv("submission.csv", index=False)
print(submission.shape, "written to submission.csv")
"""


def reference_snippets(task: Task) -> dict[str, str]:
    """The three agents' code for a mini-DSBench task (its meta names the target, id column, metric, type)."""
    fields: dict[str, Any] = {k: task.meta[k] for k in ("target", "id_column", "data_type", "metric")}
    return {
        "data_engineer": _DATA_ENGINEER.format(**fields),
        "modeler": _MODELER.format(**fields),
        "analyst": _ANALYST.format(**fields),
    }


@dataclass(frozen=True)
class ReferenceRun:
    """The reference team's run on one task."""

    score: SubmissionScore | None  # None: a step failed
    failure: str  # "agent: what went wrong"; "" when every step ran
    sandbox_s: float  # the three snippets' sandbox time
    files: tuple[str, ...]  # every file of the workspace at the end, sorted
    infra_error: bool = False  # the sandbox itself failed: no verdict on the task


def _failure(agent: str, result: ExecResult) -> str:
    if result.infra_error:
        return f"{agent}: sandbox failure ({result.infra_error})"
    if result.timed_out:
        return f"{agent}: timed out"
    if result.memory_exceeded:
        return f"{agent}: memory limit exceeded"
    last = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
    return f"{agent}: {last[:200]}"


def run_reference(sandbox: Sandbox, task: Task) -> ReferenceRun:
    """Run the three snippets in a fresh workspace holding only the task's public files, and score the result."""
    task_dir = Path(task.meta["task_dir"])
    ws = new_workspace({name: task_dir / name for name in TASK_FILES})
    seconds, failure, scored, infra = 0.0, "", None, False
    try:
        snippets = reference_snippets(task)
        for agent in AGENTS:
            result = sandbox.run(snippets[agent], ws)
            seconds += result.duration_s
            if not result.ok:
                failure, infra = _failure(agent, result), result.infra_error is not None
                break
        else:
            scored = score_submission(task, ws / "submission.csv")
        files = tuple(sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if p.is_file()))
    finally:
        remove_workspace(ws, force=True)
    return ReferenceRun(scored, failure, seconds, files, infra)
