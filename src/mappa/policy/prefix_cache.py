"""Prompt KV kept across requests, so that a prompt starting like an earlier one prefills only the rest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class PrefixCache:
    """Prompt KV kept after prefill, so that a prompt starting with the same tokens prefills only the rest.

    What it saves: a coach follow-up repeats the whole first request (only the reply and one line are
    new); every coach request starts with the same rubric; agents of one task share a system prompt.
    Entries are per owner (agent name, None for the base), least recently used go first once the
    stored KV passes `max_bytes`, and an entry that is a prefix of a newer one is dropped (the newer
    one covers it). Only for weights that do not change while the cache lives (serving, coaching).
    Counters: `hits`, `misses`, `tokens_reused`.
    """

    def __init__(self, max_bytes: int, min_tokens: int = 32) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens  # shorter shared prefixes are not worth a separate prefill
        self._entries: OrderedDict[int, tuple[str | None, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = (
            OrderedDict()
        )
        self._next = 0
        self.bytes = 0
        self.hits = self.misses = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, owner: str | None, prompt: Sequence[int]
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """(n, KV per layer of the first n tokens) for the longest cached prefix of `prompt`, or None.
        n stops one short of the whole prompt: the last token must run to give the next-token logits."""
        query = torch.tensor(list(prompt), dtype=torch.long)
        best, best_key = 0, None
        for key, (who, tokens, _) in self._entries.items():
            if who != owner:
                continue
            m = min(len(tokens), len(query) - 1)
            same = tokens[:m] == query[:m]
            n = m if bool(same.all()) else int(same.logical_not().nonzero()[0])
            if n > best:
                best, best_key = n, key
        if best < self.min_tokens or best_key is None:
            self.misses += 1
            return None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best
        kv = self._entries[best_key][2]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in kv]

    def store(self, owner: str | None, prompt: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the (1, H, L, D) keys and values per layer of `prompt` (copied: the caller's tensors stay free)."""
        if len(prompt) < self.min_tokens:
            return
        size = sum(k.nbytes + v.nbytes for k, v in kv)
        if size > self.max_bytes:
            return
        tokens = torch.tensor(list(prompt), dtype=torch.long)
        for key, (who, old, _) in list(self._entries.items()):
            if who == owner and len(old) <= len(tokens) and bool((tokens[: len(old)] == old).all()):
                self._drop(key)
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = (owner, tokens, [(k.clone(), v.clone()) for k, v in kv])
        self._next += 1
        self.bytes += size

    def forget(self, owner: str | None) -> None:
        """Drop every entry of `owner` (its weights changed: an adapter unloaded or loaded anew under its name)."""
        for key, (who, _, _) in list(self._entries.items()):
            if who == owner:
                self._drop(key)

    def _drop(self, key: int) -> None:
        _, _, kv = self._entries.pop(key)
        self.bytes -= sum(k.nbytes + v.nbytes for k, v in kv)
