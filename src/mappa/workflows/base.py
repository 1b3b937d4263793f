"""The pieces every workflow shares: agent specs, the Workflow protocol, and the lockstep stage runner.

A workflow drives all episodes of a batch in lockstep. One *stage* is one turn of one agent across every
episode still waiting on it:

    fit each prompt to the context cap -> one batched policy.generate -> run all extracted code at once
    (sandbox.run_many) -> build Action records -> one scorer call for the whole stage -> attach scores

Episodes that finish early simply are not in the next stage's list. A prompt that cannot be made to fit
ends its own episode (recorded in `Episode.meta["error"]`), never the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mappa.config import GenerationConfig
from mappa.types import Action, CoachContext, CoachScore, Episode, ExecResult, Message, Task

Scorer = Callable[[Sequence[CoachContext]], list[CoachScore]]

NO_TOOL = "no tool used"


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a workflow: who it is, how often it may act, what tools it has and what it sees."""

    name: str  # key of its weights in the policy, e.g. "code_executor"
    title: str  # how teammates call it, e.g. "Code Executor"
    role: str  # its system prompt
    max_turns: int  # turn cap within one episode
    tools: tuple[str, ...] = ()  # ("python",): every ```python block of an action runs
    sees: str = ""  # what it sees of earlier agents, for docs and the coach


class Workflow(Protocol):
    """A multiagent system: `agents` names the weights it needs; `run` plays a batch of episodes in lockstep."""

    name: str
    agents: tuple[str, ...]
    specs: tuple[AgentSpec, ...]

    def run(
        self,
        policy: Any,
        tasks: Sequence[Task],
        *,
        sandbox: Any,
        gen: GenerationConfig,
        scorer: Scorer | None = None,
        show_coach_feedback: bool = False,
        progress: bool | Progress = True,
    ) -> list[Episode]: ...


@dataclass
class EpisodeState:
    """Mutable per-episode bookkeeping while a batch is in flight; frozen into an Episode at the end."""

    id: str
    task: Task
    workspace: Path
    actions: list[Action] = field(default_factory=list)
    error: str | None = None  # set when the episode had to stop (e.g. a prompt that cannot fit)
    clipped_prompts: int = 0  # prompts whose embedded text was shortened to fit the context cap
    sandbox_s: float = 0.0


@dataclass
class Turn:
    """One agent turn waiting to be generated: its episode and how to build its prompt."""

    state: EpisodeState
    build: Callable[[int | None], list[Message]]  # char budget for embedded text (None: no clipping) -> messages


def clip_middle(text: str, budget: int | None) -> str:
    """Keep the head and tail of `text` within `budget` characters (None: unchanged), marking the cut."""
    if budget is None or len(text) <= budget:
        return text
    head = max(budget * 2 // 3, 0)
    tail = max(budget - head, 0)
    cut = len(text) - head - tail
    return text[:head] + f"\n[... {cut} characters cut to fit the context ...]\n" + (text[-tail:] if tail else "")


def fit_messages(
    policy: Any, build: Callable[[int | None], list[Message]], max_tokens: int
) -> tuple[list[Message], int, bool] | None:
    """Messages within `max_tokens` prompt tokens: first unclipped, then with shrinking embedded text.

    Returns (messages, prompt tokens, clipped) or None when even a bare prompt does not fit.
    """
    messages = build(None)
    n = len(policy.chat_ids(messages))
    if n <= max_tokens:
        return messages, n, False
    budget = sum(len(m.content) for m in messages)
    while budget > 0:
        # shrink in proportion to the overshoot (tokens ~ chars), with a margin so it converges fast
        budget = min(budget - 1, int(budget * max_tokens / n * 0.9))
        messages = build(max(budget, 0))
        n = len(policy.chat_ids(messages))
        if n <= max_tokens:
            return messages, n, True
    return None


def run_stage(
    policy: Any,
    spec: AgentSpec,
    turns: Sequence[Turn],
    *,
    turn_index: int,
    sandbox: Any,
    gen: GenerationConfig,
    extract_code: Callable[[str], list[str]],
) -> list[tuple[Turn, Action]]:
    """Generate one action for every turn (one batched call) and run its code; returns the live turns' actions.

    Code: every ```python block of an action is joined, in order, into one snippet that runs once in the
    episode's workspace (so later blocks see earlier blocks' variables, as in a notebook cell).
    """
    live: list[tuple[Turn, list[Message]]] = []
    for turn in turns:
        fitted = fit_messages(policy, turn.build, gen.max_context_tokens)
        if fitted is None:
            turn.state.error = (
                f"{spec.name} turn {turn_index + 1}: prompt exceeds generation.max_context_tokens="
                f"{gen.max_context_tokens} even with earlier text cut"
            )
            continue
        messages, _, clipped = fitted
        turn.state.clipped_prompts += clipped
        live.append((turn, messages))
    if not live:
        return []
    generations = policy.generate(
        spec.name,
        [messages for _, messages in live],
        temperature=gen.temperature,
        top_p=gen.top_p,
        max_new_tokens=gen.max_new_tokens,
        max_context_tokens=gen.max_context_tokens,
        batch_size=gen.batch_size,
    )
    codes: list[str | None] = [None] * len(live)
    if "python" in spec.tools:
        for i, g in enumerate(generations):
            blocks = extract_code(g.text)
            codes[i] = "\n\n".join(blocks) if blocks else None
    to_run = [i for i, c in enumerate(codes) if c is not None]
    results: dict[int, ExecResult] = {}
    if to_run:
        ran = sandbox.run_many([(codes[i], live[i][0].state.workspace) for i in to_run])
        results = dict(zip(to_run, ran, strict=True))
    out = []
    for i, ((turn, messages), g) in enumerate(zip(live, generations, strict=True)):
        result = results.get(i)
        if result is not None:
            turn.state.sandbox_s += result.duration_s
        action = Action(
            agent=spec.name,
            turn=turn_index,
            messages=tuple(messages),
            text=g.text,
            prompt_ids=tuple(g.prompt_ids),
            response_ids=tuple(g.response_ids),
            logprobs=tuple(g.logprobs),
            truncated=g.truncated,
            exec_result=result,
        )
        out.append((turn, action))
    return out


def score_stage(
    stage: list[tuple[Turn, Action]], contexts: Sequence[CoachContext], scorer: Scorer | None
) -> list[tuple[Turn, Action]]:
    """One scorer call for all of a stage's actions; attaches each CoachScore to its Action."""
    if scorer is None or not stage:
        return stage
    scores = scorer(contexts)
    if len(scores) != len(stage):
        raise RuntimeError(f"scorer returned {len(scores)} scores for {len(stage)} actions")
    return [(turn, action.model_copy(update={"coach": s})) for (turn, action), s in zip(stage, scores, strict=True)]


class StageProgress:
    """A rich bar over the actions of a batch; the total shrinks as episodes stop early."""

    def __init__(self, progress: bool | Progress, label: str, total: int) -> None:
        self._own = progress is True
        self._bar: Progress | None
        if progress is True:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=True,
            )
            self._bar.start()
        else:
            self._bar = progress or None
        self._label = label
        self._task = self._bar.add_task(label, total=total) if self._bar is not None else None
        self.started = time.perf_counter()

    def stage(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self._label}: {text}")

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def drop(self, n: int) -> None:
        """`n` actions will not happen (episodes that stopped early)."""
        if self._bar is not None and n:
            total = self._bar.tasks[self._bar.task_ids.index(self._task)].total or 0
            self._bar.update(self._task, total=max(total - n, 0))

    def close(self) -> None:
        if self._bar is None:
            return
        if self._own:
            self._bar.stop()
        else:
            self._bar.remove_task(self._task)
