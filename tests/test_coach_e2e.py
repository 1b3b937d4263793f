"""End to end: the `openai` coach and `mappa coach score` against a real `mappa serve` subprocess on loopback,
and the `local` coach on an in-process tiny model.

The tiny random model never writes a PROCESS_SCORE line, so every judgment takes the follow-up and
ends unscored: that is the behaviour under test (plus the cache), the parse paths are covered by
the fault server in test_coach_openai.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import free_port

from mappa.coach import build_coach
from mappa.coach.prompts import TEMPLATES, fit_prompt, follow_up_message
from mappa.config import CoachConfig, GenerationConfig
from mappa.types import Action, CoachContext, Episode, ExecResult, Message, Task, read_jsonl, write_jsonl
from mappa.workflows.mathchat import CODER, SOLVER, VERIFIER, MathChat

pytestmark = pytest.mark.integration

GEN = GenerationConfig(max_new_tokens=64)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "MAPPA_CACHE": str(tmp_path_factory.mktemp("serve-cache"))}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mappa.cli",
            "serve",
            "--model",
            "tiny-random",
            "--port",
            str(port),
            "--max-batch",
            "8",
            # The coach's prompts are longer than the tiny model's nominal context (1024); its rotary
            # positions run longer, so the server grants the room (see test_local_coach_on_a_tiny_model).
            "--max-model-len",
            "8192",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mappa serve exited: {proc.stdout.read().decode()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("mappa serve did not come up")
        time.sleep(0.3)
    yield base
    proc.terminate()
    proc.wait(30)


def requests_served(base: str) -> int:
    return httpx.get(base + "/stats").json()["requests"]


def recorded_episode(i: int) -> Episode:
    """A MathChat episode as the workflow records it (messages exactly as each agent saw them)."""
    wf = MathChat()
    task = Task(id=f"t{i}", problem=f"What is {i} + 3?", answer=str(i + 3), source="arithmetic")
    solver_msgs = tuple(wf.solver_messages(task, GEN.max_new_tokens))
    solver = Action(agent=SOLVER.name, turn=0, messages=solver_msgs, text=f"{i} + 3 = {i + 3}.")
    coder_msgs = (
        Message(role="system", content=wf.role(wf.coder, GEN.max_new_tokens)),
        Message(role="user", content=task.problem),
    )
    coder = Action(
        agent=CODER.name,
        turn=0,
        messages=coder_msgs,
        text=f"```python\nprint({i} + 3)\n```",
        exec_result=ExecResult(ok=True, exit_code=0, stdout=f"{i + 3}\n"),
    )
    ver_msgs = (
        Message(role="system", content=wf.role(VERIFIER, GEN.max_new_tokens)),
        Message(role="user", content=f"{i + 3}"),
    )
    verifier = Action(agent=VERIFIER.name, turn=0, messages=ver_msgs, text=f"\\boxed{{{i + 3}}}")
    return Episode(id=f"e{i}", workflow="mathchat", task=task, actions=(solver, coder, verifier), correct=True)


def contexts(n: int) -> list[CoachContext]:
    wf = MathChat()
    out = []
    for i in range(n):
        ep = recorded_episode(i)
        out.extend(wf.context(ep.task, a) for a in ep.actions)
    return out


def test_openai_backend_against_mappa_serve(served: str, tmp_path: Path) -> None:
    cfg = CoachConfig(
        backend="openai",
        model="tiny-random",
        base_url=served + "/v1",
        api_key_env="MAPPA_TEST_UNSET_KEY",
        max_tokens=16,
        cache_path=str(tmp_path / "coach.sqlite"),
    )
    ctxs = contexts(1)  # 3 actions, the verifier's with ground truth
    start = requests_served(served)
    with build_coach(cfg, "mathchat") as runner:
        scores = runner.score_many(ctxs)
        first = runner.stats()
        sent = requests_served(served) - start
        # Second pass: every judgment from the cache, not one request.
        again = runner.score_many(ctxs)
        second = runner.stats()
    assert requests_served(served) - start == sent
    for s in scores:
        assert s.backend == "openai" and s.model == "tiny-random" and s.raw_reply
        if s.score is None:  # the random model writes no score line and never stops: cut at the cap
            assert s.error.startswith("no PROCESS_SCORE line: the reply was cut")
            assert "[asked again with room for 32]" in s.raw_reply
        else:
            assert 0 <= s.score <= 10
    unscored = sum(s.score is None for s in scores)
    assert first["calls"] == sent == len(ctxs) + unscored  # each unscored judgment asked again with more room
    assert first["unscored"] == unscored and first["failures"] == 0 and first["prompt_tokens"] > 0
    assert all(a.cached for a in again) and [a.score for a in again] == [s.score for s in scores]
    assert second["cache_hits"] == len(ctxs) and second["calls"] == first["calls"]


def test_coach_score_command_replays_with_the_cache(served: str, tmp_path: Path) -> None:
    episodes = tmp_path / "episodes.jsonl"
    write_jsonl(episodes, [recorded_episode(0)])
    env = {**os.environ, "MAPPA_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable, "-m", "mappa.cli", "coach", "score", str(episodes), "--coach", "openai",
        "--set", "coach.model=tiny-random", "--set", f"coach.base_url={served}/v1",
        "--set", "coach.max_tokens=16", "--set", "generation.max_new_tokens=64",
    ]  # fmt: skip
    before = requests_served(served)
    one = subprocess.run(
        [*cmd, "--out", str(tmp_path / "a.jsonl")], capture_output=True, text=True, timeout=300, env=env
    )
    assert one.returncode == 0, one.stderr
    middle = requests_served(served)
    two = subprocess.run(
        [*cmd, "--out", str(tmp_path / "b.jsonl")], capture_output=True, text=True, timeout=300, env=env
    )
    assert two.returncode == 0, two.stderr
    assert middle > before and requests_served(served) == middle  # the replay made zero requests
    assert "cache hits" in two.stderr
    a = read_jsonl(tmp_path / "a.jsonl", Episode)
    b = read_jsonl(tmp_path / "b.jsonl", Episode)
    assert all(x.coach is not None and x.coach.backend == "openai" for ep in a for x in ep.actions)
    assert [x.coach.score for ep in a for x in ep.actions] == [x.coach.score for ep in b for x in ep.actions]
    assert all(x.coach.cached for ep in b for x in ep.actions)
    # Replayed contexts equal the live ones, so judgments cached while training are reused.
    live = contexts(1)
    from mappa.coach.replay import episode_contexts

    assert [c for ep in a for c in episode_contexts(ep, MathChat())] == live


def test_coach_score_command_rubric_and_outcome(tmp_path: Path) -> None:
    episodes = tmp_path / "episodes.jsonl"
    eps = [recorded_episode(0), recorded_episode(1).model_copy(update={"correct": False})]
    write_jsonl(episodes, eps)
    for coach in ("rubric", "outcome"):
        out = tmp_path / f"{coach}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "mappa.cli", "coach", "score", str(episodes), "--coach", coach, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        scored = read_jsonl(out, Episode)
        scores = [[a.coach.score for a in ep.actions] for ep in scored]
        if coach == "outcome":
            assert scores == [[10.0] * 3, [0.0] * 3]
        else:
            assert all(s is not None for row in scores for s in row)
            assert scores[0][2] == 10.0  # the verifier's boxed 3 matches the reference


def test_coach_score_command_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x"}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mappa.cli", "coach", "score", str(bad), "--out", str(tmp_path / "o.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "bad.jsonl:1" in proc.stderr
    good = tmp_path / "good.jsonl"
    write_jsonl(good, [recorded_episode(0)])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mappa.cli",
            "coach",
            "score",
            str(good),
            "--coach",
            "openai",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("mappa: error: coach.model")


def test_local_coach_on_a_tiny_model(tmp_path: Path) -> None:
    from mappa.policy.models import tiny_model_and_tokenizer
    from mappa.policy.policy import Policy

    model, tokenizer = tiny_model_and_tokenizer()
    policy = Policy.from_model(model, tokenizer, ["problem_solver", "code_executor", "verifier"])
    # The tiny model's nominal context (1024) is shorter than these prompts in its byte-level tokens; its
    # rotary positions run longer, so the test grants it more room than its own default budget.
    cfg = CoachConfig(backend="local", max_tokens=16, max_context_tokens=4096, cache_path=str(tmp_path / "c.sqlite"))
    ctxs = contexts(1)
    with build_coach(cfg, "mathchat", policy=policy) as runner:
        scores = runner.score_many(ctxs)
        stats = runner.stats()
        assert runner.coach.batches[0] == 3  # the three judgments ran as one generate call
        tokens = runner._run(runner.coach.complete([{"role": "user", "content": "hi"}])).tokens
        assert tokens and all(len(t.top) == 20 for t in tokens)
        again = runner.score_many(ctxs)
    unscored = sum(s.score is None for s in scores)
    assert stats["calls"] == 3 + unscored and stats["unscored"] == unscored
    assert stats["prompt_tokens"] > 0 and stats["completion_tokens"] > 0
    assert all(s.backend == "local" for s in scores)
    assert all(a.cached for a in again)
    assert stats["truncated_contexts"] == 0  # the model's own context holds these prompts whole


def test_local_coach_fits_long_evidence_to_its_budget(tmp_path: Path) -> None:
    """Counted with the coach model's own tokenizer and chat template: the prompt it decodes fits exactly."""
    from mappa.policy.models import tiny_model_and_tokenizer
    from mappa.policy.policy import Policy

    model, tokenizer = tiny_model_and_tokenizer()
    policy = Policy.from_model(model, tokenizer, ["verifier"])
    # Whole: 4229 tokens; without the oldest two input messages 3283, with the last character of the second 3391
    # (its fence and cut note), without three 2743 (measured).
    cfg = CoachConfig(backend="local", max_tokens=16, max_context_tokens=3700, cache=False)
    turns = tuple(Message(role="user", content=f"turn {i}: " + "word " * 150) for i in range(4))
    (long,) = [c.model_copy(update={"messages": turns}) for c in contexts(1)[-1:]]
    with build_coach(cfg, "mathchat", policy=policy) as runner:
        (score,) = runner.score_many([long])
        stats = runner.stats()
        fit = runner.coach.fit
        sent, cut = fit_prompt(long, TEMPLATES["mathchat"], fit.budget, fit.count)
    # Room is kept for the reply, and for the follow-up exchange: the first reply, the question, the second reply.
    assert fit.budget == 3700 - 3 * 16 - fit.count([follow_up_message(True)])  # a reply asked again, then followed up
    # Without the two oldest it fits with room to spare, so the newest part of the second comes back.
    assert (cut.dropped, cut.messages) == (1, 2) and cut.chars > 0
    assert score.truncated_inputs == 2 and stats["truncated_contexts"] == 1
    assert fit.budget - 20 < fit.count(sent) <= fit.budget  # as much evidence as fits, in the coach's own tokens
    text = sent[1]["content"]
    assert "turn 2:" in text and "turn 3:" in text and "turn 0:" not in text and "turn 1:" not in text


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_embedded_model_served_and_coaching(tmp_path: Path) -> None:
    """The embedded SmolLM2-135M behind `mappa serve`: the official client gets text and logprobs, and
    the openai coach completes every judgment (scored, or unscored after the follow-up; never a failure)."""
    import openai

    from mappa.policy.chat_engine import load_policy
    from mappa.serving.server import create_app, start_server

    policy = load_policy("smollm2-135m-instruct")
    server = start_server(create_app(policy, "smollm2-135m-instruct", ()))
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=600)
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
        assert r.choices[0].message.content.strip() and r.choices[0].logprobs.content
        cfg = CoachConfig(
            backend="openai",
            model="smollm2-135m-instruct",
            base_url=server.url,
            max_tokens=32,
            timeout_s=900,
            cache=False,
        )
        with build_coach(cfg, "mathchat") as runner:
            scores = runner.score_many(contexts(1)[-1:])  # the verifier's action, ground truth included
            stats = runner.stats()
    finally:
        server.stop()
    assert stats["failures"] == 0
    for s in scores:
        assert (s.score is not None and 0 <= s.score <= 10) or s.error.startswith("no PROCESS_SCORE line")
