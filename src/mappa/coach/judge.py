"""The coach as a plain async function: build the prompt, call the model, parse; one follow-up when needed.

Shared by the model-backed coaches (`openai`, `local`), which differ only in how they complete a chat.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mappa.coach.parse import TokenLogprob, expected_score, parse_answer_correct, parse_score, rationale_of
from mappa.coach.prompts import Template, build_messages, follow_up_message
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


Complete = Callable[[list[dict[str, str]]], Awaitable[Reply]]


async def judge(
    ctx: CoachContext, template: Template, complete: Complete, *, backend: str, model: str, use_expected: bool
) -> CoachScore:
    """Score one action. Never raises for endpoint trouble: failures come back unscored with an error."""
    t0 = time.perf_counter()
    messages = build_messages(ctx, template)
    prompt_tokens = completion_tokens = 0
    raw = ""

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

    # One follow-up asking for exactly the required lines; the first reply stays as the rationale.
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
        return result(None, "no PROCESS_SCORE line, also after the follow-up", reply.text)
    if use_expected and second.tokens:
        score = _expected_or(second.tokens, score)
    text = reply.text if reply.text.strip() else second.text
    scored = result(score, None, text)
    if scored.answer_correct is None and ctx.is_final and ctx.ground_truth is not None:
        scored = scored.model_copy(update={"answer_correct": parse_answer_correct(second.text)})
    return scored
