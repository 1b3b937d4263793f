"""The chat engine behind `mappa serve`: continuous batching on a tiny random model."""

from __future__ import annotations

import asyncio

import pytest

from mappa.errors import MappaError
from mappa.policy.chat_engine import ChatEngine, ChatRequest
from mappa.policy.models import tiny_model_and_tokenizer
from mappa.policy.policy import Policy
from mappa.types import Message

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policy() -> Policy:
    model, tokenizer = tiny_model_and_tokenizer()
    return Policy.from_model(model, tokenizer, ["solver"])


def request(text: str, max_tokens: int = 12, **kw) -> ChatRequest:
    return ChatRequest(
        agent=None, messages=(Message(role="user", content=text),), temperature=0.0, max_tokens=max_tokens, **kw
    )


def alone(policy: Policy, r: ChatRequest):
    return policy.generate(r.agent, [r.messages], temperature=0.0, max_new_tokens=r.max_tokens)[0]


async def wait_for_steps(engine: ChatEngine, n: int) -> None:
    while engine.steps < n:
        await asyncio.sleep(0.001)


def test_a_request_joins_the_batch_that_is_already_decoding(policy: Policy) -> None:
    engine = ChatEngine(policy, max_batch=4)
    long, late = request("Count slowly to one hundred.", max_tokens=60), request("What is 2 + 2?", max_tokens=8)

    async def run():
        first = asyncio.ensure_future(engine.chat(long))
        await wait_for_steps(engine, 3)  # the first request is mid-generation
        second = await engine.chat(late)
        assert not first.done(), "the late request finished inside the running batch, before the long one"
        result = await first, second
        await engine.aclose()
        return result

    got_long, got_late = asyncio.run(run())
    assert engine.batches == 1 and engine.largest_batch == 2 and engine.prefills == 2
    assert got_long.response_ids == alone(policy, long).response_ids
    assert got_late.response_ids == alone(policy, late).response_ids
    stats = engine.stats()
    assert stats["requests"] == 2 and 1 < stats["mean_batch"] < 2 and stats["decode_s"] > 0


def test_requests_with_other_settings_wait_for_the_running_batch(policy: Policy) -> None:
    engine = ChatEngine(policy, max_batch=4)
    base = request("Tell me about seven.", max_tokens=120)
    adapter = ChatRequest(agent="solver", messages=base.messages, temperature=0.0, max_tokens=5)
    same = request("And eight?", max_tokens=5)

    async def run():
        first = asyncio.ensure_future(engine.chat(base))
        await wait_for_steps(engine, 2)
        other = asyncio.ensure_future(engine.chat(adapter))
        await asyncio.sleep(0.05)
        # while a request with other settings waits, the running batch takes no newcomers
        third = asyncio.ensure_future(engine.chat(same))
        out = await asyncio.gather(first, other, third)
        await engine.aclose()
        return out

    got = asyncio.run(run())
    assert engine.batches == 3 and engine.largest_batch == 1
    assert got[1].response_ids == alone(policy, adapter).response_ids
    assert got[2].response_ids == alone(policy, same).response_ids


def test_a_failing_request_gets_the_error_and_the_engine_keeps_serving(policy: Policy) -> None:
    engine = ChatEngine(policy)
    bad = ChatRequest(agent="nobody", messages=(Message(role="user", content="hi"),))

    async def run():
        with pytest.raises(MappaError, match="unknown agent 'nobody'"):
            await engine.chat(bad)
        good = await engine.chat(request("still there?", max_tokens=3))
        await engine.aclose()
        return good

    assert len(asyncio.run(run()).response_ids) == 3
    assert engine._thread is None


def test_per_request_token_caps_and_top_logprobs_in_one_batch(policy: Policy) -> None:
    engine = ChatEngine(policy, max_batch=8)
    reqs = [request(f"Item {i}", max_tokens=2 + 3 * i, top_logprobs=i) for i in range(4)]

    async def run():
        out = await asyncio.gather(*(engine.chat(r) for r in reqs))
        await engine.aclose()
        return out

    got = asyncio.run(run())
    for r, g in zip(reqs, got, strict=True):
        assert g.response_ids == alone(policy, r).response_ids
        assert (g.top_logprobs is None) == (r.top_logprobs == 0)
        assert all(len(t) == r.top_logprobs for t in g.top_logprobs or ())
    assert engine.largest_batch >= 2


def test_a_follow_up_reuses_the_first_requests_prompt(policy: Policy) -> None:
    engine = ChatEngine(policy, prefix_cache_mib=64)
    first = request("Rate this action from 0 to 10 and explain. " * 6, max_tokens=6)

    async def run():
        reply = await engine.chat(first)
        follow = ChatRequest(
            agent=None,
            messages=(
                *first.messages,
                Message(role="assistant", content=reply.text),
                Message(role="user", content="Reply with PROCESS_SCORE: <0-10> only."),
            ),
            temperature=0.0,
            max_tokens=6,
        )
        again = await engine.chat(follow)
        await engine.aclose()
        return follow, again

    follow, again = asyncio.run(run())
    stats = engine.stats()
    assert stats["prefix_hits"] == 1 and stats["prefix_tokens_reused"] == len(policy.chat_ids(first.messages))
    assert again.response_ids == alone(policy, follow).response_ids
    off = ChatEngine(policy, prefix_cache_mib=0)
    assert off.prefix_cache is None and off.stats()["prefix_hits"] == 0


def test_interleaved_steps_drain_one_decoder_before_the_next() -> None:
    """Rows of different agents cannot share a forward pass, and a step costs about the same whatever its rows: the
    steps stay on the decoder stepped last until it drains (the others fill up meanwhile), then go to the fullest;
    a decoder that waited MAX_IDLE steps goes first."""
    from types import SimpleNamespace

    from mappa.policy.chat_engine import MAX_IDLE, _choose

    def live(rows: int, idle: int = 0) -> SimpleNamespace:
        return SimpleNamespace(decoder=[None] * rows, idle=idle)

    solver, coder, verifier = live(2), live(9), live(5)
    assert _choose([solver, coder, verifier], None) is coder  # nothing stepped yet: the fullest
    assert _choose([solver, coder, verifier], solver) is solver  # a tail of 2 rows drains first
    assert _choose([coder, verifier], solver) is coder  # drained: the fullest next
    starved = live(1, idle=MAX_IDLE)
    assert _choose([solver, starved, coder], solver) is starved
