"""The task sampler and `mappa rollout` end to end (real subprocess, real tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mappa.tasks import check_answer, extract_answer
from mappa.tasks.sampler import pick_tasks
from mappa.types import Episode, Task, read_jsonl

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def mappa(*args: str, cwd: Path = ROOT, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mappa.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _task(i: int) -> Task:
    return Task(id=f"t{i}", problem=f"p{i}", answer="1", source="test")


def test_pick_tasks_is_seeded_and_cycles_through_the_pool() -> None:
    pool = [_task(i) for i in range(5)]
    a = pick_tasks(pool, 12, seed=1)
    assert a == pick_tasks(pool, 12, seed=1) and a != pick_tasks(pool, 12, seed=2)
    assert len(a) == 12 and {t.id for t in a[:5]} == {t.id for t in pool}  # a whole pass before any repeat
    assert {t.id for t in a[5:10]} == {t.id for t in pool} and a[5:10] != a[:5]  # the next pass reshuffled
    assert len({t.id for t in pick_tasks(pool, 3, seed=0)}) == 3


def test_pick_tasks_reads_one_stream_from_any_cursor() -> None:
    """A training run draws steps of k tasks from a checkpointed cursor: any split reads the same stream."""
    pool = [_task(i) for i in range(10)]
    whole = pick_tasks(pool, 25, seed=3)
    assert [t for start in range(0, 25, 5) for t in pick_tasks(pool, 5, seed=3, start=start)] == whole
    assert pick_tasks(pool, 4, seed=3, start=8) == whole[8:12]  # across a pass boundary


# ------------------------------------------------------------------------------------------------- command
def _config(tmp_path: Path, extra: str = "") -> Path:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "model:\n  name: tiny-random\n"
        "generation:\n  max_new_tokens: 16\n  max_context_tokens: 900\n  batch_size: 4\n"
        "sandbox:\n  pool: false\n  timeout_s: 5\n"
        f"coach:\n  backend: rubric\n  cache_path: {tmp_path / 'cache.sqlite'}\n"
        "tasks:\n  train: [arithmetic]\n  arithmetic_train_size: 20\n  arithmetic_eval_size: 4\n" + extra
    )
    return cfg


def test_rollout_command_writes_episodes_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "eps.jsonl"
    proc = mappa("rollout", str(_config(tmp_path)), "--episodes", "5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    episodes = read_jsonl(out, Episode)
    assert len(episodes) == 5 and all(e.workflow == "mathchat" and e.task.source == "arithmetic" for e in episodes)
    for e in episodes:
        agents = [a.agent for a in e.actions]
        assert agents[0] == "problem_solver" and agents[-1] == "verifier"
        assert all(a.coach is not None for a in e.actions)  # the rubric coach scored every action
        assert all(len(a.response_ids) == len(a.logprobs) > 0 for a in e.actions)
        # The recorded verdict is the rule-based check of the verifier's own text (random tokens: never right).
        assert e.final_answer == extract_answer(e.actions[-1].text)
        assert e.correct is check_answer(e.actions[-1].text, e.task.answer) is False
    for needle in ("success", "problem_solver", "code_executor", "verifier", "mean tokens", "sandbox", "episodes/min"):
        assert needle in proc.stderr
    n_actions = sum(len(e.actions) for e in episodes)
    assert f"judgments {n_actions}" in " ".join(proc.stderr.split())  # one coach judgment per action


def test_rollout_unknown_workflow_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(
        mappa("rollout", str(_config(tmp_path)), "--set", "workflow.name=nope", "--out", str(tmp_path / "o.jsonl"))
    )
    assert "workflow.name" in line and "nope" in line and "mathchat" in line


def test_rollout_missing_data_dir_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(
        mappa(
            "rollout",
            str(_config(tmp_path)),
            "--set",
            "tasks.train=[aime]",
            "--set",
            f"tasks.data_dir={tmp_path / 'nowhere'}",
            "--out",
            str(tmp_path / "o.jsonl"),
        )
    )
    assert "nowhere" in line and "not found" in line


def test_rollout_malformed_data_line_names_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    (data / "gsm8k_train.jsonl").write_text(f"{good}\n{good}\n{good}\n{{oops\n")
    line = one_line_error(
        mappa(
            "rollout",
            str(_config(tmp_path)),
            "--set",
            "tasks.train=[gsm8k]",
            "--set",
            "tasks.eval=[gsm8k]",
            "--set",
            f"tasks.data_dir={data}",
            "--out",
            str(tmp_path / "o.jsonl"),
        )
    )
    assert "gsm8k_train.jsonl:4" in line


def test_rollout_bad_episode_count_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(mappa("rollout", str(_config(tmp_path)), "--episodes", "0", "--out", str(tmp_path / "o")))
    assert "--episodes" in line


@pytest.mark.slow
def test_two_episodes_with_the_embedded_model(tmp_path: Path) -> None:
    """The real SmolLM2-135M through the whole pipeline: generation, sandbox, rubric coach, JSONL."""
    cfg = (
        _config(tmp_path)
        .read_text()
        .replace("tiny-random", "smollm2-135m-instruct")
        .replace("max_new_tokens: 16", "max_new_tokens: 64")
    )
    (tmp_path / "real.yaml").write_text(cfg)
    out = tmp_path / "real.jsonl"
    # One BLAS thread: on a shared, oversubscribed CPU two spinning OpenMP threads can make one decode step take
    # seconds. This test checks the pipeline, not speed.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = mappa("rollout", str(tmp_path / "real.yaml"), "--episodes", "2", "--out", str(out), timeout=550, env=env)
    assert proc.returncode == 0, proc.stderr
    episodes = read_jsonl(out, Episode)
    assert len(episodes) == 2
    for e in episodes:
        assert [a.agent for a in e.actions][0] == "problem_solver" and e.actions[-1].agent == "verifier"
        assert all(a.text.strip() for a in e.actions)  # a real model says something
        verdict = check_answer(e.actions[-1].text, e.task.answer)  # the recorded verdict is the answer check's
        assert e.correct is verdict and e.final_answer == extract_answer(e.actions[-1].text)
        assert all(len(a.response_ids) == len(a.logprobs) and all(lp <= 0 for lp in a.logprobs) for a in e.actions)
