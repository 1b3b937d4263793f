"""The `local` coach: an in-process HF model (anything the policy layer loads) judges the actions.

`coach.model` names the model (`smollm2-135m-instruct`, a local HF dir, a .gguf file, or
`tiny-random`); when it is empty and the trainer passes its policy, the policy's frozen base
(adapters disabled) is the coach, at no extra memory. Concurrent judgments are batched into one
generate call. Token logprobs are always available here, so the expected score applies.
Small models rarely follow the reply format: expect many unscored actions from a 135M coach.
"""

from __future__ import annotations

from typing import Any

from mappa.coach.engine import ChatEngine, ChatRequest, load_policy
from mappa.coach.judge import Reply, RequestFailed, judge
from mappa.coach.parse import TokenLogprob
from mappa.coach.prompts import Template
from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.types import CoachContext, CoachScore, Message

TOP_LOGPROBS = 20


class LocalCoach:
    name = "local"
    cacheable = True

    def __init__(self, cfg: CoachConfig, template: Template, policy: Any = None) -> None:
        from mappa.coach import CallCounters

        if cfg.model:
            policy = load_policy(cfg.model)
            self.model = cfg.model
        elif policy is not None:
            self.model = policy.base_name or "policy-base"
        else:
            raise MappaError("coach.model: the local backend needs a model (e.g. coach.model=smollm2-135m-instruct)")
        self.cfg = cfg
        self.template = template
        self.version = template.version
        self.policy = policy
        self.engine = ChatEngine(policy, max_batch=cfg.concurrency, prefix_cache_mib=cfg.prefix_cache_mib)
        self.counters = CallCounters()

    async def complete(self, messages: list[dict[str, str]]) -> Reply:
        self.counters.calls += 1
        request = ChatRequest(
            agent=None,
            messages=tuple(Message(role=m["role"], content=m["content"]) for m in messages),
            temperature=self.cfg.temperature,
            max_tokens=self.cfg.max_tokens,
            top_logprobs=TOP_LOGPROBS if self.cfg.expected_score else 0,
        )
        try:
            gen = await self.engine.chat(request)
        except MappaError as e:  # e.g. the coach prompt is longer than the model's context
            self.counters.failures += 1
            raise RequestFailed(str(e)) from None
        eos = set(self.policy.eos_ids)
        tokens = None
        if gen.top_logprobs is not None:
            tokens = tuple(
                TokenLogprob(
                    self.engine.token_text(tid), lp, tuple((self.engine.token_text(a), alp) for a, alp in top)
                )
                for tid, lp, top in zip(gen.response_ids, gen.logprobs, gen.top_logprobs, strict=True)
                if tid not in eos
            )
        return Reply(
            text=gen.text, tokens=tokens, prompt_tokens=len(gen.prompt_ids), completion_tokens=len(gen.response_ids)
        )

    async def score(self, ctx: CoachContext) -> CoachScore:
        return await judge(
            ctx,
            self.template,
            self.complete,
            backend=self.name,
            model=self.model,
            use_expected=self.cfg.expected_score,
        )

    async def aclose(self) -> None:
        await self.engine.aclose()
