"""The serving decoder on a tiny random Llama: rows joining a running batch, the buffered KV layers, the
prefix cache, and the transformers internals they rely on (checked here so an upgrade fails loudly)."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from helpers import convs, make_policy, perturb  # the same tiny policy and conversations
from transformers.cache_utils import DynamicCache, DynamicLayer

from mappa.errors import MappaError
from mappa.policy.decoder import decoding
from mappa.policy.kvcache import BufferedLayer, stitchable
from mappa.policy.policy import Generation
from mappa.policy.prefix_cache import PrefixCache
from mappa.types import Message

PIN = "transformers==5.23.0 (requirements.lock)"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------------------------------
# continuous batching (Decoder)


def run_decoder(decoder, schedule: dict[int, list[tuple[str, list[int], int, int]]]) -> dict[str, Generation]:
    """Step `decoder` until empty; before step s, add the rows in schedule[s] as (key, prompt, cap, top_k)."""
    out: dict[str, Generation] = {}
    step = 0
    while len(decoder) or any(s >= step for s in schedule):
        for key, prompt, cap, top_k in schedule.get(step, []):
            decoder.add([prompt], cap, keys=[key], top_logprobs=top_k)
        out.update(decoder.step())
        step += 1
    return out


def test_rows_joining_a_running_batch_get_what_they_would_get_alone():
    policy = make_policy(eos_scale=1.6)
    perturb(policy, "coder", scale=1.0)
    prompts = [policy.chat_ids(c) for c in convs(5)]
    assert len({len(p) for p in prompts}) > 2, "want prompts of different lengths"
    schedule = {0: [("a", prompts[0], 20, 0), ("b", prompts[3], 6, 3)], 2: [("c", prompts[1], 12, 0)],
                5: [("d", prompts[4], 20, 5), ("e", prompts[2], 3, 0)]}  # fmt: skip
    with decoding(policy, "coder", temperature=0.0) as decoder:
        joined = run_decoder(decoder, schedule)
    for rows in schedule.values():
        for key, prompt, cap, top_k in rows:
            alone = policy.generate(
                "coder", [convs(5)[prompts.index(prompt)]], temperature=0.0, max_new_tokens=cap, top_logprobs=top_k
            )[0]
            got = joined[key]
            assert got.response_ids == alone.response_ids, key
            assert len(got.response_ids) <= cap and got.truncated == alone.truncated
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)
            assert (got.top_logprobs is None) == (top_k == 0)
            if top_k:
                assert all(len(t) == top_k for t in got.top_logprobs)
                assert [t[0][0] for t in got.top_logprobs] == list(got.response_ids)  # greedy: top-1 was taken


def test_a_finished_long_row_leaves_the_cache_and_its_padding_goes_with_it():
    policy = make_policy()
    short, long = (policy.chat_ids(c) for c in ([Message(role="user", content="Hi")], convs(8)[7]))
    assert len(long) > len(short) + 10
    with decoding(policy, "solver", temperature=0.0) as decoder:
        decoder.add([long, short], 1, keys=["long", "unused"])
        decoder.add([short], 6, keys=["short"])  # a second add merges into the padded batch
        assert len(decoder) == 3 and decoder.width == len(long)
        done = dict(decoder.step())
        assert set(done) == {"long", "unused"} and len(decoder) == 1
        assert decoder.width == len(short) + 1  # the long prompt's columns are gone
        rest = run_decoder(decoder, {})
    alone = policy.generate("solver", [[Message(role="user", content="Hi")]], temperature=0.0, max_new_tokens=6)[0]
    assert rest["short"].response_ids == alone.response_ids


def test_decoder_keeps_writing_past_its_reserved_room():
    # generate reserves room for max_new_tokens; a row added later with a larger cap must grow the buffers
    policy = make_policy()
    prompt = policy.chat_ids(convs(1)[0])
    with decoding(policy, "solver", temperature=0.0) as decoder:
        decoder.add([prompt], 2, keys=["first"])
        decoder.step()
        decoder.add([prompt], 40, keys=["second"])
        got = run_decoder(decoder, {})
    alone = policy.generate("solver", [convs(1)[0]], temperature=0.0, max_new_tokens=40)[0]
    assert got["second"].response_ids == alone.response_ids and len(alone.response_ids) == 40


def test_decoder_add_validates_its_input():
    policy = make_policy()
    with decoding(policy, "solver") as decoder:
        with pytest.raises(ValueError, match="2 prompts but 1 keys"):
            decoder.add([[1, 2], [3]], 4, keys=["a"])
        with pytest.raises(MappaError, match="max_new_tokens must be >= 1"):
            decoder.add([[1, 2]], 0, keys=["a"])
        with pytest.raises(ValueError, match="empty prompt"):
            decoder.add([[]], 3, keys=["a"])
        assert len(decoder) == 0 and decoder.step() == []


# ------------------------------------------------------------------------------------------------------------------
# prefix cache


def kv_of(n_tokens: int, layers: int = 2, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, n_tokens, 4), fill), torch.full((1, 2, n_tokens, 4), fill)) for _ in range(layers)]


def test_prefix_cache_finds_the_longest_shared_prefix_per_owner():
    cache = PrefixCache(max_bytes=10**6, min_tokens=4)
    cache.store("a", list(range(10)), kv_of(10, fill=1.0))
    cache.store("a", [*range(6), 99, 98], kv_of(8, fill=2.0))
    cache.store("b", list(range(20)), kv_of(20, fill=3.0))
    n, kv = cache.lookup("a", [*range(8), 7, 7])
    assert n == 8 and kv[0][0].shape == (1, 2, 8, 4) and float(kv[0][0][0, 0, 0, 0]) == 1.0
    assert cache.lookup("a", list(range(10)))[0] == 9  # never the whole prompt: its last token must run
    assert cache.lookup("a", [0, 1, 2, 50, 51]) is None  # 3 shared tokens < min_tokens
    assert cache.lookup("c", list(range(10))) is None  # another owner's KV is never used
    assert (cache.hits, cache.misses, cache.tokens_reused) == (2, 2, 17)


def test_prefix_cache_evicts_least_recently_used_and_entries_a_newer_prompt_covers():
    one = sum(k.nbytes + v.nbytes for k, v in kv_of(10))
    cache = PrefixCache(max_bytes=2 * one, min_tokens=4)
    cache.store(None, list(range(10)), kv_of(10))
    cache.store(None, list(range(100, 110)), kv_of(10))
    assert cache.lookup(None, [*range(10), 5]) is not None  # touch the first: the second is now oldest
    cache.store(None, list(range(200, 210)), kv_of(10))
    assert len(cache) == 2 and cache.bytes == 2 * one
    assert cache.lookup(None, [*range(100, 110), 5]) is None and cache.lookup(None, [*range(10), 5]) is not None
    # extends the first prompt, which it replaces; it is larger than one slot, so the oldest goes too
    cache.store(None, [*range(10), 11, 12], kv_of(12))
    assert len(cache) == 1 and cache.lookup(None, [*range(10), 11, 12, 13])[0] == 12
    assert cache.lookup(None, [*range(200, 210), 5]) is None and cache.bytes == one * 12 // 10
    cache.store(None, list(range(500, 600)), kv_of(100))  # larger than the whole budget: not kept
    assert len(cache) == 1


def test_a_prompt_extending_a_cached_one_prefills_only_the_new_tokens():
    policy = make_policy()
    perturb(policy, "coder")
    first = [Message(role="user", content="What is 17 * 23? " * 4)]
    follow = [*first, Message(role="assistant", content="It is 391."), Message(role="user", content="Sure?")]
    cache = PrefixCache(max_bytes=10**8)
    with decoding(policy, "coder", temperature=0.0, prefix_cache=cache) as decoder:
        decoder.add([policy.chat_ids(first)], 5, keys=["first"])
        run_decoder(decoder, {})
        assert cache.hits == 0 and len(cache) == 1
        decoder.add([policy.chat_ids(follow)], 12, keys=["follow"], top_logprobs=2)
        got = run_decoder(decoder, {})["follow"]
    assert cache.hits == 1 and cache.tokens_reused == len(policy.chat_ids(first))
    fresh = policy.generate("coder", [follow], temperature=0.0, max_new_tokens=12, top_logprobs=2)[0]
    assert got.response_ids == fresh.response_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(fresh.logprobs), atol=1e-4, rtol=0)
    # another agent's weights give other KV: the coder's cached prompt is not used for the solver
    with decoding(policy, "solver", temperature=0.0, prefix_cache=cache) as decoder:
        decoder.add([policy.chat_ids(follow)], 2, keys=["x"])
    assert cache.hits == 1


# ------------------------------------------------------------------------------------------------------------------
# the transformers internals that mappa.policy.kvcache relies on


def test_transformers_is_the_version_the_buffered_layer_was_written_against():
    assert transformers.__version__ == "5.23.0", (
        f"transformers {transformers.__version__} is installed, but mappa/policy/kvcache.py subclasses DynamicLayer "
        f"as of {PIN}: check BufferedLayer against the new DynamicLayer/DynamicCache (the tests below name what "
        "it uses), then move the pin and this check together"
    )


def test_dynamic_layer_and_cache_still_have_what_the_buffered_layer_overrides_and_reads():
    params = {name: list(inspect.signature(getattr(DynamicLayer, name)).parameters) for name in
              ("lazy_initialization", "update", "batch_select_indices", "get_seq_length")}  # fmt: skip
    assert params["lazy_initialization"] == ["self", "key_states", "value_states"], PIN
    assert params["update"][:3] == ["self", "key_states", "value_states"], PIN
    assert params["batch_select_indices"] == ["self", "indices"], PIN
    layer = DynamicLayer()
    assert not layer.is_initialized and not layer.is_sliding, PIN
    k = torch.randn(2, 3, 5, 4)
    cache = DynamicCache(ddp_cache_data=[(k, k + 1), (k + 2, k + 3)])
    assert [type(x) for x in cache.layers] == [DynamicLayer, DynamicLayer], f"DynamicCache(ddp_cache_data=...): {PIN}"
    assert torch.equal(cache.layers[1].values, k + 3) and cache.get_seq_length() == 5, PIN
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[0].keys.shape == (1, 3, 5, 4), f"DynamicCache.batch_select_indices: {PIN}"


def test_a_model_reads_and_writes_a_cache_of_buffered_layers_like_a_dynamic_one():
    """The model must call BufferedLayer.update and attend over its views: same logits as transformers' own cache."""
    policy = make_policy()
    module = policy.model
    ids = torch.tensor([policy.chat_ids(convs(1)[0])])
    with torch.no_grad():
        ref = module(input_ids=ids, use_cache=True)
        assert stitchable(ref.past_key_values), f"a Llama's prefill cache is no longer plain DynamicLayers: {PIN}"
        blocks = [[(x.keys, x.values)] for x in ref.past_key_values.layers]
        buffered = DynamicCache(ddp_cache_data=[b[0] for b in blocks])
        buffered.layers[:] = [BufferedLayer(b, ids.shape[1], spare=4) for b in blocks]
        storage = buffered.layers[0]._k.data_ptr()
        nxt = ref.logits[:, -1].argmax(-1, keepdim=True)
        want = module(input_ids=nxt, past_key_values=ref.past_key_values, use_cache=True).logits
        got_out = module(input_ids=nxt, past_key_values=buffered, use_cache=True)
    assert got_out.past_key_values is buffered and all(type(x) is BufferedLayer for x in buffered.layers), PIN
    assert buffered.layers[0]._k.data_ptr() == storage, "the step did not write into the reserved room"
    assert buffered.get_seq_length() == ids.shape[1] + 1, PIN
    torch.testing.assert_close(got_out.logits, want, atol=1e-5, rtol=0)
