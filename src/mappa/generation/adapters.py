"""Publishing the agents' LoRA adapters for a generation server: one versioned PEFT directory per agent.

Layout: `ROOT/<agent>/v<version:06d>/` holds `adapter_config.json` and `adapter_model.safetensors`, the
PEFT format that vLLM (`--enable-lora`), SGLang and `mappa serve` load at run time. The version is the
number of training steps the weights have seen (0: the freshly initialised adapters, equal to the base).

Each directory is written under a hidden temporary name and renamed into place, so a server never reads
half an adapter. Only the last `keep` versions stay on disk; a version newer than the one published
(left behind by a run killed after publishing it, before its checkpoint) is removed, since the resumed
run replays that step with its own weights.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from mappa.errors import MappaError
from mappa.policy import sharding

KEEP_VERSIONS = 2
FULL_WEIGHTS_ERROR = (
    "generation.backend=server serves LoRA adapters; model.agent_weights=full is not supported with it "
    "(use lora or shared, or generation.backend=local)"
)


def adapter_name(agent: str, version: int) -> str:
    """The name an agent's adapter of `version` is served under (unique per version: servers refuse to load
    a second adapter under a name they already serve)."""
    return f"{agent}-v{version:06d}"


def version_dir(root: Path, agent: str, version: int) -> Path:
    return Path(root) / agent / f"v{version:06d}"


def publish_adapters(policy: Any, root: Path, version: int, keep: int = KEEP_VERSIONS) -> dict[str, Path]:
    """Save every agent's adapter to `root/<agent>/v<version>/` atomically; returns {agent: directory}.

    `policy`: a `mappa.policy.policy.Policy` with LoRA agents (`lora` or `shared`; in `shared` mode every agent gets
    the one adapter, so a server can address each agent by name).
    """
    if policy.agent_weights == "full":
        raise MappaError(FULL_WEIGHTS_ERROR)
    root = Path(root)
    out = {}
    try:
        root.mkdir(parents=True, exist_ok=True)
        for agent, (state, config) in adapter_states(policy).items():
            out[agent] = _write(state, config, version_dir(root, agent, version))
            _prune(root / agent, version, keep)
    except OSError as e:
        raise MappaError(f"generation.adapter_dir: cannot publish adapters under {root} ({e.strerror or e})") from None
    return out


def adapter_states(policy: Any) -> dict[str, tuple[dict[str, torch.Tensor], Any]]:
    """Every agent's adapter as PEFT saves it: {agent: (tensors by key, without the adapter's name; LoraConfig)}.

    Read straight from the agents' trainable parameters in one pass over the model: peft's own
    `get_peft_model_state_dict` walks the whole model several times per adapter (~0.5 s each at 135M)."""
    names = {id(p): n for n, p in policy.model.named_parameters()}
    out = {}
    for agent in policy.agents:
        state, key = {}, None
        for param in policy.trainable_parameters(agent):
            head, kind, rest = re.split(r"\.(lora_[AB])\.", names[id(param)], maxsplit=1)
            key, _, tail = rest.partition(".")
            state[f"{head}.{kind}.{tail}"] = sharding.host(param)  # gathered when sharded
        if key is None:
            raise MappaError(f"agent {agent!r} has no LoRA weights to publish")
        out[agent] = (state, policy.model.peft_config[key])
    return out


def _write(state: dict[str, torch.Tensor], config: Any, final: Path) -> Path:
    """Write an adapter into a temporary sibling of `final`, then rename it into place (a re-published
    version replaces the old directory; a reader sees the old or the new one, never a mix)."""
    from safetensors.torch import save_file

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(state, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp)  # adapter_config.json
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    return final


def _prune(agent_dir: Path, version: int, keep: int) -> None:
    """Keep the `keep` newest versions up to `version`; drop newer ones (a killed run's future)."""
    versions = sorted(int(p.name[1:]) for p in agent_dir.glob("v*") if p.is_dir() and p.name[1:].isdigit())
    older = [v for v in versions if v <= version]
    stale = [v for v in versions if v > version] + older[: max(len(older) - keep, 0)]
    for v in stale:
        shutil.rmtree(agent_dir / f"v{v:06d}", ignore_errors=True)
