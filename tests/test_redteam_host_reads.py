"""Hostile agent files and answers against the host's reads: links, FIFOs, floods and costly answers are
refused quickly, with reasons that quote nothing but the submission's own header. Real files in real
workspaces (`mappa.sandbox.new_workspace`), no mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from mappa.coach.prompts import render_context
from mappa.sandbox import new_workspace, remove_workspace
from mappa.tasks.answers import CHECK_TIMEOUT_S, check_answer
from mappa.tasks.files import MAX_LISTED, AgentFileError, read_agent_file
from mappa.tasks.tabular import score_submission
from mappa.types import Action, ExecResult, Message, Task
from mappa.workflows.ds_pipeline import ANALYST, DATA_ENGINEER, DsPipeline, Team

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------------------ fixtures
def _task(root: Path, n_test: int = 200) -> Task:
    """A regression task as the builder lays it out: public files in tasks/t, the answers apart."""
    task_dir, answer_dir = root / "tasks" / "t", root / "answers" / "t"
    task_dir.mkdir(parents=True)
    answer_dir.mkdir(parents=True)
    ids = list(range(1, n_test + 1))
    truth = [float(i % 7) for i in ids]
    pd.DataFrame({"id": ids, "x": ids, "y": truth}).to_csv(task_dir / "train.csv", index=False)
    pd.DataFrame({"id": ids, "x": ids}).to_csv(task_dir / "test.csv", index=False)
    pd.DataFrame({"id": ids, "y": [3.0] * n_test}).to_csv(task_dir / "sample_submission.csv", index=False)
    (task_dir / "description.txt").write_text("Predict y.\n", encoding="utf-8")
    pd.DataFrame({"id": ids, "y": truth}).to_csv(answer_dir / "test_answer.csv", index=False)
    meta = {
        "task_dir": str(task_dir),
        "answer_path": str(answer_dir / "test_answer.csv"),
        "metric": "rmse",
        "target": "y",
        "id_column": "id",
        "data_type": "regression",
        "baseline_score": 2.0,
        "reference_score": 0.5,
        "n_test": n_test,
    }
    return Task(id="t", problem="Predict y.", answer="", source="dsbench", meta=meta)


@pytest.fixture
def task(tmp_path: Path) -> Task:
    return _task(tmp_path)


@pytest.fixture
def workspace() -> Iterator[Path]:
    ws = new_workspace()
    yield ws
    remove_workspace(ws)


def _timed(fn: Callable[[], Any], limit_s: float) -> tuple[Any, float]:
    """`fn()` in a thread (as a coach calls it), its result and how long it took; fails past `limit_s`."""
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["result"] = e
        out["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert "result" in out, f"still running after {limit_s} s"
    return out["result"], out["seconds"]


# ------------------------------------------------------------------------------------------------ links and FIFOs
def test_a_submission_linked_to_the_hidden_answers_is_invalid(task: Task, workspace: Path) -> None:
    os.symlink(task.meta["answer_path"], workspace / "submission.csv")  # a perfect score if followed
    result = score_submission(task, workspace / "submission.csv")
    assert not result.valid and result.score is None and "link" in result.reason


def test_a_submission_hard_linked_to_the_answers_is_invalid(task: Task, workspace: Path, tmp_path: Path) -> None:
    copy = tmp_path / "answers-copy.csv"
    copy.write_bytes(Path(task.meta["answer_path"]).read_bytes())
    try:
        os.link(copy, workspace / "submission.csv")
    except OSError as e:  # another filesystem: the sandbox cannot make this link either
        pytest.skip(f"no hard link possible here ({e.strerror})")
    result = score_submission(task, workspace / "submission.csv")
    assert not result.valid and "hard link" in result.reason


def _environment_entries() -> list[str]:
    # Entries with a value long enough to be told apart from ordinary words (`MAKEFLAGS=` has none).
    entries = Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
    return [e for e in entries if "=" in e and len(e.split("=", 1)[1]) >= 6]


def test_a_link_to_the_environment_quotes_none_of_it(tmp_path: Path, workspace: Path) -> None:
    task = _task(tmp_path)
    os.symlink("/proc/self/environ", workspace / "submission.csv")
    result = score_submission(task, workspace / "submission.csv")
    assert not result.valid and "link" in result.reason
    assert not [e for e in _environment_entries() if e in result.reason or e.split("=", 1)[1] in result.reason]
    # nor through the Analyst's evidence, which the coach reads
    ev = DsPipeline().evidence(ANALYST, task, workspace, ("submission.csv",), Team())
    text = json.dumps(ev)
    assert "link" in ev["test_evaluation"]["reason"] and not [e for e in _environment_entries() if e in text]


def test_a_fifo_submission_is_refused_without_blocking(task: Task, workspace: Path) -> None:
    os.mkfifo(workspace / "submission.csv")  # opening it to read would wait for a writer forever
    result, _ = _timed(lambda: score_submission(task, workspace / "submission.csv"), 5.0)
    assert not result.valid and "FIFO" in result.reason
    error, _ = _timed(lambda: read_agent_file(workspace, "submission.csv", 1024), 5.0)
    assert isinstance(error, AgentFileError) and error.kind == "not_regular" and "FIFO" in str(error)


def test_agent_file_names_stay_inside_the_workspace(workspace: Path) -> None:
    (workspace / "sub").mkdir()
    for name, kind in (("../etc", "name"), ("sub/x", "name"), ("sub", "not_regular"), ("gone.csv", "missing")):
        with pytest.raises(AgentFileError) as e:
            read_agent_file(workspace, name, 1024)
        assert e.value.kind == kind


# ------------------------------------------------------------------------------------------------ floods
def test_a_50_mb_submission_is_refused_in_under_a_second(task: Task, workspace: Path) -> None:
    with open(workspace / "submission.csv", "wb") as f:
        f.write(b"id,y\n" + b"1,1.0\n" * 8_400_000)  # 50 MB of rows
    result, seconds = _timed(lambda: score_submission(task, workspace / "submission.csv"), 10.0)
    assert not result.valid and "bytes, more than" in result.reason and seconds < 1.0


def test_a_4_mb_header_is_refused_in_under_a_second_even_when_the_size_is_allowed(
    tmp_path: Path, workspace: Path
) -> None:
    big = _task(tmp_path, n_test=20_000)  # a large test set: a 4 MB file is within its size cap
    (workspace / "submission.csv").write_text("id," + ",".join(f"c{i}" for i in range(500_000)) + "\n")
    result, seconds = _timed(lambda: score_submission(big, workspace / "submission.csv"), 10.0)
    assert not result.valid and "header line is longer than" in result.reason and seconds < 1.0


def test_a_reason_quotes_only_a_cut_header(task: Task, workspace: Path) -> None:
    names = [f"col{i}_" + "z" * 200 for i in range(300)]
    (workspace / "submission.csv").write_text("id,y," + ",".join(names[:3]) + "\n1,1,1,1,1\n")
    result = score_submission(task, workspace / "submission.csv")
    assert not result.valid and "unexpected column(s)" in result.reason and len(result.reason) < 400


# ------------------------------------------------------------------------------------------------ answers
# Each must be wrong quickly; run in a child process, so one that holds the interpreter cannot stall the tests.
HOSTILE = {
    "power tower 9^9^8": "\\boxed{9^{9^{8}}}",
    "power tower 10^10^10": "\\boxed{10^{10^{10}}}",
    "power tower of 2s": "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "factorial 99999!": "\\boxed{99999!}",
    "10k nested parentheses": "\\boxed{" + "(" * 10_000 + "1" + ")" * 10_000 + "}",
    "1 MB answer": "\\boxed{" + "1" * 1_000_000 + "}",
    "1 MB stated number": "the answer is " + "1" * 1_000_000,
    "70k reasoning blocks": "<think></think>" * 70_000 + "\\boxed{1}",
    "110k boxes": "\\boxed{1}" * 110_000,
}
SLOW_BUT_UNSCREENED = "\\boxed{(999999999^{9999})^{9999}}"  # passes the pre-screen: the worker is killed
CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    from mappa.tasks.answers import check_answer
    cases = json.loads(sys.stdin.read())
    check_answer("\\\\boxed{3}", "4")  # starts the worker
    for name, text in cases.items():
        out = {}
        def run():
            start = time.perf_counter()
            out["right"] = check_answer(text, "42")
            out["seconds"] = time.perf_counter() - start
        t = threading.Thread(target=run)  # as in a coach thread
        t.start(); t.join()
        print(json.dumps({"name": name, **out}), flush=True)
    """
)


@pytest.fixture(scope="module")
def hostile_results() -> dict[str, dict]:
    cases = {**HOSTILE, "unscreened": SLOW_BUT_UNSCREENED}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD], input=json.dumps(cases), capture_output=True, text=True, timeout=40
        )
        stdout = done.stdout
    except subprocess.TimeoutExpired as e:  # a stalled check: the cases after it never report
        stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return {r["name"]: r for r in map(json.loads, stdout.splitlines())}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_answer_is_wrong_in_well_under_a_second(name: str, hostile_results: dict[str, dict]) -> None:
    assert name in hostile_results, "the check stalled"
    assert hostile_results[name]["right"] is False and hostile_results[name]["seconds"] < 1.0


def test_a_costly_answer_the_prescreen_lets_through_is_cut_off(hostile_results: dict[str, dict]) -> None:
    assert "unscreened" in hostile_results, "the check stalled"
    assert hostile_results["unscreened"]["right"] is False
    assert hostile_results["unscreened"]["seconds"] < CHECK_TIMEOUT_S + 1.0


@pytest.mark.parametrize(
    ("text", "gold"),
    [
        ("\\boxed{080}", "80"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}"),
        ("\\boxed{x=5}", "5"),
        ("\\boxed{2^{10}}", "1024"),
        ("\\boxed{2^{2023}}", "2^{2023}"),
    ],
)
def test_normal_answers_are_still_right_in_a_thread(text: str, gold: str) -> None:
    right, _ = _timed(lambda: check_answer(text, gold), 60.0)  # the first call starts the worker
    assert right is True


# ------------------------------------------------------------------------------------------------ file lists
def test_twenty_thousand_file_names_stay_bounded_in_prompts_and_evidence(tmp_path: Path, workspace: Path) -> None:
    task = _task(tmp_path)
    names = [f"{i:05d}-" + "n" * 200 for i in range(20_000)]
    folder = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:  # a required file sorts after the flood yet stays listed
        for name in (*names, "X_train.pkl", "y_train.pkl"):
            os.close(os.open(name, os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=folder))
    finally:
        os.close(folder)
    pipeline = DsPipeline()
    result = ExecResult(ok=True, stdout="done", files_created=(*names, "X_train.pkl", "y_train.pkl"))
    ev = pipeline.evidence(DATA_ENGINEER, task, workspace, (), Team())
    assert len(ev["files_after"]) <= MAX_LISTED + 1 and ev["files_after"][-1].endswith(" more")
    assert {"X_train.pkl", "y_train.pkl"} <= set(ev["files_after"])
    action = Action(agent=DATA_ENGINEER.name, turn=0, messages=(Message(role="user", content="go"),), text="ok")
    action = action.model_copy(update={"exec_result": result, "evidence": ev})
    ctx = pipeline.context(task, action)
    assert len(ctx.extra["files_saved"]) <= MAX_LISTED + 1 and "X_train.pkl" in ctx.extra["files_saved"]
    assert len(render_context(ctx)) < 40_000  # 20,000 names of 206 characters would be 4 MB
    files = sorted(os.listdir(workspace))
    assert len(pipeline.tool_response(DATA_ENGINEER, result, files)) < 20_000
    prompt = pipeline.first_prompt(DATA_ENGINEER, task, files, Team(), None)
    assert len(prompt) < 20_000 and "... and " in prompt
