"""Continuous batching: a decode batch over one agent's weights that rows join and leave between steps.

`decoding(policy, agent)` opens a `Decoder` with that agent's weights active (under the policy's lock);
`Decoder.add` prefills new prompts and merges them into the running batch, `Decoder.step` samples one
token for every running row. The cache is made of `BufferedLayer`s, which reserve room for the tokens
still to come, and a `PrefixCache` lets a prompt that starts like an earlier one prefill only the rest.
The per-token bookkeeping (sampling, logprobs, when a row stops) is `mappa.policy.decoding.sample_step`, the policy's
own, so a row decodes exactly as it would in `Policy.generate`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from mappa.errors import MappaError
from mappa.policy.decoding import DecodeRow, Generation, Sampling, prefill_padded, sample_step, seeded_generator
from mappa.policy.kvcache import BufferedLayer, pad_left, stitchable
from mappa.policy.policy import Policy
from mappa.policy.prefix_cache import PrefixCache

Blocks = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per layer: blocks of rows, (keys (b, H, l, D), values)


@contextmanager
def decoding(
    policy: Policy,
    agent: str | None,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    prefix_cache: PrefixCache | None = None,
    sampler: bool = False,
) -> Iterator[Decoder]:
    """A `Decoder` for `agent` (None: the reference) and one sampling setting. The agent's weights stay
    active, under the policy's lock, until the block ends; use the decoder from the thread that opened it.
    `prefix_cache` reuses prompt KV across decoders; only for weights that no longer change. `sampler`: the
    agent's sampling copy where the policy keeps one (`Policy.sampler`), as `Policy.generate` decodes."""
    sampling = Sampling(temperature, top_p, seeded_generator(seed, policy.device))
    with torch.no_grad(), policy.sampler(agent) if sampler else policy.active(agent) as module:
        yield Decoder(policy, module, sampling, prefix_cache=prefix_cache, owner=agent)


class Decoder:
    """Batched decoding with a KV cache that sequences join (`add`) and leave between steps.

    `add` prefills new prompts and merges them into the running batch, left-padding whichever side is
    shorter; `step` samples one token for every running row and returns the rows that finished (EOS,
    or their own `max_new_tokens`) as `(key, Generation)`. Finished rows leave the cache, and padding
    columns no row needs any more are cut off, so a long-lived batch does not keep paying attention
    over departed prompts.
    """

    def __init__(
        self,
        policy: Policy,
        module: torch.nn.Module,
        sampling: Sampling,
        *,
        prefix_cache: PrefixCache | None = None,
        owner: str | None = None,
    ) -> None:
        self.policy = policy
        self.module = module
        self.sampling = sampling
        self.prefix_cache = prefix_cache
        self.owner = owner
        self._eos = frozenset(policy.eos_ids)
        self._rows: list[DecodeRow] = []
        self._cache: Any = None
        self._attn: torch.Tensor | None = None  # (B, L) 1 where a row has a real token
        self._pos: torch.Tensor | None = None  # (B,) position id of each row's next token
        self._logits: torch.Tensor | None = None  # (B, V) next-token logits, float32

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def width(self) -> int:
        """KV positions each row holds now (the longest row's prompt and tokens; shorter rows are padded)."""
        return 0 if self._attn is None else int(self._attn.shape[1])

    @property
    def can_add(self) -> bool:
        """False once rows are running in a cache that cannot be re-padded (sliding-window layers)."""
        return not self._rows or stitchable(self._cache)

    def add(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, keys: Sequence[Any], top_logprobs: int = 0,
        seeds: Sequence[int | None] | None = None,
    ) -> None:  # fmt: skip
        """Prefill `prompts` (token ids) and add them to the batch; `keys` identify them in `step`'s results.
        `seeds`: a row with a seed samples from its own generator (the same tokens whatever batch it is in);
        rows without one share the decoder's sampling."""
        if len(keys) != len(prompts) or (seeds is not None and len(seeds) != len(prompts)):
            raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
        if max_new_tokens < 1:
            raise MappaError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if not prompts:
            return
        if not self.can_add:
            raise RuntimeError("this model's cache cannot take new rows mid-batch; wait for the batch to finish")
        prompts = [list(p) for p in prompts]
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt")
        gens = [seeded_generator(seed, self.policy.device) for seed in seeds or [None] * len(keys)]
        done = _prefill_blocks(self.module, prompts, self.prefix_cache, self.owner)
        if done is None:  # sliding-window layers: one padded batch that takes no newcomers
            self._cache, self._logits, self._attn, self._pos = prefill_padded(self.module, prompts, self.policy.pad_id)
            self._rows = [
                DecodeRow(k, p, max_new_tokens, top_logprobs, generator=g)
                for k, p, g in zip(keys, prompts, gens, strict=True)
            ]
            return
        order, blocks, container, logits = done
        rows = [DecodeRow(keys[i], prompts[i], max_new_tokens, top_logprobs, generator=gens[i]) for i in order]
        lengths = torch.tensor([len(prompts[i]) for i in order], device=logits.device)
        width = int(lengths.max())
        attn = (torch.arange(width, device=logits.device)[None, :] >= (width - lengths)[:, None]).long()
        if not self._rows:
            self._rows, self._cache, self._logits, self._attn, self._pos = rows, container, logits, attn, lengths
            self._reserve(blocks, width)
            return
        L = max(self.width, width)
        self._rows.extend(rows)
        self._reserve([[(a.keys, a.values), *b] for a, b in zip(self._cache.layers, blocks, strict=True)], L)
        self._attn = torch.cat([pad_left(self._attn, L, 1), pad_left(attn, L, 1)])
        self._pos = torch.cat([self._pos, lengths])
        self._logits = torch.cat([self._logits, logits])

    def _reserve(self, blocks: Blocks, width: int) -> None:
        """New cache layers from blocks of rows per layer (see `BufferedLayer`), `width` columns wide,
        with room for every running row's remaining tokens."""
        spare = max(r.max_new_tokens - len(r.tokens) for r in self._rows)
        self._cache.layers[:] = [BufferedLayer(layer_blocks, width, spare) for layer_blocks in blocks]

    def step(self) -> list[tuple[Any, Generation]]:
        """Sample the next token of every running row; return the rows that finished with it."""
        if not self._rows:
            return []
        tok, finished, keep = sample_step(self._rows, self._logits, self.sampling, self._eos, self.policy.tokenizer)
        if not keep:
            self._rows, self._cache, self._attn, self._pos, self._logits = [], None, None, None, None
            return finished
        if len(keep) < len(self._rows):
            self._select(keep)
            tok = tok[keep]
        self._attn = torch.cat([self._attn, self._attn.new_ones(len(keep), 1)], dim=1)
        out = self.module(
            input_ids=tok[:, None],
            attention_mask=self._attn,
            position_ids=self._pos[:, None],
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = out.past_key_values
        self._logits = out.logits[:, -1].float()
        self._pos = self._pos + 1
        return finished

    def drop(self, keys: Collection[Any]) -> None:
        """Take the rows with these keys out of the batch between steps (their callers went away); their KV
        room is given back as if they had finished."""
        keys = set(keys)
        keep = [j for j, r in enumerate(self._rows) if r.key not in keys]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._attn, self._pos, self._logits = [], None, None, None, None
            return
        self._logits = self._logits[torch.tensor(keep, device=self._logits.device)]
        self._select(keep)

    def running(self) -> list[DecodeRow]:
        """The rows still decoding, with the tokens (and logprobs) sampled so far."""
        return list(self._rows)

    def _select(self, keep: list[int]) -> None:
        """Keep only rows `keep`, then drop leading columns that are padding for every remaining row."""
        idx = torch.tensor(keep, device=self._attn.device)
        self._rows = [self._rows[j] for j in keep]
        self._attn, self._pos = self._attn[idx], self._pos[idx]
        if not stitchable(self._cache):
            self._cache.batch_select_indices(idx)
            return
        first = int(self._attn.any(dim=0).long().argmax())
        self._attn = self._attn[:, first:]
        # one block per kept row: views, so each row is copied once, straight into the new buffer
        self._reserve(
            [
                [(x.keys[j : j + 1, :, first:], x.values[j : j + 1, :, first:]) for j in keep]
                for x in self._cache.layers
            ],
            self._attn.shape[1],
        )


def _prefill_blocks(
    module: torch.nn.Module, prompts: list[list[int]], prefix_cache: PrefixCache | None, owner: str | None
) -> tuple[list[int], Blocks, Any, torch.Tensor] | None:
    """Prefill without padding: (row order, KV blocks per layer in that order, a cache object to hold the
    layers, last-position logits (B, V) float32 in that order), or None for caches that cannot be stitched.

    Prompts of equal length run together (no mask keeps CPU attention on its fused kernel; see
    `mappa.policy.decoding.prefill`); a prompt that starts like a cached one runs alone on the cached KV, and
    every prompt's KV is offered to the prefix cache. The blocks go straight into `BufferedLayer`s,
    with no left-padded intermediate.
    """
    device = next(module.parameters()).device
    jobs: list[tuple[list[int], int, Any]] = []  # (rows, tokens already cached, cached KV per layer)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        hit = prefix_cache.lookup(owner, p) if prefix_cache is not None else None
        if hit is not None:
            jobs.append(([i], *hit))
        else:
            groups.setdefault(len(p), []).append(i)
    jobs += [(idx, 0, None) for idx in groups.values()]
    order: list[int] = []
    outs = []
    for idx, cached, kv in jobs:
        ids = torch.tensor([prompts[i][cached:] for i in idx], dtype=torch.long, device=device)
        past = DynamicCache(ddp_cache_data=kv) if kv is not None else None
        out = module(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        if not stitchable(out.past_key_values):
            return None
        if prefix_cache is not None:
            for j, i in enumerate(idx):
                layers = out.past_key_values.layers
                prefix_cache.store(owner, prompts[i], [(x.keys[j : j + 1], x.values[j : j + 1]) for x in layers])
        order += idx
        outs.append(out)
    n_layers = len(outs[0].past_key_values.layers)
    blocks = [
        [(o.past_key_values.layers[n].keys, o.past_key_values.layers[n].values) for o in outs] for n in range(n_layers)
    ]
    logits = torch.cat([o.logits[:, -1].float() for o in outs])
    return order, blocks, outs[0].past_key_values, logits
