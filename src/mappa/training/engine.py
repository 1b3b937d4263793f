"""Where a training run's work happens: `LocalEngine`, the run's `Engine` (`mappa.protocols`) in this process.

It holds the run's parts from `mappa.rollout.build_kit` (policies, generator, coach, sandbox: built as the Ray
actors, `mappa rollout` and `mappa eval` build theirs) plus one optimizer per update group, over the weights of
the group's agent on that agent's base model (`mappa.policy.team`: a team may sit on several). `open_engine` picks
where a run's work goes, once: on a Ray cluster when `place` is given (`mappa.distributed.placement`), else here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mappa.config import Config
from mappa.generation import step_sync
from mappa.protocols import Engine, ProgressFn, StatusFn, Workflow
from mappa.rollout import build_kit
from mappa.training.checkpoint import restore_run, save_checkpoint
from mappa.training.evaluate import evaluate
from mappa.training.update import GroupResult, UpdateJob, apply_update, build_optimizer
from mappa.types import Episode, Task

if TYPE_CHECKING:
    from mappa.policy.policy import Policy

# place(cfg, run_dir, agents, groups) -> the engine of a run placed elsewhere (`mappa.distributed.placement`)
Place = Callable[[Config, Path, Sequence[str], dict[str, list[str]]], Engine]


# ---------------------------------------------------------------------------------------------------- the engine
class LocalEngine:
    """A training run's work in this process: its kit plays and scores episodes and evaluates, each update group's
    policy (its agent's base) takes the group's update in turn with the group's optimizer
    (`mappa.training.update.apply_update`)."""

    def __init__(
        self, cfg: Config, run_dir: Path, workflow: Workflow, groups: dict[str, list[str]], coach: Any = None
    ) -> None:
        self.cfg, self.run_dir, self.workflow, self.groups = cfg, Path(run_dir), workflow, groups
        self.kit = build_kit(
            cfg, workflow.agents, workflow=workflow.name, coach_plugin=coach, generator=True, run_dir=self.run_dir
        )
        try:
            self.optimizers = {
                g: build_optimizer(self._policy(g), members[0], g, cfg.train) for g, members in groups.items()
            }
        except BaseException:
            self.kit.close()
            raise

    @property
    def samples_exactly(self) -> bool:
        """Whether its episodes' log-probs are the training forward pass's: its generator's answer."""
        return self.kit.generator.samples_exactly

    def play(self, tasks: Sequence[Task], seed: int, progress: ProgressFn | None = None) -> list[Episode]:
        return self.kit.play(self.workflow, tasks, seed, progress=progress)

    def update(self, jobs: dict[str, UpdateJob], status: StatusFn | None = None) -> dict[str, GroupResult]:
        """One group after another."""
        done = {}
        for g, job in jobs.items():
            if job.actions and status is not None:
                status(f"updating {g} on {len(job.actions)} actions")
            done[g] = apply_update(self._policy(g), self.optimizers[g], job)
        return done

    def _policy(self, group: str) -> Policy:
        """The policy of the group's agents' base (a shared adapter's group has every agent, on one base)."""
        return self.kit.policies[self.groups[group][0]]

    def step_sync(self, version: int) -> dict[str, float]:
        # a generation server holds one base: base 0's adapters are what it loads; local generators need nothing
        return step_sync(self.kit.generator, self.kit.policies.primary, version)

    def evaluate(
        self, tasks: Sequence[Task], progress: ProgressFn | None = None
    ) -> tuple[dict[str, float], list[Episode]]:
        return evaluate(self.cfg, self.workflow, self.kit.generator, self.kit.sandbox, tasks, progress=progress)

    def self_test(self) -> list[str]:
        return self.kit.self_test(self.workflow.agents, self.workflow.name)

    def stats(self) -> dict[str, float]:
        return self.kit.coach.stats()

    def save_checkpoint(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
        return save_checkpoint(
            run_dir, step, policy=self.kit.policies, optimizers=self.optimizers, state=state, keep=keep
        )

    def restore_checkpoint(self, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        return restore_run(run_dir, policy=self.kit.policies, optimizers=self.optimizers)

    def close(self) -> None:
        self.kit.close()


def open_engine(
    cfg: Config, run_dir: Path, workflow: Workflow, groups: dict[str, list[str]], *, place: Place | None = None,
    coach: Any = None,
) -> Engine:  # fmt: skip
    """The run's engine: `place`'s (a Ray cluster, whose actors build their own workflows and coaches from the
    config) when given, else a `LocalEngine` (with `coach`, an object from Python, if any)."""
    if place is not None:
        return place(cfg, run_dir, workflow.agents, groups)
    return LocalEngine(cfg, run_dir, workflow, groups, coach=coach)
