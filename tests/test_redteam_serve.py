"""`mappa serve` against callers it should not trust: a real uvicorn server on 127.0.0.1 with a tiny random model,
an API key, an adapter root and a bound on loaded adapters, probed over real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from mappa.config import GenerationConfig
from mappa.errors import MappaError
from mappa.generation import ServerPolicy, publish_adapters
from mappa.models import tiny_model_and_tokenizer
from mappa.policy import Policy
from mappa.serving.engine import ChatEngine, ChatRequest
from mappa.serving.guard import default_adapter_roots
from mappa.serving.server import Limits, RunningServer, create_app, start_server
from mappa.types import Message

BASE = "tiny-random"
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Say something about numbers."}]
MAX_LOADED = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policy() -> Policy:
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    policy = Policy.from_model(model, tokenizer, ["solver", "checker"], lora_r=4, lora_alpha=8)
    with torch.no_grad():  # "checker" answers differently from the base (LoRA B starts at zero)
        gen = torch.Generator().manual_seed(1)
        for p in policy.trainable_parameters("checker"):
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return policy


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, policy: Policy) -> dict[str, Path]:
    """An adapter root with the agents' adapters in it, and a sibling directory outside it with the same."""
    root, outside = tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("outside")
    publish_adapters(policy, root, 0)
    publish_adapters(policy, outside, 0)
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
def server(policy: Policy, dirs: dict[str, Path]) -> Iterator[RunningServer]:
    limits = Limits(api_key=KEY, adapter_roots=[dirs["root"]], max_loaded_adapters=MAX_LOADED)
    running = start_server(create_app(policy, BASE, max_batch=8, limits=limits))
    yield running
    running.stop()


HTTP = httpx.Client(timeout=60)  # one client: a new one per call costs ~0.1 s of TLS setup


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, headers=AUTH)


def stats(server: RunningServer) -> dict:
    return HTTP.get(server.url.removesuffix("/v1") + "/stats", headers=AUTH).json()


def models(server: RunningServer) -> list[str]:
    return [m["id"] for m in HTTP.get(server.url + "/models", headers=AUTH).json()["data"]]


def chat(**kw) -> dict:
    return {"model": BASE, "messages": HELLO, "max_tokens": 4, "temperature": 0, **kw}


# ---------------------------------------------------------------------------------------------------- the API key
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_every_path_but_health_needs_the_key(server: RunningServer, headers: dict) -> None:
    root = server.url.removesuffix("/v1")
    calls = [
        ("GET", server.url + "/models", None),
        ("POST", server.url + "/chat/completions", chat()),
        ("POST", server.url + "/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
        ("POST", server.url + "/unload_lora_adapter", {"lora_name": "x"}),
        ("GET", root + "/stats", None),
    ]
    for method, url, body in calls:
        r = HTTP.request(method, url, json=body, headers=headers)
        assert r.status_code == 401, (url, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert HTTP.get(root + "/health").status_code == 200


def test_the_openai_client_with_the_key_is_served(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data][:3] == [BASE, "solver", "checker"]
    r = client.chat.completions.create(model="checker", messages=HELLO, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------------- adapter paths
def load(server: RunningServer, name: str, path: str | Path) -> httpx.Response:
    return post(server, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def test_adapters_load_only_from_under_the_root(server: RunningServer, dirs: dict[str, Path]) -> None:
    root, outside = dirs["root"], dirs["outside"]
    r = load(server, "outsider", outside / "solver" / "v000000")
    assert r.status_code == 400 and "outside the adapter roots" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "lora_path"
    dotted = f"{root}/../{outside.name}/solver/v000000"
    r = load(server, "dotted", dotted)
    assert r.status_code == 400 and "'..'" in r.json()["error"]["message"]
    (root / "escape").symlink_to(outside / "solver" / "v000000")
    r = load(server, "escape", root / "escape")
    assert r.status_code == 400 and "link that leads outside" in r.json()["error"]["message"]
    sneaky = root / "sneaky"
    sneaky.mkdir()
    shutil.copy(root / "solver" / "v000000" / "adapter_config.json", sneaky)
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "solver" / "v000000" / "adapter_model.safetensors")
    r = load(server, "sneaky", sneaky)
    assert r.status_code == 400 and "adapter_model.safetensors is a link" in r.json()["error"]["message"]
    assert load(server, "/etc", "/etc").status_code == 400
    names = models(server)
    assert not {"outsider", "dotted", "escape", "sneaky", "/etc"} & set(names)
    inside = load(server, "inside", root / "checker" / "v000000")  # the same tree, inside: loads
    assert inside.status_code == 200, inside.text


def test_loaded_adapters_are_bounded_least_recently_used_first(server: RunningServer, dirs: dict[str, Path]) -> None:
    path = dirs["root"] / "solver" / "v000000"
    for name in ("lru-a", "lru-b", "lru-c"):
        assert load(server, name, path).status_code == 200
    assert post(server, "/chat/completions", chat(model="lru-a")).status_code == 200  # a used, b now the oldest
    assert load(server, "lru-d", path).status_code == 200
    names = models(server)
    assert [n for n in names if n.startswith("lru-")] == ["lru-a", "lru-c", "lru-d"]
    assert len(names) == 3 + MAX_LOADED  # base, two agents, the bound
    assert post(server, "/chat/completions", chat(model="lru-b")).status_code == 404
    served = server.server.config.app.state.served
    assert len(served._slot_params) <= MAX_LOADED  # peft modules are bounded too, not only names


# ---------------------------------------------------------------------------------------------------- sizes
def test_max_tokens_is_clamped_to_the_room_the_prompt_leaves(server: RunningServer, policy: Policy) -> None:
    def room(content: str) -> int:
        return 1024 - len(policy.chat_ids([Message(role="user", content=content)]))  # the tiny model's context

    content = "one two three four "
    while room(content + "one two three four ") > 0:
        content += "one two three four "
    assert 0 < room(content) < 20
    t0 = time.monotonic()
    r = post(server, "/chat/completions", chat(messages=[{"role": "user", "content": content}], max_tokens=10**15))
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= room(content)
    assert time.monotonic() - t0 < 30


def test_a_prompt_over_the_context_is_refused_before_any_work(server: RunningServer) -> None:
    before = stats(server)
    r = post(server, "/chat/completions", chat(messages=[{"role": "user", "content": "word " * 3000}]))
    assert r.status_code == 400 and "context is 1024" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
    assert stats(server)["prefills"] == before["prefills"]


def test_a_body_over_the_cap_is_413(server: RunningServer) -> None:
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 40_000_000}])).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = HTTP.post(server.url + "/chat/completions", content=big, headers=headers)
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]
    chunks = (big[i : i + 2**20] for i in range(0, len(big), 2**20))  # no Content-Length: counted as it comes
    r = HTTP.post(server.url + "/chat/completions", content=chunks, headers=headers)
    assert r.status_code == 413
    assert post(server, "/chat/completions", chat()).status_code == 200  # and the server carries on


# ---------------------------------------------------------------------------------------------------- fields
@pytest.mark.parametrize(
    "field, value",
    [
        ("response_format", {"type": "json_object"}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1.0),
        ("chat_template_kwargs", {"tokenize": True}),  # template options are served; reserved keys are not
        ("logit_bias", {"1": 10}),
        ("made_up_option", 1),
    ],
)
def test_fields_that_would_change_the_reply_are_refused_by_name(server: RunningServer, field: str, value) -> None:
    r = post(server, "/chat/completions", chat(**{field: value}))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_harmless_fields_and_neutral_values_are_accepted(server: RunningServer) -> None:
    neutral = {"user": "u1", "metadata": {"run": "x"}, "presence_penalty": 0, "response_format": {"type": "text"}}
    assert post(server, "/chat/completions", chat(**neutral)).status_code == 200
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    r = post(server, "/chat/completions", chat(messages=[{"role": "user", "content": image}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].type"


# ---------------------------------------------------------------------------------------------------- hanging up
def wait_idle(server: RunningServer, cancelled: int) -> dict:
    deadline = time.monotonic() + 20
    while True:
        now = stats(server)
        if now["cancelled"] >= cancelled and now["active_rows"] == 0:
            return now
        assert time.monotonic() < deadline, now
        time.sleep(0.02)


def wait_decoding(server: RunningServer) -> None:
    deadline = time.monotonic() + 20
    while stats(server)["active_rows"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)


# Greedy, HELLO runs 249 tokens before the tiny model's stop token: a row that stayed would decode them all.
def test_a_stream_whose_client_hangs_up_leaves_the_batch(server: RunningServer) -> None:
    before = stats(server)
    body = chat(max_tokens=900, stream=True)
    with httpx.stream("POST", server.url + "/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk
        wait_decoding(server)
    after = wait_idle(server, before["cancelled"] + 1)
    assert after["steps"] - before["steps"] < 100 and after["requests"] == before["requests"]


def test_a_plain_request_whose_client_hangs_up_leaves_the_batch(server: RunningServer) -> None:
    before = stats(server)
    body = json.dumps(chat(max_tokens=900)).encode()
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head.encode() + body)
        wait_decoding(server)
    after = wait_idle(server, before["cancelled"] + 1)
    assert after["steps"] - before["steps"] < 100 and after["requests"] == before["requests"]


def test_a_row_whose_caller_leaves_does_not_disturb_the_rows_that_stay(policy: Policy) -> None:
    def request(text: str, max_tokens: int) -> ChatRequest:
        return ChatRequest(None, (Message(role="user", content=text),), temperature=0.0, max_tokens=max_tokens)

    engine = ChatEngine(policy, max_batch=4)
    leave, stay = request("Count slowly to one hundred.", 200), request("What is 2 + 2?", 30)

    async def run():
        leaving, staying = asyncio.ensure_future(engine.chat(leave)), asyncio.ensure_future(engine.chat(stay))
        while engine.steps < 3:
            await asyncio.sleep(0.001)
        leaving.cancel()  # what the server does when the client hangs up
        got = await staying
        await engine.aclose()
        return got

    got = asyncio.run(run())
    assert engine.cancelled == 1 and engine.largest_batch == 2 and engine.active_rows == 0
    alone = policy.generate(None, [stay.messages], temperature=0.0, max_new_tokens=30)[0]
    assert got.response_ids == alone.response_ids and len(got.response_ids) > 3


# ---------------------------------------------------------------------------------------------------- clients
def test_the_generation_backend_sends_its_key(
    server: RunningServer, policy: Policy, dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = GenerationConfig(backend="server", base_url=server.url, api_key_env="MAPPA_TEST_SERVE_KEY")
    monkeypatch.delenv("MAPPA_TEST_SERVE_KEY", raising=False)
    keyless = ServerPolicy.from_policy(policy, gen, adapter_root=dirs["root"])
    with pytest.raises(MappaError, match="401"):
        keyless.generate("checker", [[Message(**m) for m in HELLO]], temperature=0, max_new_tokens=4)
    keyless.close()
    monkeypatch.setenv("MAPPA_TEST_SERVE_KEY", KEY)
    keyed = ServerPolicy.from_policy(policy, gen, adapter_root=dirs["root"])
    keyed.load_adapters(publish_adapters(policy, dirs["root"], 1), 1)
    served = keyed.generate("checker", [[Message(**m) for m in HELLO]], temperature=0, max_new_tokens=8)[0]
    local = policy.generate("checker", [[Message(**m) for m in HELLO]], temperature=0, max_new_tokens=8)[0]
    assert served.response_ids == local.response_ids and served.model == "checker-v000001"
    keyed.close()


def test_serve_refuses_a_public_host_without_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MAPPA_API_KEY"}
    cmd = [sys.executable, "-m", "mappa.cli", "serve", "--model", BASE, "--host", "0.0.0.0", "--port", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "loopback only" in proc.stderr


def test_default_adapter_roots_are_runs_and_the_served_run(tmp_path: Path) -> None:
    ckpt = tmp_path / "runs" / "demo" / "checkpoints" / "step-000004"
    assert default_adapter_roots(str(ckpt), cwd=tmp_path) == [tmp_path / "runs", tmp_path / "runs" / "demo"]
    assert default_adapter_roots(None, cwd=tmp_path) == [tmp_path / "runs"]
