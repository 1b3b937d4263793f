"""Batched prefill with a shared prefix and length buckets: each row computes what it would alone."""

from __future__ import annotations

import random

import pytest
import torch

from mappa.policy import decoding
from mappa.policy.kvcache import BufferedLayer
from mappa.policy.models import tiny_model_and_tokenizer


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m, _ = tiny_model_and_tokenizer(seed=0)
    return m.eval()


def _prompts(shared: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(5, 500) for _ in range(shared)]
    return [head + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def test_shared_prefix_leaves_every_prompt_a_token_of_its_own():
    assert decoding.shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert decoding.shared_prefix([[1, 2, 3, 9], [1, 2, 4]]) == 2
    assert decoding.shared_prefix([[7, 1], [8, 1]]) == 0


def test_length_buckets_bound_the_padding():
    lengths = [10, 200, 11, 190, 12, 400, 205]
    groups = decoding.length_buckets(lengths, max_padding=0.2)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest, real = max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert len(g) * longest - real <= 0.2 * len(g) * longest
    assert len(groups) == 3  # ~10, ~200, 400


def test_length_batches_cover_every_row_once_in_length_order():
    lengths = [5, 1, 9, 3, 7, 2, 8]
    batches = decoding.length_batches(lengths, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths)  # neighbours in length share a forward
    assert decoding.length_batches([], 4) == []


@pytest.mark.parametrize("shared", [0, 3, 40])
def test_prefill_then_decode_matches_each_prompt_alone(model: torch.nn.Module, shared: int):
    prompts = _prompts(shared, 9)
    with torch.no_grad():
        cache, logits, attn, pos = decoding.prefill(model, prompts, pad_id=0, spare=4)
        assert all(isinstance(layer, BufferedLayer) for layer in cache.layers)
        assert pos.tolist() == [len(p) for p in prompts]
        nxt = torch.full((len(prompts),), 7)
        out = model(
            input_ids=nxt[:, None],
            attention_mask=torch.cat([attn, attn.new_ones(len(prompts), 1)], dim=1),
            position_ids=pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        for i, p in enumerate(prompts):
            alone = model(input_ids=torch.tensor([p + [7]])).logits[0]
            assert torch.allclose(logits[i], alone[-2], atol=1e-4), f"row {i}: prefill logits"
            assert torch.allclose(out.logits[i, -1], alone[-1], atol=1e-4), f"row {i}: first decode step"


def test_shared_prefix_is_run_once(model: torch.nn.Module):
    """The shared prefix costs one row, not one per prompt: count the tokens the model is given."""
    prompts = _prompts(64, 8)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    try:
        with torch.no_grad():
            decoding.prefill(model, prompts, pad_id=0)
    finally:
        hook.remove()
    own = sum(len(p) - 64 for p in prompts)
    assert seen[0] == 64
    assert sum(seen[1:]) < own * 1.25  # the rows' own tokens, with bounded padding
