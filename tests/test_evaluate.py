"""Evaluation: a real eval run (tiny model, real sandbox) via `mappa eval`'s command, and the gain of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mappa.cli.evaluate import eval_command
from mappa.config import load_config
from mappa.errors import MappaError
from mappa.evaluate import eval_gain
from mappa.types import Episode, Task, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_eval_command_on_a_saved_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mappa.policy import Policy
    from mappa.workflows import build_workflow

    cfg = load_config(
        None,
        [
            "model.name=tiny-random",
            "model.lora_r=4",
            "generation.max_new_tokens=8",
            "sandbox.pool=false",
            "tasks.arithmetic_eval_size=3",
            "eval.samples=2",
        ],
    )
    agents = build_workflow(cfg).agents
    policy = Policy.from_config(cfg.model, agents, seed=0)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    policy.save(ckpt / "policy")
    assert eval_command(cfg, str(ckpt), None) == 0
    out = tmp_path / "run" / "eval"
    episodes = (out / "step-000003.jsonl").read_text().splitlines()
    assert len(episodes) == 3 * 2
    summary = json.loads((out / "summary.jsonl").read_text())
    assert summary["tag"] == "step-000003" and summary["eval/episodes"] == 6
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
    assert summary["eval/arithmetic/accuracy"] == summary["eval/accuracy"] and summary["eval/tasks"] == 3
    console = capsys.readouterr().err
    assert "arithmetic" in console and "accuracy [95% CI]" in console  # per source, with its interval
    assert all(a["coach"] is None for e in episodes for a in json.loads(e)["actions"])  # no coach in eval


def test_eval_command_rejects_a_non_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(MappaError, match="not a checkpoint"):
        eval_command(load_config(None, ["model.name=tiny-random"]), str(tmp_path / "empty"), None)


def test_eval_gain_pairs_the_start_and_final_episodes(tmp_path: Path) -> None:
    tasks = [Task(id=f"t{i}", problem="p", answer="1", source="arithmetic") for i in range(20)]

    def run(correct: list[bool]) -> list[Episode]:
        return [
            Episode(id=f"e{i}", workflow="w", task=t, correct=c)
            for i, (t, c) in enumerate(zip(tasks, correct, strict=True))
        ]

    write_jsonl(tmp_path / "start.jsonl", run([False] * 20))
    write_jsonl(tmp_path / "final.jsonl", run([True] * 6 + [False] * 14))
    gain = eval_gain(tmp_path)
    assert gain is not None and gain.paired and gain.gain == pytest.approx(0.3) and gain.improved == 6
    assert gain.significant  # six improved, none worse: more than noise even on 20 tasks
    assert eval_gain(tmp_path, after="step-000004") is None
