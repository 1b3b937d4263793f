"""Episodes as programs: a workflow plays ONE task (`async def play(task, team, tools)`); `play` runs many at once.

    episodes = play(workflow, tasks, Runtime(generator, sandbox, scorer), sampling=SamplingSettings(...), seed=7)

Each episode is a coroutine, and what it asks for is batched by the runtime, not by the workflow: generation
requests of every live episode go to the generator (the local policy decodes them together, a request joining
the running batch at the next token; a server has them all in flight), code runs in the sandbox's pool, and the
coach scores each action as it lands. An episode that finishes early, or waits on its code, holds up no other.

What a workflow writes (`Team` and `Tools` below):

    solver = await team.act("problem_solver", messages)               # generate, record, score: an Action
    coder = await team.act("code_executor", build, code=True)         # ...and run its ```python blocks first
    reply = await team.generate(agent, messages)                       # or step by step:
    result = await tools.python(code)                                  #   the code tool, in the episode's workspace
    action = await team.commit(reply, result, evidence={...})          #   record and score
    return team.episode(final_answer=..., correct=...)

`messages` is a list of messages, or `build(budget)`: the messages with the text they embed cut to `budget`
characters (None: whole), which the runtime calls with shrinking budgets until the prompt fits
`max_context_tokens`. A prompt that cannot fit ends its episode (`Episode.meta["error"]`), never the batch.

Reproducible whatever runs beside it: episode i samples from `row_seed(seed, i)`, its k-th request from
`row_seed(that, k)`, and every request draws from its own generator (`mappa.policy.decoding.DecodeRow.generator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mappa.errors import MappaError
from mappa.protocols import GenerationLike, ProgressFn, Runtime, SamplingSettings, Workflow, row_seed
from mappa.sandbox import new_workspace, remove_workspace
from mappa.types import Action, Episode, ExecResult, Message, Task
from mappa.workflows.codeblocks import extract_code_blocks

Messages = Sequence[Message] | Callable[[int | None], Sequence[Message]]


class EpisodeStopped(Exception):
    """An episode that cannot go on (a prompt that cannot fit the context): it ends with what it has."""


@dataclass
class Reply:
    """One generated reply, not yet recorded: whose, which of its turns, exactly what it saw, what it sampled."""

    agent: str
    turn: int  # 0-based: the agent's own turns in this episode
    messages: list[Message]
    generation: GenerationLike

    @property
    def text(self) -> str:
        return self.generation.text


@dataclass
class _Books:
    """What the runtime keeps of one episode while it plays."""

    actions: list[Action] = field(default_factory=list)
    turns: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    sandbox_s: float = 0.0
    clipped_prompts: int = 0


class Tools:
    """The episode's code tool: `await tools.python(code)` runs a snippet in the episode's workspace
    (`tools.workspace`, kept for every tool call of every agent of the episode), or in another one given (e.g. a
    fresh workspace per check: `mappa.sandbox.new_workspace`)."""

    def __init__(self, rt: Runtime, workspace: Path, books: _Books) -> None:
        self.workspace = workspace
        self._rt, self._books = rt, books

    async def python(self, code: str, workspace: Path | None = None) -> ExecResult:
        (result,) = await asyncio.to_thread(self._rt.sandbox.run_many, [(code, workspace or self.workspace)])
        self._books.sandbox_s += result.duration_s
        return result


class Team:
    """One episode's handle on the agents: generate, record, score (see the module docstring)."""

    def __init__(
        self, workflow: Workflow, rt: Runtime, sampling: SamplingSettings, task: Task, episode_id: str, seed: int,
        tools: Tools, books: _Books, on_action: Callable[[], None],
    ) -> None:  # fmt: skip
        self.workflow, self.rt, self.sampling, self.task, self.id = workflow, rt, sampling, task, episode_id
        self.tools, self.seed = tools, seed
        self._books, self._on_action = books, on_action

    @property
    def actions(self) -> list[Action]:
        """The actions recorded so far, in order."""
        return self._books.actions

    async def generate(self, agent: str, messages: Messages) -> Reply:
        """`agent`'s reply to `messages`, fitted to the context cap (EpisodeStopped when it cannot fit)."""
        if agent not in self.workflow.agents:
            raise MappaError(f"agent {agent!r} is not part of workflow {self.workflow.name!r}")
        msgs, ids = self._fit(agent, messages)
        seed = row_seed(self.seed, self._books.requests)
        self._books.requests += 1
        generation = await self.rt.generator.generate(agent, msgs, ids, self.sampling, seed)
        turn = self._books.turns.get(agent, 0)
        self._books.turns[agent] = turn + 1
        return Reply(agent, turn, msgs, generation)

    async def commit(
        self, reply: Reply, exec_result: ExecResult | None = None, evidence: dict[str, Any] | None = None
    ) -> Action:
        """Record `reply` as an action (with its tool call and the coach's further evidence) and have the coach
        score it; returns the scored action."""
        action = Action.sampled(reply.agent, reply.turn, reply.messages, reply.generation, exec_result=exec_result)
        if evidence:
            action = action.model_copy(update={"evidence": evidence})
        if self.rt.scorer is not None:
            context = self.workflow.context(self.task, action)
            scores = await asyncio.to_thread(self.rt.scorer, [context])
            if len(scores) != 1:
                raise RuntimeError(f"scorer returned {len(scores)} scores for 1 action")
            action = action.model_copy(update={"coach": scores[0]})
        self._books.actions.append(action)
        self._on_action()
        return action

    async def act(self, agent: str, messages: Messages, *, code: bool = False) -> Action:
        """Generate `agent`'s reply; with `code`, join its ```python blocks into one snippet and run it (a reply
        without code runs nothing); record and score it."""
        reply = await self.generate(agent, messages)
        result = None
        if code:
            blocks = extract_code_blocks(reply.text)
            if blocks:
                result = await self.tools.python("\n\n".join(blocks))
        return await self.commit(reply, result)

    def episode(
        self, *, final_answer: str | None, correct: bool | None, meta: dict[str, Any] | None = None
    ) -> Episode:
        """The finished episode: its recorded actions and the runtime's bookkeeping in `meta` beside `meta`."""
        return Episode(
            id=self.id, workflow=self.workflow.name, task=self.task, actions=tuple(self._books.actions),
            final_answer=final_answer, correct=correct, meta={**_meta(self._books), **(meta or {})},
        )  # fmt: skip

    def _fit(self, agent: str, messages: Messages) -> tuple[list[Message], list[int]]:
        build = messages if callable(messages) else (lambda budget: messages)
        cap = self.sampling.max_context_tokens
        msgs = list(build(None))
        ids = self.rt.generator.chat_ids(agent, msgs)
        if cap is None or len(ids) <= cap or not callable(messages):
            if cap is not None and len(ids) > cap:
                raise EpisodeStopped(f"{agent}: prompt of {len(ids)} tokens exceeds max_context_tokens={cap}")
            return msgs, ids
        budget = sum(len(m.content) for m in msgs)
        while budget > 0:  # shrink in proportion to the overshoot (tokens ~ chars), with a margin to converge fast
            budget = min(budget - 1, int(budget * cap / len(ids) * 0.9))
            msgs = list(build(max(budget, 0)))
            ids = self.rt.generator.chat_ids(agent, msgs)
            if len(ids) <= cap:
                self._books.clipped_prompts += 1
                return msgs, ids
        raise EpisodeStopped(
            f"{agent} turn {self._books.turns.get(agent, 0) + 1}: prompt exceeds max_context_tokens={cap} even with "
            "earlier text cut"
        )


def _meta(books: _Books) -> dict[str, Any]:
    results = [a.exec_result for a in books.actions if a.exec_result is not None]
    return {
        "sandbox_s": round(books.sandbox_s, 4),
        "tool_calls": len(results),
        "code_errors": sum(not r.ok for r in results),
        "clipped_prompts": books.clipped_prompts,
    }


class _Progress:
    """(actions done, at most this many) to a progress callback; an episode that ends gives back what it left."""

    def __init__(self, progress: ProgressFn | None, total: int) -> None:
        self.progress, self.done, self.total = progress, 0, total

    def advance(self) -> None:
        self.done += 1
        self._report()

    def finish(self, unused: int) -> None:
        if unused:
            self.total = max(self.total - unused, self.done)
            self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)


def play(
    workflow: Workflow, tasks: Sequence[Task], rt: Runtime, *, sampling: SamplingSettings, seed: int | None = None,
    progress: ProgressFn | None = None, keep_workspaces: bool = False,
) -> list[Episode]:  # fmt: skip
    """One episode of `workflow` per task, all at once; episodes come back in task order. Tasks are checked first
    (`workflow.check_task`). Episode ids are unique per call: `<task id>#<call tag>-<index>`."""
    for task in tasks:
        workflow.check_task(task)
    if not tasks:
        return []
    with asyncio.Runner() as runner:
        with sigint_deferred():
            runner.get_loop()
        return runner.run(_play_all(workflow, list(tasks), rt, sampling, seed, progress, keep_workspaces))


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Ctrl-C held back until the block ends (in the main thread; elsewhere nothing to hold). An event loop
    interrupted while it is being built is left half made, and its finaliser then fails with a traceback at exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a Ctrl-C that came meanwhile lands here


async def _play_all(
    workflow: Workflow, tasks: list[Task], rt: Runtime, sampling: SamplingSettings, seed: int | None,
    progress: ProgressFn | None, keep: bool,
) -> list[Episode]:  # fmt: skip
    tag = uuid.uuid4().hex[:8]
    count = _Progress(progress, len(tasks) * workflow.max_actions)
    base = seed if seed is not None else uuid.uuid4().int % 2**63
    jobs = [
        _play_one(workflow, task, rt, sampling, f"{task.id}#{tag}-{i}", row_seed(base, i), count, keep)
        for i, task in enumerate(tasks)
    ]
    return list(await asyncio.gather(*jobs))


async def _play_one(
    workflow: Workflow, task: Task, rt: Runtime, sampling: SamplingSettings, episode_id: str, seed: int,
    count: _Progress, keep: bool,
) -> Episode:  # fmt: skip
    books = _Books()
    workspace = new_workspace(keep=keep)
    tools = Tools(rt, workspace, books)
    team = Team(workflow, rt, sampling, task, episode_id, seed, tools, books, count.advance)
    try:
        try:
            episode = await workflow.play(task, team, tools)
        except EpisodeStopped as stop:
            episode = team.episode(final_answer=None, correct=False, meta={"error": str(stop)})
        if keep:
            episode = episode.model_copy(update={"meta": {**episode.meta, "workspace": str(workspace)}})
        return episode
    finally:
        count.finish(workflow.max_actions - len(books.actions))
        await asyncio.to_thread(remove_workspace, workspace)
