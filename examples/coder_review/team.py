"""Coder -> Reviewer: a two-agent programming team defined outside the mappa package (docs/your-team.md).

| agent    | turns | tools  | sees                                                                          |
|----------|-------|--------|-------------------------------------------------------------------------------|
| coder    | 1     | python | the task and one visible example call                                         |
| reviewer | 1     | python | the task, the example, the Coder's code and what running the example printed  |

The Coder writes the function in a ```python block; it runs in the sandbox followed by the visible example
call. The Reviewer approves (a reply saying APPROVE) or rewrites the function in its own ```python block, which
runs against the example too. The final code (the rewrite, else the Coder's) then runs against the task's
HIDDEN unit tests, `Task.answer`: lines `assert CALL == VALUE`. No agent ever sees them, and every run gets a
fresh workspace, so files an earlier run wrote cannot reach the hidden tests.

This file is the workflow: the prompts and one episode as a short program (`play`). It imports its
siblings by plain name, as a script would: the plug-in loader puts this directory first on `sys.path` (so a
sibling's name should be one no installed package uses):
- roles.py: the two agents' role prompts and how a reply is read (its code, the Reviewer's verdict);
- hidden_tests.py: parsing the tests, the harness that runs code against them, and why it cannot be fooled.

Settings (`workflow.options`): `show_example_result` (default true): whether the Reviewer sees what running
the example printed. Turning it off shows what a team loses without the execution result.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence

from hidden_tests import (
    NONCE_FILE,
    Job,
    Ran,
    Spec,
    example_evidence,
    harness,
    read_outcomes,
    readable,
    task_spec,
    tests_evidence,
)
from hidden_tests import same as same  # re-exported: tests/test_example_team.py reaches the pieces through here
from roles import CODER, REVIEWER, solution, verdict

from mappa.config import SandboxConfig, WorkflowConfig
from mappa.errors import MappaError
from mappa.sandbox import new_workspace, remove_workspace
from mappa.types import Action, CoachContext, Episode, Message, Task
from mappa.workflows import Team, Tools
from mappa.workflows.base import AgentSpec, action_context, clip_middle
from mappa.workflows.codeblocks import format_observation

OPTIONS = {"show_example_result": True}


async def run_jobs(tools: Tools, jobs: Sequence[Job | None]) -> list[Ran | None]:
    """Run every job at once, each in a fresh workspace holding its own nonce (removed after), so files an earlier
    run left behind cannot reach it; None for a job that is None."""

    async def one(job: Job) -> Ran:
        nonce = secrets.token_hex(16)
        ws = await asyncio.to_thread(new_workspace, {NONCE_FILE: nonce.encode()})
        try:
            result = await tools.python(harness(job.code, job.checks, job.quiet), ws)
        finally:
            await asyncio.to_thread(remove_workspace, ws)
        return Ran(readable(result, job.checks, nonce), read_outcomes(result, job.checks, nonce))

    async def maybe(job: Job | None) -> Ran | None:
        return None if job is None else await one(job)

    return list(await asyncio.gather(*(maybe(j) for j in jobs)))


class CoderReviewer:
    """The team, one episode at a time (`play`). Reads `workflow.options` (see OPTIONS) and from `sandbox` the longest
    observation an agent and the coach see. Every run has a fresh workspace of its own, removed after it, so the
    episode's own workspace stays empty."""

    name = "coder_review"

    def __init__(self, cfg: WorkflowConfig | None = None, sandbox: SandboxConfig | None = None) -> None:
        cfg = cfg or WorkflowConfig()
        for key, value in cfg.options.items():
            if key not in OPTIONS:
                raise MappaError(f"workflow.options: unknown key {key!r} (known: {', '.join(OPTIONS)})")
            if type(value) is not type(OPTIONS[key]):
                raise MappaError(f"workflow.options.{key}: expected {type(OPTIONS[key]).__name__}, got {value!r}")
        self.show_example_result = cfg.options.get("show_example_result", OPTIONS["show_example_result"])
        self.observation_chars = (sandbox or SandboxConfig()).observation_chars
        self.specs = (CODER, REVIEWER)
        self.agents = tuple(s.name for s in self.specs)
        self.max_actions = len(self.specs)

    def check_task(self, task: Task) -> None:
        task_spec(task)  # a malformed test line stops here, before anything runs

    def role(self, spec: AgentSpec, budget: int) -> str:
        return spec.role.format(budget=budget)

    # ---------------------------------------------------------------------------------------------- prompts
    def coder_messages(self, task: Task, spec: Spec, budget: int) -> list[Message]:
        ask = "Write the function in one ```python block."
        return [
            Message(role="system", content=self.role(CODER, budget)),
            Message(role="user", content=f"Task:\n{task.problem}\n\n{spec.example.shown}\n\n{ask}"),
        ]

    def reviewer_messages(
        self, task: Task, spec: Spec, coder: Action, observation: str, cut: int | None, budget: int
    ) -> list[Message]:
        """The Reviewer's chat: the task, the example, the Coder's code and (by default) the example's output."""
        head = f"Task:\n{task.problem}\n\n{spec.example.shown}"
        code = solution(coder.text)
        if code is None:
            body = "The Coder wrote no code. Write the function in one ```python block."
        else:
            body = f"The Coder's code:\n```python\n{clip_middle(code, cut)}\n```"
            if self.show_example_result:
                body += f"\n\nRunning it with the example printed:\n{clip_middle(observation, cut)}"
            body += "\n\nReply APPROVE if it is correct, else the corrected function in one ```python block."
        system = Message(role="system", content=self.role(REVIEWER, budget))
        return [system, Message(role="user", content=f"{head}\n\n{body}")]

    # ------------------------------------------------------------------------------------------------- coach
    def context(self, task: Task, action: Action) -> CoachContext:
        """The coach's evidence for one action: what its agent saw, its output, the example run (the tool result)
        and, for the Reviewer only, how the final code did on the hidden tests (`extra`, from `Action.evidence`);
        the hidden tests are the Reviewer's coach's ground truth only."""
        return action_context(
            self.name, self.specs, task, action, final=REVIEWER.name, observation_chars=self.observation_chars,
            extra=action.evidence,
        )  # fmt: skip

    # ----------------------------------------------------------------------------------------------------- play
    async def play(self, task: Task, team: Team, tools: Tools) -> Episode:
        """The Coder's code runs with the example call; the Reviewer approves or rewrites (a rewrite runs with the
        example too); then the Coder's code and the rewrite run against the hidden tests, and the Reviewer is
        scored knowing how they did. `correct`: the final code passed every hidden test."""
        spec, budget = task_spec(task), team.sampling.max_new_tokens
        reply = await team.generate(CODER.name, self.coder_messages(task, spec, budget))
        code = solution(reply.text)
        (ran,) = await run_jobs(tools, [Job(code, [spec.example], quiet=False) if code else None])
        result = None if ran is None else ran.result
        coder = await team.commit(reply, result, {"code": code, "example": example_evidence(spec.example, ran)})
        shown = "[no code]" if result is None else format_observation(result, self.observation_chars)
        reply = await team.generate(
            REVIEWER.name, lambda cut: self.reviewer_messages(task, spec, coder, shown, cut, budget)
        )
        rewrite, decision = solution(reply.text), verdict(reply.text)
        example, coder_tests, rewrite_tests = await run_jobs(tools, [
            Job(rewrite, [spec.example], quiet=False) if rewrite else None,
            Job(code, spec.hidden, quiet=True) if code else None,
            Job(rewrite, spec.hidden, quiet=True) if rewrite else None,
        ])  # fmt: skip
        final = tests_evidence(spec.hidden, rewrite_tests if decision == "rewrite" else coder_tests)
        evidence = {
            "verdict": decision, "code": rewrite,
            "example": example_evidence(spec.example, example) if decision == "rewrite" else None,
            "coder_tests": tests_evidence(spec.hidden, coder_tests), "final_tests": final,
        }  # fmt: skip
        await team.commit(reply, None if example is None else example.result, evidence)
        meta = {"verdict": decision, "coder_tests": evidence["coder_tests"], "final_tests": final}
        final_code = rewrite if decision == "rewrite" else code
        return team.episode(final_answer=final_code, correct=bool(final and final["ok"]), meta=meta)
