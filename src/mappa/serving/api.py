"""The OpenAI-compatible wire format of `mappa serve`: request bodies, response bodies, server-sent events.

Token ids, as vLLM returns them: `return_token_ids: true` adds `prompt_token_ids` to the response (the first
chunk when streaming) and `token_ids` to the choice (each chunk's new tokens when streaming; the stop token
included, the ids a trainer computes log-probs on); `return_tokens_as_token_ids: true` writes logprob
tokens as `token_id:<id>`. The stop token is left out of `logprobs.content`, as OpenAI does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from mappa.policy.decoding import Generation

MAX_TOP_LOGPROBS = 20


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str = ""


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")  # `name`, `tool_call_id`, ...: see `unsupported_field`
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionIn(BaseModel):
    # Other fields land in `model_extra`; `unsupported_field` accepts those that cannot change the reply.
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[Any] | None = None
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids in the response
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>"
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and SGLang's: the chat template's extra variables


def _off(*neutral: Any) -> Callable[[Any], bool]:
    """A check that a field holds a value that leaves the reply as it is (absent, empty, or one of `neutral`)."""
    return lambda v: v is None or v == [] or v == {} or any(type(v) is type(n) and v == n for n in neutral)


# Fields that cannot change the reply (bookkeeping, scheduling, caching): accepted and ignored.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls",
    "request_id", "priority", "cache_salt",
})  # fmt: skip

# Fields that would change the reply and are not implemented: accepted only at their neutral value.
_NEUTRAL = {
    "frequency_penalty": _off(0, 0.0), "presence_penalty": _off(0, 0.0), "repetition_penalty": _off(1, 1.0),
    "logit_bias": _off(), "response_format": _off({"type": "text"}), "tool_choice": _off("none", "auto"),
    "functions": _off(), "function_call": _off("none", "auto"), "reasoning_effort": _off(), "verbosity": _off(),
    "modalities": _off(["text"]), "audio": _off(), "prediction": _off(), "web_search_options": _off(),
    "chat_template": _off(), "top_k": _off(0, -1), "min_p": _off(0, 0.0),
    "min_tokens": _off(0), "ignore_eos": _off(False), "stop_token_ids": _off(), "best_of": _off(1),
    "use_beam_search": _off(False), "length_penalty": _off(1, 1.0), "include_stop_str_in_output": _off(False),
    "skip_special_tokens": _off(True), "spaces_between_special_tokens": _off(True), "echo": _off(False),
    "add_generation_prompt": _off(True), "continue_final_message": _off(False), "add_special_tokens": _off(False),
    "truncate_prompt_tokens": _off(), "documents": _off(), "bad_words": _off(), "allowed_token_ids": _off(),
    "logits_processors": _off(), "prompt_logprobs": _off(), "mm_processor_kwargs": _off(),
    "structured_outputs": _off(), "guided_json": _off(), "guided_regex": _off(), "guided_choice": _off(),
    "guided_grammar": _off(), "guided_decoding_backend": _off(), "guided_whitespace_pattern": _off(),
}  # fmt: skip

# apply_chat_template's own arguments, which a request's chat_template_kwargs may not set.
TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tokenize", "add_generation_prompt"})

# Message fields the chat template would need and the server drops: only accepted empty.
_MESSAGE_NEUTRAL = {"tool_calls": _off(), "function_call": _off(), "audio": _off()}


def unsupported_field(req: ChatCompletionIn) -> tuple[str, str] | None:
    """(field, why) for the first field that would change the reply and is not implemented, else None. A field
    this server does not know is refused too: it may be one that changes the reply."""
    for name, value in (req.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name not in _NEUTRAL:
            return name, f"{name}: unknown field (mappa serve refuses what it does not implement)"
        if not _NEUTRAL[name](value):
            return name, f"{name}: not supported by mappa serve (it would change the reply)"
    taken = sorted(set(req.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
    if taken:
        return "chat_template_kwargs", f"chat_template_kwargs: {', '.join(taken)} is the server's to set"
    checks = {"n": req.n == 1, "stop": not req.stop, "tools": not req.tools}
    for name, ok in checks.items():
        if not ok:
            return name, f"{name}: not supported by mappa serve (only n=1, no stop sequences, no tools)"
    for i, m in enumerate(req.messages):
        for name, value in (m.model_extra or {}).items():
            if name in _MESSAGE_NEUTRAL and not _MESSAGE_NEUTRAL[name](value):
                return f"messages[{i}].{name}", f"messages[{i}].{name}: not supported by mappa serve"
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                where = f"messages[{i}].content[{j}].type"
                return where, f"{where}: only text parts are supported (got {part.type!r})"
    return None


class LoadLoRAIn(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # replace an adapter already loaded under this name


class UnloadLoRAIn(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenText(Protocol):
    def token_text(self, token_id: int) -> str: ...


def logprobs_content(
    ids: Sequence[int], lps: Sequence[float], tops: Sequence[Any] | None, req: ChatCompletionIn, engine: TokenText,
    eos: frozenset[int],
) -> list[dict[str, Any]]:  # fmt: skip
    """OpenAI's `logprobs.content`: one entry per token, the stop token left out (as OpenAI does)."""

    def text(tid: int) -> str:
        return f"token_id:{tid}" if req.return_tokens_as_token_ids else engine.token_text(tid)

    k = req.top_logprobs or 0
    content = []
    for pos, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
        if tid in eos:
            continue
        top = []
        if k and tops:
            for alt, alp in tops[pos][:k]:
                top.append({"token": text(alt), "logprob": alp, "bytes": list(text(alt).encode("utf-8"))})
        token = text(tid)
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode("utf-8")), "top_logprobs": top})
    return content


def completion(req: ChatCompletionIn, gen: Generation, engine: TokenText, eos: frozenset[int]) -> dict[str, Any]:
    """The chat.completion body for one generation."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": gen.text},
        "finish_reason": "length" if gen.truncated else "stop",
        "logprobs": None,
    }
    if req.logprobs:
        content = logprobs_content(gen.response_ids, gen.logprobs, gen.top_logprobs, req, engine, eos)
        choice["logprobs"] = {"content": content, "refusal": None}
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": _usage(gen),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = list(gen.prompt_ids)
        choice["token_ids"] = list(gen.response_ids)
    return body


def _usage(gen: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": len(gen.prompt_ids),
        "completion_tokens": len(gen.response_ids),
        "total_tokens": len(gen.prompt_ids) + len(gen.response_ids),
    }


class _Chunks:
    """The chat.completion.chunk events of one streamed reply, and the text sent so far."""

    def __init__(self, req: ChatCompletionIn, tokenizer: Any, engine: TokenText, eos: frozenset[int]) -> None:
        self.req, self.tokenizer, self.engine, self.eos = req, tokenizer, engine, eos
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.tokens: list[int] = []
        self.sent_text = ""

    def event(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None), "finish_reason": finish}
        choice.update(extra.pop("choice", {}))
        body = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
            "choices": [choice], **extra,
        }  # fmt: skip
        return f"data: {json.dumps(body)}\n\n"

    def tokens_event(self, ids: list[int], lps: list[float], tops: list[Any], final_text: str | None) -> str | None:
        """An event for newly sampled tokens: the text they add (held back while it ends inside a UTF-8
        character), their logprobs and ids when asked; None when there is nothing to send."""
        self.tokens += ids
        if final_text is None:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            text = "" if text.endswith("\ufffd") else text
        else:
            text = final_text
        delta = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        self.sent_text += delta
        extra: dict[str, Any] = {}
        if self.req.logprobs and ids:
            content = logprobs_content(ids, lps, tops, self.req, self.engine, self.eos)
            extra["logprobs"] = {"content": content, "refusal": None}
        if self.req.return_token_ids and ids:
            extra["choice"] = {"token_ids": ids}
        if not delta and not extra:
            return None
        return self.event({"content": delta}, **extra)


async def stream_events(
    req: ChatCompletionIn, chunks: AsyncIterator[Any], tokenizer: Any, engine: TokenText, eos: frozenset[int],
    prompt_ids: list[int] | None = None,
) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events as OpenAI sends them: a first chunk with the role (and `prompt_token_ids` when
    given), content deltas, a last chunk with the finish reason, the usage when
    `stream_options.include_usage`, then `data: [DONE]`. `chunks`: `ChatEngine.chat_stream`'s items. An error
    after the stream began becomes an `error` event (the status line has gone out already)."""
    out = _Chunks(req, tokenizer, engine, eos)
    yield out.event({"role": "assistant", "content": ""}, **({"prompt_token_ids": prompt_ids} if prompt_ids else {}))
    try:
        async for item in chunks:
            if not isinstance(item, Generation):
                event = out.tokens_event(*item, final_text=None)
            else:  # the whole reply: whatever its last step added, then the finish reason
                rest = slice(len(out.tokens), len(item.response_ids))
                tops = list(item.top_logprobs[rest]) if item.top_logprobs else []
                event = out.tokens_event(list(item.response_ids[rest]), list(item.logprobs[rest]), tops, item.text)
            if event is not None:
                yield event
            if isinstance(item, Generation):
                yield out.event({}, "length" if item.truncated else "stop")
                if req.stream_options is not None and req.stream_options.include_usage:
                    body = {"id": out.id, "object": "chat.completion.chunk", "created": out.created,
                            "model": req.model, "choices": [], "usage": _usage(item)}  # fmt: skip
                    yield f"data: {json.dumps(body)}\n\n"
    except Exception as e:  # noqa: BLE001 - reported in the stream; the server keeps running
        error = {"message": f"generation failed: {type(e).__name__}: {e}", "type": "server_error", "code": None}
        yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"
