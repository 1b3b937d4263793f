"""`mappa trace` on a hand-written run directory: agent by agent, scores, rationale, blame."""

from __future__ import annotations

from pathlib import Path

import pytest

from mappa.cli.trace import trace_command
from mappa.errors import MappaError
from mappa.trace import lowest_scored, pick_episode
from mappa.types import Action, CoachScore, Episode, ExecResult, Message, Task, write_jsonl

TASK = Task(id="t1", problem="What is 17 * 23?", answer="391", source="arithmetic")


def action(
    agent: str, text: str, score: float | None, rationale: str = "", result: ExecResult | None = None
) -> Action:
    return Action(
        agent=agent,
        turn=0,
        messages=(Message(role="system", content="role"), Message(role="user", content=f"input for {agent}")),
        text=text,
        prompt_ids=(1, 2, 3),
        response_ids=(4, 5),
        exec_result=result,
        coach=CoachScore(score=score, rationale=rationale),
    )


def episode(eid: str, correct: bool, step: int, coder_score: float = 2.0) -> Episode:
    return Episode(
        id=eid,
        workflow="mathchat",
        task=TASK,
        actions=(
            action("problem_solver", "17*23 = 381", 6.0, "plausible plan, arithmetic slip"),
            action(
                "code_executor",
                "```python\nprint(17*22)\n```",
                coder_score,
                "computed the wrong product",
                ExecResult(ok=True, exit_code=0, stdout="374\n"),
            ),
            action("verifier", "\\boxed{374}", 4.0, "trusted a wrong tool result"),
        ),
        final_answer="374" if not correct else "391",
        correct=correct,
        meta={"step": step},
    )


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "run.json").write_text('{"mappa_run": 1}')  # marked, as mappa marks each run it makes
    write_jsonl(
        tmp_path / "episodes.jsonl",
        [episode("e1", False, 1), episode("e2", True, 1, 9.0), episode("e3", False, 2, 1.0), episode("e4", True, 2)],
    )
    return tmp_path


def test_default_is_the_latest_failed_episode_with_blame(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_command(str(run_dir)) == 0
    out = capsys.readouterr().out
    assert "episode e3 (step 2)" in out
    for agent in ("problem_solver", "code_executor", "verifier"):
        assert agent in out
    assert out.index("problem_solver") < out.index("code_executor") < out.index("verifier turn")
    assert "input for code_executor" in out and "374" in out and "print(17*22)" in out
    assert "1/10" in out and "computed the wrong product" in out
    assert "lowest-scored action: code_executor" in out


def test_select_by_id_and_step(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace_command(str(run_dir), episode="e2")
    out = capsys.readouterr().out
    assert "episode e2" in out and "correct" in out and "lowest-scored" not in out
    trace_command(str(run_dir), step=1)
    assert "episode e1 (step 1)" in capsys.readouterr().out


def test_errors_name_what_is_missing(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(MappaError, match="'nope' not found"):
        trace_command(str(run_dir), episode="nope")
    with pytest.raises(MappaError, match="no episodes of step 7"):
        trace_command(str(run_dir), step=7)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "run.json").write_text('{"mappa_run": 1}')  # a run stopped before its first step
    with pytest.raises(MappaError, match="no episodes.jsonl"):
        trace_command(str(empty))


def test_lowest_scored_ignores_unscored_actions() -> None:
    ep = episode("e", False, 0)
    unscored = ep.actions[0].model_copy(update={"coach": CoachScore(score=None, error="no score line")})
    ep = ep.model_copy(update={"actions": (unscored, *ep.actions[1:])})
    assert lowest_scored(ep).agent == "code_executor"
    assert pick_episode([ep], None).id == "e"
