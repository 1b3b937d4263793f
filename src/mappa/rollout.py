"""Rollouts: build what plays tasks (`build_kit`; the tasks are drawn by `mappa.tasks.sampler`), and the run
behind `mappa rollout` (`rollout`), which plays them with the configured coach and writes episodes to JSONL as
each batch finishes.

`build_kit(cfg, agents, ...)` is the one constructor of the parts that play and score episodes: the policies (one
per base model, `mappa.policy.team`; from the config or a checkpoint), what episodes sample from (the policies, or a
generation server), the coach and the sandbox. The training run in this process (`mappa.training.engine.LocalEngine`),
the Ray actors (`mappa.distributed.actors`), `mappa rollout` and `mappa eval` all build them here, so they load, seed
and template the same way.

Sampling is seeded per call (`play(..., seed=s)`), never through the process's global RNG, so a
rollout depends on the weights, the tasks and its seed, not on whatever ran before it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.policy import precision, sharding
from mappa.policy.sampling_copies import choose_dtype
from mappa.protocols import Generator, ProgressFn, Runtime, Workflow
from mappa.types import Episode, Task, write_jsonl

if TYPE_CHECKING:
    from mappa.coach import CoachRunner
    from mappa.policy.policy import Policy
    from mappa.policy.team import Policies
    from mappa.sandbox import Sandbox


# ---------------------------------------------------------------------------------------------------- the parts
@dataclass
class Kit:
    """A run's parts: the weights, what episodes sample from, the coach and the code tool (None: not built)."""

    cfg: Config
    policies: Policies  # one Policy per base model, every agent on its own base's (`mappa.policy.team`)
    generator: Generator  # the policies, continuously batched, or a generation server's client (`mappa.generation`)
    coach: CoachRunner | None = None
    sandbox: Sandbox | None = None
    plugin_coach: bool = False  # the coach is a plug-in (import path or object): its self-test only asks it once

    @property
    def policy(self) -> Policy:
        """The policy of a team on one base model; MappaError for a team on several (`policies[agent]`)."""
        return self.policies.single

    def runtime(self) -> Runtime:
        """What training episodes are played with: their actions scored by the coach as they land."""
        return Runtime(self.generator, self.sandbox, self.coach)

    def play(
        self, workflow: Workflow, tasks: Sequence[Task], seed: int, progress: ProgressFn | None = None
    ) -> list[Episode]:
        """Training episodes of `tasks`, at the run's sampling settings, scored as they play."""
        from mappa.workflows.runtime import play

        return play(
            workflow, tasks, self.runtime(), sampling=self.cfg.generation.sampling(), seed=seed, progress=progress,
            keep_workspaces=self.cfg.sandbox.keep_workspaces,
        )  # fmt: skip

    def self_test(self, agents: Sequence[str], workflow: str) -> list[str]:
        """`mappa.training.selftest.run_self_test` of these parts (the coach and sandbox built), at the run's
        temperature."""
        from mappa.training.selftest import run_self_test

        temperature, plugin = self.cfg.generation.temperature, self.plugin_coach
        score = self.coach.score_many
        return run_self_test(self.policies, agents, self.sandbox, score, workflow, temperature, plugin_coach=plugin)

    def close(self) -> None:
        self.generator.close()
        for part in (self.sandbox, self.coach):
            if part is not None:
                part.close()

    def __enter__(self) -> Kit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_policies(cfg: Config, agents: Sequence[str], device: str | None, weights: Path | None) -> Policies:
    """The configured base models with one set of weights per agent (seeded), or a checkpoint's `weights`
    directory (which names its own bases), which must hold every agent of `agents`."""
    from mappa.policy.storage import MANIFEST
    from mappa.policy.team import Policies

    template = cfg.generation.chat_template_kwargs  # prompts templated as generation templates them
    if weights is not None:
        policies = Policies.from_checkpoint(weights, device=device or cfg.model.device, chat_template_kwargs=template)
        if missing := [a for a in agents if a not in policies.agents]:
            raise MappaError(
                f"{weights / MANIFEST}: the checkpoint has agents {list(policies.agents)}, workflow "
                f"{cfg.workflow.name!r} needs {missing} too"
            )
    else:
        model = cfg.model if device is None else cfg.model.model_copy(update={"device": device})
        policies = Policies.from_config(
            model, agents, seed=cfg.seed, generation_batch_size=cfg.generation.batch_size,
            chat_template_kwargs=template,
        )  # fmt: skip
    for policy in policies:
        sample_as_configured(policy, cfg)
    return policies


def sample_as_configured(policy: Policy, cfg: Config) -> None:
    """Have `policy` sample from copies as `generation.sampling_copy` says, given the update's precision on this
    machine (`mappa.policy.sampling_copies.choose_dtype`)."""
    autocast = precision.autocast_dtype(cfg.train.cpu_autocast, policy.model)
    sharded = sharding.rank_world()[1] > 1
    policy.sample_from_copies(choose_dtype(cfg.generation.sampling_copy, policy.device.type, autocast, sharded))


def build_kit(
    cfg: Config, agents: Sequence[str], *, workflow: str | None = None, coach: bool = True, coach_plugin: Any = None,
    sandbox: bool = True, generator: bool = False, run_dir: Path | None = None, device: str | None = None,
    weights: Path | None = None,
) -> Kit:  # fmt: skip
    """The parts of a run over `agents`: the policies (`weights`: a checkpoint's instead of the configured models;
    `device`: instead of `model.device`), then the generation backend when `generator` (else episodes sample from
    the policies, locally), the coach for `workflow` (default `workflow.name`; `coach_plugin`: an object from Python
    used instead of `coach.backend`; a `local` coach without a model of its own judges with base 0) and the sandbox.
    A part that fails to start closes those built before it."""
    from mappa.coach import build_coach
    from mappa.generation import build_generator, local_generator
    from mappa.policy.team import team_bases
    from mappa.sandbox import Sandbox

    server = generator and cfg.generation.backend == "server"
    if server:  # a team a server cannot serve fails before any model loads
        team_bases(cfg.model, agents, server=True)
    policies = _load_policies(cfg, agents, device, weights)
    local = local_generator(policies, max_batch=cfg.generation.batch_size)
    kit = Kit(cfg, policies, local, plugin_coach=cfg.coach.is_plugin or coach_plugin is not None)
    try:
        if server:  # it starts with no adapters: `step_sync` publishes the run's first ones
            kit.generator = build_generator(cfg, policies.single, run_dir)
        if coach:
            kit.coach = build_coach(
                cfg.coach, workflow or cfg.workflow.name, policy=policies.primary, plugin=coach_plugin
            )
        if sandbox:
            kit.sandbox = Sandbox(cfg.sandbox)
    except BaseException:
        kit.close()
        raise
    return kit


@dataclass
class RolloutResult:
    episodes: list[Episode]
    seconds: float
    coach_stats: dict[str, float]


def rollout(
    cfg: Config,
    workflow: Workflow,
    tasks: Sequence[Task],
    out: Path,
    *,
    progress: ProgressFn | None = None,
    batch_progress: ProgressFn | None = None,
) -> RolloutResult:
    """Play `tasks` in batches of `generation.batch_size` with the configured coach; append each batch to `out`.

    Whole lines per batch: a killed run keeps the batches it finished. `progress(episodes done, total)` after
    each batch, `batch_progress(actions done, total)` within one. Batch k samples from seed `cfg.seed + k`.
    """
    done: list[Episode] = []
    size = cfg.generation.batch_size
    start = time.perf_counter()
    with build_kit(cfg, workflow.agents, workflow=workflow.name) as kit:
        for k, lo in enumerate(range(0, len(tasks), size)):
            batch = kit.play(workflow, tasks[lo : lo + size], cfg.seed + k, progress=batch_progress)
            write_jsonl(out, batch, append=lo > 0)
            done.extend(batch)
            if progress is not None:
                progress(len(done), len(tasks))
    return RolloutResult(done, time.perf_counter() - start, kit.coach.stats())
