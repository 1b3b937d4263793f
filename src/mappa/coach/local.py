"""The `local` coach: an in-process HF model (anything the policy layer loads) judges the actions.

`coach.model` names the model (`smollm2-135m-instruct`, a local HF dir, a .gguf file, or
`tiny-random`); when it is empty and the trainer passes its policy, the policy's frozen base
(adapters disabled) is the coach, at no extra memory. Judgments that arrive while the model is busy
wait and then decode together in one batched `Policy.generate` call per token cap (the training path never loads
the serving engine; `mappa serve` + the `openai` backend is the continuously batched alternative). Token
logprobs are always available here, so the expected score applies. A reply's cap is `coach.max_tokens` plus
`coach.thinking_budget` (a thinking model's thinking is part of its reply here); one that hits it is cut.
Small models rarely follow the reply format: expect many unscored actions from a 135M coach.
Prompts are counted with the coach model's own chat template and tokenizer, against
`coach.max_context_tokens` (default: the model's context length) less the reply's `coach.max_tokens`; its
special strings (`<|im_end|>`, ...) are broken up in agent text, which the tokenizer would otherwise read as
the end of the coach's turn.
With `coach.judge: logprob` the same model and prompt give the verdict without writing it: one forward pass, the score
read from the next token's distribution (`mappa.coach.logprob_judge`); both batch through `Batcher`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

from mappa.coach.judge import ChatCoach, Fit, Reply, RequestFailed
from mappa.coach.parse import TokenLogprob
from mappa.coach.prompts import ChatMessages, Template
from mappa.coach.tokens import special_strings
from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.policy.policy import Generation, Policy
from mappa.types import Message

TOP_LOGPROBS = 20
COACH_AGENT = "coach"  # the one agent name of a policy loaded only to coach (its adapters stay disabled)


Q = TypeVar("Q")
R = TypeVar("R")


def as_messages(chat: ChatMessages) -> tuple[Message, ...]:
    """A chat as the policy's messages."""
    return tuple(Message(role=m["role"], content=m["content"]) for m in chat)


class Batcher(Generic[Q, R]):
    """Requests that arrive while the model is busy wait, then run together: `run(batch)` in a worker thread, on every
    waiting request of the first one's `key`; repeated while more arrived meanwhile.

    Started by the first request to arrive; requests started with it (one `score_many`) have all queued by the time
    it runs, since each runs up to its await before the drainer gets its turn. A failing `run` fails every request
    of its batch with `RequestFailed`. `sizes`: requests per call of `run`, in order.
    """

    def __init__(self, run: Callable[[list[Q]], list[R]], key: Callable[[Q], Hashable] = lambda q: None) -> None:
        self.run = run
        self.key = key
        self.sizes: list[int] = []
        self._waiting: list[tuple[Q, asyncio.Future[R]]] = []
        self._drainer: asyncio.Task[None] | None = None  # runs what waits; None while idle

    async def __call__(self, request: Q) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                key = self.key(self._waiting[0][0])
                batch = [w for w in self._waiting if self.key(w[0]) == key]
                self._waiting = [w for w in self._waiting if self.key(w[0]) != key]
                self.sizes.append(len(batch))
                try:
                    results = await asyncio.to_thread(self.run, [request for request, _ in batch])
                except Exception as e:  # noqa: BLE001 - every waiting request must hear of it
                    for _, future in batch:
                        future.set_exception(RequestFailed(f"{type(e).__name__}: {e}"))
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    future.set_result(result)
        finally:
            self._drainer = None


def coach_policy(cfg: CoachConfig, policy: Policy | None, dtype: torch.dtype | None = None) -> tuple[Policy, str]:
    """The model that coaches and its name: `coach.model` loaded here (in `dtype`; None: float32 on the CPU), else the
    trainer's policy (its frozen base)."""
    if cfg.model:
        from mappa.policy.models import load_base_model

        base, tokenizer = load_base_model(cfg.model, dtype=dtype)
        return Policy.from_model(base, tokenizer, [COACH_AGENT], base_name=cfg.model), cfg.model
    if policy is not None:
        return policy, policy.base_name or "policy-base"
    raise MappaError("coach.model: the local backend needs a model (e.g. coach.model=smollm2-135m-instruct)")


class LocalCoach(ChatCoach):
    name = "local"

    def __init__(
        self, cfg: CoachConfig, template: Template, policy: Policy | None = None, dtype: torch.dtype | None = None
    ) -> None:
        policy, self.model = coach_policy(cfg, policy, dtype)
        super().__init__(cfg, template)
        self.endpoint = f"the local model {self.model}"
        self.policy = policy
        self.context_tokens = cfg.max_context_tokens or policy.model.config.max_position_embeddings
        count = lambda chat: len(policy.chat_ids(as_messages(chat)))  # noqa: E731 - the coach's own template and tokens
        self.fit = Fit(self.prompt_budget(self.context_tokens, count), count, special_strings(policy.tokenizer))
        # (chat, token cap) -> its generation; one cap per call: requests asked again with more room wait their turn
        self._generations = Batcher(self._generate, key=lambda request: request[1])
        self.batches = self._generations.sizes  # judgments per generate call, in order
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.policy.tokenizer.decode([token_id])
        return text

    def _generate(self, requests: list[tuple[ChatMessages, int]]) -> list[Generation]:
        return self.policy.generate(
            None,  # the frozen base: adapters disabled
            [as_messages(chat) for chat, _ in requests],
            temperature=self.cfg.temperature,
            max_new_tokens=requests[0][1],
            top_logprobs=TOP_LOGPROBS if self.cfg.expected_score else 0,
            batch_size=self.cfg.concurrency,
        )

    async def complete(self, messages: ChatMessages, reply_tokens: int | None = None) -> Reply:
        self.counters.calls += 1
        try:
            gen = await self._generations((messages, self.cfg.reply_cap(reply_tokens)))
        except RequestFailed:
            self.counters.failures += 1
            raise
        return self._reply(gen)

    def _reply(self, gen: Generation) -> Reply:
        eos = set(self.policy.eos_ids)
        tokens = None
        if gen.top_logprobs is not None:
            tokens = tuple(
                TokenLogprob(self.token_text(tid), lp, tuple((self.token_text(a), alp) for a, alp in top))
                for tid, lp, top in zip(gen.response_ids, gen.logprobs, gen.top_logprobs, strict=True)
                if tid not in eos
            )
        return Reply(
            text=gen.text,
            tokens=tokens,
            prompt_tokens=len(gen.prompt_ids),
            completion_tokens=len(gen.response_ids),
            cut=gen.truncated,
        )

    async def aclose(self) -> None:
        return None
