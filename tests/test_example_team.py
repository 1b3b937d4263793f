"""The example team in examples/coder_review, imported by path as a user's plug-in is: its workflow with a scripted
policy and the real sandbox, its reward function, and training it with the tiny random model through the Python
entry point and through the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from helpers import assert_updated_where_scores_differ, play_scripted

import mappa
from mappa.config import GenerationConfig, SandboxConfig, WorkflowConfig, load_config
from mappa.errors import MappaError
from mappa.plugins import load_object
from mappa.policy.models import tiny_tokenizer
from mappa.policy.policy import Generation
from mappa.sandbox import Sandbox
from mappa.tasks.sources import load_jsonl
from mappa.types import Action, CoachContext, CoachScore, Episode, ExecResult, Message, Task, read_jsonl

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "coder_review"
# imported the way `workflow.name: team.py:CoderReviewer` and `coach.backend: rewards.py:score` import them
team = sys.modules[load_object(f"{EXAMPLE}/team.py:CoderReviewer", "example").__module__]
score = load_object(f"{EXAMPLE}/rewards.py:score", "example")
TASKS = load_jsonl(str(EXAMPLE / "tasks.jsonl"), "train")
EVAL_TASKS = load_jsonl(str(EXAMPLE / "tasks.jsonl"), "eval")
ADD = next(t for t in TASKS if t.id == "add")
GEN = GenerationConfig(max_new_tokens=300, max_context_tokens=1024)

Reply = Callable[[str | None, Sequence[Message]], str]


class ScriptedPolicy:
    """The `chat_ids`/`generate` surface of mappa.policy.policy.Policy; replies come from a script, not a model."""

    def __init__(self, reply: Reply) -> None:
        self.tokenizer = tiny_tokenizer()
        self.reply = reply
        self.prompts: list[Sequence[Message]] = []  # every conversation an agent was shown

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, agent: str | None, conversations: Sequence[Sequence[Message]], **_: object) -> list[Generation]:
        out = []
        for conv in conversations:
            self.prompts.append(conv)
            text = self.reply(agent, conv)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Generation(tuple(self.chat_ids(conv)), tuple(ids), tuple(-0.5 for _ in ids), text, False))
        return out


def py(code: str) -> str:
    return f"Here it is.\n```python\n{code}\n```"


def script(coder: str, reviewer: str = "APPROVE") -> Reply:
    return lambda agent, conv: coder if agent == "coder" else reviewer


class RecordingScorer:
    """The example's reward function as the stage scorer, keeping every context it was shown."""

    def __init__(self) -> None:
        self.contexts: list[CoachContext] = []

    def __call__(self, contexts: Sequence[CoachContext]) -> list[CoachScore]:
        self.contexts += contexts
        return [CoachScore(score=score(c)) for c in contexts]


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(SandboxConfig(timeout_s=10, concurrency=2, pool=False))
    yield box
    box.close()


def play(sandbox: Sandbox, reply: Reply, tasks: Sequence[Task] = (ADD,), **options: object) -> list[Episode]:
    workflow = team.CoderReviewer(WorkflowConfig(options=options), SandboxConfig())
    return play_scripted(workflow, tasks, ScriptedPolicy(reply), sandbox, RecordingScorer(), gen=GEN)


def scores(ep: Episode) -> list[float | None]:
    return [a.coach.score if a.coach is not None else None for a in ep.actions]


RIGHT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a - b"


# ------------------------------------------------------------------------------------------ the workflow
def test_right_code_passes_the_hidden_tests_and_its_approval_scores_ten(sandbox: Sandbox) -> None:
    (ep,) = play(sandbox, script(py(RIGHT + "\nprint('defined')")))
    coder, reviewer = ep.actions
    assert ep.correct is True and ep.final_answer == RIGHT + "\nprint('defined')"
    assert ep.meta["verdict"] == "approve" and ep.meta["final_tests"]["passed"] == ep.meta["final_tests"]["total"] == 4
    assert coder.exec_result is not None and coder.exec_result.ok
    assert coder.exec_result.stdout == "defined\n>>> add(1, 2)\n3\n"  # the example call as a REPL shows it
    assert "defined\n>>> add(1, 2)\n3" in reviewer.messages[-1].content  # ... and the Reviewer sees it run
    assert reviewer.exec_result is None  # an approval runs nothing
    assert scores(ep) == [10.0, 10.0]


@pytest.mark.parametrize(
    ("coder", "reviewer", "correct", "verdict", "expected"),
    [
        (WRONG, "APPROVE", False, "approve", [5.0, 0.0]),  # approving failing code is the Reviewer's fault
        (WRONG, py(RIGHT), True, "rewrite", [5.0, 10.0]),  # a fix
        (RIGHT, py(WRONG), False, "rewrite", [10.0, 0.0]),  # breaking working code
        (RIGHT, py(RIGHT), True, "rewrite", [10.0, 7.0]),  # a needless rewrite
        (RIGHT, "Looks fine to me.", True, "unclear", [10.0, 1.0]),  # no verdict: the Coder's code stands
        ("def plus(a, b):\n    return a + b", "APPROVE", False, "approve", [2.0, 0.0]),  # wrong name
    ],
)
def test_the_final_code_decides_and_each_action_is_scored_on_its_own_evidence(
    sandbox: Sandbox, coder: str, reviewer: str, correct: bool, verdict: str, expected: list[float]
) -> None:
    (ep,) = play(sandbox, script(py(coder), reviewer))
    assert ep.correct is correct and ep.meta["verdict"] == verdict
    assert scores(ep) == expected
    if verdict == "rewrite":  # the rewrite ran on the example too, so its coach sees the tool result
        result = ep.actions[1].exec_result
        assert result is not None and result.stdout.startswith(">>> add(1, 2)\n")


@pytest.mark.parametrize(
    "code",
    [
        WRONG + "\nprint('PASS')\nprint('all tests passed')",
        # lines in the harness's format with the right values, straight to fd 1, but without the run's nonce
        WRONG
        + "\nimport os\nfor i, v in enumerate([5, 0, 0, 93]):\n    os.write(1, f'{\"0\" * 32} {i} ok {v}\\n'.encode())",
        # an object equal to everything: its repr is not a literal
        "class Same:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Same()",
        "import sys\nsys.exit(0)\n" + RIGHT,  # exits before the function exists
        "import os\n" + RIGHT + "\nos._exit(0)",  # exits before the calls run
    ],
    ids=["prints-pass", "no-nonce", "equal-to-all", "exit-early", "exit-before-calls"],
)
def test_a_faked_result_does_not_pass(sandbox: Sandbox, code: str) -> None:
    (ep,) = play(sandbox, script(py(code)))
    assert ep.correct is False
    assert ep.meta["final_tests"]["passed"] < ep.meta["final_tests"]["total"]
    assert scores(ep)[1] == 0.0  # approving it is the Reviewer's fault


# Looks for the run's nonce wherever the solution's process could find it, by its digest (so the nonce itself
# is in no string of the search); prints which of the parent's files it could open and whether it found the nonce.
NONCE = "5eed" * 8
SEARCH = f"""
import gc, hashlib, linecache, os, re, sys, time
time.sleep(0.2)
parent = os.getppid()
places = ["".join(linecache.getlines("<snippet>")), repr(os.listdir("."))]
for name in ("environ", "cmdline", "mem", "fd/1"):
    try:
        with open(f"/proc/{{parent}}/{{name}}", "rb") as f:
            places.append(f.read(1 << 16).decode("latin-1"))
        print("opened", name)
    except OSError:
        pass
frame = sys._getframe()
while frame is not None:
    places += [repr(frame.f_locals), repr(frame.f_globals)]
    frame = frame.f_back
places += [repr(o) for o in gc.get_objects() if isinstance(o, dict | list | tuple)]
tokens = set(re.findall(r"[0-9a-f]{{32}}", "\\n".join(places)))
print("found", any(hashlib.sha256(t.encode()).hexdigest() == {hashlib.sha256(NONCE.encode()).hexdigest()!r} for t in tokens))
"""


def test_the_solution_cannot_find_the_nonce(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(team.secrets, "token_hex", lambda n: NONCE)
    (ep,) = play(sandbox, script(py(SEARCH + RIGHT)))
    result = ep.actions[0].exec_result
    assert result is not None and result.ok, result
    assert "found False\n>>> add(1, 2)\n3" in result.stdout
    assert "opened mem" not in result.stdout and "opened fd/1" not in result.stdout  # the parent is not dumpable
    assert ep.correct is True  # the search itself does not break an honest solution
    # the search finds the nonce where it is in reach (here: a variable of its own process)
    found = subprocess.run([sys.executable, "-c", "x = '5eed' * 8\n" + SEARCH], capture_output=True, text=True)
    assert "found True" in found.stdout


def test_values_must_match_in_type_too() -> None:
    assert team.same([1, (2, "a")], [1, (2, "a")])
    assert not team.same(True, 1) and not team.same(1.0, 1) and not team.same([1], (1,))
    assert not team.same({"a": [True]}, {"a": [1]})


def test_hidden_tests_never_reach_an_agent(sandbox: Sandbox) -> None:
    wf = team.CoderReviewer(WorkflowConfig(), SandboxConfig())
    coder = Action(agent="coder", turn=0, messages=(), text=py(RIGHT))
    for task in [*TASKS, *EVAL_TASKS]:  # every shipped task: no hidden call in either agent's prompt
        spec = team.task_spec(task)
        assert spec.example.call not in {c.call for c in spec.hidden}
        shown = [*wf.coder_messages(task, spec, 300), *wf.reviewer_messages(task, spec, coder, "out", None, 300)]
        assert not [c.call for c in spec.hidden if any(c.call in m.content for m in shown)], task.id
    policy = ScriptedPolicy(script(py(RIGHT + "\nprint(add(1, 2))"), py(RIGHT)))
    tasks = TASKS[:3]
    episodes = play_scripted(wf, tasks, policy, sandbox, gen=GEN)
    seen = "\n".join(m.content for conv in policy.prompts for m in conv)
    seen += "\n".join(m.content for ep in episodes for a in ep.actions for m in a.messages)
    for task in tasks:
        assert not [c.call for c in team.task_spec(task).hidden if c.call in seen]
    assert not re.search(r"\b[0-9a-f]{32}\b", seen)  # nor any run's nonce


def test_the_coach_sees_each_actions_input_output_and_tool_result(sandbox: Sandbox) -> None:
    scorer = RecordingScorer()
    wf = team.CoderReviewer(WorkflowConfig(), SandboxConfig())
    (ep,) = play_scripted(wf, [ADD], ScriptedPolicy(script(py(WRONG), py(RIGHT))), sandbox, scorer, gen=GEN)
    coder, reviewer = scorer.contexts
    assert coder.agent == "coder" and not coder.is_final and coder.ground_truth is None  # judged on evidence
    assert coder.messages == ep.actions[0].messages and coder.output == ep.actions[0].text
    assert coder.observation == ">>> add(1, 2)\n-1" and coder.extra["example"]["status"] == "fail"
    assert reviewer.is_final and reviewer.ground_truth == ADD.answer  # the final agent: with the ground truth
    assert reviewer.extra["coder_tests"]["ok"] is False and reviewer.extra["final_tests"]["ok"] is True
    assert ">>> add(1, 2)\n-1" in reviewer.messages[-1].content  # what the Reviewer judged
    assert reviewer.observation.startswith(">>> add(1, 2)\n3")  # what its own rewrite did
    # a recorded episode rebuilds the same evidence (replaying it through another coach needs exactly this)
    replayed = Episode.model_validate_json(ep.model_dump_json())
    assert [wf.context(replayed.task, a) for a in replayed.actions] == scorer.contexts


def test_without_the_example_result_the_reviewer_reads_only_the_code(sandbox: Sandbox) -> None:
    (ep,) = play(sandbox, script(py(RIGHT)), show_example_result=False)
    prompt = ep.actions[1].messages[-1].content
    assert RIGHT in prompt and ">>>" not in prompt
    assert ep.actions[0].exec_result is not None  # the Coder's code still ran: its coach needs the result


def test_bad_tasks_and_options_are_one_line_errors(sandbox: Sandbox) -> None:
    bad = ADD.model_copy(update={"answer": "assert add(2, 3) == 5\nprint(add(2, 3))"})
    with pytest.raises(MappaError, match=r"task add: answer: line 2: expected assert CALL == VALUE"):
        play(sandbox, script(py(RIGHT)), [bad])
    with pytest.raises(MappaError, match="task add: meta.example"):
        play(sandbox, script(py(RIGHT)), [ADD.model_copy(update={"meta": {}})])
    with pytest.raises(MappaError, match="workflow.options: unknown key 'show_tests'"):
        team.CoderReviewer(WorkflowConfig(options={"show_tests": True}))
    with pytest.raises(MappaError, match="workflow.options.show_example_result: expected bool"):
        team.CoderReviewer(WorkflowConfig(options={"show_example_result": "yes"}))


def test_rewards_leave_what_they_cannot_judge_unscored() -> None:
    ctx = CoachContext(
        task="t", workflow="coder_review", agent="coder", role="r", is_final=False, messages=(), output="x",
        exec_result=ExecResult(ok=False, infra_error="pool died"), extra={"code": "x", "example": {}},
    )  # fmt: skip
    assert score(ctx) is None  # a sandbox fault is not the agent's
    assert score(ctx.model_copy(update={"workflow": "mathchat", "exec_result": None})) is None
    assert score(ctx.model_copy(update={"exec_result": None, "extra": {}})) is None  # no evidence, no rule


# ------------------------------------------------------------------------------------------------ training
TINY = [
    "model.name=tiny-random",
    "model.lora_r=4",
    "model.lora_alpha=8",
    "generation.max_new_tokens=24",
    "sandbox.pool=false",
    "train.steps=2",
    "train.prompts_per_step=2",
    "train.samples_per_prompt=1",
    "train.drop_truncated=false",  # 24 tokens of a random model are always cut off
    "eval.max_tasks=2",
    "logging.report_to=[]",
]


def assert_both_agents_trained(run_dir: Path, scorer: Callable = score, some: bool = True) -> None:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [next(r for r in rows if r.get("step") == step and "time/rollout_s" in r) for step in (1, 2)]
    assert all(row[f"agent/{agent}/actions_trained"] > 0 for row in steps for agent in ("coder", "reviewer"))
    assert_updated_where_scores_differ(steps, ("coder", "reviewer"), some)
    # every recorded score is the reward function's on the evidence the workflow rebuilds from the record
    wf = team.CoderReviewer(WorkflowConfig(), SandboxConfig())
    episodes = read_jsonl(run_dir / "episodes.jsonl", Episode)
    assert episodes
    for ep in episodes:
        assert [a.coach.score for a in ep.actions] == [scorer(wf.context(ep.task, a)) for a in ep.actions]


def spread_score(ctx: CoachContext) -> float | None:
    """The example's rules plus a little for longer replies: a tiny random model's replies all break the same
    rules, and scores without spread train nothing."""
    base = score(ctx)
    return None if base is None else min(10.0, base + len(ctx.output) % 3)


def test_the_team_trains_from_python_with_objects(tmp_path: Path, one_torch_thread) -> None:
    cfg = load_config(EXAMPLE / "config.yaml", [*TINY, f"run_dir={tmp_path / 'run'}"])
    workflow = team.CoderReviewer(cfg.workflow, cfg.sandbox)
    result = mappa.train(cfg, workflow=workflow, coach=spread_score, train_tasks=TASKS[:2], eval_tasks=EVAL_TASKS[:2])
    assert result.step == 2 and result.gain is not None and result.gain.n_after == 2
    assert_both_agents_trained(result.run_dir, spread_score)
    names = json.loads((result.run_dir / "run.json").read_text())["python_objects"]
    assert names["workflow"].endswith(":CoderReviewer") and names["coach"].endswith(":spread_score")


def test_the_team_trains_through_the_cli(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [a for o in [*TINY, f"run_dir={run_dir}"] for a in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "mappa.cli", "train", str(EXAMPLE / "config.yaml"), *args]
    proc = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    moved = any(v > 0 for r in rows for k, v in r.items() if k.endswith("/optimizer_steps"))
    # the tiny model's replies mostly score alike under these rules: a run that moved no weight says so, exit 3
    assert proc.returncode == (0 if moved else 3), proc.stderr[-2000:]
    assert moved or "WARNING: no agent was updated" in proc.stderr
    saved = load_config(run_dir / "config.yaml")  # absolute: --resume, eval and report import them from anywhere
    assert saved.workflow.name == f"{EXAMPLE}/team.py:CoderReviewer"
    assert saved.coach.backend == f"{EXAMPLE}/rewards.py:score"
    assert saved.tasks.train == [f"jsonl:{EXAMPLE}/tasks.jsonl"]
    assert_both_agents_trained(run_dir, some=False)  # the tiny model's replies all score alike under these rules
