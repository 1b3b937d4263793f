"""MathChat: Problem Solver -> Code Executor -> Verifier on competition math (method.md section 4).

| agent          | turns                     | tools  | sees                                                       |
|----------------|---------------------------|--------|------------------------------------------------------------|
| problem_solver | 1                         | none   | the problem                                                |
| code_executor  | <= workflow.coder_max_turns | python | the problem + the Solver's full output                   |
| verifier       | 1                         | none   | the problem + only the Code Executor's final action and    |
|                |                           |        | the last tool output; answers in \\boxed{}                 |

The Code Executor: every ```python block of an action is joined in order into one snippet that runs once in
the episode's workspace; the observation comes back as a user turn `<tool_response>...</tool_response>`.
It stops at an action without code or at its turn cap (the last action's code still runs, so the Verifier
sees its output). Every Action records exactly the messages its agent saw, including earlier turns.

With `workflow.show_coach_feedback`, an agent's prompt carries the coach's note on every earlier action whose
text it is shown (off by default, as in the published code; without a coach, as in evaluation, there is no
note to show). Every stage is scored before the next one starts either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mappa.config import SandboxConfig, WorkflowConfig
from mappa.tasks import check_answer, extract_answer
from mappa.types import Action, CoachContext, Episode, Message, Task
from mappa.workflows import paper_prompts
from mappa.workflows.base import AgentSpec, action_context, clip_middle, feedback_note
from mappa.workflows.mathchat_prompts import (
    CODER,
    CODER_ASK,
    SOLVER,
    SOLVER_ASK,
    VERIFIER,
    VERIFIER_ASK,
    VERIFIER_ASK_SHORT,
    tool_response,
)
from mappa.workflows.runtime import Team, Tools

__all__ = ["CODER", "SOLVER", "VERIFIER", "MathChat"]


class MathChat:
    """The MathChat workflow, one episode at a time (`play`); built with the settings it reads, once: the Code
    Executor's turn cap, the feedback switch and whose prompts the agents get (`workflow.prompts`: ours, or the
    paper's verbatim, `mappa.workflows.paper_prompts`), and from `sandbox` the longest tool observation an agent and
    the coach see (`observation_chars`). How it samples is the runtime's call (`mappa.workflows.runtime`)."""

    name = "mathchat"

    def __init__(self, cfg: WorkflowConfig | None = None, sandbox: SandboxConfig | None = None) -> None:
        cfg = cfg or WorkflowConfig()
        self.show_feedback = cfg.show_coach_feedback
        self.paper = cfg.prompts == "paper"
        self.answer_form = cfg.answer_form
        self.observation_chars = (sandbox or SandboxConfig()).observation_chars
        self.coder = dataclasses.replace(CODER, max_turns=cfg.coder_max_turns)
        self.specs = (SOLVER, self.coder, VERIFIER)
        self.agents = tuple(s.name for s in self.specs)
        self.max_actions = 2 + self.coder.max_turns

    def check_task(self, task: Task) -> None:
        """Any task with a problem and a gold answer plays (the answer is checked by rule at the end)."""

    # ----------------------------------------------------------------------------------------------------- play
    async def play(self, task: Task, team: Team, tools: Tools) -> Episode:
        """Solver, then the Code Executor until it stops writing code or runs out of turns (its code runs; its
        output comes back to it), then the Verifier on the Code Executor's final message and last output."""
        budget = team.sampling.max_new_tokens
        solver = await team.act(SOLVER.name, self.solver_messages(task, budget))
        history: list[tuple[Action, str]] = []
        note, coder = self._note(SOLVER, solver), None
        for _ in range(self.coder.max_turns):
            coder = await team.act(
                CODER.name, lambda cut: self.coder_messages(task, solver, history, note, cut, budget), code=True
            )
            if coder.exec_result is None:
                break
            history.append((coder, tool_response(coder.exec_result, self.observation_chars)))
        last = history[-1][1] if history else None
        note = self._note(self.coder, coder)
        verifier = await team.act(
            VERIFIER.name, lambda cut: self.verifier_messages(task, coder, last, note, cut, budget)
        )
        return team.episode(
            final_answer=extract_answer(verifier.text), correct=check_answer(verifier.text, task.answer, task.problem)
        )

    def _note(self, spec: AgentSpec, action: Action) -> str:
        if not self.show_feedback or action.coach is None:
            return ""
        return "\n\n" + feedback_note(spec.title, action.coach)

    # ---------------------------------------------------------------------------------------------- prompts
    def role(self, spec: AgentSpec, budget: int) -> str:
        return spec.role.format(budget=budget, turns=spec.max_turns)

    def solver_messages(self, task: Task, budget: int) -> list[Message]:
        if self.paper:
            return [Message(role="user", content=paper_prompts.MATHCHAT_SOLVER.format(problem=task.problem))]
        return [
            Message(role="system", content=self.role(SOLVER, budget)),
            Message(role="user", content=f"Problem:\n{task.problem}\n\n{SOLVER_ASK}"),
        ]

    def coder_messages(
        self, task: Task, solver: Action, history: Sequence[tuple[Action, str]], feedback: str, cut: int | None,
        budget: int,
    ) -> list[Message]:  # fmt: skip
        """The Code Executor's chat: the problem + the Solver's output, then its own earlier turns."""
        if self.paper:
            first = paper_prompts.MATHCHAT_CODER.format(problem=task.problem, solution=clip_middle(solver.text, cut))
            messages = [Message(role="user", content=f"{first}{feedback}")]
        else:
            first = f"Problem:\n{task.problem}\n\nThe Problem Solver's answer:\n{clip_middle(solver.text, cut)}"
            messages = [
                Message(role="system", content=self.role(self.coder, budget)),
                Message(role="user", content=f"{first}{feedback}\n\n{CODER_ASK}"),
            ]
        for action, observation in history:
            messages.append(Message(role="assistant", content=clip_middle(action.text, cut)))
            messages.append(Message(role="user", content=clip_middle(observation, cut)))
        return messages

    def verifier_ask(self, task: Task) -> str:
        short = self.answer_form == "line" or (self.answer_form == "auto" and task.source == "arithmetic")
        return VERIFIER_ASK_SHORT if short else VERIFIER_ASK

    def verifier_messages(
        self, task: Task, coder_final: Action, last_output: str | None, feedback: str, cut: int | None, budget: int
    ) -> list[Message]:
        """The Verifier's chat: the problem + only the Code Executor's final action and the last tool output."""
        if self.paper:
            last = None if last_output is None else clip_middle(last_output, cut)
            execution = paper_prompts.verifier_execution(clip_middle(coder_final.text, cut), last)
            content = paper_prompts.MATHCHAT_VERIFIER.format(problem=task.problem, execution=execution)
            return [Message(role="user", content=f"{content}{feedback}")]
        output = last_output if last_output is not None else "(no code was run)"
        content = (
            f"Problem:\n{task.problem}\n\nThe Code Executor's final message:\n{clip_middle(coder_final.text, cut)}"
            f"\n\nLast tool output:\n{clip_middle(output, cut)}"
        )
        return [
            Message(role="system", content=self.role(VERIFIER, budget)),
            Message(role="user", content=f"{content}{feedback}\n\n{self.verifier_ask(task)}"),
        ]

    # ------------------------------------------------------------------------------------------------- coach
    def context(self, task: Task, action: Action) -> CoachContext:
        """The coach's evidence for one action: exactly what its agent saw, its raw output and its tool call."""
        return action_context(
            self.name, self.specs, task, action, final=VERIFIER.name, observation_chars=self.observation_chars
        )
