"""The configured generator: `build_generator` picks the local policy or a server (`generation.backend`),
`check_backend` refuses what a server cannot honour before any model loads, and `step_sync` hands a step's new
weights to the generator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.generation.adapters import FULL_WEIGHTS_ERROR
from mappa.generation.local import LocalGenerator
from mappa.generation.server import ServerGenerator, ServerPolicy
from mappa.protocols import Generator


def adapter_root(cfg: Config, run_dir: Path) -> Path:
    """Where adapters are published: `generation.adapter_dir`, or `<run_dir>/adapters`."""
    return Path(cfg.generation.adapter_dir) if cfg.generation.adapter_dir else Path(run_dir) / "adapters"


def check_backend(cfg: Config) -> None:
    """Settings the server backend cannot honour, as one-line errors before any model is loaded."""
    if cfg.generation.backend == "server" and cfg.model.agent_weights == "full":
        raise MappaError(FULL_WEIGHTS_ERROR)


def build_generator(cfg: Config, policy: Any, run_dir: Path | None = None, step: int | None = None) -> Generator:
    """What episodes sample from: `LocalGenerator` over the policy (`local`), or a `ServerGenerator` (`server`).

    With a server and `step` given, the policy's adapters are published as version `step` and loaded, so the
    server holds the weights the run starts (or resumes) from. Either way prompts are templated with
    `generation.chat_template_kwargs`: when set, the policy takes them here too (the tokens it trains on, its
    self-test and a coach sharing its base are templated as generation is).
    """
    check_backend(cfg)
    if cfg.generation.chat_template_kwargs:
        policy.chat_template_kwargs = dict(cfg.generation.chat_template_kwargs)
    if cfg.generation.backend == "local":
        return LocalGenerator(policy, max_batch=cfg.generation.batch_size)
    root = adapter_root(cfg, run_dir or Path("."))
    generator = ServerGenerator(ServerPolicy.from_policy(policy, cfg.generation, adapter_root=root), root)
    if step is not None:
        try:
            generator.sync(policy, step)
        except BaseException:
            generator.close()
            raise
    return generator


def step_sync(generator: Generator, policy: Any, version: int) -> dict[str, float]:
    """After a step's updates: the rollout's generation counters, then the new weights to the generator."""
    return {**generator.stats(), **generator.sync(policy, version)}
