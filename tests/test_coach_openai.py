"""The `openai` coach against a real local HTTP server that misbehaves on purpose.

The server (stdlib `http.server`, threads) picks its behaviour per request from a `CASE=<name>` tag in
the task text, so concurrent judgments stay deterministic: each case has a list of responses for its
1st, 2nd, ... request (the last one repeats).
"""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import OK, FaultServer, coach_context, reply, status

from mappa.coach import build_coach
from mappa.coach.openai_backend import OpenAICoach, retry_after_s
from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.types import CoachContext, Message

pytestmark = pytest.mark.integration


def thinking(tokens: int, text: str = "The code ran and printed 5.\nPROCESS_SCORE: 7") -> dict:
    """A thinking model: it spends `tokens` on thinking inside the request's cap, then writes `text` (a token a word)."""
    return {"kind": "think", "thinking": tokens, "text": text}


def ctx(case: str, **kw) -> CoachContext:
    """The Code Executor's context; `case` (in the task) tells the fake endpoint how to answer."""
    base = dict(
        task=f"CASE={case} What is 2 + 3?",
        role="Code Executor",
        messages=(Message(role="user", content="Problem: 2 + 3"),),
    )
    return coach_context(**{**base, **kw})


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.setattr(OpenAICoach, "backoff_base_s", 0.01)
    servers, runners = [], []

    def start(plan: dict[str, list[dict]], **cfg_kw):
        server = FaultServer(plan)
        servers.append(server)
        cfg = dict(
            backend="openai",
            model="judge",
            base_url=server.url,
            api_key_env="MAPPA_TEST_NO_SUCH_KEY",
            timeout_s=5.0,
            max_retries=2,
            cache_path=str(tmp_path / "cache.sqlite"),
        )
        cfg.update(cfg_kw)
        runner = build_coach(CoachConfig(**cfg), "mathchat")
        runners.append(runner)
        return server, runner

    yield start
    for r in runners:
        r.close()
    for s in servers:
        s.close()


def test_retry_after_is_honoured(serve) -> None:
    server, runner = serve({"rl": [status(429, {"Retry-After": "1"}), OK]})
    t0 = time.perf_counter()
    (score,) = runner.score_many([ctx("rl")])
    assert time.perf_counter() - t0 >= 0.95
    assert score.score == 7.0 and score.error is None
    stats = runner.stats()
    assert (stats["calls"], stats["retries"], stats["failures"], stats["unscored"]) == (2, 1, 0, 0)


def test_server_errors_exhaust_retries_and_leave_the_action_unscored(serve) -> None:
    server, runner = serve({"down": [status(500)]})
    (score,) = runner.score_many([ctx("down")])
    assert score.score is None and score.error.startswith("request failed")
    assert "HTTP 500" in score.error and "3 attempts" in score.error
    stats = runner.stats()
    assert (stats["calls"], stats["retries"], stats["failures"], stats["unscored"]) == (3, 2, 1, 1)
    # Failures are not cached: the next pass asks again (and this time the server is still down).
    runner.score_many([ctx("down")])
    assert server.attempts["down"] == 6 and runner.stats()["cache_hits"] == 0


def test_a_hanging_endpoint_times_out_and_is_retried(serve) -> None:
    server, runner = serve({"slow": [{"kind": "hang", "seconds": 3}, OK]}, timeout_s=0.5)
    t0 = time.perf_counter()
    (score,) = runner.score_many([ctx("slow")])
    assert time.perf_counter() - t0 < 2.5
    assert score.score == 7.0
    assert runner.stats()["retries"] == 1


def test_garbage_is_a_failure_not_a_score(serve) -> None:
    server, runner = serve({"junk": [{"kind": "garbage"}]})
    (score,) = runner.score_many([ctx("junk")])
    assert score.score is None and score.error.startswith("request failed: invalid response")
    stats = runner.stats()
    assert stats["failures"] == 1 and stats["unscored"] == 1


def test_missing_score_line_gets_one_follow_up(serve) -> None:
    first = reply("The code in step 3 is fine, it prints 5 out of 10 digits.")
    server, runner = serve({"fmt": [first, reply("PROCESS_SCORE: 6")]})
    (score,) = runner.score_many([ctx("fmt")])
    assert score.score == 6.0  # from the follow-up, not the stray 3/5/10 of the analysis
    assert score.rationale.startswith("The code in step 3")
    follow = server.requests[-1]["messages"]
    assert len(follow) == 4 and follow[2]["role"] == "assistant" and "PROCESS_SCORE" in follow[3]["content"]
    stats = runner.stats()
    assert stats["calls"] == 2 and stats["prompt_tokens"] == 200 and stats["completion_tokens"] == 40


def test_still_missing_after_follow_up_is_unscored_and_cached(serve) -> None:
    server, runner = serve({"mute": [reply("Looks good overall, 8 steps.")]})
    (score,) = runner.score_many([ctx("mute")])
    assert score.score is None and "after the follow-up" in score.error
    assert server.attempts["mute"] == 2  # exactly one follow-up
    again = runner.score_many([ctx("mute")])[0]
    assert again.cached and again.score is None and server.attempts["mute"] == 2
    stats = runner.stats()
    assert stats["cache_hits"] == 1 and stats["unscored"] == 2 and stats["calls"] == 2


def test_mixed_faults_in_one_concurrent_run(serve) -> None:
    plan = {
        "ok": [OK],
        "rl": [status(429, {"Retry-After": "0"}), OK],
        "down": [status(503)],
        "junk": [{"kind": "garbage"}],
        "fmt": [reply("no line here"), reply("PROCESS_SCORE: 4")],
    }
    server, runner = serve(plan, concurrency=4)
    cases = ["ok", "rl", "down", "junk", "fmt"]
    scores = runner.score_many([ctx(c) for c in cases])
    assert [s.score for s in scores] == [7.0, 7.0, None, None, 4.0]
    stats = runner.stats()
    # calls: ok 1 + rl 2 + down 3 + junk 1 + fmt 2
    assert stats["calls"] == 9 and stats["retries"] == 3 and stats["failures"] == 2 and stats["unscored"] == 2
    # Second pass: the three judgments are cached, the two failures are asked again.
    runner.score_many([ctx(c) for c in cases])
    assert runner.stats()["cache_hits"] == 3
    assert server.attempts["ok"] == 1 and server.attempts["down"] == 6


def test_expected_score_from_top_logprobs(serve) -> None:
    def tok(t: str, p: float, top: dict[str, float] | None = None) -> dict:
        alts = top or {t: p}
        return {
            "token": t,
            "logprob": math.log(p),
            "bytes": None,
            "top_logprobs": [{"token": k, "logprob": math.log(v), "bytes": None} for k, v in alts.items()],
        }

    content = [tok("Fine", 1.0), tok(".\n", 1.0), tok("PROCESS_SCORE", 1.0), tok(":", 1.0)]
    content += [tok(" 7", 0.5, {" 7": 0.5, " 8": 0.3, " 6": 0.2}), tok("\n", 1.0)]
    step = reply("Fine.\nPROCESS_SCORE: 7\n", logprobs=content)
    server, runner = serve({"lp": [step]})
    (score,) = runner.score_many([ctx("lp")])
    assert score.score == pytest.approx(7.1)
    assert server.requests[0]["logprobs"] is True and server.requests[0]["top_logprobs"] == 20
    # Switched off: the sampled number, and no logprobs requested.
    server2, runner2 = serve({"lp": [step]}, expected_score=False, cache=False)
    assert runner2.score_many([ctx("lp")])[0].score == 7.0
    assert "logprobs" not in server2.requests[0]


def test_servers_without_logprobs_fall_back_to_parsing(serve) -> None:
    server, runner = serve({"default": [{"kind": "no_logprobs"}]}, cache=False)
    scores = runner.score_many([ctx("a"), ctx("b")])
    assert [s.score for s in scores] == [7.0, 7.0]
    assert sum(bool(r.get("logprobs")) for r in server.requests) >= 1
    assert not server.requests[-1].get("logprobs")
    assert runner.stats()["failures"] == 0


def test_concurrency_limit(serve) -> None:
    server, runner = serve({"default": [{"kind": "delay", "seconds": 0.3}]}, concurrency=2, cache=False)
    scores = runner.score_many([ctx(f"c{i} ") for i in range(6)])
    assert all(s.score == 7.0 for s in scores)
    assert server.max_in_flight == 2


def test_cost_and_latency_accounting(serve) -> None:
    server, runner = serve({"default": [OK]}, price_prompt_per_m=2.0, price_completion_per_m=10.0, cache=False)
    runner.score_many([ctx(f"x{i} ") for i in range(4)])
    stats = runner.stats()
    assert stats["prompt_tokens"] == 400 and stats["completion_tokens"] == 80
    assert stats["cost_usd"] == pytest.approx((400 * 2.0 + 80 * 10.0) / 1e6)
    assert 0 < stats["latency_p50_s"] <= stats["latency_p95_s"]


def test_wrong_credentials_stop_the_run_with_one_line(serve) -> None:
    server, runner = serve({"default": [status(401, message="invalid api key")]})
    with pytest.raises(MappaError, match="HTTP 401"):
        runner.score_many([ctx("any")])


def test_api_key_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAPPA_TEST_NO_SUCH_KEY", raising=False)
    remote = CoachConfig(
        backend="openai", model="m", base_url="https://example.com/v1", api_key_env="MAPPA_TEST_NO_SUCH_KEY"
    )
    with pytest.raises(MappaError, match="MAPPA_TEST_NO_SUCH_KEY"):
        build_coach(remote, "mathchat")
    local = remote.model_copy(update={"base_url": "http://localhost:8000/v1"})
    assert build_coach(local, "mathchat").coach.base_url == "http://localhost:8000/v1"  # a dummy key is fine
    monkeypatch.setenv("MAPPA_TEST_NO_SUCH_KEY", "sk-test")
    assert build_coach(remote, "mathchat").coach.name == "openai"


def test_retry_after_parsing() -> None:
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # in the past
    assert retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({}) is None


def test_identical_contexts_in_one_batch_are_paid_once(serve) -> None:
    server, runner = serve({"dup": [{"kind": "delay", "seconds": 0.2}]}, concurrency=4)
    scores = runner.score_many([ctx("dup"), ctx("dup"), ctx("dup")])
    assert [s.score for s in scores] == [7.0, 7.0, 7.0]
    assert server.attempts["dup"] == 1
    stats = runner.stats()
    assert stats["calls"] == 1 and stats["cache_hits"] == 2 and stats["judgments"] == 3


def test_long_evidence_goes_whole_within_a_large_budget(serve) -> None:
    server, runner = serve({}, max_context_tokens=1_000_000)
    turns = tuple(Message(role="user", content=f"<turn {i}> " + "y" * 20_000) for i in range(4))
    (score,) = runner.score_many([ctx("whole", messages=turns, output="Z" * 30_000)])
    sent = server.requests[0]["messages"][1]["content"]
    assert score.score == 7.0 and score.truncated_inputs == 0
    assert all(m.content in sent for m in turns) and "Z" * 30_000 in sent
    assert runner.stats()["truncated_contexts"] == 0


def test_budget_cuts_the_oldest_input_and_counts_it(serve) -> None:
    # No tokenizer for "judge" on this machine: UTF-8 bytes count, an upper bound on any model's tokens.
    server, runner = serve({}, max_context_tokens=40_000, max_tokens=512)
    assert runner.coach.counted_by == "UTF-8 bytes"
    turns = tuple(Message(role="user", content=f"<turn {i}> " + "y" * 20_000) for i in range(4))
    short = ctx("short")
    long = ctx("long", messages=turns, output="Z" * 10_000 + "END")
    s_short, s_long = runner.score_many([short, long])
    sent = next(r for r in server.requests if "CASE=long" in json.dumps(r))["messages"]
    text = sent[1]["content"]
    assert sum(len(m["content"].encode()) for m in sent) <= 40_000 - 512
    assert "Z" * 10_000 + "END" in text  # the output is never cut
    assert "<turn 3>" in text and "<turn 0>" not in text  # the oldest go first
    assert "cut to fit your context" in text and "left out" in text
    assert s_short.truncated_inputs == 0 and s_long.truncated_inputs >= 2 and s_long.score == 7.0
    assert runner.stats()["truncated_contexts"] == 1
    runner.score_many([long])  # a cache hit is the same judgment on the same cut evidence
    assert runner.stats()["truncated_contexts"] == 2 and runner.stats()["cache_hits"] == 1


def test_an_output_over_the_budget_is_cut_to_its_head_and_tail_and_sent(serve) -> None:
    server, runner = serve({}, max_context_tokens=6_000, max_tokens=256)
    (score,) = runner.score_many([ctx("huge", output="A" + "Z" * 10_000 + "B")])
    sent = server.requests[0]["messages"]
    assert score.score == 7.0 and sum(len(m["content"].encode()) for m in sent) <= 6_000 - 256
    assert "\nA" in sent[1]["content"] and "B\n" in sent[1]["content"]


def test_a_budget_smaller_than_the_template_stops_the_run(serve) -> None:
    server, runner = serve({}, max_context_tokens=2_000, max_tokens=256)
    with pytest.raises(MappaError, match="coach.max_context_tokens: the mathchat prompt needs"):
        runner.score_many([ctx("any")])
    assert not server.requests


def test_an_endpoint_that_is_down_leaves_the_action_unscored_and_uncached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connection refused (nothing listens), not an HTTP error: retried, then unscored with the reason, counted as
    a failure and not cached, so the same action is asked again once the endpoint is back."""
    from mappa.coach.cache import JudgmentCache

    monkeypatch.setattr(OpenAICoach, "backoff_base_s", 0.01)
    with socket.socket() as s:  # a port that was bound and closed: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    cache = tmp_path / "cache.sqlite"
    cfg = CoachConfig(
        backend="openai", model="judge", base_url=url, api_key_env="MAPPA_TEST_NO_SUCH_KEY", max_retries=2,
        cache_path=str(cache),
    )  # fmt: skip
    with build_coach(cfg, "mathchat") as runner:
        (score,) = runner.score_many([ctx("down")])
        stats = runner.stats()
    assert score.score is None and score.error.startswith(f"request failed: cannot connect to {url} (")
    assert score.error.endswith("; gave up after 3 attempts")
    assert (stats["calls"], stats["retries"], stats["failures"], stats["unscored"]) == (3, 2, 1, 1)
    assert len(JudgmentCache(cache)) == 0  # nothing cached: the next pass asks again


def test_a_verdict_cut_by_thinking_is_asked_again_with_twice_the_room(serve) -> None:
    """The thinking model spends 60 of the 64-token cap thinking: the verdict is cut (finish_reason length). The
    same request goes again with twice the written reply's room, and the cut reply counts in coach/cut_rate."""
    server, runner = serve({"think": [thinking(60)]}, max_tokens=64)
    (score,) = runner.score_many([ctx("think")])
    assert score.score == 7.0 and score.error is None
    assert [r["max_tokens"] for r in server.requests] == [64, 128]
    assert server.requests[1]["messages"] == server.requests[0]["messages"]  # asked again, not a follow-up
    stats = runner.stats()
    assert (stats["calls"], stats["replies"], stats["cut_replies"]) == (2, 2, 1)
    assert stats["cut_rate"] == 0.5 and stats["unscored"] == 0


def test_a_thinking_budget_keeps_the_verdict_room_apart(serve) -> None:
    """With coach.thinking_budget the cap is the budget plus the reply's room: the same model is not cut, and an
    OpenAI-style endpoint gets the cap as max_completion_tokens (its reasoning models refuse max_tokens)."""
    server, runner = serve({"think": [thinking(60)]}, max_tokens=64, thinking_budget=256, reasoning_effort="low")
    (score,) = runner.score_many([ctx("think")])
    assert score.score == 7.0
    (request,) = server.requests
    assert request["max_completion_tokens"] == 256 + 64 and "max_tokens" not in request
    assert request["reasoning_effort"] == "low"
    assert runner.stats()["cut_rate"] == 0.0


def test_a_verdict_still_cut_with_more_room_is_unscored_and_says_so(serve) -> None:
    server, runner = serve({"ramble": [thinking(5_000)]}, max_tokens=64)
    (score,) = runner.score_many([ctx("ramble")])
    assert score.score is None
    assert score.error.startswith("no PROCESS_SCORE line: the reply was cut at the token cap")
    assert "room for a 128-token reply" in score.error
    assert server.attempts["ramble"] == 2  # no follow-up: it would be cut as well
    stats = runner.stats()
    assert stats["cut_replies"] == 2 and stats["cut_rate"] == 1.0 and stats["unscored"] == 1 and stats["failures"] == 0


def test_a_cut_reply_that_holds_its_verdict_is_scored_as_it_is(serve) -> None:
    # The verdict came before the cap cut off whatever followed: no second request.
    server, runner = serve({"late": [{**OK, "finish": "length"}]})
    (score,) = runner.score_many([ctx("late")])
    assert score.score == 7.0 and server.attempts["late"] == 1
    assert runner.stats()["cut_rate"] == 1.0


def test_an_endpoint_without_logprobs_is_named_once_for_the_whole_run(serve) -> None:
    """coach.expected_score on and no log-probs in any reply: one warning for the run, not one per action."""
    server, runner = serve({"default": [OK]}, cache=False)
    with pytest.warns(RuntimeWarning) as record:
        runner.score_many([ctx(f"n{i} ") for i in range(4)])
        runner.score_many([ctx("again")])
    said = [str(w.message) for w in record if "log-probs" in str(w.message)]
    assert len(said) == 1 and "coach.expected_score" in said[0] and server.url in said[0]
    assert runner.stats()["replies_without_logprobs"] == 5


def test_an_endpoint_that_refuses_logprobs_is_named_once(serve) -> None:
    server, runner = serve({"default": [{"kind": "no_logprobs"}]}, cache=False)
    with pytest.warns(RuntimeWarning) as record:
        runner.score_many([ctx("a"), ctx("b"), ctx("c")])
    assert sum("log-probs" in str(w.message) for w in record) == 1


def test_no_warning_when_the_sampled_score_was_asked_for(serve, recwarn: pytest.WarningsRecorder) -> None:
    server, runner = serve({"default": [OK]}, expected_score=False, cache=False)
    runner.score_many([ctx("a"), ctx("b")])
    assert not [w for w in recwarn if "log-probs" in str(w.message)]
    assert runner.stats()["replies_without_logprobs"] == 0


@pytest.mark.parametrize(
    ("url", "settings", "fields"),
    [
        ("https://api.openai.com/v1", {}, {"max_tokens": 512}),
        (
            "https://api.openai.com/v1",
            {"reasoning_effort": "medium"},
            {"max_completion_tokens": 8192 + 512, "reasoning_effort": "medium"},
        ),
        (
            "https://generativelanguage.googleapis.com/v1beta/openai/",
            {"thinking_budget": 1024},
            {"max_tokens": 1024 + 512, "extra_body": {"google": {"thinking_config": {"thinking_budget": 1024}}}},
        ),
        (
            "https://generativelanguage.googleapis.com/v1beta/openai/",
            {"reasoning_effort": "none"},
            {"max_tokens": 512, "reasoning_effort": "none"},
        ),
        (
            "https://api.anthropic.com/v1/",
            {"thinking_budget": 2048},
            {"max_tokens": 2048 + 512, "thinking": {"type": "enabled", "budget_tokens": 2048}},
        ),
        (
            "https://api.anthropic.com/v1/",
            {"thinking_budget": 0},
            {"max_tokens": 512, "thinking": {"type": "disabled"}},
        ),
        ("http://127.0.0.1:8000/v1", {"thinking_budget": 300}, {"max_completion_tokens": 300 + 512}),
    ],
)
def test_thinking_settings_as_each_api_names_them(url: str, settings: dict, fields: dict) -> None:
    from mappa.coach.openai_backend import thinking_api, token_fields

    cfg = CoachConfig(backend="openai", model="m", base_url=url, **settings)
    assert token_fields(cfg, thinking_api(url)) == fields


def test_thinking_settings_an_api_cannot_take_stop_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAPPA_TEST_KEY", "k")
    gemini = dict(backend="openai", model="gemini-2.5-flash", api_key_env="MAPPA_TEST_KEY",
                  base_url="https://generativelanguage.googleapis.com/v1beta/openai/")  # fmt: skip
    with pytest.raises(MappaError, match="coach.reasoning_effort"):
        build_coach(CoachConfig(**gemini, thinking_budget=1024, reasoning_effort="low"), "mathchat")
    claude = {**gemini, "base_url": "https://api.anthropic.com/v1/", "model": "claude-sonnet-4-5"}
    with pytest.raises(MappaError, match="coach.thinking_budget: .*1024"):
        build_coach(CoachConfig(**claude, thinking_budget=500), "mathchat")


def test_the_prompt_budget_keeps_room_for_thinking(serve) -> None:
    with pytest.raises(MappaError, match="coach.thinking_budget"):
        serve({}, max_context_tokens=8_000, max_tokens=256, thinking_budget=7_000)


def test_thinking_settings_are_part_of_the_cache_key(serve) -> None:
    server, runner = serve({"k": [OK]})
    runner.score_many([ctx("k")])
    _, other = serve({"k": [OK]}, thinking_budget=512)
    assert runner._key(ctx("k"))[0] != other._key(ctx("k"))[0]
    assert not other.score_many([ctx("k")])[0].cached
