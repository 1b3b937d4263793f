"""LoRA adapters for `mappa.policy.policy.Policy`: their settings, peft-safe names, and one base wrapped with several.

Every adapter has the same shape (`LoraSettings`, from `model.lora_*`); the policy keeps one per agent
(`lora`) or one for all (`shared`) on a single frozen base, and switches between them before each forward.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

from mappa.errors import MappaError
from mappa.policy.models import public_name

if TYPE_CHECKING:
    from peft import PeftModel

SHARED_ADAPTER = "shared"  # the one adapter of `shared` mode
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(TypedDict):
    """How every adapter is shaped (`model.lora_*`); recorded in a checkpoint's manifest."""

    r: int
    alpha: int
    dropout: float
    target_modules: list[str]


def adapter_names(agents: Sequence[str], *, shared: bool = False) -> dict[str, str]:
    """Each agent's adapter: one named "shared" for all of them with `shared`, else one per agent. peft keeps
    adapters in ModuleDicts, whose keys may not contain '.', and warns about names that are substrings of
    'lora_' (their weights could be mistaken on load); so agent names map to safe keys."""
    if shared:
        return {agent: SHARED_ADAPTER for agent in agents}
    names: dict[str, str] = {}
    for agent in agents:
        name = "agent_" + re.sub(r"[^0-9A-Za-z_]", "_", agent)
        if name in names.values():
            name = f"{name}_{len(names)}"
        names[agent] = name
    return names


def wrap_lora(model: torch.nn.Module, adapters: list[str], lora: LoraSettings) -> PeftModel:
    """`model` with one LoRA adapter per name in `adapters`, the first active; only LoRA matrices train."""
    from peft import LoraConfig, get_peft_model

    def config() -> LoraConfig:
        return LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=list(lora["target_modules"]),
            task_type="CAUSAL_LM",
            bias="none",
        )

    try:
        with warnings.catch_warnings():  # transformers deprecation noise raised from inside peft
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(model, config(), adapter_name=adapters[0])
            for name in adapters[1:]:
                peft_model.add_adapter(name, config())
    except ValueError as e:  # e.g. target modules not found in the base
        raise MappaError(f"model.lora_target_modules: {str(e).splitlines()[0][:200]}") from None
    peft_model.set_adapter(adapters[0])
    for n, p in peft_model.named_parameters():
        p.requires_grad_(".lora_" in n)
    peft_model.eval()
    return peft_model


def name_base(peft_model: PeftModel, base_name: str, revision: str | None) -> None:
    """Saved adapters name the base as given (the embedded model: its hub id), never the cache directory it
    was read from: vLLM, peft's AutoPeftModel and the Hub resolve it (`mappa.policy.models.public_name`)."""
    for config in peft_model.peft_config.values():
        config.base_model_name_or_path = public_name(base_name)
        config.revision = revision


def plain_base(peft_model: PeftModel) -> torch.nn.Module:
    """A copy of the base model with every LoRA layer replaced by the layer it wraps (no adapter left in it)."""
    from peft.tuners.lora import LoraLayer

    plain = copy.deepcopy(peft_model.get_base_model())
    for name, module in list(plain.named_modules()):
        if isinstance(module, LoraLayer):
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent), child, module.get_base_layer())
    return plain


@torch.no_grad()
def fold_adapter(target: torch.nn.Module, peft_model: PeftModel, adapter: str | None) -> None:
    """Write each LoRA-wrapped layer's base weight plus `adapter`'s delta (None: the base alone) into the same layer
    of `target` (a `plain_base` copy), cast to its dtype; the layers no adapter wraps never change."""
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            if adapter is not None and adapter in module.lora_A:
                weight = weight + module.get_delta_weight(adapter)
            target.get_submodule(name).weight.copy_(weight)
