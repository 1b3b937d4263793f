"""Replay of a recorded rollout: a real MathChat rollout (scripted policy, real sandbox, the openai coach against a
real HTTP server, judgments cached in SQLite) is written to JSONL; the contexts rebuilt from the file must be the
ones the coach saw live, so `mappa coach score` on it answers from the cache with zero requests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from helpers import FaultServer, ScriptedPolicy, play_scripted, py, reply

from mappa.coach import build_coach
from mappa.coach.replay import episode_contexts
from mappa.config import load_config
from mappa.sandbox import Sandbox
from mappa.types import CoachContext, CoachScore, Episode, Message, Task, read_jsonl, write_jsonl
from mappa.workflows import build_workflow

ROOT = Path(__file__).resolve().parents[1]


def script(agent: str | None, conv: Sequence[Message]) -> str:
    """Right on the task whose answer is 42, wrong on the other; the Code Executor runs code, then reports."""
    text = " ".join(m.content for m in conv)
    if agent == "problem_solver":
        return "Multiply the two numbers."
    if agent == "code_executor":
        return py("print(6 * 7)") if sum(m.role == "user" for m in conv) == 1 else "The code printed 42."
    return "\\boxed{42}" if "6 * 7" in text else "\\boxed{42}, the same as before"


class Recorder:
    """The workflow's scorer: hands every context to the real coach and keeps what it was shown."""

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.runner = runner
        self.seen: list[CoachContext] = []

    def __call__(self, contexts: Sequence[CoachContext]) -> list[CoachScore]:
        self.seen.extend(contexts)
        return self.runner.score_many(contexts)


def test_replay_of_a_real_rollout_rebuilds_its_contexts_and_costs_no_request(tmp_path: Path) -> None:
    server = FaultServer({"default": [reply("The step is sound.\nPROCESS_SCORE: 7")]})
    overrides = [
        "coach.backend=openai", "coach.model=judge", f"coach.base_url={server.url}", "coach.max_retries=0",
        f"coach.cache_path={tmp_path / 'cache.sqlite'}", "workflow.coder_max_turns=2", "sandbox.pool=false",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    tasks = [
        Task(id="a", problem="What is 6 * 7?", answer="42", source="arithmetic"),
        Task(id="b", problem="What is 5 * 8?", answer="40", source="arithmetic"),
    ]
    try:
        with build_coach(cfg.coach, "mathchat") as runner, Sandbox(cfg.sandbox) as sandbox:
            recorder = Recorder(runner)
            episodes = play_scripted(
                build_workflow(cfg), tasks, ScriptedPolicy(script), sandbox, recorder, gen=cfg.generation
            )
            live_requests = len(server.requests)
        assert [e.correct for e in episodes] == [True, False]  # the rule-based verdict of each verifier
        assert [a.agent for a in episodes[0].actions] == [
            "problem_solver",
            "code_executor",
            "code_executor",
            "verifier",
        ]
        assert episodes[0].actions[1].exec_result.stdout == "42\n"  # the code really ran
        recorded = tmp_path / "episodes.jsonl"
        write_jsonl(recorded, episodes)

        # The file alone rebuilds exactly what the coach was shown, action by action.
        replayed = [c for ep in read_jsonl(recorded, Episode) for c in episode_contexts(ep, build_workflow(cfg))]
        assert len(replayed) == len(recorder.seen) == sum(len(e.actions) for e in episodes) == live_requests
        assert sorted(c.model_dump_json() for c in replayed) == sorted(c.model_dump_json() for c in recorder.seen)

        out = tmp_path / "scored.jsonl"
        cmd = [sys.executable, "-m", "mappa.cli", "coach", "score", str(recorded), "--out", str(out)]
        proc = subprocess.run(
            [*cmd, *[a for o in overrides for a in ("--set", o)]],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert len(server.requests) == live_requests  # every judgment came from the cache: zero requests
    finally:
        server.close()
    scored = read_jsonl(out, Episode)
    assert all(a.coach.cached and a.coach.score == 7.0 for ep in scored for a in ep.actions)
    assert [[a.coach.score for a in ep.actions] for ep in scored] == [
        [a.coach.score for a in ep.actions] for ep in episodes
    ]
