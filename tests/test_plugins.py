"""Plug-ins from outside the package: import paths in a config, objects from Python, reward functions as coaches.

The plug-ins here are real files written to a temporary directory (imported by path, as a user's would be) or
functions of this module; training runs the tiny random model for real.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

import mappa
from mappa.cli import main
from mappa.coach import build_coach
from mappa.coach.plugin import FunctionCoach
from mappa.config import CoachConfig, load_config
from mappa.errors import MappaError
from mappa.plugins import anchor, coach_kind, is_import_path, load_object
from mappa.tasks import load_tasks
from mappa.training.rewards import per_action_scores
from mappa.types import Action, CoachContext, CoachScore, Episode, Message, Task, read_jsonl
from mappa.workflows import build_workflow

TINY = [
    "model.name=tiny-random",
    "model.lora_r=4",
    "model.lora_alpha=8",
    "generation.max_new_tokens=12",
    "generation.max_context_tokens=1024",
    "sandbox.pool=false",
    "sandbox.timeout_s=5",
    "coach.cache=false",
    "tasks.arithmetic_train_size=8",
    "tasks.arithmetic_eval_size=2",
    "train.prompts_per_step=2",
    "train.samples_per_prompt=1",
    "train.drop_truncated=false",
    "train.lr=1e-2",
    "logging.report_to=[]",
]

CALLS: list[str] = []


def length_score(ctx: CoachContext) -> float | None:
    """A rule-based process reward: longer outputs score higher, empty ones are unscored."""
    CALLS.append(ctx.agent)
    return None if not ctx.output else min(10.0, len(ctx.output) / 4)


def ctx(output: str = "x") -> CoachContext:
    return CoachContext(
        task="t", workflow="w", agent="a", role="r", is_final=False,
        messages=(Message(role="user", content="q"),), output=output,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- naming
def test_import_path_forms_and_anchoring(tmp_path: Path) -> None:
    assert is_import_path("pkg.mod:Name") and is_import_path("team.py:Team.Inner")
    assert not any(is_import_path(s) for s in ("mathchat", "jsonl:x.jsonl", "hf:org/data:train", "a:b:c", ":x"))
    assert anchor("team.py:T", tmp_path) == f"{tmp_path}/team.py:T"
    assert anchor("sub/team.py:T", tmp_path) == f"{tmp_path}/sub/team.py:T"
    assert anchor("pkg.mod:T", tmp_path) == "pkg.mod:T" and anchor("/abs/t.py:T", tmp_path) == "/abs/t.py:T"


def test_coach_kinds_are_told_apart() -> None:
    """By what an object is and declares: a factory annotates its parameter CoachConfig; a parameter's name says
    nothing (`cfg` unannotated is a reward function's context)."""
    from mappa.coach.outcome import outcome_coach

    def undeclared(cfg):  # noqa: ANN001, ANN202
        return outcome_coach()

    def typed_factory(settings: CoachConfig):  # noqa: ANN202
        return outcome_coach()

    assert coach_kind(FunctionCoach) == "class" and coach_kind(outcome_coach()) == "instance"
    assert coach_kind(typed_factory) == "factory" and coach_kind(undeclared) == "function"
    assert coach_kind(length_score) == "function" and coach_kind(lambda c: 5.0) == "function"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("workflow.name=no_such_pkg.team:Team", "workflow.name: cannot import module 'no_such_pkg.team'"),
        ("workflow.name=mappa.workflows:NoSuch", "workflow.name: mappa.workflows has no attribute 'NoSuch'"),
        ("workflow.name=mappa.types:Task", "workflow.name: mappa.types:Task is not a workflow: no "),
        ("workflow.name=mathchatt", "'mathchatt' is neither one of mathchat, ds_pipeline nor an import path"),
        ("coach.backend=mappa.types:Task", "is not a coach: no score or aclose method"),
        ("coach.backend=/nowhere/rewards.py:score", "coach.backend: plug-in file /nowhere/rewards.py not found"),
        ("tasks.train=[mappa.types:Task]", "tasks.train: mappa.types:Task is not a function (split, seed)"),
    ],
)
def test_a_bad_plugin_is_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(MappaError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_plugin_file_that_fails_to_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "team.py").write_text("import no_such_module_here\n")
    with pytest.raises(
        MappaError, match=r"workflow.name: importing .*team.py failed: ModuleNotFoundError.*at team.py:1"
    ):
        load_config(None, [f"workflow.name={tmp_path}/team.py:Team"])


# ---------------------------------------------------------------------------------------------------- coach
def test_a_reward_function_is_a_coach_and_its_range_is_enforced() -> None:
    runner = build_coach(CoachConfig(), "mathchat", plugin=length_score)
    try:
        scores = runner.score_many([ctx("12345678"), ctx("")])
        assert [s.score for s in scores] == [2.0, None] and scores[1].error
        assert runner.stats()["unscored"] == 1
    finally:
        runner.close()

    def broken(c: CoachContext) -> float:
        raise KeyError("no such field")

    for bad, text in (
        (lambda c: 11.0, "returned 11; scores must lie in 0-10"),
        (lambda c: "7", "must be a number"),
        (broken, r"^error in your reward function test_plugins.py:\d+ \(broken\): KeyError: 'no such field'$"),
    ):
        runner = build_coach(CoachConfig(), "mathchat", plugin=bad)
        try:
            with pytest.raises(MappaError, match=text):
                runner.score_many([ctx()])
        finally:
            runner.close()


def test_a_coach_class_plugin_is_checked_too(tmp_path: Path) -> None:
    (tmp_path / "judge.py").write_text(
        textwrap.dedent(
            """
            from mappa.protocols import CallCounters
            from mappa.types import CoachScore

            class Judge:
                name, model, version, cacheable = "judge", "", "1", False

                def __init__(self, cfg):
                    self.bonus = cfg.options.get("bonus", 0.0)
                    self.counters = CallCounters()

                async def score(self, ctx):
                    return CoachScore(score=3.0 + self.bonus)

                async def aclose(self):
                    pass
            """
        )
    )
    cfg = load_config(None, [f"coach.backend={tmp_path}/judge.py:Judge", "coach.options={bonus: 2.5}"]).coach
    runner = build_coach(cfg, "mathchat")
    try:
        assert runner.score_many([ctx()])[0].score == 5.5
    finally:
        runner.close()
    cfg = load_config(None, [f"coach.backend={tmp_path}/judge.py:Judge", "coach.options={bonus: 9}"]).coach
    runner = build_coach(cfg, "mathchat")
    try:
        with pytest.raises(MappaError, match="judge.py:Judge|Judge: returned 12"):
            runner.score_many([ctx()])
    finally:
        runner.close()


def test_outcome_weight_mixes_the_episode_outcome_into_each_score() -> None:
    def episode(correct: bool | None, scores: list[float | None]) -> Episode:
        actions = tuple(
            Action(agent="a", turn=0, messages=(), text="", coach=None if s is None else CoachScore(score=s))
            for s in scores
        )  # fmt: skip
        task = Task(id="t", problem="p", answer="1", source="s")
        return Episode(id="e", workflow="w", task=task, actions=actions, correct=correct)

    eps = [episode(True, [4.0, None]), episode(False, [4.0]), episode(None, [4.0])]
    assert per_action_scores(eps, "coach", 0.25) == [[5.5, None], [3.0], [4.0]]
    assert per_action_scores(eps, "coach") == [[4.0, None], [4.0], [4.0]]
    with pytest.raises(MappaError, match="outcome_weight"):
        per_action_scores(eps, "coach", 1.5)


# ---------------------------------------------------------------------------------------------------- training
def _team_files(tmp_path: Path) -> Path:
    """A user's project: a team factory, a reward function and tasks, named relatively in its config file."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "team.py").write_text(
        textwrap.dedent(
            """
            from mappa.workflows import MathChat

            def make_team(workflow_cfg, *configs):
                team = MathChat(workflow_cfg, *configs)
                team.name = workflow_cfg.options.get("label", "my_team")
                return team
            """
        )
    )
    # scores that differ between replies: alike, they would train nothing (and `mappa train` would exit 3)
    (project / "rewards.py").write_text(
        "def score(ctx):\n    return (7.0 if len(ctx.output) % 2 else 3.0) if ctx.output.strip() else None\n"
    )
    (project / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "workflow": {"name": "team.py:make_team", "options": {"label": "mine"}},
                "coach": {"backend": "rewards.py:score"},
                "train": {"steps": 1},
            }
        )
    )
    return project


def test_a_team_from_outside_the_package_trains_through_the_cli_and_resumes(
    tmp_path: Path, one_torch_thread, capsys
) -> None:
    project = _team_files(tmp_path)
    run_dir = tmp_path / "run"
    args = ["train", str(project / "config.yaml"), *(a for o in TINY for a in ("--set", o))]
    assert main([*args, "--set", f"run_dir={run_dir}"]) == 0
    saved = load_config(run_dir / "config.yaml")
    assert saved.workflow.name == f"{project}/team.py:make_team"  # absolute: the run imports it again anywhere
    assert saved.coach.backend == f"{project}/rewards.py:score"
    assert build_workflow(saved).name == "mine"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "time/rollout_s" in r)
    scores = [a.coach.score for e in read_jsonl(run_dir / "episodes.jsonl", Episode) for a in e.actions if a.coach]
    assert set(scores) == {3.0, 7.0}  # the plug-in's, recorded as scored
    assert any(step[k] > 0 for k in step if k.endswith("/optimizer_steps"))
    err = capsys.readouterr().err
    assert "the plug-in answered" in err  # the self-test reached the plug-in coach
    # not a terminal (a CI log): what is under way, and progress lines within a step
    assert re.search(r"^step 1: rollouts\n(.*\n)*step 1: rollouts: \d+/\d+ actions \(100%\), \d+ s$", err, re.M), err
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=2"]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 2 and "time/rollout_s" in r for r in rows)
    # evaluation and the report import the plug-ins again from the run's own config
    checkpoint = run_dir / "checkpoints" / "step-000002"
    out = tmp_path / "eval"
    assert main(["eval", str(run_dir / "config.yaml"), "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").is_file() and (out / "summary.jsonl").is_file()
    row = json.loads((out / "summary.jsonl").read_text().splitlines()[-1])
    assert (row["tag"], row["step"]) == ("step-000002", 2)  # a standalone evaluation's row carries its step
    # replay through another coach: the run's config builds the plug-in workflow the episodes name
    scored = tmp_path / "scored.jsonl"
    replay = ["coach", "score", str(run_dir / "episodes.jsonl"), "--config", str(run_dir / "config.yaml")]
    assert main([*replay, "--coach", "outcome", "--out", str(scored)]) == 0
    assert len(scored.read_text().splitlines()) == len((run_dir / "episodes.jsonl").read_text().splitlines())


def test_objects_from_python_train_and_are_recorded(tmp_path: Path, one_torch_thread, capsys) -> None:
    cfg = load_config(None, [*TINY, "train.steps=1", f"run_dir={tmp_path / 'runs' / '{name}-{time}'}"])
    team = build_workflow(cfg)
    tasks = load_tasks(["arithmetic"], cfg.tasks, "train", 1)
    held_out = load_tasks(["arithmetic"], cfg.tasks, "eval", 1)[:2]
    CALLS.clear()
    result = mappa.train(cfg, workflow=team, coach=length_score, train_tasks=tasks[:4], eval_tasks=held_out)
    assert result.step == 1 and result.gain is not None and result.gain.n_after == 2
    assert set(CALLS) >= set(team.agents)  # every agent's actions went through the function
    err = capsys.readouterr().err  # from Python too the run says what it does, unless quiet
    for line in (f"run: {result.run_dir}", "step 1: rollouts", "eval final (step 1): accuracy", "held-out accuracy"):
        assert line in err, line
    assert re.search(r"^step 1: train accuracy \d+%; coach score problem_solver \d", err, re.M), err
    meta = json.loads((result.run_dir / "run.json").read_text())
    assert meta["python_objects"] == {
        "workflow": "mappa.workflows.mathchat:MathChat", "coach": "test_plugins:length_score",
        "train_tasks": "4 tasks", "eval_tasks": "2 tasks",
    }  # fmt: skip
    # the CLI cannot hand the objects back: one line, nothing rewritten
    before = (result.run_dir / "config.yaml").read_text()
    with pytest.raises(MappaError, match=r"given workflow=mappa.workflows.mathchat:MathChat.*from Python"):
        mappa.train(run_dir=result.run_dir, resume=True, overrides=["train.steps=2"])
    assert (result.run_dir / "config.yaml").read_text() == before
    again = mappa.train(
        run_dir=result.run_dir, resume=True, overrides=["train.steps=2"], workflow=team, coach=length_score,
        train_tasks=tasks[:4], eval_tasks=held_out, quiet=True,
    )  # fmt: skip
    assert again.step == 2 and again.final["eval/episodes"] == 2 and again.run_dir == result.run_dir
    assert "step 2" not in capsys.readouterr().err


def test_python_api_errors_before_writing(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(MappaError, match="eval_tasks: no evaluation tasks given"):
        mappa.train(cfg, eval_tasks=[], train_tasks=load_tasks(["arithmetic"], cfg.tasks, "train", 1))
    with pytest.raises(MappaError, match="give a Config"):
        mappa.train()
    with pytest.raises(MappaError, match="give the run_dir"):
        mappa.train(cfg, resume=True)
    assert not (tmp_path / "run").exists()


def test_a_loader_plugin_is_resolved_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "data.py").write_text("def load(split, seed):\n    return []\n")
    fn = load_object(f"{tmp_path}/data.py:load", "tasks.train")
    assert fn("train", 0) == [] and load_object(f"{tmp_path}/data.py:load", "tasks.train") is fn


def test_a_plugin_sibling_never_shadows_a_standard_module(tmp_path: Path) -> None:
    """A plug-in's folder holding a file named like a standard-library module (`json.py`, `wave.py`): the plug-in
    still imports its own siblings, and the standard module stays what every later import (and every process the
    trainer spawns, which inherits `sys.path`) gets."""
    import subprocess
    import sys

    (tmp_path / "wave.py").write_text("raise RuntimeError('the user file shadowed the standard module')\n")
    (tmp_path / "helper_mod_x1.py").write_text("VALUE = 41\n")
    (tmp_path / "team_x1.py").write_text("import helper_mod_x1\n\ndef score(ctx):\n    return helper_mod_x1.VALUE\n")
    fn = load_object(f"{tmp_path}/team_x1.py:score", "coach.backend")
    assert fn(None) == 41
    code = "import wave; print(wave.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": ":".join(sys.path)}, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not out.stdout.strip().startswith(str(tmp_path))
