"""The pieces every workflow shares: agent specs, the lockstep batch driver, and the stage runner.

A workflow drives all episodes of a batch in lockstep (`play_batch`). One *stage* is one turn of one agent
across every episode still waiting on it:

    fit each prompt to the context cap -> one batched policy.generate -> run all extracted code at once
    (sandbox.run_many) -> build Action records -> one scorer call for the whole stage -> attach scores

Episodes that finish early simply are not in the next stage's list. A prompt that cannot be made to fit
ends its own episode (recorded in `Episode.meta["error"]`), never the batch.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mappa.config import GenerationConfig
from mappa.errors import MappaError
from mappa.protocols import PolicyLike, ProgressFn, Runtime, Scorer, row_seed
from mappa.sandbox import new_workspace, remove_workspace
from mappa.sandbox.codeblocks import format_observation
from mappa.types import Action, CoachContext, CoachScore, ExecResult, Message, Task


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a workflow: who it is, how often it may act, what tools it has and what it sees."""

    name: str  # key of its weights in the policy, e.g. "code_executor"
    title: str  # how teammates call it, e.g. "Code Executor"
    role: str  # its system prompt
    max_turns: int  # turn cap within one episode
    tools: tuple[str, ...] = ()  # ("python",): every ```python block of an action runs
    sees: str = ""  # what it sees of earlier agents, for docs and the coach


def action_context(
    workflow: str, specs: Sequence[AgentSpec], role: Callable[[AgentSpec], str], task: Task, action: Action, *,
    final: str, observation_chars: int, extra: dict[str, Any] | None = None,
) -> CoachContext:  # fmt: skip
    """The coach's evidence for one action of a team whose agents take turns: exactly what its agent saw, its raw
    output, its tool call and result, the tools it had (judged on code only if it had a tool) and `extra`; the
    ground truth for the `final` agent's coach only (earlier agents are judged on evidence alone)."""
    spec = next((s for s in specs if s.name == action.agent), None)
    if spec is None:
        names = ", ".join(s.name for s in specs)
        raise MappaError(f"agent {action.agent!r} is not part of workflow {workflow!r} ({names})")
    is_final, result = spec.name == final, action.exec_result
    return CoachContext(
        task=task.problem, workflow=workflow, agent=spec.name, role=role(spec), is_final=is_final,
        messages=action.messages, output=action.text, exec_result=result,
        observation="" if result is None else format_observation(result, observation_chars),
        ground_truth=task.answer if is_final else None, extra={"tools": list(spec.tools), **(extra or {})},
    )  # fmt: skip


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


class ActionCount:
    """Reports (done, total) actions of a batch to a progress callback; the total shrinks as episodes stop."""

    def __init__(self, progress: ProgressFn | None, total: int) -> None:
        self.progress = progress
        self.done = 0
        self.total = total

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)

    def advance(self, n: int) -> None:
        self.done += n
        self._report()

    def drop(self, n: int) -> None:
        """`n` actions will not happen (episodes that stopped early)."""
        if n:
            self.total = max(self.total - n, self.done)
            self._report()


@dataclass
class Batch:
    """One batch in flight: what it is played with, its sampling settings, its episodes and its progress."""

    rt: Runtime
    gen: GenerationConfig
    states: list[EpisodeState]
    count: ActionCount
    rng: random.Random | None  # draws one sampling seed per stage; None: the policy's own randomness

    def stage_seed(self) -> int | None:
        """One sampling seed for the next stage (None: unseeded); `stage_seeds` gives each episode its own."""
        return None if self.rng is None else self.rng.randrange(2**63)

    def stage_seeds(self, states: Sequence[EpisodeState]) -> list[int] | None:
        """One sampling seed per episode for the next stage, from the stage's seed and the episode's place in the
        batch (not in the stage's list): an episode samples the same whichever others are still running."""
        stage = self.stage_seed()
        if stage is None:
            return None
        place = {id(s): i for i, s in enumerate(self.states)}
        return [row_seed(stage, place[id(s)]) for s in states]


def play_batch(
    tasks: Sequence[Task],
    rt: Runtime,
    gen: GenerationConfig,
    play: Callable[[Batch], None],
    *,
    actions_per_episode: int,
    keep_workspaces: bool,
    seed: int | None,
    progress: ProgressFn | None,
) -> list[EpisodeState]:
    """One episode state per task, each with a fresh workspace, played by `play`; workspaces are removed after
    (unless kept for inspection). Episode ids are unique per call: `<task id>#<batch tag>-<index>`."""
    tag = uuid.uuid4().hex[:8]
    states = [EpisodeState(f"{t.id}#{tag}-{i}", t, new_workspace(keep=keep_workspaces)) for i, t in enumerate(tasks)]
    count = ActionCount(progress, len(states) * actions_per_episode)
    try:
        play(Batch(rt, gen, states, count, None if seed is None else random.Random(seed)))
    finally:
        for s in states:
            remove_workspace(s.workspace)
    return states


def episode_meta(s: EpisodeState, kept: bool) -> dict[str, Any]:
    """What every workflow records of an episode's run in `Episode.meta`."""
    results = [a.exec_result for a in s.actions if a.exec_result is not None]
    meta: dict[str, Any] = {
        "sandbox_s": round(s.sandbox_s, 4),
        "tool_calls": len(results),
        "code_errors": sum(not r.ok for r in results),
        "clipped_prompts": s.clipped_prompts,
    }
    if s.error is not None:
        meta["error"] = s.error
    if kept:
        meta["workspace"] = str(s.workspace)
    return meta


def feedback_note(agent: str, score: CoachScore) -> str:
    """The text later agents see of an earlier action's judgment when `workflow.show_coach_feedback` is on."""
    if score.score is None:
        return f"Coach feedback on {agent}: unscored."
    return f"Coach feedback on {agent} ({score.score:g}/10): {score.rationale}"


def clip_middle(text: str, budget: int | None) -> str:
    """Keep the head and tail of `text` within `budget` characters (None: unchanged), marking the cut."""
    if budget is None or len(text) <= budget:
        return text
    head = max(budget * 2 // 3, 0)
    tail = max(budget - head, 0)
    cut = len(text) - head - tail
    return text[:head] + f"\n[... {cut} characters cut to fit the context ...]\n" + (text[-tail:] if tail else "")


def fit_messages(
    policy: PolicyLike, build: Callable[[int | None], list[Message]], max_tokens: int
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


def _fit_turns(
    batch: Batch, spec: AgentSpec, turns: Sequence[Turn], turn_index: int
) -> list[tuple[Turn, list[Message]]]:
    live = []
    cap = batch.gen.max_context_tokens
    for turn in turns:
        fitted = fit_messages(batch.rt.policy, turn.build, cap)
        if fitted is None:
            turn.state.error = (
                f"{spec.name} turn {turn_index + 1}: prompt exceeds generation.max_context_tokens={cap} "
                "even with earlier text cut"
            )
            continue
        messages, _, clipped = fitted
        turn.state.clipped_prompts += clipped
        live.append((turn, messages))
    return live


def run_stage(
    batch: Batch,
    spec: AgentSpec,
    turns: Sequence[Turn],
    *,
    turn_index: int,
    extract_code: Callable[[str], list[str]],
) -> list[tuple[Turn, Action]]:
    """Generate one action for every turn (one batched call) and run its code; returns the live turns' actions.

    Code: every ```python block of an action is joined, in order, into one snippet that runs once in the
    episode's workspace (so later blocks see earlier blocks' variables, as in a notebook cell).
    """
    live = _fit_turns(batch, spec, turns, turn_index)
    if not live:
        return []
    gen = batch.gen
    generations = batch.rt.policy.generate(
        spec.name,
        [messages for _, messages in live],
        temperature=gen.temperature,
        top_p=gen.top_p,
        max_new_tokens=gen.max_new_tokens,
        max_context_tokens=gen.max_context_tokens,
        seed=batch.stage_seeds([turn.state for turn, _ in live]),
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
        ran = batch.rt.sandbox.run_many([(codes[i], live[i][0].state.workspace) for i in to_run])
        results = dict(zip(to_run, ran, strict=True))
    out = []
    for i, ((turn, messages), g) in enumerate(zip(live, generations, strict=True)):
        result = results.get(i)
        if result is not None:
            turn.state.sandbox_s += result.duration_s
        out.append((turn, Action.sampled(spec.name, turn_index, messages, g, exec_result=result)))
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
