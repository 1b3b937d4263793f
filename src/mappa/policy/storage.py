"""The files a `Policy` is saved as, and read back from.

A policy checkpoint directory holds:
  mappa_policy.json     the manifest: base name and init_kwargs, agents, weight mode, adapter names, LoRA settings
  adapters/<adapter>/   one LoRA adapter in peft format (`lora`: one per agent; `shared`: one for all)
  agents/<agent>/       one full copy as an HF model directory (`full`)
  base/                 the base weights and tokenizer, only when the base has no name to be reloaded by
  tokenizer/            the tokenizer

A heterogeneous team (agents on several base models, `mappa.policy.team`) is saved as one such directory per base,
`base-0/`, `base-1/`, ... (base-0: `model.name`'s), beside a manifest that lists the agents of each:
  mappa_policy.json     {"format_version": 2, "agents": [...], "bases": [{"model": ..., "agents": [...]}, ...]}
Format 2 added that layout; a one-base policy's files are those of format 1, which loads as it did. A manifest
of a newer format is refused, and so is a team's where one policy is expected (`read_manifest`).

Weights are written whole and on the CPU: sharded tensors (`mappa.policy.sharding`) are gathered first, and laid
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

from mappa.errors import MappaError
from mappa.policy import sharding
from mappa.policy.lora import LoraSettings

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

MANIFEST = "mappa_policy.json"
FORMAT_VERSION = 2  # 2: a team of several bases (`bases`); 1: before, one base
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


class BaseEntry(TypedDict):
    """One base of a team's manifest: the model its policy was loaded from (None: stored in its base/), its agents."""

    model: str | None
    agents: list[str]


# subdirectory -> (tensors whole on the CPU, the config saved beside them)
WeightFiles = dict[str, tuple[dict[str, torch.Tensor], "PretrainedConfig | PeftConfig"]]


# ----------------------------------------------------------------------------------------------------------------
# Manifest


def _read_json(directory: Path) -> dict[str, Any]:
    """`mappa_policy.json` as written, of a format this code reads; MappaError if absent, not JSON or newer."""
    path = directory / MANIFEST
    if not path.is_file():
        raise MappaError(f"{directory}: not a mappa policy checkpoint ({MANIFEST} not found)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MappaError(f"{path}:{e.lineno}: invalid JSON") from None
    if not isinstance(manifest, dict):
        raise MappaError(f"{path}: not a policy manifest (a JSON object)")
    version = manifest.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise MappaError(
            f"{path}: format version {version!r} (this mappa reads up to {FORMAT_VERSION}: written by a newer mappa?)"
        )
    return manifest


def read_manifest(directory: str | Path) -> Manifest:
    """A checkpoint's `mappa_policy.json` (base name, agents, mode, LoRA settings), checked; MappaError if absent,
    or if it is a team's of several bases (whose base-<i>/ subdirectories are each one policy)."""
    directory = Path(directory)
    manifest = _read_json(directory)
    if (bases := _bases(directory, manifest)) is not None:
        dirs = ", ".join(f"{base_dir(Path(), i)}/" for i in range(len(bases)))
        raise MappaError(
            f"{directory / MANIFEST}: a team on {describe_bases(bases)}, not one policy (each base's policy is its "
            f"subdirectory: {dirs})"
        )
    for key in ("agents", "agent_weights", "base_name", "lora"):
        if key not in manifest:
            raise MappaError(f"{directory / MANIFEST}: missing field {key!r}")
    return manifest


def read_team(directory: str | Path) -> list[BaseEntry] | None:
    """The bases a team's checkpoint lists (each one's files under `base_dir(directory, i)`); None for one base."""
    directory = Path(directory)
    return _bases(directory, _read_json(directory))


def _bases(directory: Path, manifest: dict[str, Any]) -> list[BaseEntry] | None:
    if (bases := manifest.get("bases")) is None:
        return None
    ok = isinstance(bases, list) and bases and all(
        isinstance(b, dict) and isinstance(b.get("agents"), list) and all(isinstance(a, str) for a in b["agents"])
        and (b.get("model") is None or isinstance(b["model"], str)) for b in bases
    )  # fmt: skip
    if not ok:
        raise MappaError(f"{directory / MANIFEST}: 'bases' is not a list of {{model, agents}}")
    return [BaseEntry(model=b.get("model"), agents=list(b["agents"])) for b in bases]


def base_dir(directory: Path, index: int) -> Path:
    """Where a team's checkpoint keeps the policy of its base `index` (0: `model.name`'s)."""
    return directory / f"base-{index}"


def describe_bases(bases: Iterable[BaseEntry]) -> str:
    """For one-line errors: "2 base models (tiny-random: solver, coder; tiny-random-2: verifier)"."""
    bases = list(bases)
    each = "; ".join(f"{b['model'] or 'an in-memory model'}: {', '.join(b['agents'])}" for b in bases)
    return f"{len(bases)} base model{'s' if len(bases) != 1 else ''} ({each})"


def write_team_manifest(directory: str | Path, agents: Iterable[str], bases: Iterable[BaseEntry]) -> None:
    """The manifest of a team saved as one policy directory per base (`base_dir`), written beside them."""
    directory = Path(directory)
    manifest = {"format_version": FORMAT_VERSION, "agents": list(agents), "bases": list(bases)}
    try:
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    except OSError as e:
        raise MappaError(f"cannot write checkpoint {directory} ({e.strerror or e})") from None


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
