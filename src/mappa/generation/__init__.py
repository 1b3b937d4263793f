"""Where the agents' tokens come from: one `Generator` (`mappa.protocols`) per backend, behind which the runtime
(`mappa.workflows.runtime`) sends every episode's requests.

`generation.backend: local` (default): `LocalGenerator`, the policy that trains, continuously batched
(`mappa.chat_engine.ChatEngine` on its sampling copies): requests of concurrent episodes decode together, a
request joining the running batch at the next token. `generation.backend: server`: `ServerGenerator` sends every
request to `generation.base_url` (vLLM, SGLang or `mappa serve`), and `sync` publishes each agent's adapter after
every step and has the server load it (`ServerPolicy.load_adapters`). A server's log-probs are never the update's
(`samples_exactly` is false: the trainer recomputes them at the sampling temperature, and measures how far the
server's are, `mappa.rl.logprob_gap`), which is small only when the server reports temperature-scaled log-probs
too (vLLM: `--logprobs-mode processed_logprobs`; docs/training.md). Setup and the GPU recipes: docs/scale.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mappa.chat_engine import ChatEngine, ChatRequest
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
from mappa.protocols import GenerationLike, Generator, PolicyLike, SamplingSettings
from mappa.types import Message


class LocalGenerator:
    """The trainer's own policy as a generator: a `ChatEngine` over its sampling copies (`Policy.sampler`), no
    prefix cache (the weights change every step). The policy's log-probs are exact unless it samples from
    bfloat16 copies (`Policy.samples_exactly`)."""

    def __init__(self, policy: Any, max_batch: int = 16) -> None:
        self.policy = policy
        self.engine = ChatEngine(policy, max_batch=max_batch, prefix_cache_mib=0, sampler=True)
        self._seen = dict.fromkeys(("steps", "row_steps", "prefill_s", "decode_s"), 0.0)

    @property
    def samples_exactly(self) -> bool:
        return self.policy.samples_exactly

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.policy.chat_ids(messages)

    async def generate(
        self, agent: str, messages: Sequence[Message], prompt_ids: Sequence[int], sampling: SamplingSettings,
        seed: int | None,
    ) -> GenerationLike:  # fmt: skip
        request = ChatRequest(
            agent, tuple(messages), sampling.temperature, sampling.top_p, sampling.max_new_tokens, 0, seed,
            tuple(prompt_ids),
        )  # fmt: skip
        return await self.engine.chat(request)

    def sync(self, policy: Any, version: int) -> dict[str, float]:
        return {}  # it samples from the policy itself: a sampling copy refills when the weights under it change

    def stats(self) -> dict[str, float]:
        """Decoding since the last call, as counters that add up over workers: decode steps, rows decoded over
        those steps (their ratio is the mean batch), seconds prefilling and decoding."""
        now = self.engine.stats()
        d = {k: float(now[k]) - self._seen[k] for k in self._seen}
        self._seen = {k: float(now[k]) for k in self._seen}
        return {"generation/decode_steps": d["steps"], "generation/decode_rows": d["row_steps"],
                "generation/prefill_s": d["prefill_s"], "generation/decode_s": d["decode_s"]}  # fmt: skip

    def close(self) -> None:
        self.engine.close()


class PolicyGenerator:
    """Any `PolicyLike` (a batched, synchronous `generate`: a scripted policy in a test, a user's own) as a
    generator: the requests waiting whenever it is free go in one call, one agent and one sampling setting at a
    time, on a worker thread."""

    def __init__(self, policy: PolicyLike) -> None:
        self.policy = policy
        self.samples_exactly = bool(getattr(policy, "samples_exactly", True))  # a plug-in may not say
        self._waiting: list[tuple[str, Sequence[Message], SamplingSettings, int | None, asyncio.Future]] = []
        self._busy: asyncio.Task | None = None

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.policy.chat_ids(messages)

    async def generate(
        self, agent: str, messages: Sequence[Message], prompt_ids: Sequence[int], sampling: SamplingSettings,
        seed: int | None,
    ) -> GenerationLike:  # fmt: skip
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((agent, messages, sampling, seed, future))
        if self._busy is None or self._busy.done():
            self._busy = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let every episode that is ready ask first
        while self._waiting:
            agent, _, sampling, _, _ = self._waiting[0]
            batch = [w for w in self._waiting if w[0] == agent and w[2] == sampling]
            self._waiting = [w for w in self._waiting if not (w[0] == agent and w[2] == sampling)]
            try:
                out = await asyncio.to_thread(
                    self.policy.generate, agent, [w[1] for w in batch], temperature=sampling.temperature,
                    top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens,
                    max_context_tokens=sampling.max_context_tokens, seed=[w[3] for w in batch], batch_size=None,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - each waiting episode gets the error
                for w in batch:
                    w[4].set_exception(e)
                continue
            for w, g in zip(batch, out, strict=True):
                w[4].set_result(g)
            await asyncio.sleep(0)

    def sync(self, policy: Any, version: int) -> dict[str, float]:
        return {}

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class ServerGenerator:
    """An OpenAI-compatible LoRA server as a generator (`ServerPolicy`): every request in flight at once, up to
    `generation.concurrency`; `sync` publishes the agents' adapters as the step's version and has it load them."""

    samples_exactly = False  # another engine's kernels (maybe another dtype): the update recomputes the old log-probs

    def __init__(self, server: ServerPolicy, adapter_root: Path) -> None:
        self.server, self.adapter_root = server, adapter_root

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.server.chat_ids(messages)

    async def generate(
        self, agent: str, messages: Sequence[Message], prompt_ids: Sequence[int], sampling: SamplingSettings,
        seed: int | None,
    ) -> GenerationLike:  # fmt: skip
        job = self.server.submit(
            agent, messages, prompt_ids, temperature=sampling.temperature, top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens, seed=seed,
        )  # fmt: skip
        return await asyncio.wrap_future(job)

    def sync(self, policy: Any, version: int) -> dict[str, float]:
        """Publish every agent's adapter as `version` and have the server load it: `generation/publish_s` and
        `generation/reload_s`."""
        t0 = time.perf_counter()
        paths = publish_adapters(policy, self.adapter_root, version)
        publish_s = time.perf_counter() - t0
        reload_s = self.server.load_adapters(paths, version)
        return {"generation/publish_s": publish_s, "generation/reload_s": reload_s}

    def stats(self) -> dict[str, float]:
        return self.server.stats()

    def close(self) -> None:
        self.server.close()


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


def logprob_gap(metrics: dict[str, float]) -> dict[str, float]:
    """`generation/logprob_gap`: the token-weighted mean of the update groups' `agent/<group>/logprob_gap` in
    `metrics` (the server backend's update reports them); nothing when there is none."""
    gaps = {k.removesuffix("/logprob_gap"): v for k, v in metrics.items() if k.endswith("/logprob_gap")}
    tokens = {g: metrics.get(f"{g}/tokens", 0.0) for g in gaps}
    if sum(tokens.values()) <= 0:
        return {}
    return {"generation/logprob_gap": sum(gaps[g] * tokens[g] for g in gaps) / sum(tokens.values())}


def step_sync(
    generator: Generator, policy: Any, version: int, metrics: dict[str, float] | None = None
) -> dict[str, float]:
    """After a step's updates: the rollout's generation counters, then the new weights to the generator."""
    return {**generator.stats(), **logprob_gap(metrics or {}), **generator.sync(policy, version)}


__all__ = [
    "LocalGenerator",
    "PolicyGenerator",
    "ServedGeneration",
    "ServerGenerator",
    "ServerPolicy",
    "adapter_name",
    "adapter_root",
    "adapter_states",
    "build_generator",
    "check_backend",
    "logprob_gap",
    "publish_adapters",
    "step_sync",
    "version_dir",
]
