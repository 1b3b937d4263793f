"""The paper's prompts as the paper ran them (`workflow.prompts: paper`): the published templates, pinned by hash,
reach the agents as their one first user message; ours stay the default."""

from __future__ import annotations

import hashlib

import pytest
from helpers import GEN, RecordingSandbox, ScriptedPolicy, ScriptedScorer, py, script, task

from mappa.config import SandboxConfig, WorkflowConfig
from mappa.generation import PolicyGenerator
from mappa.protocols import Runtime
from mappa.types import Episode, Message
from mappa.workflows import MathChat, play
from mappa.workflows import paper_prompts as paper

# sha256 of each template as the published code holds it (ltjed/multiagent-coaching@ed66921): the wording is the
# paper's, so an edit here is a departure to document, never a fix.
PUBLISHED = {
    "MATHCHAT_SOLVER": "23f03bcb2f1313523d98218db8065996bdd9df2f4003d7af4e06c06184d73245",
    "MATHCHAT_CODER": "49c009e16f62339db6b5130786daa40b55f3e02264546b47e26bc31f3af6c359",
    "MATHCHAT_VERIFIER": "7782cc7b803cc2c303e731b7ed505b7ee8c679e850924143da41546f4aefe020",
    "DS_DATA_ENGINEER": "d4b209ebf7aa99b9c89546d960ffc60e4223199663ae1727fb5028a75931dbd4",
    "DS_MODELER": "3480d00a7f2477ead55a201f78aabac42d7ca516325c74088d06f3c3937511d5",
    "DS_ANALYST": "8149a2fd92e087d128482bd4471254ada0d6a612fe951fdd84f0f87e75252b89",
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_agent_templates_are_the_published_ones(name: str) -> None:
    assert hashlib.sha256(getattr(paper, name).encode()).hexdigest() == PUBLISHED[name]


@pytest.fixture(scope="module")
def sandbox():
    box = RecordingSandbox(SandboxConfig(timeout_s=10, concurrency=2, pool=False))
    yield box
    box.close()


def run(policy: ScriptedPolicy, sandbox: RecordingSandbox, prompts: str, scorer: object = None) -> Episode:
    wf = MathChat(WorkflowConfig(prompts=prompts), SandboxConfig())
    (ep,) = play(wf, [task()], Runtime(PolicyGenerator(policy), sandbox, scorer=scorer), sampling=GEN.sampling())
    return ep


def test_mathchat_agents_get_the_published_templates_and_nothing_else(sandbox: RecordingSandbox) -> None:
    policy = ScriptedPolicy(script(solver="SOLVER says 42", coder=[py("print(6 * 7)"), "The code printed 42."]))
    scorer = ScriptedScorer()
    ep = run(policy, sandbox, "paper", scorer)
    solver, c0, c1, verifier = ep.actions
    # without a system prompt the coach is told the agent's title as its role, as the published coach was
    assert [c.role for call in scorer.calls for c in call] == [
        "Problem Solver", "Code Executor", "Code Executor", "Verifier"
    ]  # fmt: skip
    problem = "What is 6 * 7?"
    assert list(solver.messages) == [Message(role="user", content=paper.MATHCHAT_SOLVER.format(problem=problem))]
    coder_first = paper.MATHCHAT_CODER.format(problem=problem, solution="SOLVER says 42")
    assert list(c0.messages) == [Message(role="user", content=coder_first)]
    observation = c1.messages[-1].content  # the run's output, back as the next user turn
    assert [m.role for m in c1.messages] == ["user", "assistant", "user"] and c1.messages[1].content == c0.text
    assert observation.startswith("<tool_response>\n42") and observation.endswith("</tool_response>")
    execution = f"The code printed 42.\n\n{observation}"  # the final output, then the last tool response
    assert list(verifier.messages) == [
        Message(role="user", content=paper.MATHCHAT_VERIFIER.format(problem=problem, execution=execution))
    ]
    assert ep.correct is True
    ours = run(policy, sandbox, "mappa")  # the default: a system prompt with the role, our wording
    assert ours.actions[0].messages[0].role == "system" and "Problem Solver" in ours.actions[0].messages[0].content
    assert all(a.messages != b.messages for a, b in zip(ours.actions, ep.actions, strict=True))
