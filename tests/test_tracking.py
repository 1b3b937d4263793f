"""Experiment tracking and the per-agent metrics it carries: metrics.jsonl always, the trackers of
`logging.report_to` (real TensorBoard event files, W&B offline, MLflow on a local store, trackio on a local
database) continuing the same tracked run across a resume, a step's typed results under the names metrics.jsonl
has always used, and the update's `entropy` and the trainer's `reward_std` checked against a direct computation."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import sampled_actions, tiny_cfg, update_policy

from mappa.config import Config, dump_config, load_config
from mappa.errors import MappaError
from mappa.training.tracking import Tracker, drop_lines_after, new_run_dir, read_metrics, tracker_ids

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


def log_steps(run_dir: Path, steps: range, offset: float, **kw: object) -> Tracker:
    tracker = Tracker(run_dir, run_name="r1", config={"seed": 1, "train": {"lr": 1e-5}}, **kw)
    for step in steps:
        tracker.log({"agent/solver/entropy": offset + step, "nan_is_dropped": math.nan}, step)
    tracker.close()
    return tracker


def resume_at(run_dir: Path, step: int) -> None:
    """What `restore_run` does to the logs when it loads the checkpoint of `step`."""
    drop_lines_after(run_dir / "metrics.jsonl", step)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "report_to", "project"),
    [
        ([], ["tensorboard"], "mappa"),
        (["logging.report_to=wandb,mlflow"], ["wandb", "mlflow"], "mappa"),
        (["logging.report_to=[]"], [], "mappa"),
        (["logging.report_to=[trackio,trackio]", "logging.project=p"], ["trackio"], "p"),
    ],
)
def test_report_to_and_project(overrides: list[str], report_to: list[str], project: str) -> None:
    cfg = load_config(None, overrides)
    assert (cfg.logging.report_to, cfg.logging.project) == (report_to, project)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("logging.report_to=[neptune]", "logging.report_to.0: Input should be 'tensorboard'"),
        # the keys of an unreleased draft: report_to and project say it
        ("logging.tensorboard=false", "logging.tensorboard"),
        ("logging.wandb_project=x", "logging.wandb_project"),
    ],
)
def test_bad_logging_keys_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(MappaError, match=message) as err:
        load_config(None, [override, "logging.project=y"])
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------- trackers
def test_tensorboard_events_continue_across_a_resume(tmp_path: Path) -> None:
    """Real event files read back: the resumed run writes a second file in the same directory, and the steps
    the killed run logged after its checkpoint are replaced by the resumed run's, as in metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    log_steps(run_dir, range(0, 4), 0.0)  # killed after logging step 3; its last checkpoint was step 2
    resume_at(run_dir, 2)
    log_steps(run_dir, range(3, 5), 100.0)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("agent/solver/entropy")]
    assert scalars == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
    assert "nan_is_dropped" not in events.Tags()["scalars"]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    jsonl = [(r["step"], r["agent/solver/entropy"]) for r in read_metrics(run_dir)]
    assert jsonl == scalars  # the ground truth and TensorBoard agree


def test_a_missing_tracker_package_is_one_note_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were not installed
    tracker = log_steps(tmp_path / "run", range(2), 0.0, report_to=["wandb", "tensorboard"])
    assert tracker.warnings == ["logging.report_to: wandb is not installed (pip install wandb); skipped"]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]
    assert any((tmp_path / "run" / "tensorboard").iterdir())
    assert tracker_ids(tmp_path / "run") == {}


def test_wandb_offline_resumes_the_same_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = new_run_dir(load_config(None, [f"run_dir={tmp_path / 'run'}"]))
    started = json.loads((run_dir / "run.json").read_text())["started"]
    first = Tracker(run_dir, report_to=["wandb"], project="p", run_name="r1", config={"seed": 1})
    run_id = first._sinks[0].tracker.id
    first.log({"x": 1.0}, 0)
    first.close()
    second = Tracker(run_dir, report_to=["wandb"], project="p", run_name="r1", config={"seed": 1})
    assert second.warnings == [] and second._sinks[0].tracker.id == run_id
    second.log({"x": 2.0}, 1)
    second.close()
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["trackers"] == {"wandb": run_id} and meta["started"] == started  # new_run_dir's keys kept
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    # `wandb sync` joins them; two runs started within one second get a "-1" suffix after the run id
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(offline) == 2 and all(named.fullmatch(name) for name in offline)


def test_mlflow_resumes_the_same_run_on_a_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for opt-in use
    run_dir = tmp_path / "run"
    kw = {"report_to": ["mlflow"], "project": "exp"}
    log_steps(run_dir, range(0, 3), 0.0, **kw)
    resume_at(run_dir, 1)
    assert log_steps(run_dir, range(2, 4), 100.0, **kw).warnings == []
    run_id = tracker_ids(run_dir)["mlflow"]
    client = MlflowClient()
    experiment = client.get_experiment_by_name("exp")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]  # one run
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "agent/solver/entropy")]
    assert sorted(history) == [(0, 0.0), (1, 1.0), (2, 2.0), (2, 102.0), (3, 103.0)]  # MLflow keeps both of step 2
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "1e-05" and run.info.run_name == "r1"


def test_a_tracker_that_fails_to_start_is_one_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow 3 refuses a file store unless told otherwise: a real start failure, skipped with its reason."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    tracker = log_steps(tmp_path / "run", range(2), 0.0, report_to=["mlflow"])
    assert len(tracker.warnings) == 1 and tracker.warnings[0].startswith("logging.report_to: mlflow did not start (")
    assert "\n" not in tracker.warnings[0] and len(read_metrics(tmp_path / "run")) == 2


TRACKIO_RUN = """
import sys
from mappa.training.tracking import Tracker
tracker = Tracker(sys.argv[1], report_to=["trackio"], project="proj", run_name="r1", config={"seed": 1})
assert tracker.warnings == [], tracker.warnings
for step in range(int(sys.argv[2]), int(sys.argv[3])):
    tracker.log({"x": float(step)}, step)
tracker.close()
"""


def test_trackio_resumes_the_same_run(tmp_path: Path) -> None:
    """In a child process: trackio reads TRACKIO_DIR (its local database) once, at import."""
    pytest.importorskip("trackio")
    import sqlite3

    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "OMP_NUM_THREADS": "1"}
    for start, stop in ((0, 2), (2, 4)):
        cmd = [sys.executable, "-c", TRACKIO_RUN, str(tmp_path / "run"), str(start), str(stop)]
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=240)
    assert tracker_ids(tmp_path / "run") == {"trackio": "r1"}
    with sqlite3.connect(tmp_path / "trackio" / "proj.db") as db:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "metrics" in tables, tables
        runs = {name for (name,) in db.execute("SELECT DISTINCT run_name FROM metrics")}
        steps = sorted(step for (step,) in db.execute("SELECT step FROM metrics WHERE run_name = 'r1'"))
    assert runs == {"r1"} and steps[:4] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------- metrics
def test_update_entropy_is_the_sampled_distributions_entropy_over_the_trained_tokens() -> None:
    """`agent/<g>/entropy` of one optimizer step over the whole batch, against the entropy of softmax(logits / T)
    computed here from one unpadded forward per action, before the step."""
    from mappa.training.trainer import update_settings
    from mappa.training.update import update_group

    temperature = 0.7
    policy = update_policy()
    actions = sampled_actions(policy, "solver", 5, seed=3)
    cfg = Config()
    cfg = cfg.model_copy(
        update={
            "generation": cfg.generation.model_copy(update={"temperature": temperature}),
            "train": cfg.train.model_copy(update={"mini_batch_size": 5, "micro_batch_size": 2, "epochs": 1}),
        }
    )
    entropies = []
    with torch.no_grad(), policy.active("solver") as module:
        for a in actions:
            ids = torch.tensor([list(a.prompt_ids) + list(a.response_ids)])
            logits = module(input_ids=ids).logits[0, len(a.prompt_ids) - 1 : -1].float() / temperature
            entropies += torch.distributions.Categorical(logits=logits).entropy().tolist()
    assert len(entropies) == sum(len(a.response_ids) for a in actions)
    opt = torch.optim.SGD(policy.trainable_parameters("solver"), lr=0.1)
    stats = update_group(policy, opt, actions, [9.0, 1.0, 6.0, 3.0, 10.0], update_settings(cfg, True))
    assert stats.optimizer_steps == 1
    assert stats.entropy == pytest.approx(sum(entropies) / len(entropies), rel=1e-4)
    assert 0 < stats.entropy < math.log(policy.tokenizer.vocab_size)


def test_a_training_step_logs_reward_std_and_entropy_per_agent(tmp_path: Path) -> None:
    from mappa.training.rewards import per_action_scores, reward_mode, select_actions
    from mappa.training.trainer import setup, train_step
    from mappa.types import Episode

    cfg = tiny_cfg(tmp_path, "train.steps=1", "train.prompts_per_step=3", "train.samples_per_prompt=2")
    run_dir = tmp_path / "run"
    run = setup(cfg, run_dir)
    try:
        result = train_step(run)
    finally:
        run.close()
    episodes = [Episode.model_validate_json(x) for x in (run_dir / "episodes.jsonl").read_text().splitlines()]
    scores = per_action_scores(episodes, reward_mode(cfg.coach.backend), cfg.coach.outcome_weight)
    logged = read_metrics(run_dir)[-1]
    spread = []
    for group, members in run.groups.items():
        _, kept, _ = select_actions(episodes, scores, members, cfg.coach.on_unscored, cfg.train.drop_truncated)
        assert kept, group
        mean = sum(kept) / len(kept)
        std = math.sqrt(sum((s - mean) ** 2 for s in kept) / len(kept))
        assert result.groups[group].reward_std == pytest.approx(std)
        assert logged[f"agent/{group}/reward_std"] == pytest.approx(std)
        assert logged[f"agent/{group}/reward_mean"] == pytest.approx(mean)
        assert logged[f"agent/{group}/reward_zero_std"] == float(std == 0)
        if std > 0:
            assert logged[f"agent/{group}/entropy"] > 0
        else:  # scores alike: no update, so no update's figures
            assert f"agent/{group}/entropy" not in logged and logged[f"agent/{group}/optimizer_steps"] == 0
        spread.append(std)
    assert any(s > 0 for s in spread), "no group with different scores: the check would pass with a constant 0"


# What metrics.jsonl names a step's results: these names are the file format (`mappa report`, resumes and the
# tests read them), so they are written out here, not derived from the code that makes them.
GROUP_NAMES = {
    "dropped_empty", "dropped_infra_error", "dropped_truncated", "dropped_unscored", "actions_trained",
    "optimizer_steps", "lr",
}  # fmt: skip
TRAINED_NAMES = GROUP_NAMES | {
    "reward_mean", "reward_std", "reward_zero_std", "loss", "grad_norm", "clip_frac", "ratio_mean", "approx_kl",
    "entropy", "kl", "advantage_abs", "tokens",
}  # fmt: skip


def _update(tokens: float, gap: float | None) -> Any:
    from mappa.training.update import UpdateStats

    return UpdateStats(
        loss=0.1, grad_norm=2.0, clip_frac=0.0, ratio_mean=1.0, approx_kl=0.0, entropy=1.5, kl=0.01,
        advantage_abs=0.8, tokens=tokens, optimizer_steps=2, logprob_gap=gap,
    )  # fmt: skip


def _step(gaps: tuple[float | None, float | None]) -> Any:
    from mappa.training.tracking import StepResult
    from mappa.training.update import GroupResult

    dropped = {"empty": 0, "infra_error": 0, "truncated": 1, "unscored": 2}
    groups = {
        "solver": GroupResult(3, dropped, 5.0, 0.0, 1e-5, _update(30.0, gaps[0])),
        "coder": GroupResult(2, dropped, 6.0, 1.5, 2e-5, _update(10.0, gaps[1])),
        "verifier": GroupResult(0, dropped, None, None, 3e-5, None),
    }
    return StepResult(
        step=4, agents=("solver", "coder", "verifier"), episodes={"train/accuracy": 0.5},
        groups=groups, generation={"generation/decode_steps": 7.0}, coach={"judgments": 9.0, "unscored_rate": 0.0},
        rollout_s=2.0, update_s=4.0, rollout_tokens=100,
    )  # fmt: skip


def test_a_steps_results_are_named_as_metrics_jsonl_has_always_named_them(tmp_path: Path) -> None:
    from mappa.training.tracking import step_metrics

    metrics = step_metrics(_step((None, None)))
    agents = {k for k in metrics if k.startswith("agent/")}
    assert agents == {f"agent/{g}/{k}" for g in ("solver", "coder") for k in TRAINED_NAMES} | {
        f"agent/verifier/{k}" for k in GROUP_NAMES
    }
    assert set(metrics) - agents == {
        "train/accuracy", "generation/decode_steps", "time/rollout_s", "time/update_s", "time/rollout_tokens_per_s",
        "time/update_tokens_per_s", "coach/judgments", "coach/unscored_rate",
    }  # fmt: skip
    assert metrics["agent/solver/reward_zero_std"] == 1.0 and metrics["agent/coder/reward_zero_std"] == 0.0
    assert metrics["agent/verifier/optimizer_steps"] == 0.0 and metrics["agent/verifier/lr"] == 3e-5
    assert metrics["agent/solver/dropped_unscored"] == 2.0 and metrics["agent/coder/actions_trained"] == 2.0
    assert metrics["time/update_tokens_per_s"] == 40.0 / 4.0 and metrics["time/rollout_tokens_per_s"] == 50.0
    tracker = Tracker(tmp_path, report_to=())
    tracker.log_step(_step((None, None)))
    tracker.close()
    (row,) = read_metrics(tmp_path)
    assert row["step"] == 4 and set(row) == {"step", "time", *metrics}

    # a generator that did not sample exactly: each group's gap, and their token-weighted mean
    served = step_metrics(_step((0.2, 0.6)))
    assert served["agent/solver/logprob_gap"] == 0.2 and served["agent/coder/logprob_gap"] == 0.6
    assert served["generation/logprob_gap"] == pytest.approx((0.2 * 30 + 0.6 * 10) / 40)
    assert set(served) - set(metrics) == {
        "agent/solver/logprob_gap",
        "agent/coder/logprob_gap",
        "generation/logprob_gap",
    }


def test_mappa_train_resume_continues_the_tracked_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mappa train`, then `mappa train --resume RUN --set train.steps=2`: TensorBoard holds every row of
    metrics.jsonl once (the first attempt's final evaluation at step 1 included), and W&B (offline, when
    installed) logs both attempts under the one run id kept in run.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mappa.cli import main

    trackers = "[tensorboard,wandb]" if importlib.util.find_spec("wandb") else "[tensorboard]"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(dump_config(tiny_cfg(tmp_path, "train.steps=1", f"logging.report_to={trackers}")))
    assert main(["train", str(config)]) == 0
    time.sleep(1.1)  # W&B names an offline run's folder by the second it started: the attempts must not share one
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=2"]) == 0
    key = "eval/accuracy"
    jsonl = [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r]
    assert [step for step, _ in jsonl] == [0, 1, 2]  # start, the first attempt's final, the resumed run's final
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars(key)] == jsonl
    train_rows = [r["step"] for r in read_metrics(run_dir) if "time/rollout_s" in r]
    assert [e.step for e in events.Scalars("time/rollout_s")] == train_rows == [1, 2]
    if "wandb" in trackers:
        run_id = tracker_ids(run_dir)["wandb"]
        assert len([p for p in (run_dir / "wandb").glob(f"offline-run-*-{run_id}")]) == 2
