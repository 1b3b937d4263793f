"""`mappa serve` against callers it should not trust: a real uvicorn server on 127.0.0.1 with a tiny random model,
an API key, an adapter root and a bound on loaded adapters, probed over real HTTP."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from mappa import beneath
from mappa.config import GenerationConfig
from mappa.errors import MappaError
from mappa.generation import ServerPolicy, publish_adapters
from mappa.policy.chat_engine import ChatEngine, ChatRequest
from mappa.policy.models import tiny_model_and_tokenizer
from mappa.policy.policy import Policy
from mappa.serving.adapters import ServedPolicy, _drop
from mappa.serving.guard import AdapterRoots, default_adapter_roots
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
    assert r.status_code == 400 and "escape is a symbolic link" in r.json()["error"]["message"]
    sneaky = root / "sneaky"
    sneaky.mkdir()
    shutil.copy(root / "solver" / "v000000" / "adapter_config.json", sneaky)
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "solver" / "v000000" / "adapter_model.safetensors")
    r = load(server, "sneaky", sneaky)
    assert r.status_code == 400 and "adapter_model.safetensors is a symbolic link" in r.json()["error"]["message"]
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


# ---------------------------------------------------------------------------------------------------- adapter files
@pytest.fixture(params=["openat2", "enosys", "unknown-machine"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way the server opens files beneath a root: the kernel's openat2; the component walk after the kernel
    answers ENOSYS (as any kernel answers an unassigned syscall number); the walk where openat2's number is
    unknown. The in-process server reads the module's number at every open."""
    if request.param == "enosys":
        monkeypatch.setattr(beneath, "OPENAT2_NR", 1000)
    elif request.param == "unknown-machine":
        monkeypatch.setattr(beneath, "OPENAT2_NR", None)
    return request.param


def _config_only(root: Path, at: Path) -> Path:
    at.mkdir(parents=True)
    shutil.copy(root / "solver" / "v000000" / "adapter_config.json", at)
    return at / "adapter_model.safetensors"


def _linked_file(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    _config_only(root, at).symlink_to(root / "solver" / "v000000" / "adapter_model.safetensors")  # inside, even
    return at, "adapter_model.safetensors is a symbolic link"


def _linked_directory(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    at.symlink_to(root / "solver")  # a link on the way that stays inside the root
    return at / "v000000", f"{at.name} is a symbolic link"


def _hard_link_out(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    os.link(outside / "solver" / "v000000" / "adapter_model.safetensors", _config_only(root, at))
    return at, "hard link"


def _fifo(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    os.mkfifo(_config_only(root, at))
    return at, "a FIFO"


def _device(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    try:
        os.mknod(_config_only(root, at), 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    return at, "a device"


def _directory(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    _config_only(root, at).mkdir()
    return at, "a directory"


def _oversized(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    with open(_config_only(root, at), "wb") as f:
        f.truncate(2**40)  # sparse: a terabyte that takes no room
    return at, "more than"


def _oversized_config(root: Path, outside: Path, at: Path) -> tuple[Path, str]:
    at.mkdir(parents=True)
    shutil.copy(root / "solver" / "v000000" / "adapter_model.safetensors", at)
    with open(at / "adapter_config.json", "wb") as f:
        f.truncate(2**30)
    return at, "more than"


# Each builds, under the root, an adapter directory that must not load, and returns (its path, the reason's words).
HOSTILE = [_linked_file, _linked_directory, _hard_link_out, _fifo, _device, _directory, _oversized, _oversized_config]


@pytest.mark.parametrize("build", HOSTILE, ids=[b.__name__.strip("_") for b in HOSTILE])
def test_adapter_files_that_are_not_plain_files_of_their_own_are_refused(
    server: RunningServer, dirs: dict[str, Path], build, resolution: str
) -> None:
    at = dirs["root"] / "hostile" / f"{build.__name__.strip('_')}-{resolution}"
    at.parent.mkdir(exist_ok=True)
    path, reason = build(dirs["root"], dirs["outside"], at)
    r = load(server, at.name, path)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert reason in r.json()["error"]["message"], r.json()["error"]["message"]
    assert at.name not in models(server)


def test_the_kernel_resolves_beneath_where_it_has_openat2(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    (tmp_path / "l").symlink_to(tmp_path / "d")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fd = beneath.openat2(dir_fd, "d/f", os.O_RDONLY, beneath.RESOLVE)
        except OSError as e:
            if e.errno in (errno.ENOSYS, errno.EPERM):
                pytest.skip("no openat2 on this machine: the walk does it all")
            raise
        assert os.read(fd, 2) == b"x"
        os.close(fd)
        refusals = [
            ("l/f", errno.ELOOP),
            (f"../{tmp_path.name}/d/f", errno.EXDEV),
            (str(tmp_path / "d/f"), errno.EXDEV),
        ]
        for path, code in refusals:
            with pytest.raises(OSError) as refused:
                beneath.openat2(dir_fd, path, os.O_RDONLY, beneath.RESOLVE)
            assert refused.value.errno == code, path
    finally:
        os.close(dir_fd)


@pytest.fixture(scope="module")
def spare() -> Policy:
    """A policy of its own for loads outside the server (the server's slots live in `policy`'s model)."""
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    spare = Policy.from_model(model, tokenizer, ["solver", "checker"], lora_r=4, lora_alpha=8)
    with torch.no_grad():
        for p in spare.trainable_parameters("checker"):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    return spare


@pytest.fixture
def served(spare: Policy) -> Iterator[ServedPolicy]:
    served = ServedPolicy(spare, BASE, spare.agents)
    yield served
    for slot in list(served._slot_params):
        _drop(spare.model, slot)


@pytest.mark.parametrize("swapped", ["the adapter directory", "a directory above it"])
def test_a_directory_swapped_for_a_link_after_the_check_is_never_read(
    spare: Policy, served: ServedPolicy, tmp_path: Path, resolution: str, swapped: str
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    publish_adapters(spare, root, 0)
    publish_adapters(spare, outside, 0)
    checked = root / "solver" / "v000000"
    victim, target = (checked, outside / "checker" / "v000000")
    if swapped == "a directory above it":
        victim, target = (checked.parent, outside / "checker")
    moved = victim.with_name("moved")
    roots = AdapterRoots([root])
    with roots.open(str(checked)) as directory:  # the check
        victim.rename(moved)  # the swap, after the check and before the load
        victim.symlink_to(target, target_is_directory=True)
        served.load("raced", directory)
    loaded = served._slot_params[served.loaded["raced"][0]]
    weights = "adapter_model.safetensors"
    was_checked = load_file((moved if victim == checked else moved / "v000000") / weights)
    linked = load_file(target / weights if victim == checked else target / "v000000" / weights)
    assert all(torch.equal(loaded[k], was_checked[k]) for k in was_checked)
    assert not all(torch.equal(loaded[k], linked[k]) for k in linked)  # the outside adapter was never read
    with pytest.raises(MappaError, match=f"{victim.name} is a symbolic link"):
        roots.open(str(checked))  # asked again, the path is refused at the check


def _with_config(dirs: dict[str, Path], name: str, **change) -> Path:
    at = dirs["root"] / "configs" / name
    shutil.copytree(dirs["root"] / "solver" / "v000000", at)
    config = json.loads((at / "adapter_config.json").read_text())
    (at / "adapter_config.json").write_text(json.dumps({**config, **change}))
    return at


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"r": 4096}, "not a LoRA matrix of rank 4096"),  # peft would make modules 1000x the file's size
        ({"target_modules": ".*proj"}, "list of module names"),  # a pattern peft would run as a regex
        ({"alpha_pattern": {"q_proj": 64}}, "it sets alpha_pattern"),  # a scaling a refilled slot would drop
        ({"layer_replication": [[0, 1]]}, "it sets layer_replication"),
        ({"bias": "all"}, "only plain LoRA"),
    ],
)
def test_an_adapter_config_that_is_not_plain_lora_is_refused(
    server: RunningServer, dirs: dict[str, Path], change: dict, reason: str
) -> None:
    name = "config-" + "-".join(change)
    r = load(server, name, _with_config(dirs, name, **change))
    assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    assert name not in models(server)


def test_an_adapter_config_cannot_rewrite_the_base_weights(
    server: RunningServer, policy: Policy, dirs: dict[str, Path]
) -> None:
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if ".lora_" not in n}
    at = _with_config(dirs, "pissa", init_lora_weights="pissa")  # pissa's init subtracts from the base
    assert load(server, "pissa", at).status_code == 200  # the values come from the file: no init runs
    after = dict(policy.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base.items())
