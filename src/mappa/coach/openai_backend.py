"""Any OpenAI-compatible chat-completions endpoint as the coach (OpenAI, Gemini, Anthropic, vLLM, SGLang, Ollama, `mappa serve`).

The SDK's own retries are switched off so that every request is counted: this module retries 429,
5xx, timeouts and connection errors itself, with exponential backoff and full jitter, honouring the
server's Retry-After. A request that still fails leaves the action unscored (never a made-up score).
Wrong credentials, model or URL (401/403/404) are configuration errors and stop the run with a
one-line message instead of silently leaving a day of actions unscored.

Every prompt is counted offline (`mappa.coach.tokens`) and fitted to a context budget less the reply's
`coach.max_tokens`: `coach.max_context_tokens`, else `DEFAULT_CONTEXT_TOKENS`, so that evidence flooded by
an agent (thousands of file names, a huge output) is cut to fit instead of sent whole. An endpoint that still
answers that a prompt exceeds its context (HTTP 400) has a smaller context than the budget: that stops the
run, since only the actions with the most evidence would go unscored.

A thinking model spends its thinking inside the request's token cap, so the cap is the thinking budget plus the
written reply's room (`coach.thinking_budget` + `coach.max_tokens`), and the budget and effort go out as each API
names them (`token_fields`); which API is read from `coach.base_url` (`thinking_api`). A reply that stopped at the
cap (finish_reason "length") is marked cut, and `judge` asks again with more room.
"""

from __future__ import annotations

import asyncio
import email.utils
import ipaddress
import os
import random
import re
import time
from typing import Any
from urllib.parse import urlparse

import openai

from mappa.coach.judge import ChatCoach, Fit, Reply, RequestFailed
from mappa.coach.parse import TokenLogprob
from mappa.coach.prompts import ChatMessages, Template
from mappa.config import CoachConfig
from mappa.errors import MappaError

OPENAI_URL = "https://api.openai.com/v1"
TOP_LOGPROBS = 20  # the most OpenAI and vLLM (by default) return; enough for all 11 score values
MAX_RETRY_AFTER_S = 300.0
# The context assumed for an endpoint when coach.max_context_tokens is unset: what any current chat model
# takes. Counted in UTF-8 bytes when no tokenizer is on disk, it admits about 32 KB of prompt.
DEFAULT_CONTEXT_TOKENS = 32_768
# How servers word a prompt longer than the model's context (OpenAI, vLLM, SGLang, Anthropic, Gemini, mappa serve).
_CONTEXT_OVERFLOW_RE = re.compile(
    r"context[ _]?(?:length|window|is \d)|maximum context|too long|too many tokens|exceeds the maximum", re.IGNORECASE
)


def _host_in(url: str, domain: str) -> bool:
    host = urlparse(url).hostname or ""
    return host == domain or host.endswith("." + domain)


def thinking_api(base_url: str) -> str:
    """How the endpoint names the thinking settings: "gemini" (Google's OpenAI-compatible API, Vertex's too),
    "anthropic" (Anthropic's OpenAI SDK layer), else "openai" (OpenAI, vLLM, SGLang, Ollama, mappa serve, gateways)."""
    if _host_in(base_url, "googleapis.com"):
        return "gemini"
    if _host_in(base_url, "anthropic.com"):
        return "anthropic"
    return "openai"


def token_fields(cfg: CoachConfig, api: str, reply_tokens: int | None = None) -> dict[str, Any]:
    """The request body's fields that cap the reply and set the thinking, as `api` names them.

    Without thinking settings the request is as ever (`max_tokens`). With them the cap is the thinking room plus the
    written reply's (`reply_tokens`, default coach.max_tokens): OpenAI's reasoning models take it only as
    `max_completion_tokens` and take no budget; Gemini takes a budget in `extra_body.google.thinking_config` (the
    JSON field really is named extra_body), or an effort; Anthropic takes `thinking.budget_tokens` and ignores the
    effort.
    """
    room = cfg.max_tokens if reply_tokens is None else reply_tokens
    if cfg.thinking_budget is None and not cfg.reasoning_effort:
        return {"max_tokens": room}
    fields: dict[str, Any] = {"max_completion_tokens" if api == "openai" else "max_tokens": cfg.reply_cap(room)}
    if cfg.reasoning_effort:
        fields["reasoning_effort"] = cfg.reasoning_effort
    budget = cfg.thinking_budget
    if budget is not None and api == "gemini":
        fields["extra_body"] = {"google": {"thinking_config": {"thinking_budget": budget}}}
    elif budget is not None and api == "anthropic":
        fields["thinking"] = {"type": "enabled", "budget_tokens": budget} if budget else {"type": "disabled"}
    return fields


def check_thinking(cfg: CoachConfig, api: str) -> None:
    """Thinking settings the endpoint would refuse stop the run before any request, naming the field."""
    if api == "gemini" and cfg.thinking_budget is not None and cfg.reasoning_effort:
        raise MappaError(
            "coach.reasoning_effort: Gemini takes either it or coach.thinking_budget, not both (its efforts are "
            "thinking budgets: low 1024, medium 8192, high 24576 tokens)"
        )
    if api == "anthropic" and cfg.thinking_budget is not None and 0 < cfg.thinking_budget < 1024:
        raise MappaError(
            f"coach.thinking_budget: Anthropic takes at least 1024 (or 0: thinking off), not {cfg.thinking_budget}"
        )


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def retry_after_s(headers: Any) -> float | None:
    """Seconds the server asked us to wait (`retry-after-ms`, `retry-after` as seconds or HTTP date)."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class OpenAICoach(ChatCoach):
    name = "openai"
    backoff_base_s = 0.5  # first retry waits U(0, 0.5) s, then U(0, 1), U(0, 2), ... capped at backoff_cap_s
    backoff_cap_s = 30.0

    def __init__(self, cfg: CoachConfig, template: Template) -> None:
        if not cfg.model:
            raise MappaError("coach.model: the openai backend needs a model name (e.g. coach.model=gpt-4o-mini)")
        super().__init__(cfg, template)
        self.model = cfg.model
        from mappa.coach.tokens import token_counter

        self.context_tokens = cfg.max_context_tokens or DEFAULT_CONTEXT_TOKENS
        count, self.counted_by, specials = token_counter(cfg.tokenizer, cfg.model)
        self.fit = Fit(self.prompt_budget(self.context_tokens, count), count, specials)
        self.base_url = self.endpoint = cfg.base_url or OPENAI_URL
        self.api = thinking_api(self.base_url)
        check_thinking(cfg, self.api)
        key = os.environ.get(cfg.api_key_env, "")
        if not key:
            if not is_loopback(self.base_url):
                raise MappaError(
                    f"coach.api_key_env: environment variable {cfg.api_key_env} is not set (needed for {self.base_url})"
                )
            key = "EMPTY"  # local servers (vLLM, Ollama, mappa serve) accept any key
        self._api_key = key
        self._logprobs = cfg.expected_score
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, openai.AsyncOpenAI]] = {}

    def _client(self) -> openai.AsyncOpenAI:
        # An async HTTP client belongs to one event loop; keep one per loop.
        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is None or entry[0] is not loop:
            client = openai.AsyncOpenAI(
                base_url=self.base_url, api_key=self._api_key, timeout=self.cfg.timeout_s, max_retries=0
            )
            self._clients[id(loop)] = (loop, client)
            return client
        return entry[1]

    def _backoff(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.backoff_cap_s, self.backoff_base_s * 2**attempt))

    async def _request(self, messages: ChatMessages, reply_tokens: int | None) -> Any:
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.cfg.temperature}
        if self._logprobs:
            kwargs.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        # The cap and thinking fields go into the JSON body as written, whatever the SDK calls them.
        extra = token_fields(self.cfg, self.api, reply_tokens)
        return await self._client().chat.completions.create(**kwargs, extra_body=extra)

    async def complete(self, messages: ChatMessages, reply_tokens: int | None = None) -> Reply:
        """One chat completion with retries; raises RequestFailed when it gives up."""
        last = ""
        attempt = 0
        while True:
            self.counters.calls += 1
            wait: float | None = None
            asked_logprobs = self._logprobs
            try:
                resp = await self._request(messages, reply_tokens)
            except openai.APIStatusError as e:
                code = e.status_code
                if code == 400 and asked_logprobs and "logprob" in str(e).lower():
                    # The server does not do logprobs: carry on without the expected score.
                    self._logprobs = False
                    continue
                if code == 400 and _CONTEXT_OVERFLOW_RE.search(str(e.message)):
                    # Only the prompts with the most evidence overflow: left unscored they would be skipped, so a
                    # budget over the endpoint's context stops the run like a wrong URL.
                    raise MappaError(
                        f"coach.max_context_tokens: {self.base_url} rejected a prompt as longer than {self.model!r}'s "
                        f"context (HTTP 400: {_short(e.message)}); set it to the endpoint's context (it is "
                        f"{self.context_tokens}), or name the model's tokenizer (coach.tokenizer)"
                    ) from None
                if code in (401, 403, 404):
                    raise MappaError(
                        f"coach: {self.base_url} answered HTTP {code} for model {self.model!r} "
                        f"(check coach.base_url, coach.model and ${self.cfg.api_key_env})"
                    ) from None
                if code not in (408, 409, 429) and code < 500:
                    self.counters.failures += 1
                    raise RequestFailed(f"HTTP {code}: {_short(e.message)}") from None
                last = f"HTTP {code}"
                wait = retry_after_s(e.response.headers)
            except openai.APITimeoutError:
                last = f"timed out after {self.cfg.timeout_s:g} s"
            except openai.APIConnectionError as e:
                # Refused, reset or unresolvable: the server may be restarting, so it is retried like a 503;
                # the reason names the URL, since a wrong coach.base_url is the usual cause when it persists.
                last = f"cannot connect to {self.base_url} ({_short(str(e.__cause__ or e))})"
            except (openai.APIResponseValidationError, ValueError) as e:
                self.counters.failures += 1
                raise RequestFailed(f"invalid response: {_short(str(e))}") from None
            else:
                try:
                    return _to_reply(resp)
                except RequestFailed:
                    self.counters.failures += 1
                    raise
            if attempt >= self.cfg.max_retries:
                self.counters.failures += 1
                raise RequestFailed(f"{last}; gave up after {attempt + 1} attempts")
            delay = min(wait, MAX_RETRY_AFTER_S) if wait is not None else self._backoff(attempt)
            await asyncio.sleep(delay)
            attempt += 1
            self.counters.retries += 1

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._clients.pop(id(loop), None)
        if entry is not None and entry[0] is loop:
            await entry[1].close()


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _to_reply(resp: Any) -> Reply:
    """A ChatCompletion -> Reply; anything else (a proxy's HTML page, garbage) is a failed request."""
    if not isinstance(resp, openai.types.chat.ChatCompletion) or not resp.choices:
        raise RequestFailed(f"invalid response: {_short(repr(resp))}")
    choice = resp.choices[0]
    text = choice.message.content or ""
    tokens = None
    if choice.logprobs is not None and choice.logprobs.content:
        tokens = tuple(
            TokenLogprob(t.token, t.logprob, tuple((a.token, a.logprob) for a in (t.top_logprobs or ())))
            for t in choice.logprobs.content
        )
    usage = resp.usage
    return Reply(
        text=text,
        tokens=tokens,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        cut=choice.finish_reason == "length",
    )
