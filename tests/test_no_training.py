"""A run whose settings leave every action out of the update says so: per step on the console, in the metrics,
in the report, and with exit code 3 at the end; a run that trains says nothing of the kind and exits 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_cfg

from mappa.analysis.behaviour import untrained_lines
from mappa.analysis.report import build_report
from mappa.analysis.runs import load_run
from mappa.cli import main
from mappa.config import dump_config
from mappa.training.rewards import DROP_REASONS, no_training_reason, untrained_groups
from mappa.training.trainer import TrainResult

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def step_row(step: int, **groups: dict[str, int]) -> dict[str, float]:
    row: dict[str, float] = {"step": step, "time/rollout_s": 1.0}
    for g, counts in groups.items():
        row[f"agent/{g}/actions_trained"] = counts.pop("trained", 0)
        row.update({f"agent/{g}/dropped_{why}": counts.get(why, 0) for why in DROP_REASONS})
    return row


def test_the_reason_names_the_counts_and_the_setting() -> None:
    row = step_row(1, coder={"truncated": 6}, verifier={"trained": 2, "truncated": 1}, solver={})
    groups = untrained_groups(row)
    assert set(groups) == {"coder", "solver"}  # verifier trained on 2 actions
    assert no_training_reason(groups["coder"], 128) == (
        "6 of 6 cut off at generation.max_new_tokens=128 (train.drop_truncated)"
    )
    assert no_training_reason(groups["solver"]) == "it played no action"
    mixed = no_training_reason({"truncated": 4, "empty": 0, "infra_error": 0, "unscored": 2}, 64)
    assert mixed == (
        "4 of 6 cut off at generation.max_new_tokens=64 (train.drop_truncated), "
        "2 of 6 unscored by the coach (coach.on_unscored: skip)"
    )


def test_the_report_line_spans_the_steps_and_sums_the_counts() -> None:
    rows = [
        step_row(1, coder={"truncated": 3}, verifier={"trained": 3}),
        step_row(2, coder={"truncated": 2, "empty": 1}, verifier={"trained": 1}),
        step_row(3, coder={"trained": 2}, verifier={"trained": 2}),
        step_row(4, coder={"truncated": 3}, verifier={"trained": 2}),
    ]
    assert untrained_lines(rows, 128) == [
        "coder trained on no action at steps 1-2, 4: 8 of 9 cut off at generation.max_new_tokens=128 "
        "(train.drop_truncated), 1 of 9 empty (no response tokens)"
    ]
    assert untrained_lines([step_row(1, coder={"trained": 1})]) == []


def test_the_report_names_agents_kept_but_not_updated() -> None:
    rows = [step_row(s, coder={"trained": 2}, verifier={"trained": 3}) for s in (1, 2, 3)]
    for r, moved in zip(rows, ((2, 0), (1, 0), (0, 4)), strict=True):  # optimizer steps: coder, verifier
        r["agent/coder/optimizer_steps"], r["agent/verifier/optimizer_steps"] = moved
    assert untrained_lines(rows) == [
        "verifier not updated at steps 1-2: the coach scored its kept actions alike (no spread)",
        "coder not updated at step 3: the coach scored its kept actions alike (no spread)",
    ]
    legacy = [step_row(1, coder={"trained": 2})]  # a run from before optimizer steps were logged: no claim
    assert untrained_lines(legacy) == []


def test_trained_nothing_needs_steps_that_moved_no_weight() -> None:
    def result(trained: dict[str, int], moved: dict[str, int], steps: int) -> TrainResult:
        return TrainResult(Path("."), steps, {}, None, trained, steps, optimizer_steps=moved)

    dropped = result({"coder": 0, "verifier": 0}, {"coder": 0, "verifier": 0}, 2)
    assert dropped.trained_nothing and dropped.why_nothing_trained == "no agent trained on any action"
    # actions kept, but every step's scores agreed within each agent: no update, the weights never moved
    alike = result({"coder": 4, "verifier": 8}, {"coder": 0, "verifier": 0}, 2)
    assert (
        alike.trained_nothing and "scored each agent's kept actions alike in every step" in alike.why_nothing_trained
    )
    assert not result({"coder": 0, "verifier": 1}, {"coder": 0, "verifier": 1}, 2).trained_nothing
    assert not result({}, {}, 0).trained_nothing  # a resume of a finished run ran no step: nothing to judge


def run_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str, Path]:
    cfg = tiny_cfg(tmp_path, "logging.report_to=[]", *overrides)
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    code = main(["train", str(path)])
    return code, capsys.readouterr().err, Path(cfg.run_dir)


def test_a_run_that_drops_every_action_warns_and_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one token per action: every action is cut off at the cap, and drop_truncated leaves all of them out
    code, err, run_dir = run_cli(tmp_path, capsys, "generation.max_new_tokens=1", "train.drop_truncated=true")
    assert code == 3, err
    lines = err.splitlines()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/rollout_s" in r]
    groups = sorted({k.split("/")[1] for r in steps for k in r if k.endswith("/actions_trained")})
    assert len(steps) == 2 and len(groups) == 3
    for r in steps:
        for g in groups:  # the metrics hold the reason: nothing kept, every action dropped for being cut off
            assert r[f"agent/{g}/actions_trained"] == 0 and r[f"agent/{g}/optimizer_steps"] == 0
            played = sum(r[f"agent/{g}/dropped_{why}"] for why in DROP_REASONS)
            assert played > 0 and r[f"agent/{g}/dropped_truncated"] + r[f"agent/{g}/dropped_empty"] == played
            line = f"step {r['step']}: {g} trained on no action: "
            assert any(x.startswith(line) and "generation.max_new_tokens=1 (train.drop_truncated)" in x for x in lines)
    assert any(x.startswith("WARNING: no agent trained on any action in 2 step(s)") for x in lines), err
    run = load_run(run_dir)
    page = build_report([run], [run.thresholds()]).html()
    for g in groups:
        assert f'<div class="warn">warning: {run.name}: {g} trained on no action at steps 1-2: ' in page


def test_a_run_whose_scores_never_differ_warns_and_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # every action kept and scored, all alike: no agent has a spread to learn from, so no weight moves
    (tmp_path / "flat.py").write_text("def score(ctx):\n    return 6.0\n")
    code, err, run_dir = run_cli(tmp_path, capsys, f"coach.backend={tmp_path}/flat.py:score", "train.self_test=false")
    assert code == 3, err
    steps = [r for r in json.loads("[" + ",".join((run_dir / "metrics.jsonl").read_text().splitlines()) + "]")
             if "time/rollout_s" in r]  # fmt: skip
    kept = {k: v for r in steps for k, v in r.items() if k.endswith("/actions_trained")}
    assert len(steps) == 2 and kept and all(v > 0 for v in kept.values())
    assert all(v == 0 for r in steps for k, v in r.items() if k.endswith("/optimizer_steps"))
    assert "trained on no action" not in err and "no spread: nothing to learn from, not updated" in err
    assert any(x.startswith("WARNING: no agent was updated: the coach scored each agent's kept actions alike in "
                            "every step (no spread) in 2 step(s)") for x in err.splitlines()), err  # fmt: skip
    run = load_run(run_dir)
    page = build_report([run], [run.thresholds()]).html()
    groups = sorted({k.split("/")[1] for k in kept})
    for g in groups:
        assert f"{run.name}: {g} not updated at steps 1-2: the coach scored its kept actions alike" in page


def test_a_run_that_trains_exits_0_without_the_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err, run_dir = run_cli(tmp_path, capsys)
    assert code == 0, err
    assert "trained on no action" not in err and "WARNING: no agent trained" not in err
    assert "held-out episodes ending with a final answer (right or wrong): " in err  # before the accuracy lines
    assert err.index("ending with a final answer") < err.index("held-out accuracy") < err.index("gain ")
    run = load_run(run_dir)
    report = build_report([run], [run.thresholds()])
    assert not [x for x in report.untrained if "trained on no action" in x]
    assert "trained on no action" not in report.html()


def test_a_resume_counts_what_the_run_trained_before_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two steps that train, then a resume whose one more step trains nothing: the run as a whole trained.
    code, err, run_dir = run_cli(tmp_path, capsys, "train.checkpoint_every=1")
    assert code == 0, err
    more = ["--set", "train.steps=3", "--set", "generation.max_new_tokens=1", "--set", "train.drop_truncated=true"]
    code = main(["train", "--resume", str(run_dir), *more])
    err = capsys.readouterr().err
    assert code == 0, err
    assert any(x.startswith("step 3: ") and "trained on no action" in x for x in err.splitlines()), err
    assert "WARNING: no agent trained" not in err
