"""Evaluation: metrics from hand-made episodes, and a real eval run (tiny model, real sandbox) via eval_command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mappa.config import load_config
from mappa.errors import MappaError
from mappa.evaluate import eval_command, summarize
from mappa.types import Action, Episode, ExecResult, Task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def act(agent: str, n_tokens: int, ran: bool = False, truncated: bool = False) -> Action:
    return Action(
        agent=agent,
        turn=0,
        messages=(),
        text="x",
        response_ids=tuple(range(n_tokens)),
        truncated=truncated,
        exec_result=ExecResult(ok=True) if ran else None,
    )


def test_summarize_counts_per_agent() -> None:
    task = Task(id="t", problem="p", answer="1", source="arithmetic")
    episodes = [
        Episode(
            id="a",
            workflow="w",
            task=task,
            actions=(act("s", 10), act("c", 4, ran=True), act("c", 6)),
            correct=True,
            final_answer="1",
        ),
        Episode(
            id="b",
            workflow="w",
            task=task,
            actions=(act("s", 20, truncated=True), act("c", 2, ran=True)),
            correct=False,
        ),
    ]
    m = summarize(episodes, ["s", "c"])
    assert m["eval/accuracy"] == 0.5 and m["eval/answered_rate"] == 0.5 and m["eval/episodes"] == 2
    assert m["eval/s/tool_use_rate"] == 0 and m["eval/c/tool_use_rate"] == pytest.approx(2 / 3)
    assert m["eval/s/response_tokens"] == 15 and m["eval/c/response_tokens"] == 4
    assert m["eval/s/truncation_rate"] == 0.5 and m["eval/c/truncation_rate"] == 0
    assert m["eval/c/actions_per_episode"] == 1.5


def test_summarize_empty_is_zero_not_an_error() -> None:
    assert summarize([], ["s"])["eval/accuracy"] == 0.0


def test_eval_command_on_a_saved_checkpoint(tmp_path: Path) -> None:
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
    agents = build_workflow(cfg.workflow).agents
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
    assert all(a["coach"] is None for e in episodes for a in json.loads(e)["actions"])  # no coach in eval


def test_eval_command_rejects_a_non_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(MappaError, match="not a checkpoint"):
        eval_command(load_config(None, ["model.name=tiny-random"]), str(tmp_path / "empty"), None)
