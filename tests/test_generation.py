"""Generation on a LoRA server: `mappa serve` in a subprocess stands in for vLLM/SGLang, with the tiny random model.

The trainer publishes adapters, the server loads them by name, rollouts go over HTTP, and what comes back
must be the exact tokens (and, greedy, the exact text) the trainer's own policy would produce.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers import TINY, kill_at_checkpoint  # TINY: 2 tasks a step, several optimizer steps per agent

from mappa.config import load_config
from mappa.errors import MappaError
from mappa.generation import LocalGenerator, ServerGenerator, ServerPolicy, build_generator, publish_adapters
from mappa.generation.server import response_token_ids
from mappa.policy.policy import Policy
from mappa.training.checkpoint import latest_checkpoint
from mappa.types import Message

ROOT = Path(__file__).resolve().parents[1]
HELLO = [Message(role="user", content="Say something about numbers.")]
OTHER = [Message(role="system", content="Be brief."), Message(role="user", content="What is 2 + 3?")]

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mappa serve --model tiny-random` on a free port: the same base weights the trainer builds."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "mappa.cli", "serve", "--model", "tiny-random", "--port", "0", "--threads", "1"]
    cmd += ["--adapter-root", str(tmp_path_factory.getbasetemp())]  # every test's tmp_path is below it
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=_env())
    deadline = time.monotonic() + 120
    try:
        while "/v1" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "mappa serve did not start"
            time.sleep(0.05)
        url = re.search(r"http://\S+/v1", log.read_text()).group(0)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def tiny_policy(agents: list[str]) -> Policy:
    return Policy.from_config(load_config(None, TINY).model, agents, seed=0)


def perturb(policy: Policy, agent: str, seed: int) -> None:
    """Give `agent` weights of its own (LoRA B starts at zero: an untrained adapter is the base model)."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in policy.trainable_parameters(agent):
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


def client_for(policy: Policy, url: str, root: Path) -> ServerPolicy:
    cfg = load_config(None, [*TINY, "generation.backend=server", f"generation.base_url={url}"])
    generator = build_generator(cfg, policy)
    assert isinstance(generator, ServerGenerator) and not generator.samples_exactly
    generator.server.adapter_root = root
    return generator.server


def served_models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/models").json()["data"]]


# ---------------------------------------------------------------------------------------------------- adapters
def test_publish_writes_peft_directories_atomically_and_keeps_two_versions(tmp_path: Path) -> None:
    policy = tiny_policy(["solver", "checker"])
    for version in (0, 1, 2):
        paths = publish_adapters(policy, tmp_path, version)
    assert paths == {a: tmp_path / a / "v000002" for a in ("solver", "checker")}
    for agent in ("solver", "checker"):
        assert sorted(p.name for p in (tmp_path / agent).iterdir()) == ["v000001", "v000002"]
        files = sorted(p.name for p in paths[agent].iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        assert json.loads((paths[agent] / "adapter_config.json").read_text())["r"] == 4
    assert not [p for p in tmp_path.rglob(".*")]  # no staging or temporary directories left
    # A resumed run re-publishes an older version: the newer one is a killed run's future and goes.
    publish_adapters(policy, tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "solver").iterdir()) == ["v000001"]


def test_full_weight_agents_are_refused_with_the_server_backend() -> None:
    cfg = load_config(None, [*TINY, "generation.backend=server", "model.agent_weights=full"])
    with pytest.raises(MappaError, match="agent_weights=full is not supported"):
        build_generator(cfg, None)
    local = build_generator(load_config(None, TINY), tiny_policy(["solver"]))
    assert isinstance(local, LocalGenerator) and local.samples_exactly  # the policy itself, continuously batched


def test_a_prompt_longer_than_the_context_is_refused_before_any_request(tmp_path: Path) -> None:
    policy = tiny_policy(["solver"])
    client = client_for(policy, "http://127.0.0.1:9/v1", tmp_path)  # a port nothing listens on: no request is made
    conv = [Message(role="user", content="word " * 50)]
    n = len(client.chat_ids(conv))
    with pytest.raises(MappaError, match=rf"agent solver: prompt 0 has {n} tokens.*max_context_tokens={n - 1}"):
        client.generate("solver", [conv], max_context_tokens=n - 1)


# ---------------------------------------------------------------------------------------------------- the server
def test_an_adapter_loaded_into_the_server_answers_as_the_trainers_policy(server: str, tmp_path: Path) -> None:
    policy = tiny_policy(["solver", "checker"])
    perturb(policy, "checker", seed=1)
    generator = client_for(policy, server, tmp_path)
    generator.load_adapters(publish_adapters(policy, tmp_path, 1), 1)
    assert {"checker-v000001", "solver-v000001"} <= set(served_models(server))

    conversations = [HELLO, OTHER]
    served = generator.generate("checker", conversations, temperature=0, max_new_tokens=12)
    local = policy.generate("checker", conversations, temperature=0, max_new_tokens=12)
    for s, g in zip(served, local, strict=True):
        assert (s.text, s.prompt_ids, s.response_ids) == (g.text, g.prompt_ids, g.response_ids)
        assert s.model == "checker-v000001" and s.version == 1 and s.dropped is None
        n = len(s.logprobs)  # the stop token's log-prob is left out, as OpenAI does
        assert n >= len(s.response_ids) - 1
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(g.logprobs[:n]), atol=1e-4, rtol=0)
    base = generator.generate(None, conversations, temperature=0, max_new_tokens=12)
    assert [b.text for b in base] != [s.text for s in served]  # the adapter, not the base, answered
    stats = generator.stats()
    assert stats["generation/requests"] == 4 and stats["generation/dropped_prompt_mismatch"] == 0
    generator.close()


def test_reloading_switches_every_agent_and_unloads_the_old_version(server: str, tmp_path: Path) -> None:
    policy = tiny_policy(["drafter", "reviser"])
    generator = client_for(policy, server, tmp_path)
    generator.load_adapters(publish_adapters(policy, tmp_path, 0), 0)
    before = generator.generate("reviser", [HELLO], temperature=0, max_new_tokens=12)[0]
    assert before.text == policy.generate(None, [HELLO], temperature=0, max_new_tokens=12)[0].text  # B = 0

    perturb(policy, "reviser", seed=2)  # an optimizer step
    seconds = generator.load_adapters(publish_adapters(policy, tmp_path, 1), 1)
    after = generator.generate("reviser", [HELLO], temperature=0, max_new_tokens=12)[0]
    assert after.text != before.text and after.version == 1
    assert after.text == policy.generate("reviser", [HELLO], temperature=0, max_new_tokens=12)[0].text
    names = served_models(server)
    assert {"drafter-v000001", "reviser-v000001"} <= set(names) and "reviser-v000000" not in names
    assert 0 < seconds < 30
    stats = generator.stats()
    assert stats["generation/adapter_version"] == 1 and stats["generation/mixed_versions"] == 1  # 0 then 1
    generator.close()


def test_token_ids_are_recovered_exactly_or_the_action_is_dropped(server: str) -> None:
    policy = tiny_policy(["solver"])
    prompt = policy.chat_ids(HELLO)
    body = {"model": "tiny-random", "messages": [m.model_dump() for m in HELLO], "max_tokens": 12, "seed": 3}
    body.update(temperature=0, logprobs=True, return_token_ids=True)
    reply = httpx.post(server + "/chat/completions", json=body, timeout=60).json()
    exact, why = response_token_ids(reply, prompt, policy.tokenizer, policy.eos_ids)
    assert why is None and exact == reply["choices"][0]["token_ids"] and reply["prompt_token_ids"] == prompt

    # A server without token ids: `token_id:N` logprob tokens, or the text re-tokenized and checked.
    as_ids = httpx.post(server + "/chat/completions", json={**body, "return_token_ids": False,
                        "return_tokens_as_token_ids": True}, timeout=60).json()  # fmt: skip
    assert "token_ids" not in as_ids["choices"][0]
    assert response_token_ids(as_ids, prompt, policy.tokenizer, policy.eos_ids) == (exact, None)
    plain = json.loads(json.dumps(reply))
    del plain["choices"][0]["token_ids"], plain["prompt_token_ids"]
    ids, why = response_token_ids(plain, prompt, policy.tokenizer, policy.eos_ids)
    assert (ids, why) == (exact, None) or (ids, why) == ([], "retokenize_mismatch")
    altered = json.loads(json.dumps(plain))
    altered["choices"][0]["logprobs"]["content"][0]["token"] += "x"  # the server sampled other pieces
    assert response_token_ids(altered, prompt, policy.tokenizer, policy.eos_ids) == ([], "retokenize_mismatch")
    reply["prompt_token_ids"] = prompt[:-1]  # the server templated the chat differently
    assert response_token_ids(reply, prompt, policy.tokenizer, policy.eos_ids) == ([], "prompt_mismatch")


def test_requests_with_their_own_seeds_batch_and_stay_reproducible(server: str) -> None:
    policy = tiny_policy(["solver"])
    generator = client_for(policy, server, Path("."))
    before = httpx.get(server.removesuffix("/v1") + "/stats").json()
    first = generator.generate(None, [HELLO] * 4, temperature=1.0, max_new_tokens=8, seed=7)
    again = generator.generate(None, [HELLO] * 4, temperature=1.0, max_new_tokens=8, seed=7)
    after = httpx.get(server.removesuffix("/v1") + "/stats").json()
    assert after["batches"] - before["batches"] < 8  # different seeds, shared batches
    assert [g.response_ids for g in first] == [g.response_ids for g in again]
    assert len({g.response_ids for g in first}) > 1  # one seed per request: equal prompts sample apart
    generator.close()


# ---------------------------------------------------------------------------------------------------- training
def _train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/rollout_s" in r]


def test_two_training_steps_through_mappa_serve(server: str, tmp_path: Path) -> None:
    from mappa.cli import main

    run_dir = tmp_path / "run"
    sets = [*TINY, "generation.backend=server", f"generation.base_url={server}", "train.steps=2", f"run_dir={run_dir}"]
    # One adapter for the three agents: their rubric scores differ, so its update is never zero (each agent
    # alone scores the same on every action of the random model, and whitening would leave nothing to learn).
    sets.append("model.agent_weights=shared")
    assert main(["train", *[a for o in sets for a in ("--set", o)]]) == 0
    rows = _train_rows(run_dir)
    assert [r["generation/adapter_version"] for r in rows] == [0.0, 1.0]  # each rollout on the previous step's
    for r in rows:
        assert r["generation/mixed_versions"] == 0 and r["generation/dropped_prompt_mismatch"] == 0
        assert 0 <= r["generation/logprob_gap"] < 1e-3  # same fp32 weights on both sides
        assert r["generation/reload_s"] < 30 and r["generation/requests"] > 0
    agents = Policy.from_checkpoint(latest_checkpoint(run_dir) / "policy", device="cpu")
    names = served_models(server)
    for agent in agents.agents:
        assert sorted(p.name for p in (run_dir / "adapters" / agent).iterdir()) == ["v000001", "v000002"]
        assert f"{agent}-v000002" in names and f"{agent}-v000001" not in names
    # The served adapter is the checkpoint's: same log-probs of the same greedy reply, unlike the base's.
    agent = agents.agents[0]
    body = {"messages": [m.model_dump() for m in HELLO], "max_tokens": 8, "temperature": 0, "logprobs": True}
    trained = httpx.post(server + "/chat/completions", json={**body, "model": f"{agent}-v000002"}, timeout=60).json()
    base = httpx.post(server + "/chat/completions", json={**body, "model": "tiny-random"}, timeout=60).json()
    local = agents.generate(agent, [HELLO], temperature=0, max_new_tokens=8)[0]
    assert trained["choices"][0]["message"]["content"] == local.text
    served_lp = [t["logprob"] for t in trained["choices"][0]["logprobs"]["content"]]
    base_lp = [t["logprob"] for t in base["choices"][0]["logprobs"]["content"]]
    torch.testing.assert_close(
        torch.tensor(served_lp), torch.tensor(local.logprobs[: len(served_lp)]), atol=1e-4, rtol=0
    )
    assert served_lp != base_lp[: len(served_lp)]


def test_kill_and_resume_with_the_server_backend(server: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    sets = [*TINY, "generation.backend=server", f"generation.base_url={server}", "train.steps=3", f"run_dir={run_dir}"]
    log = tmp_path / "first.log"
    cmd = [sys.executable, "-m", "mappa.cli", "train", *[a for o in sets for a in ("--set", o)]]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=_env())
    try:
        kill_at_checkpoint(proc, run_dir, 2, log)  # step 3 is then under way
    finally:
        proc.kill()
        proc.wait()
    resume_log = tmp_path / "resume.log"
    resumed = subprocess.run(
        [sys.executable, "-m", "mappa.cli", "train", "--resume", str(run_dir)],
        stdout=resume_log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=_env(), timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resume_log.read_text()[-3000:]
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["generation/adapter_version"] == 2.0  # step 3 ran on the restored step-2 adapters
    names = served_models(server)
    for agent in (p.name for p in (run_dir / "adapters").iterdir()):
        assert f"{agent}-v000003" in names and f"{agent}-v000002" not in names


def test_served_logprobs_are_those_of_the_sampling_temperature(server: str) -> None:
    """`mappa serve` reports the log-probs of the distribution it sampled from (as vLLM with
    `--logprobs-mode processed_logprobs`), and the trainer's recompute at that temperature matches them."""
    from mappa.training.rl import logprob_gap
    from mappa.types import Action

    policy = tiny_policy(["solver"])
    generator = client_for(policy, server, Path("."))
    chats = [HELLO, [Message(role="user", content="Count to three.")]]
    try:
        served = generator.generate(None, chats, temperature=0.7, max_new_tokens=10, seed=5)
    finally:
        generator.close()
    actions = [Action.sampled("solver", 0, c, g) for c, g in zip(chats, served, strict=True)]
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    at_t, mask = policy.sequence_logprobs(None, prompts, responses, temperature=0.7)
    raw, _ = policy.sequence_logprobs(None, prompts, responses)
    served_logps = [a.logprobs for a in actions]
    assert logprob_gap(at_t, served_logps) < 1e-3  # same fp32 weights on both sides
    assert logprob_gap(raw, served_logps) > 0.05  # what a trainer ignoring the temperature would be off by
    assert mask.sum() == sum(len(r) for r in responses)
