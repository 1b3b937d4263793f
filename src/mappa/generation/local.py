"""The generators that sample in this process: `LocalGenerator` (the policy that trains, continuously batched), a
`TeamGenerator` over several base models (one `LocalGenerator` each), and `PolicyGenerator` (any batched
`PolicyLike`, such as a scripted policy in a test).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mappa.errors import MappaError
from mappa.policy.chat_engine import ChatEngine, ChatRequest
from mappa.protocols import GenerationLike, Generator, PolicyLike, SamplingSettings
from mappa.types import Message

if TYPE_CHECKING:
    from mappa.policy.team import Policies


class LocalGenerator:
    """The trainer's own policy as a generator: a `ChatEngine` over its sampling copies (`Policy.sampler`), every
    agent's decoder alive at once (`ChatEngine._interleave`). The policy's log-probs are exact unless it samples
    from bfloat16 copies (`Policy.samples_exactly`)."""

    def __init__(self, policy: Any, max_batch: int = 16, prefix_cache_mib: float = 256) -> None:
        self.policy = policy
        # The prefix cache keys prompt KV by the weights it was computed with (`ChatEngine._owner`): a prompt that
        # starts like an earlier one of the same agent at the same step (its system prompt, its own earlier turns)
        # prefills only the rest.
        self.engine = ChatEngine(
            policy, max_batch=max_batch, prefix_cache_mib=prefix_cache_mib, sampler=True, interleave=True
        )
        self._seen = dict.fromkeys(("steps", "row_steps", "prefill_s", "decode_s"), 0.0)

    @property
    def samples_exactly(self) -> bool:
        return self.policy.samples_exactly

    def chat_ids(self, agent: str, messages: Sequence[Message]) -> list[int]:
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


class TeamGenerator:
    """The local backend for a team on several base models (`mappa.policy.team.Policies`): one `LocalGenerator` per
    base, and each request sent to its agent's, so that the agent's prompt is templated, sampled and scored with its
    own base's tokenizer and weights. The bases decode side by side, each on its engine's thread."""

    def __init__(self, policies: Policies, max_batch: int = 16) -> None:
        self.bases = [LocalGenerator(policy, max_batch=max_batch) for policy in policies]
        self._of = {agent: base for base in self.bases for agent in base.policy.agents}

    @property
    def samples_exactly(self) -> bool:
        return all(base.samples_exactly for base in self.bases)

    def _base(self, agent: str) -> LocalGenerator:
        if agent not in self._of:
            raise MappaError(f"generation: unknown agent {agent!r} (agents: {', '.join(self._of)})")
        return self._of[agent]

    def chat_ids(self, agent: str, messages: Sequence[Message]) -> list[int]:
        return self._base(agent).chat_ids(agent, messages)

    async def generate(
        self, agent: str, messages: Sequence[Message], prompt_ids: Sequence[int], sampling: SamplingSettings,
        seed: int | None,
    ) -> GenerationLike:  # fmt: skip
        return await self._base(agent).generate(agent, messages, prompt_ids, sampling, seed)

    def sync(self, policy: Any, version: int) -> dict[str, float]:
        return {}  # each base samples from its policy itself, as `LocalGenerator` does

    def stats(self) -> dict[str, float]:
        """The bases' counters, added up (as a Ray run adds up its workers')."""
        out: dict[str, float] = {}
        for base in self.bases:
            for k, v in base.stats().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def close(self) -> None:
        for base in self.bases:
            base.close()


def local_generator(policies: Policies, max_batch: int = 16) -> Generator:
    """The local backend over a team's policies: a `LocalGenerator` on its one base, a `TeamGenerator` on several."""
    if len(policies) == 1:
        return LocalGenerator(policies.single, max_batch=max_batch)
    return TeamGenerator(policies, max_batch=max_batch)


class PolicyGenerator:
    """Any `PolicyLike` (a batched, synchronous `generate`: a scripted policy in a test, a user's own) as a
    generator: the requests waiting whenever it is free go in one call, one agent and one sampling setting at a
    time, on a worker thread."""

    def __init__(self, policy: PolicyLike) -> None:
        self.policy = policy
        self.samples_exactly = bool(getattr(policy, "samples_exactly", True))  # a plug-in may not say
        self._waiting: list[tuple[str, Sequence[Message], SamplingSettings, int | None, asyncio.Future]] = []
        self._busy: asyncio.Task | None = None

    def chat_ids(self, agent: str, messages: Sequence[Message]) -> list[int]:
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
