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

from mappa.config import GenerationConfig, SandboxConfig, WorkflowConfig
from mappa.protocols import ProgressFn, Runtime
from mappa.sandbox.codeblocks import extract_code_blocks, format_observation
from mappa.tasks import check_answer, extract_answer
from mappa.types import Action, CoachContext, Episode, ExecResult, Message, Task
from mappa.workflows.base import (
    AgentSpec,
    Batch,
    EpisodeState,
    Turn,
    action_context,
    clip_middle,
    episode_meta,
    feedback_note,
    play_batch,
    run_stage,
    score_stage,
)

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
    """The MathChat workflow: `MathChat(cfg.workflow, cfg.generation, cfg.sandbox).run(tasks, Runtime(...))`.

    It reads its settings here, once: the Code Executor's turn cap and the feedback switch (`workflow`),
    the sampling settings and token caps (`gen`), and from `sandbox` the longest tool observation an agent
    and the coach see (`observation_chars`) and whether workspaces are kept.
    """

    name = "mathchat"

    def __init__(
        self,
        cfg: WorkflowConfig | None = None,
        gen: GenerationConfig | None = None,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        cfg = cfg or WorkflowConfig()
        sandbox = sandbox or SandboxConfig()
        self.gen = gen or GenerationConfig()
        self.show_feedback = cfg.show_coach_feedback
        self.observation_chars = sandbox.observation_chars
        self.keep_workspaces = sandbox.keep_workspaces
        self.coder = dataclasses.replace(CODER, max_turns=cfg.coder_max_turns)
        self.specs = (SOLVER, self.coder, VERIFIER)
        self.agents = tuple(s.name for s in self.specs)

    def role(self, spec: AgentSpec) -> str:
        return spec.role.format(budget=self.gen.max_new_tokens, turns=spec.max_turns)

    # ---------------------------------------------------------------------------------------------- prompts
    def solver_messages(self, task: Task) -> list[Message]:
        return [
            Message(role="system", content=self.role(SOLVER)),
            Message(role="user", content=f"Problem:\n{task.problem}\n\n{SOLVER_ASK}"),
        ]

    def coder_messages(
        self, task: Task, solver: Action, history: Sequence[tuple[Action, str]], feedback: str, budget: int | None
    ) -> list[Message]:
        """The Code Executor's chat: the problem + the Solver's output, then its own earlier turns."""
        first = f"Problem:\n{task.problem}\n\nThe Problem Solver's answer:\n{clip_middle(solver.text, budget)}"
        messages = [
            Message(role="system", content=self.role(self.coder)),
            Message(role="user", content=f"{first}{feedback}\n\n{CODER_ASK}"),
        ]
        for action, observation in history:
            messages.append(Message(role="assistant", content=clip_middle(action.text, budget)))
            messages.append(Message(role="user", content=clip_middle(observation, budget)))
        return messages

    @staticmethod
    def verifier_ask(task: Task) -> str:
        return VERIFIER_ASK_SHORT if task.source == "arithmetic" else VERIFIER_ASK

    def verifier_messages(
        self, task: Task, coder_final: Action, last_output: str | None, feedback: str, budget: int | None
    ) -> list[Message]:
        """The Verifier's chat: the problem + only the Code Executor's final action and the last tool output."""
        output = last_output if last_output is not None else "(no code was run)"
        content = (
            f"Problem:\n{task.problem}\n\nThe Code Executor's final message:\n{clip_middle(coder_final.text, budget)}"
            f"\n\nLast tool output:\n{clip_middle(output, budget)}"
        )
        return [
            Message(role="system", content=self.role(VERIFIER)),
            Message(role="user", content=f"{content}{feedback}\n\n{self.verifier_ask(task)}"),
        ]

    # ------------------------------------------------------------------------------------------------- coach
    def context(self, task: Task, action: Action) -> CoachContext:
        """The coach's evidence for one action: exactly what its agent saw, its raw output and its tool call."""
        return action_context(
            self.name, self.specs, self.role, task, action, final=VERIFIER.name,
            observation_chars=self.observation_chars,
        )  # fmt: skip

    # --------------------------------------------------------------------------------------------------- run
    def run(
        self, tasks: Sequence[Task], rt: Runtime, *, seed: int | None = None, progress: ProgressFn | None = None
    ) -> list[Episode]:
        """Play one episode per task, all in lockstep; returns episodes in task order."""
        if not tasks:
            return []
        states = play_batch(
            tasks,
            rt,
            self.gen,
            self._play,
            actions_per_episode=2 + self.coder.max_turns,
            keep_workspaces=self.keep_workspaces,
            seed=seed,
            progress=progress,
        )
        return [self._episode(s) for s in states]

    def _note(self, spec: AgentSpec, action: Action) -> str:
        if not self.show_feedback or action.coach is None:
            return ""
        return "\n\n" + feedback_note(spec.title, action.coach)

    def _stage(self, batch: Batch, spec: AgentSpec, turns: list[Turn], turn_index: int) -> list[tuple[Turn, Action]]:
        done = run_stage(batch, spec, turns, turn_index=turn_index, extract_code=extract_code_blocks)
        contexts = [self.context(t.state.task, a) for t, a in done]
        done = score_stage(done, contexts, batch.rt.scorer)
        for turn, action in done:
            turn.state.actions.append(action)
        batch.count.advance(len(turns))
        return done

    def _play(self, batch: Batch) -> None:
        states, count, max_turns = batch.states, batch.count, self.coder.max_turns
        # Stage 1: the Problem Solver, one turn.
        turns = [Turn(s, lambda budget, s=s: self.solver_messages(s.task)) for s in states]
        solved = {id(t.state): a for t, a in self._stage(batch, SOLVER, turns, 0)}
        count.drop((len(states) - len(solved)) * (1 + max_turns))

        # Stage 2: the Code Executor, up to max_turns turns; an action without code ends its turns.
        history: dict[int, list[tuple[Action, str]]] = {id(s): [] for s in states}
        last_output: dict[int, str | None] = {id(s): None for s in states}
        coder_final: dict[int, Action] = {}
        waiting = [s for s in states if id(s) in solved]
        for k in range(max_turns):
            turns = [
                Turn(
                    s,
                    lambda budget, s=s: self.coder_messages(
                        s.task, solved[id(s)], history[id(s)], self._note(SOLVER, solved[id(s)]), budget
                    ),
                )
                for s in waiting
            ]
            done = self._stage(batch, self.coder, turns, k)
            waiting = []
            for turn, action in done:
                key = id(turn.state)
                coder_final[key] = action
                if action.exec_result is None:
                    continue
                observation = tool_response(action.exec_result, self.observation_chars)
                last_output[key] = observation
                history[key].append((action, observation))
                if k + 1 < max_turns:
                    waiting.append(turn.state)
            count.drop((len(turns) - len(waiting)) * (max_turns - k - 1) + len(turns) - len(done))

        # Stage 3: the Verifier, one turn, on the Code Executor's final action and the last tool output.
        finals = [s for s in states if id(s) in coder_final]
        turns = [
            Turn(
                s,
                lambda budget, s=s: self.verifier_messages(
                    s.task, coder_final[id(s)], last_output[id(s)], self._note(self.coder, coder_final[id(s)]), budget
                ),
            )
            for s in finals
        ]
        self._stage(batch, VERIFIER, turns, 0)

    def _episode(self, s: EpisodeState) -> Episode:
        verifier = next((a for a in s.actions if a.agent == VERIFIER.name), None)
        return Episode(
            id=s.id,
            workflow=self.name,
            task=s.task,
            actions=tuple(s.actions),
            final_answer=extract_answer(verifier.text) if verifier is not None else None,
            correct=check_answer(verifier.text, s.task.answer, s.task.problem) if verifier is not None else False,
            meta=episode_meta(s, self.keep_workspaces),
        )
