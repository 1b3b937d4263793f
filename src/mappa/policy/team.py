"""A team's weights: one `mappa.policy.policy.Policy` per base model, every agent on its own base's.

`model.agent_models` (agent -> model name) puts agents on other base models than `model.name`; `team_bases` groups
the agents by base, `model.name`'s first, and refuses what such a team cannot hold. Agents on one base share it as
before (one adapter each, or a full copy each); nothing is shared across bases, and each base keeps its tokenizer,
so an agent's prompts, samples and updates are its own base's token ids.

`Policies` maps an agent to its `Policy` and saves and loads the team as one: a team on one base is saved exactly as
its `Policy` is, a team on several as one `Policy` directory per base beside a manifest of the agents on each
(`mappa.policy.storage`). `mappa.rollout.build_kit` builds it; the local generator sends each request to its agent's
policy (`mappa.generation.TeamGenerator`), an update group trains on its agent's policy (`mappa.training.engine`), and
the self-test checks each base (`mappa.training.selftest`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mappa.errors import MappaError
from mappa.policy import storage
from mappa.policy.policy import Policy
from mappa.policy.storage import MANIFEST, BaseEntry, base_dir, describe_bases

if TYPE_CHECKING:
    from mappa.config import ModelConfig


def team_bases(cfg: ModelConfig, agents: Sequence[str], *, server: bool = False) -> dict[str, list[str]]:
    """Base model name -> its agents, in the team's order: `model.name`'s first (when any agent runs on it), then
    each other base as its first agent comes. MappaError for a `model.agent_models` key that names no agent, and for
    two or more bases under a shared adapter or, with `server`, a generation server (each holds one base)."""
    if unknown := sorted(set(cfg.agent_models) - set(agents)):
        raise MappaError(f"model.agent_models: unknown agent(s) {unknown} (agents: {', '.join(agents)})")
    names = {agent: cfg.agent_models.get(agent, cfg.name) for agent in agents}
    order = sorted(dict.fromkeys(names.values()), key=lambda name: name != cfg.name)  # stable: model.name first
    bases = {name: [a for a in agents if names[a] == name] for name in order}
    if len(bases) > 1 and cfg.agent_weights == "shared":
        raise MappaError(
            f"model.agent_weights: shared (one adapter for every agent) needs one base model; model.agent_models "
            f"puts the team on {_describe(bases)}"
        )
    if len(bases) > 1 and server:
        raise MappaError(
            f"generation.backend: server serves one base model; model.agent_models puts the team on {_describe(bases)}"
        )
    return bases


def _describe(bases: Mapping[str, Sequence[str]]) -> str:
    return describe_bases(BaseEntry(model=name, agents=list(agents)) for name, agents in bases.items())


class Policies:
    """agent -> its `Policy`, one per base (see the module docstring); iterating yields the policies, base 0 first."""

    def __init__(self, policies: Sequence[Policy]) -> None:
        if not policies:
            raise MappaError("policies: at least one base model is required")
        self.policies = tuple(policies)
        self._of: dict[str, Policy] = {}
        for policy in self.policies:
            for agent in policy.agents:
                if agent in self._of:
                    raise MappaError(f"policies: agent {agent!r} is on two base models")
                self._of[agent] = policy
        self.agents = tuple(self._of)

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, agents: Sequence[str], seed: int = 0, generation_batch_size: int = 16,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Policies:  # fmt: skip
        """Each base of `team_bases` loaded with the rest of `cfg` and its agents' weights drawn from `seed`, as a
        one-base team's are: a base's initial weights do not depend on which other bases the team has."""
        return cls([
            Policy.from_config(
                cfg.model_copy(update={"name": name}), members, seed=seed,
                generation_batch_size=generation_batch_size, chat_template_kwargs=chat_template_kwargs,
            )
            for name, members in team_bases(cfg, agents).items()
        ])  # fmt: skip

    @classmethod
    def from_checkpoint(
        cls, directory: str | Path, device: str | torch.device = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Policies:  # fmt: skip
        """The team `save` wrote: one `Policy.from_checkpoint` per base (each names its own base model)."""
        directory = Path(directory)
        bases = storage.read_team(directory)
        if bases is None:
            return cls([Policy.from_checkpoint(directory, device=device, chat_template_kwargs=chat_template_kwargs)])
        policies = []
        for i, base in enumerate(bases):
            policy = Policy.from_checkpoint(
                base_dir(directory, i), device=device, chat_template_kwargs=chat_template_kwargs
            )
            if list(policy.agents) != base["agents"]:
                raise MappaError(
                    f"{base_dir(directory, i) / MANIFEST}: agents {list(policy.agents)}, the team's manifest lists "
                    f"{base['agents']}"
                )
            policies.append(policy)
        return cls(policies)

    # ------------------------------------------------------------------------------------------------------------
    # Agents

    def __getitem__(self, agent: str) -> Policy:
        if agent not in self._of:
            raise MappaError(f"policies: unknown agent {agent!r} (agents: {', '.join(self.agents)})")
        return self._of[agent]

    def __iter__(self) -> Iterator[Policy]:
        return iter(self.policies)

    def __len__(self) -> int:
        return len(self.policies)

    @property
    def primary(self) -> Policy:
        """Base 0's policy (`model.name`'s): what a `local` coach without a model of its own judges with, and what
        a generation server (one base) publishes from."""
        return self.policies[0]

    @property
    def single(self) -> Policy:
        """The policy of a team on one base; MappaError for a team on several (take an agent's: `policies[agent]`)."""
        if len(self.policies) > 1:
            raise MappaError(f"one policy asked of a team on {describe_bases(self.entries())}: take an agent's own")
        return self.policies[0]

    def entries(self) -> list[BaseEntry]:
        return [BaseEntry(model=p.base_name, agents=list(p.agents)) for p in self.policies]

    def trainable_parameters(self, agent: str) -> list[torch.nn.Parameter]:
        return self[agent].trainable_parameters(agent)

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints

    def save(self, directory: str | Path, *, write: bool = True) -> None:
        """`Policy.save` of the one base into `directory`, or of base i into its `base-<i>/` beside the team's
        manifest (`write=False`: a sharded rank that takes part in the gathers without writing)."""
        directory = Path(directory)
        if len(self.policies) == 1:
            self.policies[0].save(directory, write=write)
            return
        for i, policy in enumerate(self.policies):
            policy.save(base_dir(directory, i), write=write)
        if write:
            storage.write_team_manifest(directory, self.agents, self.entries())

    def load_weights(self, directory: str | Path) -> None:
        """Load each base's weights from what `save` wrote: the one base's directory, or the `base-<i>/` whose agents
        are this base's (a Ray trainer holds one base of a team and loads just that one)."""
        directory = Path(directory)
        bases = storage.read_team(directory)
        if bases is None:
            if len(self.policies) > 1:
                agents = storage.read_manifest(directory)["agents"]
                raise MappaError(
                    f"{directory / MANIFEST}: the checkpoint holds one base model (agents {', '.join(agents)}); "
                    f"this team has {describe_bases(self.entries())}"
                )
            self.policies[0].load_weights(directory)
            return
        for policy in self.policies:
            found = [i for i, base in enumerate(bases) if base["agents"] == list(policy.agents)]
            if not found:
                raise MappaError(
                    f"{directory / MANIFEST}: the checkpoint holds a team on {describe_bases(bases)}; this team has "
                    f"{describe_bases(self.entries())}"
                )
            policy.load_weights(base_dir(directory, found[0]))
