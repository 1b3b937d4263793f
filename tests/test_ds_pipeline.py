"""The data-science pipeline with a scripted policy (fixed replies, a real tokenizer), the real sandbox and real
tabular tasks: a tiny benchmark directory in the mini-DSBench's layout, written here (two train tasks, one eval)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pytest
from helpers import (
    FORGETFUL_ENGINEER,
    ScriptedPolicy,
    fenced,
    play,
    play_scripted,
    reference_team,
)

from mappa.coach.caps import apply_caps, score_cap
from mappa.coach.prompts import DS_PIPELINE, build_messages
from mappa.coach.replay import episode_contexts
from mappa.coach.rubric import rubric_score
from mappa.config import WorkflowConfig, load_config
from mappa.errors import MappaError
from mappa.metrics import episode_metrics
from mappa.sandbox import remove_workspace
from mappa.tasks.dsbench.reference import reference_snippets
from mappa.tasks.sampler import pick_tasks
from mappa.tasks.tabular import TASK_FILES, load_dsbench
from mappa.types import CoachContext, CoachScore, Episode, Task, read_jsonl, write_jsonl
from mappa.workflows import WORKFLOWS, DsPipeline

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ a tiny benchmark


# ------------------------------------------------------------------------------------------------ a scripted team


class RecordingScorer:
    """The rubric coach's rules as a stage scorer, keeping every context it was handed."""

    def __init__(self) -> None:
        self.contexts: list[CoachContext] = []

    def __call__(self, contexts: Sequence[CoachContext]) -> list[CoachScore]:
        self.contexts.extend(contexts)
        return [rubric_score(c) for c in contexts]


def by_agent(episode: Episode, agent: str) -> list:
    return [a for a in episode.actions if a.agent == agent]


# ------------------------------------------------------------------------------------------------ the tests
def test_scripted_team_passes_files_through_all_three_agents(bench: Path, sandbox, tmp_path: Path) -> None:
    tasks = load_dsbench(bench, "train")
    scorer = RecordingScorer()
    episodes = play(tasks, reference_team, sandbox, scorer=scorer)
    for e in episodes:
        assert [a.agent for a in e.actions] == ["data_engineer", "modeler", "analyst"]  # each done in one turn
        assert all(a.exec_result is not None and a.exec_result.ok for a in e.actions), e.actions[-1].exec_result
        de, modeler, analyst = e.actions
        assert {"X_train.pkl", "y_train.pkl", "X_test.pkl"} <= set(de.evidence["files_after"])
        assert de.evidence["files_before"] == sorted(TASK_FILES)
        seen = modeler.messages[1].content
        assert "Saved by the Data Engineer: X_test.pkl, X_train.pkl, y_train.pkl" in seen
        assert "I prepared the data." in seen and "secret plan" not in seen  # final text, reasoning removed
        assert "Warning" not in seen
        assert "Saved by the Modeler: model.pkl" in analyst.messages[1].content
        assert modeler.evidence["files_by_agent"] == {"data_engineer": ["X_test.pkl", "X_train.pkl", "y_train.pkl"]}
        assert "test_evaluation" in analyst.evidence and "test_evaluation" not in modeler.evidence
        sub = e.meta["submission"]
        assert e.correct and sub["valid"] and sub["reason"] == "" and sub["gap"] > 0
        assert sub["reference_fraction"] > 0.9  # the reference team reproduces the reference model
        assert e.meta["missing_files"] == [] and e.final_answer.startswith(f"{sub['metric']}=")
        assert [a.coach.score for a in e.actions][:2] == [8.0, 8.0] and analyst.coach.score >= 8.0
    metrics = episode_metrics(episodes, DsPipeline().agents, "rollout")
    assert metrics["rollout/tabular/valid_rate"] == 1.0 and metrics["rollout/tabular/episodes"] == 2
    assert metrics["rollout/tabular/classification/episodes"] == metrics["rollout/tabular/regression/episodes"] == 1
    assert metrics["rollout/tabular/regression/reference_fraction"] > 0.9
    assert metrics["rollout/tabular/classification/analyst/score_mean"] >= 8.0
    # A replay rebuilds exactly the contexts the coach saw live, from the recorded episodes alone.
    write_jsonl(tmp_path / "episodes.jsonl", episodes)
    again = read_jsonl(tmp_path / "episodes.jsonl", Episode)
    rebuilt = [c for e in again for c in episode_contexts(e, DsPipeline(WorkflowConfig(ds_max_turns=2)))]
    assert sorted(rebuilt, key=repr) == sorted(scorer.contexts, key=repr)  # live order is by stage


def test_no_answer_ever_reaches_a_workspace(bench: Path, sandbox) -> None:
    tasks = load_dsbench(bench, "train")[:1]
    (episode,) = play(tasks, reference_team, sandbox, keep=True)
    workspace = Path(episode.meta["workspace"])
    try:
        files = sorted(str(p.relative_to(workspace)) for p in workspace.rglob("*") if p.is_file())
        answer = Path(tasks[0].meta["answer_path"]).read_bytes()
        assert set(TASK_FILES) <= set(files)
        assert not [f for f in files if "answer" in f.lower()]
        assert not [f for f in files if (workspace / f).read_bytes() == answer]
        assert "target" not in pd.read_csv(workspace / "test.csv").columns
        assert set(files) - set(TASK_FILES) <= {
            "X_train.pkl",
            "y_train.pkl",
            "X_test.pkl",
            "model.pkl",
            "submission.csv",
        }
    finally:
        remove_workspace(workspace, force=True)


def test_a_forgotten_x_test_is_blamed_on_the_data_engineer_not_the_modeler(bench: Path, sandbox) -> None:
    tasks = load_dsbench(bench, "train")[:1]

    def script(task: Task, agent: str, turn: int) -> str:
        if agent == "data_engineer":
            return fenced(FORGETFUL_ENGINEER) if turn == 0 else "I saved the training data."
        return fenced(reference_snippets(task)[agent])

    scorer = RecordingScorer()
    (e,) = play(tasks, script, sandbox, scorer=scorer)
    de, modeler, analyst = by_agent(e, "data_engineer"), by_agent(e, "modeler"), by_agent(e, "analyst")
    assert len(de) == 2 and len(modeler) == 1 and len(analyst) == 2  # the Analyst retries up to its cap
    assert all(a.coach.score <= 2 for a in de) and "X_test.pkl" in de[0].coach.rationale
    assert modeler[0].coach.score >= 7, modeler[0].coach.rationale
    assert all(3 <= a.coach.score <= 5 for a in analyst) and "data_engineer" in analyst[0].coach.rationale
    for later in (modeler[0], analyst[0]):
        assert "Warning: X_test.pkl is missing: the Data Engineer did not save it." in later.messages[1].content
    retry = analyst[1].messages  # the Analyst's second turn sees its traceback and the files
    assert "FileNotFoundError" in retry[-1].content and "Still missing: submission.csv" in retry[-1].content
    assert not e.correct and e.meta["missing_files"] == ["X_test.pkl", "submission.csv"] and e.final_answer is None
    assert e.meta["submission"]["valid"] is False and e.meta["submission"]["gap"] == 0.0
    # The LLM coach's prompt carries the same receipts, and the test-set evaluation for the Analyst only.
    analyst_prompt = build_messages(scorer.contexts[-1], DS_PIPELINE)[1]["content"]
    # File names are JSON strings; the cap's number stands outside the evidence fences, its rule inside.
    assert '- "X_test.pkl" (the data_engineer\'s)' in analyst_prompt and "Test-set evaluation" in analyst_prompt
    # No valid submission, an earlier agent's file missing: capped at 3, never above a trivial submission's cap.
    assert "Hard cap on this action's score\nat most 3\n<<<EVIDENCE-" in analyst_prompt
    assert "no valid submission" in analyst_prompt
    assert "earlier agents' files were missing or unusable" in analyst_prompt
    capped = [apply_caps(c, rubric_score(c)) for c in scorer.contexts if c.agent == "analyst"]
    assert [c.score for c in capped] == [3.0, 3.0] and "capped at 3 from 4" in capped[0].rationale
    assert "a missing required file is the fault of the agent that had to save" in analyst_prompt
    de_prompt = build_messages(scorer.contexts[0], DS_PIPELINE)[1]["content"]
    assert "Test-set evaluation" not in de_prompt and 'missing after the action: "X_test.pkl"' in de_prompt


def test_the_papers_stop_rule_spends_the_turns_an_agent_has(bench: Path, sandbox) -> None:
    """workflow.ds_stop_when_done: false, the paper's rule: an agent whose job is done still takes its next turn
    (the reference team then says "Done." without code, which ends it); ours stops it once its files count."""
    tasks = load_dsbench(bench, "train")[:1]
    (ours,) = play(tasks, reference_team, sandbox)
    scorer = RecordingScorer()
    (paper,) = play(tasks, reference_team, sandbox, scorer=scorer, ds_stop_when_done=False, ds_caps="paper")
    assert [a.agent for a in ours.actions] == ["data_engineer", "modeler", "analyst"]
    # workflow.ds_caps is recorded with the evidence, so the coach (and a replay) caps by the paper's rules
    assert {c.extra.get("cap_rules") for c in scorer.contexts} == {"paper"} and "cap_rules" not in ours.actions[
        -1
    ].evidence
    assert [a.agent for a in paper.actions] == ["data_engineer"] * 2 + ["modeler"] * 2 + ["analyst"] * 2
    assert [a.exec_result is None for a in paper.actions] == [False, True] * 3 and paper.correct


def test_the_papers_prompts_and_coach_feedback_in_the_data_science_team(bench: Path, sandbox) -> None:
    """workflow.prompts: paper: each agent's one first user message is the published template (the Analyst's file
    list with the published warning), a run returns a bare <tool_response>. workflow.show_coach_feedback: each
    later agent's first message carries the coach's note on the final action it is shown of each earlier agent."""
    from mappa.workflows import paper_prompts as paper

    tasks = load_dsbench(bench, "train")[:1]

    def script(task: Task, agent: str, turn: int) -> str:
        if agent == "data_engineer":
            return fenced(FORGETFUL_ENGINEER) if turn == 0 else "<think>plan</think>I saved the training data."
        return fenced(reference_snippets(task)[agent])

    scorer = RecordingScorer()
    (e,) = play(tasks, script, sandbox, scorer=scorer, prompts="paper", show_coach_feedback=True)
    de, modeler, analyst = by_agent(e, "data_engineer"), by_agent(e, "modeler"), by_agent(e, "analyst")
    files = ["description.txt", "sample_submission.csv", "test.csv", "train.csv"]
    first = paper.DS_DATA_ENGINEER.format(
        task_description=tasks[0].problem, available_files_list=paper.files_list(files)
    )
    assert [m.role for m in de[1].messages] == ["user", "assistant", "user"] and de[0].messages[0].content == first
    assert de[1].messages[2].content.startswith("<tool_response>\n") and "Files in the folder" not in str(
        de[1].messages
    )
    modeler_first = modeler[0].messages[0].content
    assert modeler_first.startswith("You are a Modeler in a data science pipeline.")
    assert "**Preprocessing Summary from Data Engineer:**\nI saved the training data." in modeler_first
    note = f"Coach feedback on Data Engineer ({de[1].coach.score:g}/10): {de[1].coach.rationale}"
    assert modeler_first.endswith(note)
    analyst_first = analyst[0].messages[0].content
    assert (
        "\u26a0\ufe0f WARNING: CRITICAL FILES MISSING:\n    - X_test.pkl (preprocessed test features)\n"
        in analyst_first
    )
    assert "model.pkl (trained model)" not in analyst_first  # the Modeler saved it
    assert "Coach feedback on Data Engineer" in analyst_first and "Coach feedback on Modeler" in analyst_first
    # the coach is told each agent's title as its role (the paper's agents had no system prompt)
    assert {c.agent: c.role for c in scorer.contexts}["modeler"] == "Modeler"
    (bare,) = play(tasks, script, sandbox, scorer=RecordingScorer(), prompts="paper")
    assert "Coach feedback" not in str([a.messages for a in bare.actions])  # off: the published behaviour


def test_score_caps_follow_the_paper_and_the_reference_share() -> None:
    def test(metric: str, score: float, share: float) -> dict:
        return {"valid": True, "metric": metric, "score": score, "reference_fraction": share}

    assert score_cap(test("roc_auc", 0.80, 0.95), {})[0] == 8
    assert score_cap(test("accuracy", 0.90, 1.0), {})[0] == 9
    assert score_cap(test("accuracy", 0.90, 0.02), {})[0] == 4  # the majority class: high accuracy, no gain
    assert score_cap(test("roc_auc", 0.50, 0.0), {})[0] == 3
    assert score_cap(test("rmse", 30.0, 0.95), {"range": 100.0})[0] == 6  # 30% of the range
    assert score_cap(test("rmsle", 0.3, 0.5), {})[0] == 6
    # No success, no valid submission: never above what the trivial prediction earns (test_redteam_dsbench.py).
    assert score_cap({**test("accuracy", 0.90, 1.0), "success": False}, {})[0] == 4
    assert score_cap({"valid": False, "metric": "rmse", "score": None, "reference_fraction": 0.0}, {})[0] == 2


def test_the_papers_cap_rules_are_its_prompts_and_travel_in_the_evidence() -> None:
    """workflow.ds_caps: paper: the published coach prompt's rules alone (dsbench_ds_pipeline.yaml, lines 198-255 of
    the published code), where ours differ: no reference-share or trivial-prediction cap, RMSE as a share of the
    IQR for an outlier-heavy target, the upstream-fault exception up to 8, 3-5 for an Analyst an earlier agent
    left without its files."""

    def test(metric: str, score: float, share: float = 0.02) -> dict:
        return {"valid": True, "metric": metric, "score": score, "reference_fraction": share}

    assert score_cap(test("accuracy", 0.90), {})[0] == 4  # the majority class: no gain over the trivial prediction
    assert score_cap(test("accuracy", 0.90), {}, rules="paper")[0] == 9  # the paper's table alone
    heavy, normal = {"range": 100.0, "iqr": 5.0}, {"range": 100.0, "iqr": 25.0}  # 20 IQRs wide vs 4
    assert score_cap(test("rmse", 5.0, 1.0), heavy)[0] == 9  # 5% of the range
    assert score_cap(test("rmse", 5.0, 1.0), heavy, rules="paper")[0] == 4  # 100% of the IQR
    assert score_cap(test("rmse", 5.0, 1.0), normal, rules="paper")[0] == 9
    assert score_cap(test("rmsle", 0.3, 0.5), {}, rules="paper")[0] is None  # no table of the paper's covers it
    upstream = {"X_test.pkl": "data_engineer"}
    assert score_cap(test("roc_auc", 0.54, 0.0), {}, upstream)[0] == 3
    assert score_cap(test("roc_auc", 0.54, 0.0), {}, upstream, rules="paper")[0] == 8
    assert score_cap(test("roc_auc", 0.90, 1.0), {}, upstream, rules="paper")[0] == 9  # never lowered by it
    invalid = {"valid": False, "metric": "rmse", "score": None}
    assert [score_cap(invalid, {}, up, rules="paper")[0] for up in ({}, upstream)] == [2, 5]
    assert [score_cap(invalid, {}, up)[0] for up in ({}, upstream)] == [2, 3]
    evidence = {"test_evaluation": test("accuracy", 0.90), "target_statistics": {}}
    ctx = CoachContext(
        task="t",
        workflow="ds_pipeline",
        agent="analyst",
        role="",
        is_final=True,
        messages=[],
        output="o",
        extra=evidence,
    )
    paper = ctx.model_copy(update={"extra": {**evidence, "cap_rules": "paper"}})
    assert [apply_caps(c, CoachScore(score=9.0)).score for c in (ctx, paper)] == [4.0, 9.0]
    assert "cap_rules" not in build_messages(paper, DS_PIPELINE)[1]["content"]  # bookkeeping, not evidence


def test_a_task_without_files_is_a_one_line_error(sandbox) -> None:
    wf = DsPipeline()
    with pytest.raises(MappaError, match="no meta\\['task_dir'\\]"):
        play_scripted(
            wf, [Task(id="x", problem="p", answer="1", source="arithmetic")], ScriptedPolicy(lambda a, c: ""), sandbox
        )


def test_stratified_draws_keep_the_data_types_in_proportion() -> None:
    tasks = [
        Task(id=f"t{i}", problem="", answer="", source="s", meta={"data_type": "regression" if i < 34 else "cls"})
        for i in range(64)
    ]
    stream = pick_tasks(tasks, 3 * 64, seed=7, stratify_by="data_type")
    for p in range(3):  # every pass is a permutation
        assert sorted(t.id for t in stream[64 * p : 64 * (p + 1)]) == sorted(t.id for t in tasks)
    for lo in range(0, 3 * 64, 16):  # every step of 16 holds 34/64 regression tasks, within one
        n = sum(t.meta["data_type"] == "regression" for t in stream[lo : lo + 16])
        assert abs(n - 16 * 34 / 64) <= 1.5, (lo, n)
    assert pick_tasks(tasks, 20, seed=7, start=30, stratify_by="data_type") == stream[30:50]  # resumable
    assert pick_tasks(tasks, 64, seed=7) != stream[:64]
    with pytest.raises(MappaError, match="no meta\\['level'\\]"):
        pick_tasks(tasks, 4, seed=7, stratify_by="level")


def test_the_workflow_and_presets_are_registered() -> None:
    assert WORKFLOWS["ds_pipeline"] is DsPipeline
    paper = load_config(ROOT / "configs" / "ds_pipeline.yaml")
    t = paper.train
    assert (t.prompts_per_step, t.samples_per_prompt, t.stratify_by, t.mini_batch_size) == (16, 2, "data_type", 16)
    assert (paper.workflow.name, paper.workflow.ds_max_turns, paper.sandbox.timeout_s) == ("ds_pipeline", 4, 60)
    assert paper.tasks.train == ["dsbench"] and paper.tasks.eval == ["dsbench"]
    demo = load_config(ROOT / "configs" / "ds_demo.yaml")
    assert demo.model.name == "smollm2-135m-instruct" and demo.coach.backend == "rubric"


def test_train_one_step_on_tabular_tasks_with_a_tiny_model(bench: Path, tmp_path: Path, one_torch_thread) -> None:
    from mappa.training.trainer import train

    run_dir = tmp_path / "run"
    cfg = load_config(
        ROOT / "configs" / "ds_demo.yaml",
        [
            "model.name=tiny-random",
            f"tasks.dsbench_dir={bench}",
            "tasks.train_size=null",
            "tasks.eval_size=null",
            "generation.max_new_tokens=16",
            "generation.max_context_tokens=4096",
            "sandbox.pool=false",
            "train.steps=1",
            "train.prompts_per_step=2",
            f"run_dir={run_dir}",
        ],
    )
    run_dir.mkdir()
    result = train(cfg, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "time/rollout_s" in r)
    assert step["train/tabular/episodes"] == 4 and "train/tabular/classification/valid_rate" in step
    assert math.isfinite(step["train/tabular/regression/gap"])
    assert "eval/tabular/classification/reference_fraction" in result.final
    episodes = [json.loads(x) for x in (run_dir / "eval" / "final.jsonl").read_text().splitlines()]
    assert all("submission" in e["meta"] for e in episodes)


@pytest.mark.slow
def test_mappa_rollout_of_the_demo_preset_with_the_embedded_model(bench: Path, tmp_path: Path) -> None:
    out = tmp_path / "episodes.jsonl"
    cmd = [sys.executable, "-m", "mappa.cli", "rollout", str(ROOT / "configs" / "ds_demo.yaml"), "--episodes", "1"]
    cmd += ["--out", str(out), "--set", f"tasks.dsbench_dir={bench}", "--set", "tasks.train_size=null"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    (episode,) = read_jsonl(out, Episode)
    assert episode.workflow == "ds_pipeline" and episode.actions[0].agent == "data_engineer"
    assert "submission" in episode.meta and "ds_pipeline rollout" in done.stderr
