"""`mappa serve` in-process: a real uvicorn server on 127.0.0.1 with a tiny random model and two agent adapters."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from mappa.models import tiny_model_and_tokenizer
from mappa.policy import Policy
from mappa.serving.engine import load_policy
from mappa.serving.server import RunningServer, create_app, served_names, start_server
from mappa.types import Message

BASE = "tiny-random"
HELLO = [{"role": "user", "content": "Say something about numbers."}]


@pytest.fixture(scope="module")
def policy() -> Policy:
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    policy = Policy.from_model(model, tokenizer, ["solver", "checker"], lora_r=4, lora_alpha=8)
    with torch.no_grad():  # give "checker" weights of its own (LoRA B starts at zero = the base model)
        gen = torch.Generator().manual_seed(1)
        for p in policy.trainable_parameters("checker"):
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return policy


@pytest.fixture(scope="module")
def server(policy: Policy) -> Iterator[RunningServer]:
    running = start_server(create_app(policy, BASE, max_batch=8))
    yield running
    running.stop()


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def stats(server: RunningServer) -> dict:
    return httpx.get(server.url.removesuffix("/v1") + "/stats").json()


def test_models_lists_base_and_agents(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [BASE, "solver", "checker"]


def test_openai_client_chat_with_logprobs(client: openai.OpenAI, policy: Policy) -> None:
    r = client.chat.completions.create(
        model=BASE, messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == BASE
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.prompt_tokens == len(policy.chat_ids([Message(**m) for m in HELLO]))
    content = choice.logprobs.content
    assert 1 <= len(content) <= r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert t.logprob == pytest.approx(lps[0], abs=1e-5)


def test_temperature_zero_is_greedy_and_matches_the_policy(client: openai.OpenAI, policy: Policy) -> None:
    texts = [
        client.chat.completions.create(model=BASE, messages=HELLO, max_tokens=10, temperature=0)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    direct = policy.generate(None, [[Message(**m) for m in HELLO]], temperature=0, max_new_tokens=10)[0].text
    assert texts[0] == texts[1] == direct


def test_model_name_selects_the_agent_weights(client: openai.OpenAI) -> None:
    def greedy(model: str) -> str:
        r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=10, temperature=0)
        return r.choices[0].message.content

    base, solver, checker = greedy(BASE), greedy("solver"), greedy("checker")
    assert solver == base  # an untrained adapter is the base model
    assert checker != base  # the perturbed adapter answers differently


def test_concurrent_requests_are_batched(server: RunningServer, policy: Policy) -> None:
    before = stats(server)
    prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)
        rs = await asyncio.gather(
            *(client.chat.completions.create(model=BASE, messages=m, max_tokens=8, temperature=0) for m in prompts)
        )
        await client.close()
        return [r.choices[0].message.content for r in rs]

    texts = asyncio.run(run())
    after = stats(server)
    assert after["requests"] - before["requests"] == 6
    assert after["batches"] - before["batches"] < 6
    assert after["largest_batch"] >= 2
    # Batching does not change what each request gets (greedy is stable across batch layouts).
    alone = [
        policy.generate(None, [[Message(**x) for x in m]], temperature=0, max_new_tokens=8)[0].text for m in prompts
    ]
    assert texts == alone


def test_max_tokens_and_finish_reason(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=BASE, messages=HELLO, max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"model": "nope", "messages": HELLO}, 404, "not found"),
        ({"model": BASE, "messages": HELLO, "stream": True}, 400, "stream"),
        ({"model": BASE, "messages": HELLO, "n": 2}, 400, "n=1"),
        ({"model": BASE, "messages": HELLO, "stop": ["\n"]}, 400, "stop"),
        ({"model": BASE, "messages": HELLO, "temperature": -1}, 400, "temperature"),
        ({"model": BASE, "messages": HELLO, "top_logprobs": 3}, 400, "logprobs"),
        ({"model": BASE, "messages": HELLO, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
        ({"model": BASE, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        ({"model": BASE, "messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_style_errors(server: RunningServer, body: dict, status: int, needle: str) -> None:
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]


def test_content_parts_and_developer_role(client: openai.OpenAI) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]},
    ]
    r = client.chat.completions.create(model=BASE, messages=messages, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_serve_command_rejects_a_taken_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "mappa.cli", "serve", "--model", BASE, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "cannot listen" in proc.stderr


def test_serving_a_checkpoint_exposes_its_agents(policy: Policy, tmp_path) -> None:
    policy.save(tmp_path / "ckpt")
    loaded = load_policy(BASE, str(tmp_path / "ckpt"))
    base_name, agents = served_names(loaded, BASE, str(tmp_path / "ckpt"))
    assert agents == ("solver", "checker") and base_name == "base"  # the tiny base is stored in the checkpoint
    assert served_names(loaded, BASE, None) == (BASE, ())
    app_server = start_server(create_app(loaded, base_name, agents))
    try:
        client = openai.OpenAI(base_url=app_server.url, api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="checker", messages=HELLO, max_tokens=8, temperature=0)
    finally:
        app_server.stop()
    direct = policy.generate("checker", [[Message(**m) for m in HELLO]], temperature=0, max_new_tokens=8)[0].text
    assert r.choices[0].message.content == direct  # the trained adapter, reloaded from disk


def test_responses_are_not_held_back_by_nagle() -> None:
    # Without TCP_NODELAY the response body (a second write after the headers) waits ~40 ms for the
    # client's delayed ACK: every request paid it. Accepted connections inherit the listening socket's option.
    from mappa.serving.server import bind

    sock = bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        client = socket.create_connection(sock.getsockname())
        conn, _ = sock.accept()
        with client, conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        sock.close()
