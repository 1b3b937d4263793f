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
from mappa.sandbox.codeblocks import format_observation
from mappa.tasks import check_answer, extract_answer
from mappa.types import Action, CoachContext, Episode, ExecResult, Message, Task
from mappa.workflows.base import AgentSpec, action_context, clip_middle, feedback_note
from mappa.workflows.runtime import Team, Tools

_TEAM = "a math team of three agents: Problem Solver, then Code Executor, then Verifier"

SOLVER = AgentSpec(
    name="problem_solver",
    title="Problem Solver",
    role=(
        f"You are the Problem Solver, the first agent of {_TEAM}. The Code Executor will check your work by "
        "running Python, and the Verifier gives the team's final answer: the team succeeds only if the "
        "Verifier's answer is right. Solve the problem step by step and state your answer clearly. You cannot "
        "run code. Keep it short: your reply is cut off after {budget} tokens."
    ),
    max_turns=1,
    sees="the problem",
)

CODER = AgentSpec(
    name="code_executor",
    title="Code Executor",
    role=(
        f"You are the Code Executor, the second agent of {_TEAM}. You see the problem and the Problem "
        "Solver's answer. Write a ```python code block that computes the answer and prints it; the code runs "
        "and its output comes back to you in <tool_response>. You can run code {turns} time(s); reply without a "
        "code block when you are done, stating the result. The Verifier sees only your final message and the "
        "last tool output, so make your final message self-contained. Keep it short: each reply is cut off "
        "after {budget} tokens."
    ),
    max_turns=2,
    tools=("python",),
    sees="the problem and the Problem Solver's full output",
)

VERIFIER = AgentSpec(
    name="verifier",
    title="Verifier",
    role=(
        f"You are the Verifier, the last agent of {_TEAM}. You see the problem, the Code Executor's final "
        "message and its last tool output. Check them and give the team's final answer as \\boxed{{answer}}. "
        "The team succeeds only if your boxed answer is right. Keep it short: your reply is cut off after "
        "{budget} tokens."
    ),
    max_turns=1,
    sees="the problem, the Code Executor's final action and the last tool output (not the Solver's text)",
)


# The task restated at the end of each prompt: small models follow the last instruction they read.
SOLVER_ASK = "Solve it step by step and end with the answer."
CODER_ASK = "Write a ```python block that computes the answer and prints it."
VERIFIER_ASK = "Check the work, then give the final answer in the form \\boxed{...}."
# Generated arithmetic has integer answers and is what small models train on: a one-line answer is the format
# a 135M model follows (measured: about 7x more replies with an extractable answer than with the boxed ask).
VERIFIER_ASK_SHORT = "Reply with one line only: The answer is <number>."


def tool_response(result: ExecResult, max_chars: int) -> str:
    """The user turn that carries a code run's observation back to the agent."""
    return f"<tool_response>\n{format_observation(result, max_chars=max_chars)}\n</tool_response>"


class MathChat:
    """The MathChat workflow, one episode at a time (`play`); built with the settings it reads, once: the Code
    Executor's turn cap and the feedback switch (`workflow`), and from `sandbox` the longest tool observation an
    agent and the coach see (`observation_chars`). How it samples is the runtime's call (`mappa.workflows.runtime`)."""

    name = "mathchat"

    def __init__(self, cfg: WorkflowConfig | None = None, sandbox: SandboxConfig | None = None) -> None:
        cfg = cfg or WorkflowConfig()
        self.show_feedback = cfg.show_coach_feedback
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
        return [
            Message(role="system", content=self.role(SOLVER, budget)),
            Message(role="user", content=f"Problem:\n{task.problem}\n\n{SOLVER_ASK}"),
        ]

    def coder_messages(
        self, task: Task, solver: Action, history: Sequence[tuple[Action, str]], feedback: str, cut: int | None,
        budget: int,
    ) -> list[Message]:  # fmt: skip
        """The Code Executor's chat: the problem + the Solver's output, then its own earlier turns."""
        first = f"Problem:\n{task.problem}\n\nThe Problem Solver's answer:\n{clip_middle(solver.text, cut)}"
        messages = [
            Message(role="system", content=self.role(self.coder, budget)),
            Message(role="user", content=f"{first}{feedback}\n\n{CODER_ASK}"),
        ]
        for action, observation in history:
            messages.append(Message(role="assistant", content=clip_middle(action.text, cut)))
            messages.append(Message(role="user", content=clip_middle(observation, cut)))
        return messages

    @staticmethod
    def verifier_ask(task: Task) -> str:
        return VERIFIER_ASK_SHORT if task.source == "arithmetic" else VERIFIER_ASK

    def verifier_messages(
        self, task: Task, coder_final: Action, last_output: str | None, feedback: str, cut: int | None, budget: int
    ) -> list[Message]:
        """The Verifier's chat: the problem + only the Code Executor's final action and the last tool output."""
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
