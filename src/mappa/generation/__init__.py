"""Where the agents' tokens come from: the trainer's own policy, or an OpenAI-compatible LoRA server.

`generation.backend: local` (default): the policy that trains also generates (`mappa.policy.Policy.generate`).
`generation.backend: server`: a `ServerPolicy` sends every turn to `generation.base_url` (vLLM, SGLang or
`mappa serve`), and after every optimizer step the trainer publishes each agent's adapter
(`publish_adapters`) and has the server load it (`ServerPolicy.load_adapters`). The trainer recomputes
PPO's old log-probs with its own forward pass at the sampling temperature (the distribution the server
sampled from); the server's are kept only to measure how far they are (`mappa.rl.logprob_gap`), which is small only
when the server reports temperature-scaled log-probs too (vLLM: `--logprobs-mode processed_logprobs`;
docs/training.md). Setup and the GPU recipes: docs/scale.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.generation.adapters import (
    FULL_WEIGHTS_ERROR,
    adapter_name,
    adapter_states,
    publish_adapters,
    version_dir,
)
from mappa.generation.server import ServedGeneration, ServerPolicy
from mappa.protocols import PolicyLike


def adapter_root(cfg: Config, run_dir: Path) -> Path:
    """Where adapters are published: `generation.adapter_dir`, or `<run_dir>/adapters`."""
    return Path(cfg.generation.adapter_dir) if cfg.generation.adapter_dir else Path(run_dir) / "adapters"


def check_backend(cfg: Config) -> None:
    """Settings the server backend cannot honour, as one-line errors before any model is loaded."""
    if cfg.generation.backend == "server" and cfg.model.agent_weights == "full":
        raise MappaError(FULL_WEIGHTS_ERROR)


def build_generator(cfg: Config, policy: Any, run_dir: Path | None = None, step: int | None = None) -> PolicyLike:
    """What the workflow samples from: the policy itself (`local`), or a `ServerPolicy` (`server`).

    With a server and `step` given, the policy's adapters are published as version `step` (under
    `adapter_root(cfg, run_dir)`) and loaded, so the server holds the weights the run starts (or resumes) from.
    Either way prompts are templated with `generation.chat_template_kwargs`: when set, the policy takes them here
    too (the tokens it trains on, its self-test and a coach sharing its base are templated as generation is).
    """
    check_backend(cfg)
    if cfg.generation.chat_template_kwargs:
        policy.chat_template_kwargs = dict(cfg.generation.chat_template_kwargs)
    if cfg.generation.backend == "local":
        return policy
    root = adapter_root(cfg, run_dir or Path("."))
    generator = ServerPolicy.from_policy(policy, cfg.generation, adapter_root=root)
    if step is not None:
        try:
            sync_adapters(generator, policy, root, step)
        except BaseException:
            generator.close()
            raise
    return generator


def sync_adapters(generator: PolicyLike, policy: Any, root: Path, version: int) -> dict[str, float]:
    """With a server: publish every agent's adapter as `version` and have the server load it; returns
    `generation/publish_s` and `generation/reload_s`. The local backend needs nothing (no metrics)."""
    if not isinstance(generator, ServerPolicy):
        return {}
    t0 = time.perf_counter()
    paths = publish_adapters(policy, root, version)
    publish_s = time.perf_counter() - t0
    reload_s = generator.load_adapters(paths, version)
    return {"generation/publish_s": publish_s, "generation/reload_s": reload_s}


def step_sync(
    generator: PolicyLike, policy: Any, root: Path, version: int, metrics: dict[str, float] | None = None
) -> dict[str, float]:
    """After a step's updates: the rollout's generation counters (`generation_stats`), then the new adapters
    published as `version` and loaded (`sync_adapters`). Nothing for the local backend."""
    if not isinstance(generator, ServerPolicy):
        return {}
    return {**generation_stats(generator, metrics or {}), **sync_adapters(generator, policy, root, version)}


def generation_stats(generator: PolicyLike, metrics: dict[str, float]) -> dict[str, float]:
    """The server backend's counters since the last call (`generation/...`), and `generation/logprob_gap`: the
    token-weighted mean of the groups' `agent/<group>/logprob_gap` in `metrics`. Nothing for the local backend."""
    if not isinstance(generator, ServerPolicy):
        return {}
    out = generator.stats()
    gaps = {k.removesuffix("/logprob_gap"): v for k, v in metrics.items() if k.endswith("/logprob_gap")}
    tokens = {g: metrics.get(f"{g}/tokens", 0.0) for g in gaps}
    if sum(tokens.values()) > 0:
        out["generation/logprob_gap"] = sum(gaps[g] * tokens[g] for g in gaps) / sum(tokens.values())
    return out


def close_generator(generator: PolicyLike) -> None:
    if isinstance(generator, ServerPolicy):
        generator.close()


__all__ = [
    "ServedGeneration",
    "ServerPolicy",
    "adapter_name",
    "adapter_root",
    "adapter_states",
    "build_generator",
    "check_backend",
    "close_generator",
    "generation_stats",
    "publish_adapters",
    "step_sync",
    "sync_adapters",
    "version_dir",
]
