"""Decoding steps: prefill, sample one token per row, decode a batch to the end.

`Policy.generate` runs `decode`, a plain batched loop (unpadded prefill, finished rows leave the batch).
The serving package builds continuous batching (rows joining mid-batch, KV layers with reserved room, the
prefix cache) on the same `prefill_padded` and `sample_step`, so a row decodes there exactly as it does here.

Logprobs are those of the distribution the tokens were drawn from: the logits divided by the sampling
temperature (`scaled_logits`; before top-p, whose truncation is left out as in TRL and verl). Temperature 0
(greedy) has no distribution of its own: its log-probs are the raw logits'.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from mappa.errors import MappaError
from mappa.policy.kvcache import BufferedLayer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What a prefill hands to the decode loop: (KV cache, last-position logits (B, V) float32, attention mask (B, L),
# next position id (B,)).
Prefilled = tuple[Cache, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Generation:
    """One sampled response. Token-level fields have one entry per response token."""

    prompt_ids: tuple[int, ...]  # (P,) chat-templated prompt
    response_ids: tuple[int, ...]  # (T,) sampled tokens, EOS included when generated
    logprobs: tuple[float, ...]  # (T,) log pi(a_t | s) at the sampling temperature (`scaled_logits`)
    text: str  # decoded response without special tokens
    truncated: bool  # hit max_new_tokens without EOS
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None  # (T, k) (token_id, logprob) when asked


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: temperature 0 is greedy; `generator` seeds sampling (None: torch's global RNG)."""

    temperature: float = 1.0
    top_p: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class DecodeRow:
    """One sequence being decoded: its prompt, cap, and the tokens sampled so far with their logprobs."""

    key: Hashable  # what the caller gets back with the finished Generation
    prompt: list[int]
    max_new_tokens: int
    top_k: int = 0  # top_logprobs kept per token
    # The row's own sampler: it draws the same tokens whatever else is in the batch (None: the batch's `Sampling`)
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    def generation(self, tokenizer: PreTrainedTokenizerBase, stopped: bool) -> Generation:
        return Generation(
            prompt_ids=tuple(self.prompt),
            response_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            text=tokenizer.decode(self.tokens, skip_special_tokens=True),
            truncated=not stopped,
            top_logprobs=tuple(self.tops) if self.top_k else None,
        )


def eos_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Stop tokens: the tokenizer's EOS and ChatML's <|im_end|> (turn end), when they exist."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end not in ids:
        ids.append(im_end)
    if not ids:
        raise MappaError("tokenizer has no EOS token and no <|im_end|>: generation could never stop")
    return tuple(ids)


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the distribution sampled at `temperature`: divided by it (as TRL and verl do for the loss),
    so log_softmax of the result is log pi_T. Temperature 0 (greedy) samples from no distribution: the raw
    logits stand in, which keeps the log-probs finite."""
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def response_layout(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Given responses laid out for one forward, as `prefill_padded` lays out prompts: prompts left-padded to a
    common length P, so every response starts at column P (the LM head then runs on response positions only),
    responses right-padded to the longest, T. Returns (input_ids (B, P+T), attention mask (B, P+T), position ids
    (B, P+T), response mask (B, T) True on response tokens)."""
    B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
    T = max(len(r) for r in response_ids)
    if min(len(p) for p in prompt_ids) == 0:
        raise ValueError("every prompt needs at least one token")
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros(B, P + T, dtype=torch.long, device=device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        input_ids[i, P - len(p) : P] = torch.tensor(list(p), dtype=torch.long)
        attn[i, P - len(p) : P + len(r)] = 1
        if r:
            input_ids[i, P : P + len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = True
    return input_ids, attn, (attn.cumsum(-1) - 1).clamp(min=0), mask


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log pi_T(target) from (B, T, V) float32 logits at the sampling temperature (`scaled_logits`), and
    with `entropy` the (B, T) entropy of pi_T (no gradient: a metric, so no graph over (B, T, V)); else None."""
    logits = scaled_logits(logits, temperature)
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - logz
    if not entropy:
        return logp, None
    with torch.no_grad():  # H = log Z - E_pi[logit]
        return logp, logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, rows: list[DecodeRow]
) -> torch.Tensor:
    """(b, V) logits -> (b,) token ids: greedy at temperature 0, else temperature + nucleus sampling. A row with a
    generator of its own draws from it alone; the others share `generator`.

    One uniform per row through the inverse of the row's CDF (float64, so even a 1e-12 token keeps its share):
    torch.multinomial draws V exponentials per row, 3-4x slower at the embedded model's vocabulary (bench_sampler.py).
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_i, sorted_p)
    u = torch.empty(len(rows), dtype=torch.float64, device=logits.device)
    shared = [j for j, r in enumerate(rows) if r.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared), generator=generator, dtype=torch.float64, device=logits.device)
    for j, r in enumerate(rows):
        if r.generator is not None:
            u[j] = torch.rand((), generator=r.generator, dtype=torch.float64, device=logits.device)
    return inverse_cdf(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(b, V) non-negative weights (any total), (b,) uniforms in [0, 1) -> (b,) the index where each row's CDF
    first exceeds its uniform times the total: index i with probability probs[i] / total (a 0 is never drawn)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    x = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def sample_step(
    rows: list[DecodeRow],
    logits: torch.Tensor,
    sampling: Sampling,
    eos: frozenset[int],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[torch.Tensor, list[tuple[Hashable, Generation]], list[int]]:
    """Sample one token for each row from its (B, V) float32 logits and record it in the row.

    Returns (the sampled tokens (B,), `(key, Generation)` of the rows that finished with this token (EOS or
    their own cap), indices of the rows still running). Logprobs (the sampled token's and the top ones) are
    those of the distribution sampled from: the logits at the sampling temperature (`scaled_logits`).
    """
    logp = torch.log_softmax(scaled_logits(logits, sampling.temperature), dim=-1)
    tok = _sample(logits, sampling.temperature, sampling.top_p, sampling.generator, rows)
    tok_lp = logp.gather(1, tok[:, None]).squeeze(1)
    k = min(max(r.top_k for r in rows), logp.shape[-1])
    if k:
        top_v, top_i = (t.tolist() for t in logp.topk(k, dim=-1))
    finished: list[tuple[Hashable, Generation]] = []
    keep: list[int] = []
    for j, (row, t, lp) in enumerate(zip(rows, tok.tolist(), tok_lp.tolist(), strict=True)):
        row.tokens.append(t)
        row.logprobs.append(lp)
        if row.top_k:
            row.tops.append(tuple(zip(top_i[j][: row.top_k], top_v[j][: row.top_k], strict=True)))
        if t in eos or len(row.tokens) >= row.max_new_tokens:
            finished.append((row.key, row.generation(tokenizer, stopped=t in eos)))
        else:
            keep.append(j)
    return tok, finished, keep


def decode(
    module: torch.nn.Module,
    rows: list[DecodeRow],
    sampling: Sampling,
    pad_id: int,
    eos_ids: Collection[int],
    tokenizer: PreTrainedTokenizerBase,
) -> list[tuple[Hashable, Generation]]:
    """Prefill the rows' prompts, then one forward per token until every row has stopped (at one of `eos_ids`
    or its own cap); returns `(key, Generation)` per row, in the order they finished.

    A finished row leaves the batch (and the cache); the cache grows by one column per step. The
    serving package's decoder also lets rows join mid-batch and writes into reserved room instead.
    """
    eos = frozenset(eos_ids)
    cache, logits, attn, pos = prefill(
        module, [r.prompt for r in rows], pad_id, spare=max(r.max_new_tokens for r in rows)
    )
    done: list[tuple[Hashable, Generation]] = []
    while True:
        tok, finished, keep = sample_step(rows, logits, sampling, eos, tokenizer)
        done += finished
        if not keep:
            return done
        if len(keep) < len(rows):
            idx = torch.tensor(keep, device=attn.device)
            rows = [rows[j] for j in keep]
            cache.batch_select_indices(idx)
            attn, pos, tok = attn[idx], pos[idx], tok[idx]
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
        out = module(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        cache, logits, pos = out.past_key_values, out.logits[:, -1].float(), pos + 1


# A prompt prefix shared by every row is run once when it is at least this long: below it, the extra forward
# costs more than the rows' repeated tokens.
MIN_SHARED_PREFIX = 16
# Rows of similar length share a forward while the padding stays under this share of its tokens.
MAX_PADDING = 0.2


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt has in common, leaving each at least one of its own."""
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def length_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Row indices sorted by length, `size` at a time: rows of similar length share a forward (less padding)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[start : start + size] for start in range(0, len(order), size)]


def check_context(prompts: Sequence[Sequence[int]], max_context_tokens: int | None, who: str) -> None:
    """Refuse a prompt longer than the context: it is never cut silently (the agent would act on a context it
    never saw)."""
    if max_context_tokens is None:
        return
    for i, p in enumerate(prompts):
        if len(p) > max_context_tokens:
            raise MappaError(
                f"agent {who}: prompt {i} has {len(p)} tokens, more than generation.max_context_tokens={max_context_tokens}"
            )


def length_buckets(lengths: Sequence[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Row indices grouped by length (shortest first) so that each group, padded to its longest row,
    spends at most `max_padding` of its tokens on padding."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        if groups and (len(groups[-1]) + 1) * lengths[i] * (1 - max_padding) <= real + lengths[i]:
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def prefill(module: torch.nn.Module, prompts: list[list[int]], pad_id: int, spare: int = 0) -> Prefilled:
    """Run the prompts through the model: (KV cache, last-position logits (B, V) in float32, attention mask
    (B, L), next position id (B,)).

    The prompts of one agent's turn share their opening (system prompt, chat template): a prefix common to
    every row (`shared_prefix`, at least `MIN_SHARED_PREFIX` tokens) runs once and every row continues from
    its KV. The rows' own tokens then run in a few forwards of similar lengths (`length_buckets`), each
    left-padded so that every row ends in the last column. The cache reads, per row: the shared prefix, a
    masked gap, the row's own tokens; positions skip the gap, so each row computes what it would alone
    (measured on the demo's evaluation: half of the prompt tokens were a shared prefix). Its layers are
    `BufferedLayer`s with `spare` columns reserved, so decoding writes each new token in place instead of
    copying the cache (the copy was a third of a decode step at the demo's size).
    Caches with other than plain dynamic layers (sliding windows) are padded the classic way.
    """
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt")
    device = next(module.parameters()).device
    P = shared_prefix(prompts) if len(prompts) > 1 else 0
    P = P if P >= MIN_SHARED_PREFIX else 0
    prefix: list[tuple[torch.Tensor, torch.Tensor]] = []
    if P:
        out = module(input_ids=torch.tensor([prompts[0][:P]], device=device), use_cache=True, logits_to_keep=1)
        if not plain_layers(out.past_key_values):
            return prefill_padded(module, prompts, pad_id)
        prefix = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    own = [len(p) - P for p in prompts]
    B, T = len(prompts), max(own)
    attn = torch.zeros(B, P + T, dtype=torch.long, device=device)
    attn[:, :P] = 1
    logits: torch.Tensor | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in length_buckets(own):
        n, t = len(group), max(own[i] for i in group)
        ids = torch.full((n, t), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros(n, P + t, dtype=torch.long, device=device)
        mask[:, :P] = 1
        for r, i in enumerate(group):
            ids[r, t - own[i] :] = torch.tensor(prompts[i][P:], dtype=torch.long)
            mask[r, P + t - own[i] :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]
        # each row of the group reads the one prefix KV (expanded, not copied); no prefix and no padding: no mask,
        # which keeps attention on the fused causal kernel
        past = DynamicCache(ddp_cache_data=[(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in prefix])
        needs_mask = bool(P) or bool((mask == 0).any())
        out = module(
            input_ids=ids,
            attention_mask=mask if needs_mask else None,
            position_ids=positions,
            past_key_values=past if P else None,
            use_cache=True,
            logits_to_keep=1,
        )
        if not plain_layers(out.past_key_values):
            return prefill_padded(module, prompts, pad_id)
        if logits is None:
            logits = torch.empty(B, out.logits.shape[-1], device=device)
            kv = [
                (layer.keys.new_zeros(B, layer.keys.shape[1], P + T + spare, layer.keys.shape[3]),
                 layer.values.new_zeros(B, layer.values.shape[1], P + T + spare, layer.values.shape[3]))
                for layer in out.past_key_values.layers
            ]  # fmt: skip
        idx = torch.tensor(group, device=device)
        logits[idx] = out.logits[:, -1].float()
        attn[idx, P + T - t :] = mask[:, P:]
        for (keys, values), layer in zip(kv, out.past_key_values.layers, strict=True):
            keys[idx, :, :P] = layer.keys[:, :, :P]  # the shared prefix, then this group's own columns, right-aligned
            values[idx, :, :P] = layer.values[:, :, :P]
            keys[idx, :, P + T - t : P + T] = layer.keys[:, :, P:]
            values[idx, :, P + T - t : P + T] = layer.values[:, :, P:]
    assert logits is not None
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    cache = DynamicCache()
    cache.layers[:] = [BufferedLayer.over(k, v, P + T) for k, v in kv]
    return cache, logits, attn, lengths


def prefill_padded(module: torch.nn.Module, prompts: list[list[int]], pad_id: int) -> Prefilled:
    """`prefill` with left padding and an attention mask, in one forward: for any cache type."""
    device = next(module.parameters()).device
    L = max(len(s) for s in prompts)
    input_ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    attn = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, s in enumerate(prompts):
        if not s:
            raise ValueError("empty prompt")
        input_ids[i, L - len(s) :] = torch.tensor(s, dtype=torch.long)
        attn[i, L - len(s) :] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    out = module(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1].float(), attn, position_ids[:, -1] + 1


def plain_layers(cache: Cache) -> bool:
    """Whether every cache layer is a plain DynamicLayer: (B, H, L, D) tensors rows can be padded into."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)
