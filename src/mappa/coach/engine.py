"""A local model as a batched chat engine: shared by the `local` coach and `mappa serve`.

Concurrent chat requests are queued; a single worker takes everything that arrived (after the first,
it waits for more up to 10% of the last generate call's duration, 10-250 ms, unless a full batch is
already waiting), groups requests that can share one `Policy.generate` call (same
agent, temperature, top-p, token cap and seed), and runs each group as one batched generation in a
worker thread. While a batch generates, new requests queue up and form the next batch, so the
batch size follows the load without a fixed schedule.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mappa.types import Message

TINY_RANDOM = "tiny-random"  # a 2-layer random model built in-process: smoke tests, no download
PLACEHOLDER_AGENT = "base"  # the policy needs one agent; a plain model is served with adapters disabled


def load_policy(model: str, adapters: str | None = None) -> Any:
    """A `mappa.policy.Policy` for serving or coaching: a checkpoint's agents, or a plain base model.

    `model` is a name `mappa.models.load_base_model` understands, or `tiny-random`.
    """
    from mappa.policy import Policy

    if adapters:
        return Policy.from_checkpoint(adapters)
    if model == TINY_RANDOM:
        from mappa.models import tiny_model_and_tokenizer

        base, tokenizer = tiny_model_and_tokenizer()
        return Policy.from_model(base, tokenizer, [PLACEHOLDER_AGENT], base_name=None)
    from mappa.models import load_base_model

    base, tokenizer = load_base_model(model)
    return Policy.from_model(base, tokenizer, [PLACEHOLDER_AGENT], base_name=model)


@dataclass(frozen=True)
class ChatRequest:
    agent: str | None  # None: the base model (adapters disabled)
    messages: tuple[Message, ...]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    top_logprobs: int = 0
    seed: int | None = None

    def group_key(self) -> tuple:
        return (self.agent, self.temperature, self.top_p, self.max_tokens, self.seed)


class ChatEngine:
    """Micro-batches concurrent `chat` calls into `Policy.generate` calls (see the module docstring)."""

    def __init__(
        self, policy: Any, max_batch: int = 16, max_wait_s: float = 0.01, max_wait_cap_s: float = 0.25
    ) -> None:
        self.policy = policy
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s  # shortest wait for more requests after the first
        self.max_wait_cap_s = max_wait_cap_s  # longest wait, however slow generation is
        self._last_generate_s = 0.0
        self.batches = 0  # generate calls made
        self.requests = 0  # requests served
        self.largest_batch = 0
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task | None = None
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.policy.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    async def chat(self, request: ChatRequest) -> Any:
        """One response (`mappa.policy.Generation`), generated in a batch with whatever else is waiting."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._worker is None or self._worker.done():
            self._loop = loop
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._run())
        future: asyncio.Future = loop.create_future()
        await self._queue.put((request, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._queue is not None
        while True:
            pending = [await self._queue.get()]
            # Wait a little for company, in proportion to how long a generate call takes (10%, capped):
            # clients whose previous reply just went out need a moment to send their next request, and
            # without the wait two half-full batches would keep alternating. A full batch goes at once.
            window = min(self.max_wait_cap_s, max(self.max_wait_s, 0.1 * self._last_generate_s))
            deadline = loop.time() + window
            while True:
                while len(pending) < 4 * self.max_batch:
                    try:
                        pending.append(self._queue.get_nowait())
                    except asyncio.QueueEmpty:
                        break
                remaining = deadline - loop.time()
                if len(pending) >= self.max_batch or remaining <= 0:
                    break
                try:
                    pending.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            groups: dict[tuple, list] = {}
            for req, fut in pending:
                if not fut.done():  # the client went away
                    groups.setdefault(req.group_key(), []).append((req, fut))
            for members in groups.values():
                for start in range(0, len(members), self.max_batch):
                    await self._generate(members[start : start + self.max_batch])

    async def _generate(self, members: Sequence[tuple[ChatRequest, asyncio.Future]]) -> None:
        first = members[0][0]
        k = max(r.top_logprobs for r, _ in members)
        t0 = time.perf_counter()
        try:
            gens = await asyncio.to_thread(
                self.policy.generate,
                first.agent,
                [r.messages for r, _ in members],
                temperature=first.temperature,
                top_p=first.top_p,
                max_new_tokens=first.max_tokens,
                top_logprobs=k,
                seed=first.seed,
                batch_size=len(members),
            )
        except Exception as e:  # delivered to each caller; the worker keeps serving
            for _, fut in members:
                if not fut.done():
                    fut.set_exception(e)
            return
        self._last_generate_s = time.perf_counter() - t0
        self.batches += 1
        self.requests += len(members)
        self.largest_batch = max(self.largest_batch, len(members))
        for (req, fut), gen in zip(members, gens, strict=True):
            if fut.done():
                continue
            if gen.top_logprobs is not None and req.top_logprobs < k:
                trimmed = tuple(top[: req.top_logprobs] for top in gen.top_logprobs) if req.top_logprobs else None
                gen = _replace_top(gen, trimmed)
            fut.set_result(gen)

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None


def _replace_top(gen: Any, top: Any) -> Any:
    import dataclasses

    return dataclasses.replace(gen, top_logprobs=top)
