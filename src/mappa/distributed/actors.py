"""The two kinds of actor a Ray run places: rollout workers (play episodes) and trainers (one per update group).

Plain classes: `mappa.distributed.cluster` wraps them with `ray.remote` when it places them, so this module
imports without Ray and each method is the local loop's own code (`Workflow.run`, `evaluate`,
`run_self_test`, `apply_update`, `Policy.save`) running in another process. Their parts (policy, generator,
sandbox, coach) come from `mappa.rollout.build_kit`, as the local run's do.

Weights travel as lists of tensors, one list per update group in the order of
`Policy.trainable_parameters(<the group's first agent>)`: a trainer hands out its group's after each update,
and every other actor copies them into its own policy (`copy_weights`), so after a step every actor holds the
same weights as a local run would.

A heterogeneous team (agents on several base models, `mappa.policy.team`): a trainer builds its group's base alone,
with the agents on it (and copies in their weights only); a rollout worker holds every base.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mappa.config import Config
from mappa.policy import sharding
from mappa.policy.team import Policies, team_bases
from mappa.rollout import Kit, build_kit
from mappa.training.update import GroupResult, UpdateJob, apply_update, build_optimizer
from mappa.types import Episode, Task


def _kit(cfg: Config, agents: Sequence[str], device: str, cpus: float, **parts: Any) -> Kit:
    """The actor's parts (`build_kit`): the run's policy over every agent, initialised as the local run's (same
    seed, same order of agents), and whichever of generator, sandbox and coach `parts` asks for."""
    torch.set_num_threads(max(1, int(cpus)))  # an actor's share of the machine, not every core
    torch.manual_seed(cfg.seed)
    return build_kit(cfg, agents, device=device, **parts)


def _policies(cfg: Config, agents: Sequence[str], device: str, cpus: float) -> Policies:
    """A trainer's policies (`mappa.policy.team.Policies` of its one base): the kit's weights, without sandbox or
    coach."""
    return _kit(cfg, agents, device, cpus, coach=False, sandbox=False).policies


def _on_base(cfg: Config, agents: Sequence[str], agent: str) -> tuple[Config, list[str]]:
    """`agent`'s base alone, as the config of a team on that one base, and the agents on it. Their weights start as
    the whole team's do: a base's are drawn from the seed over its own agents (`Policies.from_config`)."""
    name, members = next((n, m) for n, m in team_bases(cfg.model, agents).items() if agent in m)
    model = cfg.model.model_copy(update={"name": name, "agent_models": {}})
    return cfg.model_copy(update={"model": model}), members


def copy_weights(policy: Any, agents: Sequence[str], weights: Sequence[Sequence[torch.Tensor]]) -> None:
    """Copy each group's trainable tensors into `policy` (into this rank's shards where it is sharded);
    `agents[i]` is the first agent of the group whose tensors are `weights[i]`. An agent `policy` does not hold
    (another base's, at a trainer) is left out."""
    with torch.no_grad():
        for agent, tensors in zip(agents, weights, strict=True):
            if agent not in policy.agents:
                continue
            for p, w in zip(policy.trainable_parameters(agent), tensors, strict=True):
                p.copy_(sharding.like(p, w))


class Trainer:
    """One update group's trainer: the group's weights and optimizer, reference log-probs and updates.

    It holds its base's whole policy, every agent's weights on it (the others' copied in after each step), so that
    one trainer per base can save its checkpoint files and publish adapters exactly as a local run does; it trains
    only its group's. (`cfg` and `agents`: the run's; it keeps those of its base, `_on_base`.)
    """

    rank = 0

    def __init__(self, cfg: Config, agents: Sequence[str], group: str, agent: str, device: str, cpus: float) -> None:
        cfg, agents = _on_base(cfg, agents, agent)
        self.cfg, self.agents, self.group, self.agent, self.device, self.cpus = cfg, agents, group, agent, device, cpus
        self.policies = _policies(cfg, agents, device, cpus)
        self.policy = self.policies.single
        self.optimizer = build_optimizer(self.policy, agent, group, cfg.train)

    def update(self, job: UpdateJob) -> tuple[GroupResult, list[torch.Tensor]]:
        """The group's update (`mappa.training.update.apply_update`); returns its result and the group's new weights
        (sharded: the first rank's; the others return none)."""
        result, weights = apply_update(self.policy, self.optimizer, job), self.weights()
        return result, weights if self.rank == 0 else []

    def weights(self) -> list[torch.Tensor]:
        return [sharding.host(p) for p in self.policy.trainable_parameters(self.agent)]

    def set_weights(self, agents: list[str], *weights: list[torch.Tensor]) -> None:
        """The other groups' new weights (`agents[i]`: the first agent of the group of `weights[i]`)."""
        copy_weights(self.policy, agents, weights)

    def save(self, directory: str) -> None:
        self.policy.save(directory, write=self.rank == 0)

    def load_weights(self, directory: str) -> None:
        self.policies.load_weights(directory)  # a team's checkpoint: its base's directory

    def optimizer_state(self) -> dict[str, Any]:
        return sharding.host_state(self.optimizer.state_dict())

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sharding.optimizer_state_like(self.optimizer, state))

    def publish(self, root: str, version: int) -> dict[str, Path]:
        """Every agent's adapter for a generation server (`mappa.generation.publish_adapters`); sharded, the
        other ranks take part in the gathers without writing."""
        from mappa.generation import adapter_states, publish_adapters

        if self.rank != 0:
            adapter_states(self.policy)
            return {}
        return publish_adapters(self.policy, Path(root), version)


class ShardedTrainer(Trainer):
    """One rank of an update group's trainer whose weights are sharded over `world` processes
    (`mappa.policy.sharding`).

    Built in two calls, because every rank must know where the first one listens before any can join:
    `address()` on rank 0, then `setup(address)` on all of them at once. The policy is sharded before the
    optimizer is built over it (FSDP2 swaps each parameter for its shard)."""

    def __init__(
        self, cfg: Config, agents: Sequence[str], group: str, agent: str, device: str, cpus: float, rank: int, world: int
    ) -> None:  # fmt: skip
        cfg, agents = _on_base(cfg, agents, agent)
        self.cfg, self.agents, self.group, self.agent, self.device, self.cpus = cfg, agents, group, agent, device, cpus
        self.rank, self.world = rank, world

    def address(self) -> str:
        """host:port where rank 0 waits for its peers (a port free now on this node)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def setup(self, address: str) -> None:
        torch.set_num_threads(max(1, int(self.cpus)))
        sharding.init(self.rank, self.world, address, self.device)
        self.policies = _policies(self.cfg, self.agents, self.device, self.cpus)
        self.policy = self.policies.single
        sharding.shard_modules(self.policy.shardable_modules(), self.device)
        self.optimizer = build_optimizer(self.policy, self.agent, self.group, self.cfg.train)


class RolloutWorker:
    """Plays episodes with its own sandbox and coach, sampling from its policy copy or a generation server."""

    def __init__(
        self, cfg: Config, agents: Sequence[str], run_dir: str, device: str, cpus: float, base_url: str
    ) -> None:
        from mappa.workflows import build_workflow

        cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"base_url": base_url})})
        self.cfg, self.workflow = cfg, build_workflow(cfg)
        # a generation server: its adapters come by `load_adapters` / `use_version`
        self.kit = _kit(cfg, agents, device, cpus, workflow=self.workflow.name, generator=True, run_dir=Path(run_dir))

    def play(self, tasks: Sequence[Task], seed: int) -> tuple[list[Episode], dict[str, float]]:
        """Episodes of `tasks` (as the local loop plays them) and the generator's counters."""
        episodes = self.kit.play(self.workflow, tasks, seed)
        return episodes, self.kit.generator.stats()

    def samples_exactly(self) -> bool:
        """Whether its episodes' log-probs are a training forward pass's: its generator's `samples_exactly` (not a
        server's, not a bfloat16 sampling copy's)."""
        return self.kit.generator.samples_exactly

    def evaluate(self, tasks: Sequence[Task]) -> list[Episode]:
        from mappa.training.evaluate import evaluate

        return evaluate(self.cfg, self.workflow, self.kit.generator, self.kit.sandbox, tasks)[1]

    def self_test(self) -> list[str]:
        return self.kit.self_test(self.workflow.agents, self.workflow.name)

    def set_weights(self, agents: list[str], *weights: list[torch.Tensor]) -> None:
        copy_weights(self.kit.policies, agents, weights)

    def load_weights(self, directory: str) -> None:
        self.kit.policies.load_weights(directory)

    def load_adapters(self, paths: dict[str, Path], version: int) -> float:
        """Have the generation server load the published adapters (one worker does; returns the seconds)."""
        return self.kit.generator.server.load_adapters(paths, version)

    def use_version(self, version: int) -> None:
        self.kit.generator.server.use_version(version)

    def coach_stats(self) -> dict[str, float]:
        return self.kit.coach.stats()

    def close(self) -> None:
        self.kit.close()
