"""Counting a coach prompt's tokens offline, for a coach behind an endpoint (`coach.max_context_tokens`).

The count must never come out lower than the coach model's own, or a prompt cut "to fit" would still
overflow. In order of preference:
- the tokenizer named by `coach.tokenizer`, else the coach model's own (`coach.model` as a local HF
  directory or a hub id already in the local cache; nothing is downloaded), with its chat template;
- otherwise UTF-8 bytes plus a margin per message for the chat template's special tokens: every token
  of a byte-level BPE or SentencePiece vocabulary covers at least one byte, so this is an upper bound on
  any such model's count (about 3-4x the real count for English text, so cuts come early, never late).
"""

from __future__ import annotations

from collections.abc import Callable

from mappa.errors import MappaError

ChatMessages = list[dict[str, str]]

MESSAGE_MARGIN = 8  # role header and separators of one chat message, in tokens (ChatML uses about 4)
PROMPT_MARGIN = 16  # BOS, generation prompt and the like


def byte_count(messages: ChatMessages) -> int:
    """An upper bound on any byte-level tokenizer's count of `messages`, chat template included."""
    return PROMPT_MARGIN + sum(len(m["content"].encode("utf-8")) + MESSAGE_MARGIN for m in messages)


def _load(name: str) -> object | None:
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, KeyError):  # not a local directory, not in the cache, or not a tokenizer
        return None


def _counter(tokenizer: object) -> Callable[[ChatMessages], int]:
    def count(messages: ChatMessages) -> int:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return PROMPT_MARGIN + sum(len(tokenizer(m["content"])["input_ids"]) + MESSAGE_MARGIN for m in messages)

    return count


def special_strings(tokenizer: object) -> tuple[str, ...]:
    """The strings `tokenizer` reads as its special tokens wherever they stand in a text (a chat turn's end...)."""
    return tuple(tokenizer.all_special_tokens)


def token_counter(tokenizer: str, model: str) -> tuple[Callable[[ChatMessages], int], str, tuple[str, ...]]:
    """(count, what counts, its special strings): `tokenizer` when given (it must load), else `model`'s own, else
    UTF-8 bytes (and no special strings known)."""
    if tokenizer:
        loaded = _load(tokenizer)
        if loaded is None:
            raise MappaError(f"coach.tokenizer: no tokenizer at {tokenizer!r} (a local HF dir or a cached hub id)")
        return _counter(loaded), f"tokenizer {tokenizer}", special_strings(loaded)
    loaded = _load(model) if model else None
    if loaded is not None:
        return _counter(loaded), f"tokenizer {model}", special_strings(loaded)
    return byte_count, "UTF-8 bytes", ()
