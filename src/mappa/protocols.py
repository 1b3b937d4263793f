"""The plug-in points: what a workflow needs of a policy and a sandbox, what a coach and a workflow are, and what
the training loop needs of wherever its work runs (`Engine`).

Small structural Protocols (anything with the right methods fits; nothing subclasses them) plus the two
records that cross the boundaries between stages. This module imports only the standard library and
`mappa.types`, so every stage can depend on it without depending on another stage: tasks -> workflow
(policy + sandbox) -> coach -> rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mappa.types import Action, CoachContext, CoachScore, Episode, ExecResult, Message, Task

# Progress of a long call: (done, total). The total may shrink as work turns out not to be needed.
ProgressFn = Callable[[int, int], None]

# Scores a batch of coach contexts, one CoachScore per context, in order (a `CoachRunner` is one).
Scorer = Callable[[Sequence[CoachContext]], list[CoachScore]]


class GenerationLike(Protocol):
    """One sampled response (`mappa.policy.policy.Generation`), read-only."""

    @property
    def prompt_ids(self) -> tuple[int, ...]: ...  # (P,) chat-templated prompt
    @property
    def response_ids(self) -> tuple[int, ...]: ...  # (T,) sampled tokens, EOS included when generated
    @property
    def logprobs(self) -> tuple[float, ...]: ...  # (T,) log pi(a_t | s) at sampling time
    @property
    def text(self) -> str: ...
    @property
    def truncated(self) -> bool: ...  # hit the token cap without EOS


def row_seed(seed: int, row: int) -> int:
    """The seed of row `row` of a call seeded with `seed`: distinct per row, so equal prompts do not sample alike."""
    return (seed * 1_000_003 + row) % 2**63


def row_seeds(seed: int | Sequence[int] | None, n: int) -> list[int | None]:
    """One seed per row of an `n`-row call: None (unseeded), one call seed spread over the rows by position
    (`row_seed`), or the rows' own seeds as given."""
    if seed is None:
        return [None] * n
    if isinstance(seed, int):
        return [row_seed(seed, i) for i in range(n)]
    if len(seed) != n:
        raise ValueError(f"{n} rows but {len(seed)} seeds")
    return list(seed)


class PolicyLike(Protocol):
    """What a workflow needs of the agents' weights: count prompt tokens, sample replies per agent."""

    def chat_ids(self, messages: Sequence[Message]) -> list[int]: ...

    def generate(
        self,
        agent: str | None,  # whose weights; None: the reference (base) model
        conversations: Sequence[Sequence[Message]],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        max_context_tokens: int | None,  # a longer prompt is an error, never silently cut
        # reproducible sampling without the global RNG: one seed for the call, or one per conversation (`row_seeds`)
        seed: int | Sequence[int] | None,
        batch_size: int | None,
    ) -> Sequence[GenerationLike]: ...


class SandboxLike(Protocol):
    """What a workflow needs of the code tool: run (code, workspace) pairs, results in input order."""

    def run_many(self, items: Sequence[tuple[str, Path]]) -> list[ExecResult]: ...


@dataclass(frozen=True)
class SamplingSettings:
    """How one call of the runtime samples: training and evaluation play the same workflow with their own."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256  # per action; longer replies are cut and marked truncated
    max_context_tokens: int | None = None  # an action's prompt is fitted to this (earlier text cut), never cut blind


class Generator(Protocol):
    """Where the agents' tokens come from, one request at a time (`mappa.generation`: the local policy, continuously
    batched, or an OpenAI-compatible LoRA server). Requests of concurrent episodes are batched behind this surface."""

    samples_exactly: bool  # its log-probs are the training forward pass's (else the update recomputes them)

    def chat_ids(self, agent: str, messages: Sequence[Message]) -> list[int]: ...  # `agent`'s prompt tokens

    async def generate(
        self, agent: str, messages: Sequence[Message], prompt_ids: Sequence[int], sampling: SamplingSettings,
        seed: int | None,
    ) -> GenerationLike: ...  # fmt: skip

    def sync(self, policy: Any, version: int) -> dict[str, float]:
        """After an update: sample from `policy`'s weights as of step `version` from now on; its counters."""
        ...

    def stats(self) -> dict[str, float]: ...  # `generation/...` counters since the last call

    def close(self) -> None: ...


@dataclass
class CallCounters:
    """Per-backend counters the runner cannot see from the outside (one coach call may be several requests)."""

    calls: int = 0  # requests sent to the endpoint / model, follow-ups and retries included
    retries: int = 0  # requests repeated after a 429, 5xx, timeout or connection error
    failures: int = 0  # judgments abandoned after the last retry (or an unusable response)
    replies: int = 0  # replies received (model-backed coaches)
    cut_replies: int = 0  # of them, stopped by the token cap (finish_reason "length")
    replies_without_logprobs: int = 0  # of them, without the log-probs coach.expected_score asked for


class Coach(Protocol):
    """A coach backend: scores one action from its context (`mappa.coach.COACHES` lists them)."""

    name: str  # backend name; part of the cache key
    model: str  # coach model; part of the cache key
    version: str  # template or rules version; part of the cache key
    cacheable: bool  # worth caching (costs calls); the free rule-based coaches are not
    counters: CallCounters

    async def score(self, ctx: CoachContext) -> CoachScore: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Runtime:
    """What episodes are played with: where tokens come from, the code tool, and the coach (optional)."""

    generator: Generator
    sandbox: SandboxLike
    scorer: Scorer | None = None  # called once per action; None: actions stay unscored (evaluation)


class Workflow(Protocol):
    """A multiagent system (`mappa.workflows.WORKFLOWS` lists them): a short program over one episode.

    `play(task, team, tools)` plays one task: `await team.act(agent, messages, code=True)` generates the agent's
    reply, runs its code with `tools`, records the action and has the coach score it (`mappa.workflows.runtime`,
    which plays many episodes at once and batches what they ask for). `context` builds the coach's evidence for an
    action, live and again when recorded episodes are replayed through another coach. `max_actions`: the most
    actions one episode takes (progress). `check_task` raises MappaError for a task it cannot play, before anything
    runs.
    """

    name: str
    agents: tuple[str, ...]  # the weights it needs, in order of play
    max_actions: int

    async def play(self, task: Task, team: Any, tools: Any) -> Episode: ...

    def context(self, task: Task, action: Action) -> CoachContext: ...

    def check_task(self, task: Task) -> None: ...


# Reports a line of status as long work starts (`Engine.update`: which groups it updates, and where).
StatusFn = Callable[[str], None]


class Engine(Protocol):
    """Where a training run's work happens: `mappa.training.engine.LocalEngine` (this process) or
    `mappa.distributed.Cluster` (Ray actors). `mappa.training.trainer` drives one through these calls only, so the loop
    reads the same either way; both keep a checkpoint's files identical, so a run resumes under either."""

    # its episodes' log-probs are a training forward pass's (every generator's `samples_exactly`): else the update
    # recomputes them (`mappa.training.update.recomputes_old_logprobs`)
    samples_exactly: bool

    def play(self, tasks: Sequence[Task], seed: int, progress: ProgressFn | None = None) -> list[Episode]:
        """One episode per task, scored by the coach as it plays, in task order; sampling seeded by `seed`."""
        ...

    def update(self, jobs: dict[str, Any], status: StatusFn | None = None) -> dict[str, Any]:
        """Each update group's job (`mappa.training.update.UpdateJob`) applied to its weights; a
        `mappa.training.update.GroupResult` per group."""
        ...

    def step_sync(self, version: int) -> dict[str, float]:
        """After the updates (and once at start): the weights as of step `version` to whatever samples episodes;
        returns the `generation/...` counters of the last rollout (none for the local backend)."""
        ...

    def evaluate(
        self, tasks: Sequence[Task], progress: ProgressFn | None = None
    ) -> tuple[dict[str, float], list[Episode]]:
        """`mappa.training.evaluate.evaluate` on the held-out tasks: its metrics and episodes."""
        ...

    def self_test(self) -> list[str]:
        """The start-up checks (`mappa.training.selftest`) of the weights, sandbox and coach; a line per check."""
        ...

    def stats(self) -> dict[str, float]:
        """The coach's accounting since the last call (`CoachRunner.stats`)."""
        ...

    def save_checkpoint(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
        """`mappa.training.checkpoint.save_checkpoint` of the weights and optimizers with `state`; its directory."""
        ...

    def restore_checkpoint(self, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        """`mappa.training.checkpoint.restore_run` into the weights and optimizers: (checkpoint, state.json) or
        None."""
        ...

    def close(self) -> None: ...
