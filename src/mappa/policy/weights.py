"""The weight modes behind `mappa.policy.policy.Policy` (`model.agent_weights`): where each agent's trainable weights
live.

- `AdapterWeights` (`lora`, `shared`): one peft LoRA adapter per agent (one for all in `shared`) on one frozen base;
  the reference is the base with the adapters switched off.
- `FullWeights` (`full`): a separate full trainable copy of the base per agent; the reference is the untouched base.

Each answers the same questions: which module runs an agent, which parameters are its own, which files hold them
(`mappa.policy.storage`), and what a sampling copy of them is (`mappa.policy.sampling_copies`). The policy holds one
and calls it under its lock, so it never asks which mode it is in.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mappa.policy import sampling_copies, storage
from mappa.policy.lora import LoraSettings, adapter_names, fold_adapter, name_base, plain_base, wrap_lora

if TYPE_CHECKING:
    from peft import PeftModel


class AdapterWeights:
    """One LoRA adapter per agent (`shared`: one for every agent) on one frozen base."""

    def __init__(
        self, base: torch.nn.Module, agents: Sequence[str], lora: LoraSettings, *, shared: bool,
        base_name: str | None, revision: str | None,
    ) -> None:  # fmt: skip
        self.adapter = adapter_names(agents, shared=shared)  # agent -> its peft adapter
        self.model: PeftModel = wrap_lora(base, self.adapters(), lora)
        if base_name is not None:
            name_base(self.model, base_name, revision)

    def adapters(self) -> list[str]:
        """The distinct peft adapters, in agent order (one for every agent in `shared` mode)."""
        return list(dict.fromkeys(self.adapter.values()))

    def modules(self) -> list[torch.nn.Module]:
        """The modules that train (gradient checkpointing is switched on in these)."""
        return [self.model]

    def trainable_parameters(self, agent: str) -> list[torch.nn.Parameter]:
        pattern = re.compile(rf"\.lora_\w+\.{re.escape(self.adapter[agent])}(\.|$)")
        return [p for n, p in self.model.named_parameters() if pattern.search(n)]

    @contextmanager
    def active(self, agent: str | None) -> Iterator[torch.nn.Module]:
        if agent is None:
            try:
                with self.model.disable_adapter():
                    # switched off, not frozen: FSDP2 (`mappa.policy.sharding`) reads which weights train at the first
                    # forward pass, often this one, to reduce their gradients in float32 for float32 adapters
                    self._unfreeze_adapters()
                    yield self.model
            finally:
                self._unfreeze_adapters()
            return
        name = self.adapter[agent]
        if self.model.active_adapter != name:
            self.model.set_adapter(name)
            self._unfreeze_adapters()
        yield self.model

    def _unfreeze_adapters(self) -> None:
        """peft freezes every inactive adapter on a switch (and all of them around disable_adapter); keep
        all trainable so an optimizer built earlier over another agent's parameters sees requires_grad=True. Looked
        up anew: sharding (`mappa.policy.sharding`) replaces each parameter by its shard."""
        for n, p in self.model.named_parameters():
            if ".lora_" in n:
                p.requires_grad_(True)

    def files(self, with_base: bool) -> dict[str, Any]:
        files = storage.adapter_files(self.model, self.adapters())
        return (files | storage.base_files(self.model.get_base_model())) if with_base else files

    def load(self, directory: Path) -> None:
        storage.load_adapters(directory, self.model, self.adapters())

    def sampling_key(self, agent: str | None) -> str | None:
        """Which sampling copy serves `agent`: its adapter's (`shared`: one for every agent); None: the base."""
        return None if agent is None else self.adapter[agent]

    def sampling_base(self) -> torch.nn.Module:
        return plain_base(self.model)

    def fill(self, target: torch.nn.Module, key: str | None) -> None:
        fold_adapter(target, self.model, key)


class FullWeights:
    """A full trainable copy of the base per agent; the base itself is the reference. The copies are in the base's
    dtype: in bfloat16 (a GPU) AdamW steps float32 masters of them (`mappa.training.update.MasterAdamW`; sharded,
    `mappa.policy.sharding.mixed_precision` makes the shards float32), or lr 1e-6 would be lost to rounding."""

    def __init__(self, base: torch.nn.Module, agents: Sequence[str]) -> None:
        self.adapter: dict[str, str] = {}  # no peft adapters (`AdapterWeights.adapter`)
        self.model = base
        self.copies: dict[str, torch.nn.Module] = {}
        for agent in agents:
            clone = copy.deepcopy(base)
            clone.requires_grad_(True)
            clone.eval()
            self.copies[agent] = clone

    def modules(self) -> list[torch.nn.Module]:
        return list(self.copies.values())

    def trainable_parameters(self, agent: str) -> list[torch.nn.Parameter]:
        return list(self.copies[agent].parameters())

    @contextmanager
    def active(self, agent: str | None) -> Iterator[torch.nn.Module]:
        yield self.model if agent is None else self.copies[agent]

    def files(self, with_base: bool) -> dict[str, Any]:
        files = storage.full_copy_files(self.copies)
        return (files | storage.base_files(self.model)) if with_base else files

    def load(self, directory: Path) -> None:
        storage.load_full_copies(directory, self.copies)

    def sampling_key(self, agent: str | None) -> str | None:
        return agent

    def sampling_base(self) -> torch.nn.Module:
        return copy.deepcopy(self.model)

    def fill(self, target: torch.nn.Module, key: str | None) -> None:
        sampling_copies.copy_weights(target, self.model if key is None else self.copies[key])
