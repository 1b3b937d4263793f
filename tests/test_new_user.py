"""What a new user meets when bringing their own team: how a coach plug-in's kind is declared, errors in their own
code named by their file and line, their modules under their own names, a reward function's rationale, progress in
a log that is not a terminal, and the command line's help.

Plug-ins are real files written to a temporary directory (imported by path, as a user's are); the CLI runs as a
subprocess, whose stdout and stderr are pipes, as in a CI log.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from helpers import SPREAD_COACH
from rich.console import Console

from mappa.cli import build_parser
from mappa.coach import build_coach
from mappa.config import CoachConfig, load_config
from mappa.errors import MappaError
from mappa.plugins import coach_kind, load_object, qualified_name
from mappa.training.selftest import check_coach
from mappa.training.trainer import Event, Parts
from mappa.types import Action, CoachContext, Episode, Message, Task, read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def mappa(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mappa.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def ctx(**fields: object) -> CoachContext:
    messages = (Message(role="user", content="q"),)
    base = dict(task="t", workflow="w", agent="a", role="r", is_final=False, messages=messages, output="x")
    return CoachContext(**{**base, **fields})


def score_once(plugin: object, context: CoachContext | None = None) -> object:
    runner = build_coach(CoachConfig(), "mathchat", plugin=plugin)
    try:
        return runner.score_many([context or ctx()])[0]
    finally:
        runner.close()


def write(folder: Path, name: str, source: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(source).lstrip())
    return path


def unique(stem: str) -> str:
    """A module name no other test of this process has loaded (a plug-in is imported once per process)."""
    return f"{stem}_{uuid.uuid4().hex[:8]}"


def recorded(folder: Path, agent: str = "verifier", n: int = 1) -> Path:
    task = Task(id="t", problem="What is 2 + 3?", answer="5", source="arithmetic")
    action = Action(agent=agent, turn=0, messages=(Message(role="system", content="role"),), text="\\boxed{5}")
    episodes = [Episode(id=f"e{i}", workflow="mathchat", task=task, actions=(action,), correct=True) for i in range(n)]
    path = folder / "episodes.jsonl"
    write_jsonl(path, episodes)
    return path


# ---------------------------------------------------------------------------------------------- the coach's kind
def test_a_reward_function_whose_parameter_is_named_cfg_is_a_reward_function() -> None:
    def score(cfg):  # noqa: ANN001, ANN202 - the parameter's name says nothing of what it is called with
        return 6.0 if cfg.output else None

    assert coach_kind(score) == "function"
    assert score_once(score).score == 6.0


def test_a_factory_is_declared_by_annotating_its_parameter(tmp_path: Path) -> None:
    name = unique("judges")
    write(tmp_path, f"{name}.py", """
        from __future__ import annotations

        from mappa.coach.outcome import outcome_coach
        from mappa.config import CoachConfig

        def make(settings: CoachConfig):
            return outcome_coach()

        def make_unannotated(cfg):
            return outcome_coach()
    """)  # fmt: skip
    make = load_object(f"{tmp_path}/{name}.py:make", "coach.backend")
    assert coach_kind(make) == "factory"  # a string annotation (postponed evaluation) is read too
    cfg = load_config(None, [f"coach.backend={tmp_path}/{name}.py:make"]).coach
    runner = build_coach(cfg, "mathchat")
    try:
        assert runner.coach.name == "outcome"
    finally:
        runner.close()
    # undeclared, it is a reward function; returning a coach instead of a score says what to declare, in one line
    unannotated = load_object(f"{tmp_path}/{name}.py:make_unannotated", "coach.backend")
    assert coach_kind(unannotated) == "function"
    with pytest.raises(MappaError) as err:
        score_once(unannotated)
    text = str(err.value)
    assert f"{name}.py:make_unannotated" in text and "returned a coach" in text and "cfg: CoachConfig" in text
    assert "\n" not in text


def test_every_kind_mismatch_is_one_line_naming_the_object_and_what_was_expected(tmp_path: Path) -> None:
    name = unique("mistakes")
    write(tmp_path, f"{name}.py", """
        from mappa.config import Config
        from mappa.types import Episode

        def reads_options(cfg):
            return cfg.options.get("bonus", 1.0)

        def takes_an_episode(episode: Episode):
            return 5.0

        def takes_the_whole_config(cfg: Config):
            return None

        def two_arguments(ctx, extra):
            return 5.0
    """)  # fmt: skip
    with pytest.raises(MappaError) as err:
        score_once(load_object(f"{tmp_path}/{name}.py:reads_options", "coach.backend"))
    text = str(err.value)
    assert f"{name}.py:5 (reads_options): AttributeError" in text and "cfg: CoachConfig" in text and "\n" not in text
    for fn, expected in (
        ("takes_an_episode", "a reward function takes one CoachContext"),
        ("takes_the_whole_config", "a factory takes the coach's section: annotate it CoachConfig"),
        ("two_arguments", "must accept one argument"),
    ):
        with pytest.raises(MappaError) as err:
            load_config(None, [f"coach.backend={tmp_path}/{name}.py:{fn}"])
        text = str(err.value)
        assert f"coach.backend: {name}.py:{fn}" in text and expected in text and "\n" not in text, text


def test_a_coach_instance_is_used_as_it_is() -> None:
    from mappa.coach.outcome import outcome_coach

    coach = outcome_coach()
    assert coach_kind(coach) == "instance"
    assert score_once(coach, ctx(is_final=True, extra={"episode_correct": True})).score == 10.0


# ---------------------------------------------------------------------------------------------- (score, why)
def test_a_reward_function_may_return_a_score_and_why() -> None:
    def explained(c: CoachContext) -> tuple[float | None, str]:
        return (3.0, "the example call raised") if c.output else (None, "no code to judge")

    judged = score_once(explained)
    assert (judged.score, judged.rationale) == (3.0, "the example call raised")
    unscored = score_once(explained, ctx(output=""))
    assert unscored.score is None and unscored.rationale == "no code to judge"
    assert "no code to judge" in (unscored.error or "")
    with pytest.raises(MappaError, match=r"returned a tuple of 3 items; return a score .* or \(score, why\)"):
        score_once(lambda c: (1.0, "a", "b"))


def test_coach_score_records_the_why_and_takes_a_plugin_coach(tmp_path: Path) -> None:
    """`mappa coach score --coach FILE.py:NAME` takes a reward function relative to the working directory; the
    rationale it returns lands in the scored episodes (what `mappa trace` and `mappa blame` print)."""
    write(tmp_path, "rewards.py", """
        def score(ctx):
            return 4.0, f"{ctx.agent} answered {ctx.output}"
    """)  # fmt: skip
    episodes = recorded(tmp_path)
    proc = mappa("coach", "score", str(episodes), "--coach", "rewards.py:score", "--out", "scored.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (scored,) = read_jsonl(tmp_path / "scored.jsonl", Episode)
    assert scored.actions[0].coach.score == 4.0 and scored.actions[0].coach.rationale == "verifier answered \\boxed{5}"
    assert "coach rewards.py:score on 1 episodes" in " ".join(proc.stderr.split())
    assert "coach rewards.py:score: scoring: 1/1 actions (100%)" in proc.stderr  # a pipe: lines, not a bar
    proc = mappa("coach", "score", str(episodes), "--coach", "rewards.py:scor", "--out", "scored.jsonl", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("mappa: error: --coach rewards.py:scor: "), proc.stderr
    assert "has no attribute 'scor'" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------- errors in user code
BROKEN_REWARDS = """
    def ratio(ctx):
        return 10 / len(ctx.files_visible)

    def score(ctx):
        return ratio(ctx)
"""


def test_an_error_in_the_reward_function_names_its_file_and_line(tmp_path: Path) -> None:
    write(tmp_path, "rewards.py", BROKEN_REWARDS)
    episodes = recorded(tmp_path)
    args = ["coach", "score", str(episodes), "--coach", "rewards.py:score", "--out", "scored.jsonl"]
    proc = mappa(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "mappa: error in your reward function rewards.py:2 (ratio): ZeroDivisionError: division by zero "
        "(--debug or MAPPA_DEBUG=1: the whole traceback)"
    ]
    for debug in (mappa(*args, "--debug", cwd=tmp_path), mappa(*args, cwd=tmp_path, env={"MAPPA_DEBUG": "1"})):
        assert debug.returncode == 2
        assert "Traceback (most recent call last)" in debug.stderr and 'rewards.py", line 2, in ratio' in debug.stderr
        assert debug.stderr.strip().splitlines()[-1].startswith("mappa: error in your reward function rewards.py:2")
    assert not (tmp_path / "scored.jsonl").exists()


def test_an_error_in_the_workflow_names_its_file_and_line(tmp_path: Path) -> None:
    """A plug-in workflow (a factory in team.py) whose `context` raises while recorded episodes are replayed."""
    write(tmp_path, "team.py", """
        from mappa.workflows import MathChat

        def broken_context(task, action):
            raise ValueError(f"no evidence for {action.agent}")

        def make_team(*configs):
            team = MathChat(*configs)
            team.context = broken_context
            return team
    """)  # fmt: skip
    (tmp_path / "config.yaml").write_text("workflow:\n  name: team.py:make_team\n")
    proc = mappa(
        "coach", "score", str(recorded(tmp_path)), "--config", "config.yaml", "--coach", "rubric", "--out", "s.jsonl",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "mappa: error in your workflow team.py:4 (broken_context): ValueError: no evidence for verifier "
        "(--debug or MAPPA_DEBUG=1: the whole traceback)"
    ]


def test_a_failure_on_the_self_tests_context_says_so_and_what_it_held() -> None:
    def needs_evidence(c: CoachContext) -> float:
        return 10.0 if c.extra["example"]["status"] == "pass" else 0.0

    runner = build_coach(CoachConfig(), "coder_review", plugin=needs_evidence)
    try:
        with pytest.raises(MappaError) as err:
            check_coach(runner.score_many, "coder_review", "reviewer", plugin=True)
    finally:
        runner.close()
    text = str(err.value)
    line = needs_evidence.__code__.co_firstlineno + 1
    assert text.startswith(f"error in your reward function test_new_user.py:{line} (needs_evidence)"), text
    assert "on the self-test's synthetic context" in text and "KeyError: 'example'" in text
    assert "agent 'reviewer' (final)" in text and "task 'What is 2 + 3?'" in text and "extra {}" in text
    assert "return None" in text and "\n" not in text

    runner = build_coach(CoachConfig(), "coder_review", plugin=lambda c: 12.0)
    try:
        with pytest.raises(MappaError, match=r"^self-test: coach .*returned 12.*on the self-test's synthetic context"):
            check_coach(runner.score_many, "coder_review", "reviewer", plugin=True)
    finally:
        runner.close()


# ---------------------------------------------------------------------------------------------- module names
def test_user_files_load_under_their_own_module_names(tmp_path: Path) -> None:
    name, helper = unique("rules"), unique("helpers")
    write(tmp_path, f"{helper}.py", "BONUS = 1.0\n")
    write(tmp_path, f"{name}.py", f"""
        import {helper}

        def score(ctx):
            return 5.0 + {helper}.BONUS
    """)  # fmt: skip
    score = load_object(f"{tmp_path}/{name}.py:score", "coach.backend")
    assert score.__module__ == name and sys.modules[name].score is score
    # a sibling imported by its plain name and named in a config are one module, not two copies
    assert load_object(f"{tmp_path}/{helper}.py:BONUS", "x") == 1.0
    assert sys.modules[helper] is sys.modules[name].__dict__[helper]
    assert qualified_name(score) == f"{name}.py:score"
    assert Parts(coach=score).names() == {"coach": f"{name}.py:score"}  # what run.json records


def test_a_file_named_like_another_module_never_replaces_it(tmp_path: Path) -> None:
    import json as stdlib_json

    shadow = write(tmp_path, "json.py", "def score(ctx):\n    return 1.0\n")
    score = load_object(f"{shadow}:score", "coach.backend")
    assert sys.modules["json"] is stdlib_json and score.__module__ != "json"
    assert qualified_name(score) == "json.py:score"
    name = unique("twice")
    first = load_object(f"{write(tmp_path / 'a', f'{name}.py', 'X = 1')}:X", "x")
    second = load_object(f"{write(tmp_path / 'b', f'{name}.py', 'X = 2')}:X", "x")
    assert (first, second) == (1, 2) and sys.modules[name].X == 1


# ---------------------------------------------------------------------------------------------- progress, help
def test_progress_lines_every_tenth_or_every_half_minute() -> None:
    from mappa.progress import ProgressLines

    lines: list[str] = []
    clock = iter([0.0, 0.0, 1.0, 3.0, 4.0, 40.0, 41.0, 90.0]).__next__
    progress = ProgressLines(lines.append, clock=clock)
    progress.start("step 1: rollouts")  # t=0
    progress(1, 100)  # 1%, t=0: nothing yet
    progress(12, 100)  # 12% at t=1: too soon after the start
    progress(13, 100)  # t=3: a tenth further and 2 s on
    progress(14, 100)  # t=4: nothing
    progress(15, 100)  # t=40: half a minute since the last line
    progress(16, 100)  # t=41: nothing
    progress(100, 100)  # done
    assert lines == [
        "step 1: rollouts: 13/100 (13%), 3 s",
        "step 1: rollouts: 15/100 (15%), 40 s",
        "step 1: rollouts: 100/100 (100%), 90 s",
    ]


def test_the_train_console_prints_progress_lines_when_not_a_terminal() -> None:
    from mappa.cli.train import Printer

    out = io.StringIO()
    printer = Printer(Console(file=out, force_terminal=False, width=200), load_config(None, []))
    printer(Event("status", 1, "step 1: rollouts"))
    for done in range(1, 7):
        printer.progress(done, 6)
    printer(Event("status", 1, "step 1: updating problem_solver"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1: rollouts" and lines[-1] == "step 1: updating problem_solver"
    assert any(x.startswith("step 1: rollouts: 6/6 actions (100%)") for x in lines[1:-1]), lines


@pytest.mark.slow
def test_a_training_run_in_a_log_shows_progress_inside_each_step(tmp_path: Path) -> None:
    """`mappa train` with its output piped (CI, nohup): a line per phase and progress lines within it."""
    settings = [
        "model.name=tiny-random", "model.lora_r=4", "generation.max_new_tokens=8", "sandbox.pool=false",
        "tasks.arithmetic_train_size=4", "tasks.arithmetic_eval_size=2", "train.prompts_per_step=2",
        "train.samples_per_prompt=1", "train.steps=1", "train.drop_truncated=false", f"coach.backend={SPREAD_COACH}",
        "logging.report_to=[]", f"run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    proc = mappa("train", *(a for o in settings for a in ("--set", o)), cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    start, table = lines.index("step 1: rollouts"), next(i for i, x in enumerate(lines) if x.lstrip().startswith("1 "))
    assert any(x.startswith("step 1: rollouts: 6/6 actions (100%)") for x in lines[start:table]), proc.stderr
    assert any(x.startswith("evaluating (start): 2 held-out tasks x 1 at T=") for x in lines), proc.stderr


def test_help_lists_every_command_and_every_option_has_help() -> None:
    proc = mappa("--help")
    assert proc.returncode == 0
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert "{" not in proc.stdout and all(line.strip() != "..." for line in proc.stdout.splitlines())
    for name in commands:
        assert f"\n    {name} " in proc.stdout, name
    description = " ".join(proc.stdout.split("\n\n")[1].split())
    assert description.endswith(".") and "," not in description[-3:]

    def parsers(p: object) -> list[object]:
        subs = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]  # type: ignore[attr-defined]
        return [p, *(q for s in subs for c in s.choices.values() for q in parsers(c))]

    for p in parsers(parser):
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{p.prog} {action.option_strings[0]} has no help"
    score = mappa("coach", "score", "--help").stdout
    assert "FILE.py:NAME" in " ".join(score.split()) and "--debug" in score
