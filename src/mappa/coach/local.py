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
"""

from __future__ import annotations

import asyncio

from mappa.coach.judge import ChatCoach, Fit, Reply, RequestFailed
from mappa.coach.parse import TokenLogprob
from mappa.coach.prompts import ChatMessages, Template
from mappa.coach.tokens import special_strings
from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.policy import Generation, Policy
from mappa.types import Message

TOP_LOGPROBS = 20
COACH_AGENT = "coach"  # the one agent name of a policy loaded only to coach (its adapters stay disabled)


def _messages(chat: ChatMessages) -> tuple[Message, ...]:
    return tuple(Message(role=m["role"], content=m["content"]) for m in chat)


class LocalCoach(ChatCoach):
    name = "local"

    def __init__(self, cfg: CoachConfig, template: Template, policy: Policy | None = None) -> None:
        if cfg.model:
            from mappa.models import load_base_model

            base, tokenizer = load_base_model(cfg.model)
            policy = Policy.from_model(base, tokenizer, [COACH_AGENT], base_name=cfg.model)
            self.model = cfg.model
        elif policy is not None:
            self.model = policy.base_name or "policy-base"
        else:
            raise MappaError("coach.model: the local backend needs a model (e.g. coach.model=smollm2-135m-instruct)")
        super().__init__(cfg, template)
        self.endpoint = f"the local model {self.model}"
        self.policy = policy
        self.context_tokens = cfg.max_context_tokens or policy.model.config.max_position_embeddings
        count = lambda chat: len(policy.chat_ids(_messages(chat)))  # noqa: E731 - the coach's own template and tokens
        self.fit = Fit(self.prompt_budget(self.context_tokens, count), count, special_strings(policy.tokenizer))
        self.batches: list[int] = []  # judgments per generate call, in order
        self._waiting: list[tuple[ChatMessages, int, asyncio.Future[Generation]]] = []  # (chat, token cap, reply)
        self._drainer: asyncio.Task[None] | None = None  # decodes what waits; None while idle
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.policy.tokenizer.decode([token_id])
        return text

    def _generate(self, chats: list[ChatMessages], cap: int) -> list[Generation]:
        return self.policy.generate(
            None,  # the frozen base: adapters disabled
            [_messages(c) for c in chats],
            temperature=self.cfg.temperature,
            max_new_tokens=cap,
            top_logprobs=TOP_LOGPROBS if self.cfg.expected_score else 0,
            batch_size=self.cfg.concurrency,
        )

    async def _drain(self) -> None:
        """Decode everything waiting in one call, in a worker thread; repeat while more arrived meanwhile.

        Started by the first judgment to arrive; judgments started with it (one `score_many`) have all
        queued by the time it runs, since each runs up to this await before the drainer gets its turn.
        """
        try:
            while self._waiting:
                cap = self._waiting[0][1]  # one cap per call: requests asked again with more room wait their turn
                batch = [w for w in self._waiting if w[1] == cap]
                self._waiting = [w for w in self._waiting if w[1] != cap]
                self.batches.append(len(batch))
                try:
                    gens = await asyncio.to_thread(self._generate, [chat for chat, _, _ in batch], cap)
                except Exception as e:  # noqa: BLE001 - every waiting judgment must hear of it
                    for _, _, future in batch:
                        future.set_exception(RequestFailed(f"{type(e).__name__}: {e}"))
                    continue
                for (_, _, future), gen in zip(batch, gens, strict=True):
                    future.set_result(gen)
        finally:
            self._drainer = None

    async def complete(self, messages: ChatMessages, reply_tokens: int | None = None) -> Reply:
        self.counters.calls += 1
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._waiting.append((messages, self.cfg.reply_cap(reply_tokens), future))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        try:
            gen = await future
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
