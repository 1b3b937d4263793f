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
    """One sampled response (`mappa.policy.Generation`), read-only."""

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


@dataclass
class CallCounters:
    """Per-backend counters the runner cannot see from the outside (one coach call may be several requests)."""

    calls: int = 0  # requests sent to the endpoint / model, follow-ups and retries included
    retries: int = 0  # requests repeated after a 429, 5xx, timeout or connection error
    failures: int = 0  # judgments abandoned after the last retry (or an unusable response)


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
    """What a batch of episodes is played with: the agents' weights, the code tool, and the coach (optional)."""

    policy: PolicyLike
    sandbox: SandboxLike
    scorer: Scorer | None = None  # called once per stage; None: actions stay unscored (evaluation)


class Workflow(Protocol):
    """A multiagent system (`mappa.workflows.WORKFLOWS` lists them), built with the settings it reads.

    `run` plays one episode per task, all in lockstep, and returns them in task order; `seed` makes the
    sampling reproducible without touching the global RNG. `context` rebuilds the coach's evidence for a
    recorded action exactly as it was built live (replaying episodes through another coach needs it).
    """

    name: str
    agents: tuple[str, ...]  # the weights it needs, in order of play

    def run(
        self, tasks: Sequence[Task], rt: Runtime, *, seed: int | None = None, progress: ProgressFn | None = None
    ) -> list[Episode]: ...

    def context(self, task: Task, action: Action) -> CoachContext: ...


# Reports a line of status as long work starts (`Engine.update`: which groups it updates, and where).
StatusFn = Callable[[str], None]


class Engine(Protocol):
    """Where a training run's work happens: `mappa.engine.LocalEngine` (this process) or
    `mappa.distributed.Cluster` (Ray actors). `mappa.trainer` drives one through these calls only, so the loop
    reads the same either way; both keep a checkpoint's files identical, so a run resumes under either."""

    def play(self, tasks: Sequence[Task], seed: int, progress: ProgressFn | None = None) -> list[Episode]:
        """One episode per task, scored by the coach as it plays, in task order; sampling seeded by `seed`."""
        ...

    def update(self, jobs: dict[str, Any], status: StatusFn | None = None) -> dict[str, dict[str, float]]:
        """Each update group's job (`mappa.update.UpdateJob`) applied to its weights; metrics per group."""
        ...

    def step_sync(self, version: int, metrics: dict[str, float] | None = None) -> dict[str, float]:
        """After the updates (and once at start): the weights as of step `version` to whatever samples episodes;
        returns the `generation/...` counters of the last rollout (none for the local backend)."""
        ...

    def evaluate(
        self, tasks: Sequence[Task], progress: ProgressFn | None = None
    ) -> tuple[dict[str, float], list[Episode]]:
        """`mappa.evaluate.evaluate` on the held-out tasks: its metrics and episodes."""
        ...

    def self_test(self) -> list[str]:
        """The start-up checks (`mappa.selftest`) of the weights, sandbox and coach; a line per check."""
        ...

    def stats(self) -> dict[str, float]:
        """The coach's accounting since the last call (`CoachRunner.stats`)."""
        ...

    def save_checkpoint(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
        """`mappa.checkpoint.save_checkpoint` of the weights and optimizers with `state`; its directory."""
        ...

    def restore_checkpoint(self, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        """`mappa.checkpoint.restore_run` into the weights and optimizers: (checkpoint, state.json) or None."""
        ...

    def close(self) -> None: ...
