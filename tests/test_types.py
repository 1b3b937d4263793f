import json

import pytest
from pydantic import ValidationError

from mappa.errors import MappaError
from mappa.types import (
    Action,
    CoachContext,
    CoachScore,
    Episode,
    ExecResult,
    Message,
    Task,
    read_jsonl,
    write_jsonl,
)


def _episode() -> Episode:
    task = Task(id="t1", problem="What is 2+3?", answer="5", source="arithmetic", meta={"level": 1})
    msgs = (Message(role="system", content="You solve."), Message(role="user", content="What is 2+3?"))
    exec_result = ExecResult(
        ok=False,
        exit_code=1,
        stdout="x" * 3,
        stderr="Traceback...\nZeroDivisionError",
        duration_s=0.125,
        files_created=("a.pkl",),
    )
    act = Action(
        agent="code_executor",
        turn=1,
        messages=msgs,
        text="```python\nprint(1/0)\n```",
        prompt_ids=(1, 2, 3),
        response_ids=(4, 5, 2),
        logprobs=(-0.1234567890123, -2.5e-9, -13.0),
        truncated=False,
        exec_result=exec_result,
        coach=CoachScore(score=3.5, rationale="crashed", raw_reply="...\nPROCESS_SCORE: 3.5", backend="rubric"),
    )
    return Episode(id="e1", workflow="mathchat", task=task, actions=(act,), final_answer="5", correct=True)


def test_episode_jsonl_round_trip_is_lossless(tmp_path):
    ep = _episode()
    path = tmp_path / "eps.jsonl"
    write_jsonl(path, [ep, ep])
    back = read_jsonl(path, Episode)
    assert back == [ep, ep]
    # floats survive bit-exactly, tuples come back as tuples
    assert back[0].actions[0].logprobs == ep.actions[0].logprobs
    assert isinstance(back[0].actions[0].response_ids, tuple)


def test_records_are_frozen_and_reject_unknown_fields():
    ep = _episode()
    with pytest.raises(ValidationError):
        ep.correct = False  # type: ignore[misc]
    with pytest.raises(ValidationError):
        Task(id="x", problem="p", answer="1", source="s", surprise=1)  # type: ignore[call-arg]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = _episode().model_dump_json()
    path.write_text(good + "\n" + json.dumps({"id": "e2"}) + "\n")
    with pytest.raises(MappaError, match=r"bad.jsonl:2: not a valid Episode"):
        read_jsonl(path, Episode)
    with pytest.raises(MappaError, match="file not found"):
        read_jsonl(tmp_path / "missing.jsonl", Episode)


def test_coach_context_round_trip():
    ctx = CoachContext(
        task="t",
        workflow="mathchat",
        agent="verifier",
        role="checks",
        is_final=True,
        messages=(Message(role="user", content="hi"),),
        output="\\boxed{5}",
        exec_result=ExecResult(ok=True, exit_code=0, stdout="5\n"),
        observation="5",
        files_by_agent={"a": ("x.pkl",)},
        ground_truth="5",
    )
    assert CoachContext.model_validate_json(ctx.model_dump_json()) == ctx


def test_no_tool_is_exec_result_none_not_a_sentence():
    base = dict(task="t", workflow="w", agent="a", role="r", is_final=False, messages=(), output="o")
    assert CoachContext(**base).exec_result is None and CoachContext(**base).observation == ""
    with pytest.raises(ValidationError, match="exec_result is None"):
        CoachContext(**base, observation="no tool used")  # an observation without a tool call is a contradiction
