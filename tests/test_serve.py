"""`mappa serve` in-process: a real uvicorn server on 127.0.0.1 with a tiny random model and two agent adapters."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from mappa import beneath
from mappa.errors import MappaError
from mappa.policy.chat_engine import load_policy
from mappa.policy.models import tiny_model_and_tokenizer
from mappa.policy.policy import Policy
from mappa.serving.guard import AdapterRoots
from mappa.serving.server import Limits, RunningServer, create_app, served_names, start_server
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
def server(policy: Policy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    limits = Limits(adapter_roots=[tmp_path_factory.getbasetemp()])  # every test's tmp_path is below it
    running = start_server(create_app(policy, BASE, max_batch=8, limits=limits))
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


# ---------------------------------------------------------------------------------------------------- streaming
def _streamed(client: openai.OpenAI, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


@pytest.mark.parametrize("model", [BASE, "checker"])
def test_streaming_with_the_openai_client_matches_the_plain_reply(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "messages": HELLO, "max_tokens": 16, "temperature": 0, "logprobs": True}
    plain = client.chat.completions.create(**kw)
    text, chunks = _streamed(client, stream_options={"include_usage": True}, **kw)
    assert text == plain.choices[0].message.content and len(chunks) > 3  # token by token, not one blob
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    streamed_lp = [
        t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed_lp == pytest.approx([t.logprob for t in plain.choices[0].logprobs.content], abs=1e-5)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_token_ids_as_vllm_returns_them(client: openai.OpenAI, policy: Policy) -> None:
    kw = {"model": "checker", "messages": HELLO, "max_tokens": 10, "temperature": 0}
    plain = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    ids = plain.choices[0].model_extra["token_ids"]
    direct = policy.generate("checker", [[Message(**m) for m in HELLO]], temperature=0, max_new_tokens=10)[0]
    assert ids == list(direct.response_ids) and plain.model_extra["prompt_token_ids"] == list(direct.prompt_ids)
    _, chunks = _streamed(client, **kw, extra_body={"return_token_ids": True})
    assert chunks[0].model_extra["prompt_token_ids"] == list(direct.prompt_ids)
    assert [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == ids
    as_ids = client.chat.completions.create(**kw, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    eos = set(policy.eos_ids)
    assert [t.token for t in as_ids.choices[0].logprobs.content] == [f"token_id:{i}" for i in ids if i not in eos]


# ---------------------------------------------------------------------------------------------------- LoRA loading
def test_load_and_unload_lora_adapters_as_vllm_does(server: RunningServer, policy: Policy, tmp_path) -> None:
    from mappa.generation import publish_adapters

    paths = publish_adapters(policy, tmp_path, 0)
    post = lambda what, body: httpx.post(f"{server.url}/{what}_lora_adapter", json=body, timeout=60)  # noqa: E731
    r = post("load", {"lora_name": "checker-copy", "lora_path": str(paths["checker"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'checker-copy' added successfully."
    models = httpx.get(server.url + "/models").json()["data"]
    assert {"id": "checker-copy", "parent": BASE}.items() <= next(
        m for m in models if m["id"] == "checker-copy"
    ).items()

    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)

    def greedy(model: str) -> str:
        r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=10, temperature=0)
        return r.choices[0].message.content

    assert greedy("checker-copy") == greedy("checker") != greedy(BASE)  # the loaded adapter is the checker's
    again = post("load", {"lora_name": "checker-copy", "lora_path": str(paths["checker"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    inplace = post("load", {"lora_name": "checker-copy", "lora_path": str(paths["solver"]), "load_inplace": True})
    assert inplace.status_code == 200 and greedy("checker-copy") == greedy(BASE)  # the solver's (untrained) weights
    assert post("load", {"lora_name": "solver", "lora_path": str(paths["checker"])}).status_code == 400  # taken
    assert post("load", {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}).status_code == 400
    assert (
        post("unload", {"lora_name": "checker-copy"}).text
        == "Success: LoRA adapter 'checker-copy' removed successfully."
    )
    assert post("unload", {"lora_name": "checker-copy"}).status_code == 404
    assert post("unload", {"lora_name": "checker"}).status_code == 400  # the checkpoint's own agents stay
    gone = httpx.post(server.url + "/chat/completions", json={"model": "checker-copy", "messages": HELLO}, timeout=60)
    assert gone.status_code == 404


@pytest.mark.parametrize("number", [beneath.OPENAT2_NR, 1000, None], ids=["openat2", "enosys", "unknown-machine"])
def test_an_adapter_loads_alike_whichever_way_its_files_are_opened(
    client: openai.OpenAI, server: RunningServer, policy: Policy, tmp_path: Path, monkeypatch, number
) -> None:
    """openat2 where the kernel has it; else (ENOSYS, as for an unassigned number, or no number known for this
    machine) each directory opened in turn: the same adapter either way."""
    from mappa.generation import publish_adapters

    monkeypatch.setattr(beneath, "OPENAT2_NR", number)
    path = publish_adapters(policy, tmp_path, 0)["checker"]
    r = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "walked", "lora_path": str(path)}, timeout=60)
    assert r.status_code == 200, r.text
    kw = {"messages": HELLO, "max_tokens": 10, "temperature": 0}
    walked = client.chat.completions.create(model="walked", **kw).choices[0].message.content
    assert walked == client.chat.completions.create(model="checker", **kw).choices[0].message.content
    assert httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "walked"}).status_code == 200


def test_a_root_is_matched_as_configured_and_as_resolved(tmp_path: Path) -> None:
    """The root itself is the operator's and may be a link; below it nothing is followed."""
    (tmp_path / "real" / "solver" / "v1").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "latest").symlink_to(tmp_path / "real" / "solver")
    roots = AdapterRoots([tmp_path / "link"])
    for spelled in ("link", "real"):
        with roots.open(str(tmp_path / spelled / "solver" / "v1")) as directory:
            assert os.path.samestat(os.fstat(directory.fd), os.stat(tmp_path / "real" / "solver" / "v1"))
    with pytest.raises(MappaError, match="latest is a symbolic link"):
        roots.open(str(tmp_path / "link" / "latest" / "v1"))
    with pytest.raises(MappaError, match="No adapter found"):
        roots.open(str(tmp_path / "link" / "solver" / "v2"))
    with pytest.raises(MappaError, match="outside the adapter roots"):
        roots.open(str(tmp_path / "elsewhere"))


# ------------------------------------------------------------------------------------ what a reply reports
CONVERSATION = [
    {"role": "system", "content": "You check arithmetic."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "It is 42."},
    {"role": "user", "content": "Are you sure? Say it again."},
]


def test_prompt_tokens_are_the_chat_templates_length(client: openai.OpenAI, policy: Policy) -> None:
    tok = policy.tokenizer
    for messages in (HELLO, CONVERSATION):
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = len(tok(rendered, add_special_tokens=False)["input_ids"])
        r = client.chat.completions.create(model="checker", messages=messages, max_tokens=3, temperature=0)
        assert r.usage.prompt_tokens == expected, messages
        assert r.usage.total_tokens == expected + r.usage.completion_tokens


def test_greedy_reply_is_the_policys_on_the_same_messages(client: openai.OpenAI, policy: Policy) -> None:
    """The served conversation is the one the policy would see: roles, order and content parts included."""
    as_parts = [
        {"role": "developer", "content": CONVERSATION[0]["content"]},  # OpenAI's newer name for system
        *CONVERSATION[1:3],
        {"role": "user", "content": [{"type": "text", "text": "Are you sure? "}, {"type": "text", "text": "Say it again."}]},
    ]  # fmt: skip
    direct = policy.generate(
        "checker", [[Message(**m) for m in CONVERSATION]], temperature=0, max_new_tokens=12
    )[0]  # fmt: skip
    for messages in (CONVERSATION, as_parts):
        r = client.chat.completions.create(model="checker", messages=messages, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == direct.text
        assert r.usage.completion_tokens == len(direct.response_ids)


def test_finish_reason_is_length_exactly_when_the_cap_cut_the_reply() -> None:
    """On a model that sometimes stops by itself: `stop` when EOS came (even as the last allowed token), `length`
    when the cap cut the reply one token short of it or in the middle of a long one."""
    from helpers import convs, make_policy, perturb

    eager = make_policy(eos_scale=1.6)
    perturb(eager, "coder", scale=1.0)
    running = start_server(create_app(eager, BASE, max_batch=4))
    client = openai.OpenAI(base_url=running.url, api_key="x", max_retries=0, timeout=120)
    seen = set()
    try:
        for conv in convs(7):
            (free,) = eager.generate("coder", [conv], temperature=0, max_new_tokens=20)
            n = len(free.response_ids)
            caps = [n, n - 1] if not free.truncated else [n]
            for cap in (c for c in caps if c >= 1):
                r = client.chat.completions.create(
                    model="coder", messages=[m.model_dump() for m in conv], max_tokens=cap, temperature=0
                )
                stopped = not free.truncated and cap == n
                assert r.choices[0].finish_reason == ("stop" if stopped else "length"), (n, cap, free.truncated)
                assert r.usage.completion_tokens == cap  # EOS counts as a completion token, as it is generated
                seen.add(r.choices[0].finish_reason)
    finally:
        running.stop()
    assert seen == {"stop", "length"}
