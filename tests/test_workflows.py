"""MathChat with a scripted policy (fixed replies, a real tokenizer) and the real sandbox."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import GEN, RecordingSandbox, ScriptedPolicy, ScriptedScorer, act, py, script, task

from mappa.config import SandboxConfig, WorkflowConfig, load_config
from mappa.errors import MappaError
from mappa.generation import PolicyGenerator
from mappa.protocols import Runtime
from mappa.sandbox import Sandbox
from mappa.types import CoachScore, Episode, ExecResult, Message
from mappa.workflows import WORKFLOWS, MathChat, build_workflow, feedback_note, play


@pytest.fixture(scope="module")
def sandbox():
    box = RecordingSandbox(SandboxConfig(timeout_s=10, concurrency=2, pool=False))
    yield box
    box.close()


def run(policy, tasks, sandbox, **kw) -> list[Episode]:  # type: ignore[no-untyped-def]
    settings = WorkflowConfig(
        coder_max_turns=kw.pop("coder_max_turns", 2), show_coach_feedback=kw.pop("show_coach_feedback", False)
    )
    wf = MathChat(settings, kw.pop("sandbox_cfg", SandboxConfig()))
    rt = Runtime(PolicyGenerator(policy), sandbox, scorer=kw.pop("scorer", None))
    return play(wf, tasks, rt, sampling=kw.pop("gen", GEN).sampling(), **kw)


class BareSandbox:
    """Only what a workflow may use of a sandbox (`SandboxLike.run_many`): no `cfg` to reach into."""

    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner

    def run_many(self, items: Sequence[tuple[str, Path]]) -> list[ExecResult]:
        return self.inner.run_many(items)


def by_agent(ep: Episode, agent: str) -> list:
    return [a for a in ep.actions if a.agent == agent]


# -------------------------------------------------------------------------------------------------- the flow
def test_code_only_inside_reasoning_is_no_tool_call(sandbox: RecordingSandbox) -> None:
    """A reasoning model drafts code while thinking: it does not run, the action is no tool call, and the Code
    Executor's turns end there as after any reply without code."""
    thought = "<think>\nMaybe:\n```python\nprint(6 * 7)\n```\n</think>\nIt is 42."
    policy = ScriptedPolicy(script(coder=[thought, py("print(1)")]))
    before = len(sandbox.batches)
    (ep,) = run(policy, [task()], sandbox, coder_max_turns=2)
    (c0,) = by_agent(ep, "code_executor")
    assert c0.exec_result is None and len(sandbox.batches) == before


def test_code_after_reasoning_runs(sandbox: RecordingSandbox) -> None:
    reply = "<think>\n```python\nprint('draft')\n```\n</think>\n" + py("print(6 * 7)")
    policy = ScriptedPolicy(script(coder=[reply, "The code printed 42."]))
    (ep,) = run(policy, [task()], sandbox)
    c0, _ = by_agent(ep, "code_executor")
    assert c0.exec_result is not None and c0.exec_result.stdout.strip() == "42"


def test_code_is_executed_and_fed_back(sandbox: RecordingSandbox) -> None:
    policy = ScriptedPolicy(script(coder=[py("print(6 * 7)"), "The code printed 42."]))
    (ep,) = run(policy, [task()], sandbox)
    c0, c1 = by_agent(ep, "code_executor")
    assert c0.exec_result is not None and c0.exec_result.ok and c0.exec_result.stdout.strip() == "42"
    # the second turn saw its full context: the first turn's prompt, its own reply, then the observation
    assert c1.messages[: len(c0.messages)] == c0.messages
    assert c1.messages[len(c0.messages)] == Message(role="assistant", content=c0.text)
    last = c1.messages[-1]
    assert last.role == "user" and last.content.startswith("<tool_response>") and "42" in last.content
    assert c1.exec_result is None and c1.turn == 1
    (v,) = by_agent(ep, "verifier")
    assert "The code printed 42." in v.messages[-1].content and "<tool_response>" in v.messages[-1].content
    assert ep.final_answer == "42" and ep.correct is True
    assert ep.meta["tool_calls"] == 1 and ep.meta["code_errors"] == 0 and ep.meta["sandbox_s"] > 0
    # token-level records line up
    for a in ep.actions:
        assert len(a.response_ids) == len(a.logprobs) > 0 and a.prompt_ids


def test_early_stop_without_code(sandbox: RecordingSandbox) -> None:
    policy = ScriptedPolicy(script(coder=["No code needed: 6 * 7 = 42."], verifier="\\boxed{41}"))
    (ep,) = run(policy, [task()], sandbox)
    assert [a.agent for a in ep.actions] == ["problem_solver", "code_executor", "verifier"]
    assert ep.actions[1].exec_result is None
    assert "(no code was run)" in ep.actions[2].messages[-1].content
    assert ep.correct is False and ep.final_answer == "41" and ep.meta["tool_calls"] == 0


def test_verifier_never_sees_the_solver_text(sandbox: RecordingSandbox) -> None:
    policy = ScriptedPolicy(script(solver="SOLVER-ONLY-7731 says 42", coder=[py("print(42)"), "Printed 42."]))
    (ep,) = run(policy, [task()], sandbox)
    coder_first = by_agent(ep, "code_executor")[0]
    assert "SOLVER-ONLY-7731" in coder_first.messages[1].content  # the Code Executor sees it
    (v,) = by_agent(ep, "verifier")
    assert not any("SOLVER-ONLY-7731" in m.content for m in v.messages)
    assert [m.role for m in v.messages] == ["system", "user"]


@pytest.mark.parametrize(
    ("form", "source", "asked"),
    [("auto", "arithmetic", "The answer is <number>"), ("auto", "test", "\\boxed"), ("boxed", "arithmetic", "\\boxed"),
     ("line", "test", "The answer is <number>")],
)  # fmt: skip
def test_the_verifier_is_asked_for_the_answer_form_set(form: str, source: str, asked: str) -> None:
    """`workflow.answer_form`: the closing ask names one form; `auto` keeps the one line for generated arithmetic."""
    wf = MathChat(WorkflowConfig(answer_form=form))
    t = task().model_copy(update={"source": source})
    ask = wf.verifier_messages(t, act("code_executor", 5.0), "42", "", None, 48)[-1].content.rsplit("\n\n", 1)[-1]
    assert asked in ask and ("boxed" in ask) != ("The answer is" in ask)


def test_truncated_actions_are_flagged(sandbox: RecordingSandbox) -> None:
    gen = GEN.model_copy(update={"max_new_tokens": 12})
    policy = ScriptedPolicy(script(solver="word " * 200, coder=["ok"], verifier="\\boxed{42}"))
    (ep,) = run(policy, [task()], sandbox, gen=gen)
    solver, coder, verifier = ep.actions
    assert solver.truncated and len(solver.response_ids) == 12
    assert not coder.truncated and not verifier.truncated
    assert "12 tokens" in solver.messages[0].content  # the role states the token budget


def test_exceptions_in_agent_code_become_observations(sandbox: RecordingSandbox) -> None:
    policy = ScriptedPolicy(script(coder=[py("x = 1\nraise ValueError('boom-314')"), "It failed."]))
    (ep,) = run(policy, [task()], sandbox)
    c0, c1 = by_agent(ep, "code_executor")
    assert c0.exec_result is not None and not c0.exec_result.ok
    assert "ValueError" in c0.exec_result.stderr and "boom-314" in c0.exec_result.stderr
    assert "boom-314" in c1.messages[-1].content  # fed back to the agent, the episode went on
    assert ep.meta["code_errors"] == 1 and len(by_agent(ep, "verifier")) == 1


def test_every_python_block_runs_as_one_snippet(sandbox: RecordingSandbox) -> None:
    two_blocks = "First:\n```python\na = 20\n```\nthen:\n```python\nprint(a + 22)\n```\n```text\nnot code\n```"
    policy = ScriptedPolicy(script(coder=[two_blocks, "done"]))
    (ep,) = run(policy, [task()], sandbox)
    result = by_agent(ep, "code_executor")[0].exec_result
    assert result is not None and result.ok and result.stdout.strip() == "42"


def test_turn_cap_stops_the_code_executor_and_the_last_output_reaches_the_verifier(
    sandbox: RecordingSandbox,
) -> None:
    policy = ScriptedPolicy(script(coder=[py("print('first')"), py("print('second-run')")]))
    (ep,) = run(policy, [task()], sandbox, coder_max_turns=2)
    coders = by_agent(ep, "code_executor")
    assert len(coders) == 2 and all(a.exec_result is not None for a in coders)  # the capped turn's code ran
    verifier_input = by_agent(ep, "verifier")[0].messages[-1].content
    assert "second-run" in verifier_input and "first\n" not in verifier_input


def test_episodes_play_at_once_and_none_waits_for_another(sandbox: RecordingSandbox) -> None:
    """Episode "a"'s code sleeps; "b" and "c" go on meanwhile (their Verifiers answer before a's Code Executor
    takes its second turn), while requests that are waiting together are generated together."""
    order: list[tuple[str | None, str]] = []

    def reply(agent: str | None, conv: Sequence[Message]) -> str:
        name = conv[1].content.split("problem ")[1][0]
        turn = sum(m.role == "user" for m in conv) - 1
        order.append((agent, f"{name}{turn}"))
        if agent == "code_executor":
            return "no code" if turn == 1 else py(f"import time; time.sleep({1.5 if name == 'a' else 0}); print(1)")
        return "\\boxed{1}"

    policy = ScriptedPolicy(reply)
    tasks = [task("1", f"problem {x}", x) for x in "abc"]
    t0 = time.monotonic()
    eps = run(policy, tasks, sandbox)
    assert [e.task.id for e in eps] == ["a", "b", "c"]  # task order kept
    assert len({e.id for e in eps}) == 3 and all(e.correct for e in eps)
    assert order.index(("verifier", "b0")) < order.index(("code_executor", "a1"))  # b did not wait for a's code
    assert order.index(("verifier", "c0")) < order.index(("code_executor", "a1"))
    assert policy.calls[0] == ("problem_solver", 3)  # the three Solvers asked at once: one call
    assert sum(n for _, n in policy.calls) == sum(len(e.actions) for e in eps) == 12
    assert time.monotonic() - t0 < 1.5 + 5


# ------------------------------------------------------------------------------------------------- the coach


def test_every_action_is_scored_as_it_lands_with_ground_truth_only_for_the_verifier(
    sandbox: RecordingSandbox,
) -> None:
    policy = ScriptedPolicy(script(coder=[py("print(42)"), "42"]))
    scorer = ScriptedScorer()
    (ep,) = run(policy, [task()], sandbox, scorer=scorer)
    assert [[c.agent for c in call] for call in scorer.calls] == [
        ["problem_solver"], ["code_executor"], ["code_executor"], ["verifier"]
    ]  # fmt: skip
    for call in scorer.calls:
        for c in call:
            assert (c.ground_truth == "42") is c.is_final is (c.agent == "verifier")
            assert c.workflow == "mathchat" and c.task == "What is 6 * 7?" and c.role == c.messages[0].content
    coder_ctx = scorer.calls[1][0]
    assert "42" in coder_ctx.observation and coder_ctx.messages == by_agent(ep, "code_executor")[0].messages
    assert scorer.calls[2][0].exec_result is None and scorer.calls[2][0].observation == ""
    assert [a.coach.score for a in ep.actions] == [1, 2, 3, 4]
    # off by default: no agent sees coach notes
    assert not any("note-" in m.content for a in ep.actions for m in a.messages)


def test_show_coach_feedback_puts_earlier_notes_in_later_prompts(sandbox: RecordingSandbox) -> None:
    policy = ScriptedPolicy(script(coder=[py("print(42)"), "42"]))
    (ep,) = run(policy, [task()], sandbox, scorer=ScriptedScorer(), show_coach_feedback=True)
    c0, c1 = by_agent(ep, "code_executor")
    assert "note-problem_solver-1" in c0.messages[1].content and "(1/10)" in c0.messages[1].content
    (v,) = by_agent(ep, "verifier")
    assert "note-code_executor-3" in v.messages[-1].content  # the note on the action it is shown
    assert "note-problem_solver" not in v.messages[-1].content  # nothing about the Solver it never sees
    # Without a coach (evaluation) there is no note to show: the same prompts as with the switch off.
    bare = run(policy, [task()], sandbox, show_coach_feedback=True)[0]
    assert [a.messages for a in bare.actions] == [a.messages for a in run(policy, [task()], sandbox)[0].actions]


def test_feedback_note() -> None:
    assert "7/10" in feedback_note("Code Executor", CoachScore(score=7.0, rationale="ran fine"))
    assert "unscored" in feedback_note("Code Executor", CoachScore(score=None))


def test_agent_and_coach_see_one_observation_setting(sandbox: RecordingSandbox) -> None:
    policy = ScriptedPolicy(script(coder=[py("print('a' * 5000); print('TAIL-END')"), "done"]))
    scorer = ScriptedScorer()
    cfg = SandboxConfig(observation_chars=300)
    (ep,) = run(policy, [task()], BareSandbox(sandbox), scorer=scorer, sandbox_cfg=cfg)
    c0, c1 = by_agent(ep, "code_executor")
    seen_by_agent = c1.messages[-1].content
    seen_by_coach = scorer.calls[1][0].observation
    assert len(seen_by_coach) <= 300 and seen_by_coach in seen_by_agent
    assert seen_by_agent == f"<tool_response>\n{seen_by_coach}\n</tool_response>"
    assert scorer.calls[1][0].exec_result == c0.exec_result  # the structured result travels with it
    assert MathChat(sandbox=cfg).context(ep.task, c0) == scorer.calls[1][0]  # a replay rebuilds it exactly


def test_progress_and_seeds(sandbox: RecordingSandbox) -> None:
    seen: list[tuple[int, int]] = []
    policy = ScriptedPolicy(script(coder=["no code"]))
    run(policy, [task(), task(tid="u")], sandbox, seed=7, progress=lambda done, total: seen.append((done, total)))
    # 2 episodes x 4 possible actions; both Code Executors stop after one turn, so the total shrinks to 6.
    assert seen[0][1] == 8 and seen[-1] == (6, 6) and all(d <= t for d, t in seen)
    first = [s for call in policy.seeds for s in call]
    assert len(set(first)) == len(first) == 6 and None not in first  # a fresh seed per request
    policy.seeds.clear()
    run(policy, [task(), task(tid="u")], sandbox, seed=7)
    assert sorted(s for call in policy.seeds for s in call) == sorted(first)  # the same seed, the same draws


def test_an_episode_samples_alike_whatever_runs_beside_it(sandbox: RecordingSandbox) -> None:
    """Seeds follow the episode's place in the call and its own requests: the first episode draws the same
    alone as beside another that stops early or goes on."""
    seeds: dict[str, list[int]] = {}

    def reply(agent: str | None, conv: Sequence[Message]) -> str:
        return "no code" if "stop" in conv[1].content else py("print(42)") if agent == "code_executor" else "42"

    class Seeing(ScriptedPolicy):
        def generate(self, agent, conversations, **kw):  # type: ignore[no-untyped-def]
            for conv, s in zip(conversations, kw["seed"], strict=True):
                seeds.setdefault(conv[1].content.split("\n")[1], []).append(s)
            return super().generate(agent, conversations, **kw)

    for others in ([], [task(problem="stop now", tid="x")], [task(problem="keep going", tid="y")]):
        seeds.clear()
        run(Seeing(reply), [task(problem="first one"), *others], sandbox, seed=11)
        if not others:
            alone = list(seeds["first one"])
        assert seeds["first one"] == alone


# ---------------------------------------------------------------------------------------------- context cap
def test_long_embedded_text_is_clipped_to_fit_the_context(sandbox: RecordingSandbox) -> None:
    gen = GEN.model_copy(update={"max_context_tokens": 600, "max_new_tokens": 4000})
    long_solver = "The answer is 42. " + "blah " * 500 + "FINAL-LINE"
    policy = ScriptedPolicy(script(solver=long_solver, coder=[py("print('x' * 3000)"), "done"]))
    (ep,) = run(policy, [task()], sandbox, gen=gen)
    assert "error" not in ep.meta and ep.meta["clipped_prompts"] >= 2
    c0, c1 = by_agent(ep, "code_executor")
    assert len(c0.prompt_ids) <= 600 and len(c1.prompt_ids) <= 600
    assert "characters cut to fit the context" in c0.messages[1].content
    assert "FINAL-LINE" in c0.messages[1].content  # head and tail kept
    assert ep.correct


def test_a_prompt_that_cannot_fit_ends_only_its_own_episode(sandbox: RecordingSandbox) -> None:
    gen = GEN.model_copy(update={"max_context_tokens": 500})
    policy = ScriptedPolicy(script(coder=["no code"]))
    huge = task(problem="Compute this. " + "digits 123 " * 400, tid="huge")
    eps = run(policy, [huge, task(tid="ok")], sandbox, gen=gen)
    assert eps[0].actions == () and "max_context_tokens=500" in eps[0].meta["error"] and eps[0].correct is False
    assert eps[1].correct and "error" not in eps[1].meta


def test_unknown_workflow_is_a_user_error() -> None:
    with pytest.raises(MappaError, match="workflow.name"):
        load_config(None, ["workflow.name=mathchatt"])
    cfg = load_config(None, ["workflow.coder_max_turns=3", "sandbox.observation_chars=123"])
    wf = build_workflow(cfg)
    assert isinstance(wf, MathChat) and {"mathchat", "ds_pipeline"} <= set(WORKFLOWS)
    assert wf.agents == ("problem_solver", "code_executor", "verifier") and wf.specs[1].max_turns == 3
    assert wf.observation_chars == 123 and wf.max_actions == 5


def test_episodes_round_trip_through_jsonl(sandbox: RecordingSandbox, tmp_path: Path) -> None:
    from mappa.types import read_jsonl, write_jsonl

    policy = ScriptedPolicy(script(coder=[py("print(42)"), "42"]))
    eps = run(policy, [task()], sandbox, scorer=ScriptedScorer())
    write_jsonl(tmp_path / "e.jsonl", eps)
    assert read_jsonl(tmp_path / "e.jsonl", Episode) == eps
    assert re.search(r"#\w+-0$", eps[0].id)
