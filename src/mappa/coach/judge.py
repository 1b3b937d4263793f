"""The coach as a plain async function: build the prompt, call the model, parse; one follow-up when needed.

The prompt fences the evidence with a fresh random token (`mappa.coach.prompts.draw_fence`); the reply's
score is its own verdict line only (`mappa.coach.parse.verdict`). Score caps are not applied here but by
`CoachRunner`, to every backend alike (`mappa.coach.caps`).

Unjudgeable is never better than judged-bad. An unscored action is left out of training, so an action whose
own content left it unscored would escape the low score a judged one gets, and a policy would learn to
produce it. The rule, in this function for every model-backed coach:
- evidence over the coach's budget is judged cut to fit (`fit_prompt`: the oldest input first, then every
  field to its head and tail), the cut stated in the prompt and at the head of the rationale;
- the action scores `WORST_SCORE` when nothing judgeable is left of it: an output with no visible text,
  evidence that does not fit even cut to `MIN_FIELD_CHARS` a field, or replies that stay without an
  unambiguous verdict while the action's own text holds the verdict's markers (which the coach then quotes);
- only the coach's own failures leave it unscored: the endpoint failing after its retries, no verdict after the
  follow-up with no marker in the action's text, or a reply cut at the token cap also when asked again with twice
  the room (`coach.max_tokens`, `coach.thinking_budget`: a thinking model spends its thinking inside the cap). A
  setting under which no action can be judged (a budget smaller than the template, an endpoint context smaller than
  the budget) stops the run.
Text no coach could read (control characters, lone surrogates) is escaped before any coach or the cache sees
it (`CoachRunner`, `mappa.coach.prompts.readable_context`).

Shared by the model-backed coaches (`openai`, `local`), which differ only in how they complete a chat and
count a prompt's tokens (`ChatCoach`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mappa.coach.parse import (
    TokenLogprob,
    expected_score,
    holds_marker,
    parse_answer_correct,
    parse_score,
    rationale_of,
)
from mappa.coach.prompts import (
    MIN_FIELD_CHARS,
    ChatMessages,
    Cut,
    EvidenceTooLong,
    Template,
    draw_fence,
    fit_prompt,
    follow_up_message,
)
from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.protocols import CallCounters
from mappa.types import CoachContext, CoachScore

# Errors that start with this prefix mean the endpoint never gave a judgment (after retries):
# counted as failures and not cached, so a later run asks again.
REQUEST_FAILED = "request failed"
NO_VERDICT = "no PROCESS_SCORE line, also after the follow-up"
# A reply the token cap cut before its verdict, asked again with this many times the written reply's room.
CUT_VERDICT = "no PROCESS_SCORE line: the reply was cut at the token cap"
CUT_ROOM_FACTOR = 2
# The error of a judgment cached before evidence over the budget was cut to fit: the runner asks again.
EVIDENCE_TOO_LONG = "evidence too long"
WORST_SCORE = 0.0


class RequestFailed(Exception):
    """The endpoint gave no usable reply after its retries; the action stays unscored."""


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: tuple[TokenLogprob, ...] | None = None  # per generated token, when logprobs were returned
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cut: bool = False  # stopped by the token cap (finish_reason "length"), not by the model


def _expected_or(tokens: tuple[TokenLogprob, ...], parsed: float) -> float:
    value = expected_score(tokens)
    return parsed if value is None else value


# complete(messages) or complete(messages, reply_tokens): one reply, the written part within `reply_tokens`
# (default coach.max_tokens) on top of the thinking budget.
Complete = Callable[..., Awaitable[Reply]]


@dataclass(frozen=True)
class Fit:
    """The coach's prompt budget in tokens (None: no limit), how it counts a prompt's tokens, and the special
    strings of its tokenizer (broken up in agent text, `mappa.coach.prompts.Fence`)."""

    budget: int | None
    count: Callable[[ChatMessages], int]
    specials: tuple[str, ...] = ()


NO_LIMIT = Fit(None, lambda messages: 0)


def own_text(ctx: CoachContext) -> str:
    """What the judged action itself wrote: its output, and its tool call's output and file names."""
    parts = [ctx.output, ctx.observation]
    if ctx.exec_result is not None:
        r = ctx.exec_result
        parts += [r.stdout, r.stderr, *r.files_created, *r.files_changed]
    return "\n".join(parts)


def _visible(text: str) -> bool:
    return any(c.isprintable() and not c.isspace() for c in text)


def _unjudgeable(why: str) -> str:
    return f"[unjudgeable: {why}; scored {WORST_SCORE:g}, the worst] "


def _worst(why: str, **fields: object) -> CoachScore:
    """The worst score for an action judged unjudgeable before any request, the rationale saying why."""
    return CoachScore(score=WORST_SCORE, rationale=_unjudgeable(why).rstrip(), **fields)


def superseded(ctx: CoachContext, cached: CoachScore) -> bool:
    """Whether a cached judgment left the action unscored where the rule above now judges it: it is asked again."""
    if cached.score is not None or cached.error is None:
        return False
    return cached.error.startswith(EVIDENCE_TOO_LONG) or (
        cached.error.startswith(NO_VERDICT) and holds_marker(own_text(ctx))
    )


@dataclass
class _Asked:
    """What one judgment's requests returned so far: the raw text of its replies and their token counts."""

    raw: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, reply: Reply, label: str) -> Reply:
        self.raw = f"{self.raw}\n\n[{label}]\n{reply.text}" if label else reply.text
        self.prompt_tokens += reply.prompt_tokens
        self.completion_tokens += reply.completion_tokens
        return reply


async def _first_reply(complete: Complete, messages: ChatMessages, retry_tokens: int, asked: _Asked) -> Reply:
    """The first reply; when the token cap stopped it before its verdict (a thinking model may have spent the cap
    thinking), the same request once more with `retry_tokens` of room for the written reply."""
    reply = asked.add(await complete(messages), "")
    if reply.cut and parse_score(reply.text) is None:
        reply = asked.add(await complete(messages, retry_tokens), f"asked again with room for {retry_tokens}")
    return reply


def prompt_or_worst(
    ctx: CoachContext, template: Template, fit: Fit, *, backend: str, model: str
) -> tuple[ChatMessages, Cut] | CoachScore:
    """The judgment's prompt within the coach's budget and what it cut, or the worst score when nothing judgeable
    is left of the action (the rule above). Shared by every judge of a model-backed coach, the log-prob one too."""
    # Both deterministic, so cached like any judgment (a larger budget is a new key); no request is made.
    if not _visible(ctx.output):
        answer = False if ctx.is_final and ctx.ground_truth is not None else None  # no answer given is no right one
        return _worst("the output has no visible text", answer_correct=answer, backend=backend, model=model)
    try:
        return fit_prompt(ctx, template, fit.budget, fit.count, draw_fence(ctx, fit.specials))
    except EvidenceTooLong as e:
        why = f"its evidence does not fit the coach's budget even cut to {MIN_FIELD_CHARS} characters a field ({e})"
        return _worst(why, truncated_inputs=len(ctx.messages), backend=backend, model=model)


def cut_note(cut: Cut) -> str:
    """What the prompt left out, at the head of the rationale; "" when the coach saw everything."""
    said = cut.describe()
    return f"[evidence cut: {said}] " if said else ""


async def judge(
    ctx: CoachContext,
    template: Template,
    complete: Complete,
    *,
    backend: str,
    model: str,
    use_expected: bool,
    retry_tokens: int,
    fit: Fit = NO_LIMIT,
) -> CoachScore:
    """Score one action. Never raises for endpoint trouble: failures come back unscored with an error.

    `retry_tokens`: the written reply's room when a reply the token cap cut before its verdict is asked again.
    """
    t0 = time.perf_counter()
    asked = _Asked()
    final = ctx.is_final and ctx.ground_truth is not None
    prepared = prompt_or_worst(ctx, template, fit, backend=backend, model=model)
    if isinstance(prepared, CoachScore):
        return prepared
    messages, cut = prepared
    note = cut_note(cut)

    def result(score: float | None, error: str | None, text: str, why: str = "") -> CoachScore:
        return CoachScore(
            score=score,
            rationale=note + why + (rationale_of(text) if text else ""),
            raw_reply=asked.raw,
            error=error,
            answer_correct=parse_answer_correct(text) if final else None,
            latency_s=time.perf_counter() - t0,
            prompt_tokens=asked.prompt_tokens,
            completion_tokens=asked.completion_tokens,
            backend=backend,
            model=model,
            truncated_inputs=cut.messages,
        )

    def scored(score: float, reply: Reply, text: str) -> CoachScore:
        if use_expected and reply.tokens:
            score = _expected_or(reply.tokens, score)
        return result(score, None, text)

    try:
        reply = await _first_reply(complete, messages, retry_tokens, asked)
    except RequestFailed as e:
        return result(None, f"{REQUEST_FAILED}: {e}", "")
    score = parse_score(reply.text)
    if score is not None:
        return scored(score, reply, reply.text)
    if reply.cut:  # cut again with more room: a follow-up would be cut as well
        why = f"{CUT_VERDICT}, also with room for a {retry_tokens}-token reply (coach.max_tokens, thinking_budget)"
        return result(None, why, reply.text)

    # No unambiguous verdict (none, only mid-text, or contradicted by a quoted score): one follow-up asking for
    # exactly the required lines; the first reply stays as the rationale.
    follow = [*messages, {"role": "assistant", "content": reply.text}, follow_up_message(final)]
    try:
        second = asked.add(await complete(follow), "follow-up reply")
    except RequestFailed as e:
        return result(None, f"{REQUEST_FAILED} on the follow-up: {e}", reply.text)
    score = parse_score(second.text)
    if score is None:
        if holds_marker(own_text(ctx)):  # the action wrote the verdict's markers, which the coach echoes
            why = _unjudgeable("its own text holds the coach's verdict marker and no reply gave one unambiguously")
            return result(WORST_SCORE, None, reply.text, why)
        # "line": a verdict line (parse.verdict); a score only quoted or contradicted mid-reply is none.
        return result(None, NO_VERDICT, reply.text)
    judged = scored(score, second, reply.text if reply.text.strip() else second.text)
    if judged.answer_correct is None and final:
        judged = judged.model_copy(update={"answer_correct": parse_answer_correct(second.text)})
    return judged


class ChatCoach:
    """A coach backed by a chat model: `judge` over the backend's `complete`, within its context budget.

    Subclasses set `name`, `model`, `cfg`, `template`, `fit`, `context_tokens` and `endpoint`, and implement
    `complete` and `aclose`. Every reply passes through here: counted (replies, cut at the token cap, without the
    log-probs the expected score needs), and an endpoint that gives no log-probs although `coach.expected_score` asks
    for them is named once, in a warning, rather than once per action or never.
    """

    name: str
    model: str
    cfg: CoachConfig
    template: Template
    fit: Fit = NO_LIMIT
    context_tokens: int | None = None  # the context budget in force (coach.max_context_tokens or the default)
    endpoint: str = ""  # where replies come from, as a warning names it
    cacheable = True

    def __init__(self, cfg: CoachConfig, template: Template) -> None:
        self.cfg = cfg
        self.template = template
        self.version = template.version
        self.counters = CallCounters()
        self._warned_logprobs = False

    def prompt_budget(self, context_tokens: int | None, count: Callable[[ChatMessages], int]) -> int | None:
        """Prompt tokens left in a context of `context_tokens` once room is kept for the longest exchange: the
        thinking budget, and a first reply asked again with twice the room whose follow-up (that reply, the question
        and a second reply) must fit too. A follow-up that overflowed would leave exactly the actions with the most
        evidence unscored."""
        if context_tokens is None:
            return None
        mt = self.cfg.max_tokens
        kept = self.cfg.thinking_tokens + (CUT_ROOM_FACTOR + 1) * mt
        budget = context_tokens - kept - count([follow_up_message(True)])
        if budget < 64:
            raise MappaError(
                f"coach.max_context_tokens: {context_tokens} leaves {budget} tokens for the prompt after room for "
                f"coach.thinking_budget ({self.cfg.thinking_tokens}), {CUT_ROOM_FACTOR + 1} x coach.max_tokens={mt} "
                "(a reply asked again with more room, then followed up) and the follow-up question"
            )
        return budget

    async def complete(self, messages: ChatMessages, reply_tokens: int | None = None) -> Reply:
        raise NotImplementedError

    async def _complete_counted(self, messages: ChatMessages, reply_tokens: int | None = None) -> Reply:
        reply = await self.complete(messages, reply_tokens)
        c = self.counters
        c.replies += 1
        c.cut_replies += reply.cut
        if self.cfg.expected_score and reply.tokens is None:
            c.replies_without_logprobs += 1
            if not self._warned_logprobs:
                self._warned_logprobs = True
                warnings.warn(
                    f"mappa coach: coach.expected_score is on, but {self.endpoint or self.name} gives no token "
                    f"log-probs for {self.model!r}: every score is the number the coach wrote (the sampled score). "
                    "Set coach.expected_score: false to ask for that.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return reply

    async def score(self, ctx: CoachContext) -> CoachScore:
        return await judge(
            ctx,
            self.template,
            self._complete_counted,
            backend=self.name,
            model=self.model,
            use_expected=self.cfg.expected_score,
            retry_tokens=CUT_ROOM_FACTOR * self.cfg.max_tokens,
            fit=self.fit,
        )
