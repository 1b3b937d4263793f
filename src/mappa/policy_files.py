"""The files a `Policy` is saved as, and read back from.

A policy checkpoint directory holds:
  mappa_policy.json     the manifest: base name and init_kwargs, agents, weight mode, adapter names, LoRA settings
  adapters/<adapter>/   one LoRA adapter in peft format (`lora`: one per agent; `shared`: one for all)
  agents/<agent>/       one full copy as an HF model directory (`full`)
  base/                 the base weights and tokenizer, only when the base has no name to be reloaded by
  tokenizer/            the tokenizer

Weights are written whole and on the CPU: sharded tensors (`mappa.sharding`) are gathered first, and laid
out as this rank's shard again on load. The functions here take the modules and names they work on, not
the `Policy`, which calls them from `save`, `load_weights` and `from_checkpoint`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from mappa import sharding
from mappa.errors import MappaError
from mappa.lora import LoraSettings

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

MANIFEST = "mappa_policy.json"
FORMAT_VERSION = 1
_WEIGHT_FILES = {"agents": "model.safetensors", "base": "model.safetensors", "adapters": "adapter_model.safetensors"}


class Manifest(TypedDict, total=False):
    """`mappa_policy.json`. `read_manifest` checks the first four keys are there; checkpoints written before
    `model.init_kwargs` existed have no `init_kwargs`."""

    agents: list[str]
    agent_weights: str  # lora, full or shared
    base_name: str | None  # None: the base weights are stored under base/
    lora: LoraSettings
    format_version: int
    init_kwargs: dict[str, Any]  # how the base was loaded (`model.init_kwargs`)
    adapters: dict[str, str]  # agent -> adapter directory name (empty for `full`)


# subdirectory -> (tensors whole on the CPU, the config saved beside them)
WeightFiles = dict[str, tuple[dict[str, torch.Tensor], "PretrainedConfig | PeftConfig"]]


# ----------------------------------------------------------------------------------------------------------------
# Manifest


def read_manifest(directory: str | Path) -> Manifest:
    """A checkpoint's `mappa_policy.json` (base name, agents, mode, LoRA settings), checked; MappaError if absent."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise MappaError(f"{directory}: not a mappa policy checkpoint ({MANIFEST} not found)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MappaError(f"{path}:{e.lineno}: invalid JSON") from None
    for key in ("agents", "agent_weights", "base_name", "lora"):
        if key not in manifest:
            raise MappaError(f"{path}: missing field {key!r}")
    return manifest


def base_source(directory: Path, manifest: Manifest) -> str:
    """What to load the base from: its name, or the checkpoint's base/ when it was saved without one."""
    return str(directory / "base") if manifest["base_name"] is None else manifest["base_name"]


def check_fits(directory: Path, manifest: Manifest, agents: Iterable[str], agent_weights: str) -> None:
    """MappaError unless the checkpoint holds weights for exactly these agents, in this mode."""
    if manifest["agent_weights"] != agent_weights or list(manifest["agents"]) != list(agents):
        raise MappaError(
            f"{directory / MANIFEST}: checkpoint has agents {manifest['agents']} ({manifest['agent_weights']}), "
            f"this policy has {list(agents)} ({agent_weights})"
        )


# ----------------------------------------------------------------------------------------------------------------
# Saving


def full_copy_files(copies: Mapping[str, torch.nn.Module]) -> WeightFiles:
    """agents/<agent>: each agent's full copy with its model config."""
    return {
        f"agents/{agent}": (_untied(_host_state(m.state_dict()), m.config), m.config) for agent, m in copies.items()
    }


def adapter_files(model: PeftModel, adapters: Iterable[str]) -> WeightFiles:
    """adapters/<adapter>: each adapter's LoRA matrices in peft's key format, with its peft config."""
    from peft import get_peft_model_state_dict

    files: WeightFiles = {}
    for adapter in adapters:
        # no embedding layers: peft would otherwise look the base up on the Hub to compare vocab sizes
        state = get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False)
        files[f"adapters/{adapter}"] = (_host_state(state), model.peft_config[adapter])
    return files


def base_files(base: torch.nn.Module) -> WeightFiles:
    """base: the base weights as an HF model directory (LoRA layers unwrapped, their matrices left out)."""
    state = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
    return {"base": (_untied(_host_state(state), base.config), base.config)}


def write_checkpoint(
    directory: str | Path, files: WeightFiles, tokenizer: PreTrainedTokenizerBase, manifest: Manifest
) -> None:
    """Write `files` (safetensors + config per subdirectory), the tokenizer and the manifest under `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    try:
        for sub, (state, config) in files.items():
            (directory / sub).mkdir(parents=True, exist_ok=True)
            save_file(state, directory / sub / _WEIGHT_FILES[sub.partition("/")[0]], metadata={"format": "pt"})
            config.save_pretrained(directory / sub)
        if manifest["base_name"] is None:
            tokenizer.save_pretrained(directory / "base")
        tokenizer.save_pretrained(directory / "tokenizer")
        (directory / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, **manifest}, indent=2) + "\n")
    except OSError as e:
        raise MappaError(f"cannot write checkpoint {directory} ({e.strerror or e})") from None


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_full_copies(directory: Path, copies: Mapping[str, torch.nn.Module]) -> None:
    """Load agents/<agent>/model.safetensors into each agent's full copy."""
    from safetensors.torch import load_file

    for agent, module in copies.items():
        path = directory / "agents" / agent / "model.safetensors"
        state = _laid_out(_load_safetensors(path, load_file), module.state_dict())
        missing, unexpected = module.load_state_dict(state, strict=False)
        # tied weights (lm_head = embed_tokens) are saved once; anything else missing is an error
        missing = [k for k in missing if k not in _tied_keys(module)]
        if missing or unexpected:
            raise MappaError(
                f"{path}: weights do not fit the base model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )


def load_adapters(directory: Path, model: PeftModel, adapters: Iterable[str]) -> None:
    """Load adapters/<adapter>/adapter_model.safetensors into each of `model`'s adapters."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    for adapter in adapters:
        path = directory / "adapters" / adapter / "adapter_model.safetensors"
        expected = {n for n, _ in model.named_parameters() if f".{adapter}." in n}
        # peft's keys leave the adapter's name out: lora_A.weight stands for lora_A.<adapter>.weight
        targets = {re.sub(r"\.(lora_\w+)\." + re.escape(adapter) + r"\.", r".\1.", n): p
                   for n, p in model.named_parameters() if n in expected}  # fmt: skip
        state = _laid_out(_load_safetensors(path, load_file), targets)
        try:
            result = set_peft_model_state_dict(model, state, adapter_name=adapter)
        except RuntimeError as e:  # shape mismatch: different rank or base
            raise MappaError(f"{path}: adapter does not fit this model ({str(e).splitlines()[0][:200]})") from None
        missing = [k for k in result.missing_keys if k in expected]
        if missing or result.unexpected_keys:
            raise MappaError(
                f"{path}: adapter does not fit this model (missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
            )


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _load_safetensors(path: Path, load_file: Callable[[str], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise MappaError(f"{path}: weights file not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type on truncated/corrupt files
        raise MappaError(f"{path}: unreadable weights ({type(e).__name__})") from None


def _host_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict whole and on the CPU, in key order (a sharded tensor's gather is a collective)."""
    return {k: sharding.host(v) for k, v in state.items()}


def _laid_out(state: dict[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loaded tensors laid out as the weights they go into: this rank's shard where those are sharded (a
    tensor of another shape is left for `load_state_dict` to name in its error)."""
    return {
        k: sharding.like(targets[k], v) if k in targets and targets[k].shape == v.shape else v
        for k, v in state.items()
    }


def _untied(state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The LM head left out when it is the embeddings (safetensors refuses aliases; HF re-ties on load)."""
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def _tied_keys(module: torch.nn.Module) -> set[str]:
    return {"lm_head.weight"} if module.config.tie_word_embeddings else set()
