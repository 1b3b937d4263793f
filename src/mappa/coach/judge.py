"""The coach as a plain async function: build the prompt, call the model, parse; one follow-up when needed.

The prompt fences the evidence with a fresh random token (`mappa.coach.prompts.draw_fence`); the reply's
score is its own verdict line only (`mappa.coach.parse.verdict`). Score caps are not applied here but by
`CoachRunner`, to every backend alike (`mappa.coach.caps`).

Shared by the model-backed coaches (`openai`, `local`), which differ only in how they complete a chat and
count a prompt's tokens (`ChatCoach`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mappa.coach.parse import TokenLogprob, expected_score, parse_answer_correct, parse_score, rationale_of
from mappa.coach.prompts import ChatMessages, EvidenceTooLong, Template, fit_prompt, follow_up_message
from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.protocols import CallCounters
from mappa.types import CoachContext, CoachScore

# Errors that start with this prefix mean the endpoint never gave a judgment (after retries):
# counted as failures and not cached, so a later run asks again.
REQUEST_FAILED = "request failed"


class RequestFailed(Exception):
    """The endpoint gave no usable reply after its retries; the action stays unscored."""


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: tuple[TokenLogprob, ...] | None = None  # per generated token, when logprobs were returned
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _expected_or(tokens: tuple[TokenLogprob, ...], parsed: float) -> float:
    value = expected_score(tokens)
    return parsed if value is None else value


Complete = Callable[[ChatMessages], Awaitable[Reply]]


@dataclass(frozen=True)
class Fit:
    """The coach's prompt budget in tokens (None: no limit) and how it counts a prompt's tokens."""

    budget: int | None
    count: Callable[[ChatMessages], int]


NO_LIMIT = Fit(None, lambda messages: 0)


async def judge(
    ctx: CoachContext,
    template: Template,
    complete: Complete,
    *,
    backend: str,
    model: str,
    use_expected: bool,
    fit: Fit = NO_LIMIT,
) -> CoachScore:
    """Score one action. Never raises for endpoint trouble: failures come back unscored with an error."""
    t0 = time.perf_counter()
    prompt_tokens = completion_tokens = 0
    raw = ""
    try:
        messages, cut = fit_prompt(ctx, template, fit.budget, fit.count)
    except EvidenceTooLong as e:  # deterministic, so cached like any judgment; a larger budget is a new key
        return CoachScore(
            score=None,
            error=f"evidence too long: {e}",
            truncated_inputs=len(ctx.messages),
            backend=backend,
            model=model,
        )

    def result(score: float | None, error: str | None, text: str) -> CoachScore:
        return CoachScore(
            score=score,
            rationale=rationale_of(text) if text else "",
            raw_reply=raw,
            error=error,
            answer_correct=parse_answer_correct(text) if ctx.is_final and ctx.ground_truth is not None else None,
            latency_s=time.perf_counter() - t0,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            backend=backend,
            model=model,
            truncated_inputs=cut.messages,
        )

    try:
        reply = await complete(messages)
    except RequestFailed as e:
        return result(None, f"{REQUEST_FAILED}: {e}", "")
    prompt_tokens, completion_tokens = reply.prompt_tokens, reply.completion_tokens
    raw = reply.text
    score = parse_score(reply.text)
    if score is not None:
        if use_expected and reply.tokens:
            score = _expected_or(reply.tokens, score)
        return result(score, None, reply.text)

    # No unambiguous verdict (none, only mid-text, or contradicted by a quoted score): one follow-up asking for
    # exactly the required lines; the first reply stays as the rationale.
    follow = [*messages, {"role": "assistant", "content": reply.text}, follow_up_message(ctx)]
    try:
        second = await complete(follow)
    except RequestFailed as e:
        return result(None, f"{REQUEST_FAILED} on the follow-up: {e}", reply.text)
    prompt_tokens += second.prompt_tokens
    completion_tokens += second.completion_tokens
    raw = f"{reply.text}\n\n[follow-up reply]\n{second.text}"
    score = parse_score(second.text)
    if score is None:
        # "line": a verdict line (parse.verdict); a score only quoted or contradicted mid-reply is none.
        return result(None, "no PROCESS_SCORE line, also after the follow-up", reply.text)
    if use_expected and second.tokens:
        score = _expected_or(second.tokens, score)
    text = reply.text if reply.text.strip() else second.text
    scored = result(score, None, text)
    if scored.answer_correct is None and ctx.is_final and ctx.ground_truth is not None:
        scored = scored.model_copy(update={"answer_correct": parse_answer_correct(second.text)})
    return scored


class ChatCoach:
    """A coach backed by a chat model: `judge` over the backend's `complete`, within its context budget.

    Subclasses set `name`, `model`, `cfg`, `template`, `fit` and `context_tokens`, and implement `complete` and
    `aclose`.
    """

    name: str
    model: str
    cfg: CoachConfig
    template: Template
    fit: Fit = NO_LIMIT
    context_tokens: int | None = None  # the context budget in force (coach.max_context_tokens or the default)
    cacheable = True

    def __init__(self, cfg: CoachConfig, template: Template) -> None:
        self.cfg = cfg
        self.template = template
        self.version = template.version
        self.counters = CallCounters()

    def prompt_budget(self, context_tokens: int | None) -> int | None:
        """Prompt tokens left in a context of `context_tokens` once the reply's room is kept free."""
        if context_tokens is None:
            return None
        budget = context_tokens - self.cfg.max_tokens
        if budget < 64:
            raise MappaError(
                f"coach.max_context_tokens: {context_tokens} leaves {budget} tokens for the prompt after "
                f"coach.max_tokens={self.cfg.max_tokens}"
            )
        return budget

    async def complete(self, messages: ChatMessages) -> Reply:
        raise NotImplementedError

    async def score(self, ctx: CoachContext) -> CoachScore:
        return await judge(
            ctx,
            self.template,
            self.complete,
            backend=self.name,
            model=self.model,
            use_expected=self.cfg.expected_score,
            fit=self.fit,
        )
