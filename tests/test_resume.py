"""Checkpoint and resume: atomic checkpoints, and a real `mappa train` process killed mid-run and resumed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, ToyPolicy, interruptible, kill_at_checkpoint, wait_for

from mappa.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


def test_checkpoint_round_trip_restores_weights_optimizer_rng(tmp_path: Path) -> None:
    toy = ToyPolicy()
    opt = torch.optim.AdamW([toy.w], lr=0.1)
    for _ in range(2):
        toy.w.grad = torch.ones(3)
        opt.step()
    opt.param_groups[0]["lr"] = 0.05  # the schedule's value at the step saved
    torch.manual_seed(5)
    save_checkpoint(tmp_path, 2, policy=toy, optimizers={"a": opt}, state={"cursor": 8})
    expected_next = torch.rand(4)
    w_saved = toy.w.detach().clone()

    toy2 = ToyPolicy()
    opt2 = torch.optim.AdamW([toy2.w], lr=0.1)
    state = load_checkpoint(latest_checkpoint(tmp_path), policy=toy2, optimizers={"a": opt2})
    assert state == {"step": 2, "cursor": 8}
    assert torch.equal(toy2.w, w_saved)
    assert torch.equal(torch.rand(4), expected_next)  # RNG continues where it was saved
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_kept_rng_leaves_every_generator_where_it_was() -> None:
    """The resume's self-test runs inside `kept_rng`: whatever it draws, the next step samples as if it had not."""
    import random

    import numpy as np

    from mappa.training.checkpoint import kept_rng

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
    with kept_rng():
        random.random(), np.random.rand(3), torch.rand(5)  # the work in between
    assert (random.random(), float(np.random.rand())) == expected[:2] and torch.equal(torch.rand(2), expected[2])


def test_half_written_checkpoints_are_ignored(tmp_path: Path) -> None:
    toy = ToyPolicy()
    opt = torch.optim.AdamW([toy.w])
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, policy=toy, optimizers={"a": opt}, state={"cursor": step})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000002", "step-000003"]  # older ones pruned
    (root / ".tmp-step-000004-123").mkdir()  # a kill during the next save
    (root / "step-000005").mkdir()  # a directory without state.json
    assert latest_checkpoint(tmp_path) == root / "step-000003"
    (root / "latest").unlink()
    assert latest_checkpoint(tmp_path) == root / "step-000003"


def _train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/rollout_s" in r]


def _mappa(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "mappa.cli", *args], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        preexec_fn=interruptible,
    )  # fmt: skip


def test_sigkill_mid_run_then_resume_continues_exactly(tmp_path: Path) -> None:
    from mappa.config import load_config
    from mappa.policy.policy import Policy
    from mappa.training.trainer import train

    steps = 4
    killed_dir = tmp_path / "killed"
    overrides = [*TINY, f"train.steps={steps}", f"run_dir={killed_dir}"]
    proc = _mappa(["train", *[a for o in overrides for a in ("--set", o)]], tmp_path / "first.log")
    try:
        kill_at_checkpoint(proc, killed_dir, 2, tmp_path / "first.log")
    finally:
        proc.kill()
        proc.wait()
    interrupted = {r["step"] for r in _train_rows(killed_dir)}
    assert 2 in interrupted and steps not in interrupted

    resumed = _mappa(["train", "--resume", str(killed_dir)], tmp_path / "resume.log")
    assert resumed.wait(timeout=240) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    log = (tmp_path / "resume.log").read_text()
    assert "resumed from" in log and "at step 2" in log and "self-test ok" in log  # the self-test runs again
    assert [r["step"] for r in _train_rows(killed_dir)] == list(range(1, steps + 1))  # each step logged once
    episode_steps = [json.loads(x)["meta"]["step"] for x in (killed_dir / "episodes.jsonl").read_text().splitlines()]
    assert episode_steps == sorted(episode_steps) and episode_steps.count(3) == 2
    assert latest_checkpoint(killed_dir).name == f"step-{steps:06d}"

    # The same run without the kill ends with the same weights: resume restored everything that matters.
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    cfg = load_config(None, [*TINY, f"train.steps={steps}", f"run_dir={straight_dir}"])
    train(cfg, straight_dir)
    a = Policy.from_checkpoint(latest_checkpoint(killed_dir) / "policy", device="cpu")
    b = Policy.from_checkpoint(latest_checkpoint(straight_dir) / "policy", device="cpu")
    for agent in a.agents:
        for p, q in zip(a.trainable_parameters(agent), b.trainable_parameters(agent), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ damaged runs and interrupted ones
def tree(path: Path) -> dict[str, str]:
    """Every file under `path` and the hash of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def error_line(err: str) -> str:
    """The one error line of a failed command: the last line, the only error, no traceback."""
    lines = [x for x in err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("mappa: error: ")]
    assert "Traceback" not in err and len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-step run made by `mappa train` (in-process): two checkpoints, logs, evals, config.yaml."""
    from mappa.cli import main

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = [a for o in [*TINY, "train.steps=2", f"run_dir={run_dir}"] for a in ("--set", o)]
        assert main(["train", *args]) == 0
    finally:
        torch.set_num_threads(before)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000002"
    return run_dir


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def other_agents(ckpt: Path) -> None:
    """The checkpoint's weights replaced by those of a team with other agents."""
    from mappa.config import load_config
    from mappa.policy.policy import Policy

    shutil.rmtree(ckpt / "policy")
    Policy.from_config(load_config(None, TINY).model, ["analyst", "critic"], seed=0).save(ckpt / "policy")


def no_state_anywhere(ckpt: Path) -> None:
    """No `latest` and no checkpoint with its state.json: damage, not a run stopped before its first checkpoint."""
    (ckpt.parent / "latest").unlink()
    for state in ckpt.parent.glob("step-*/state.json"):
        state.unlink()


DAMAGE = {
    "truncated trainer.pt": (lambda c: truncate(c / "trainer.pt"), "step-000002/trainer.pt: unreadable, truncated"),
    "truncated rng.pt": (lambda c: truncate(c / "rng.pt"), "step-000002/rng.pt: unreadable, truncated"),
    "missing state.json": (lambda c: (c / "state.json").unlink(), "step-000002/state.json: missing"),
    "no complete checkpoint": (no_state_anywhere, "step-000002/state.json: missing (no complete checkpoint"),
    "truncated adapter": (
        lambda c: truncate(c / "policy" / "adapters" / "agent_problem_solver" / "adapter_model.safetensors"),
        "agent_problem_solver/adapter_model.safetensors: unreadable weights",
    ),
    "other agents": (other_agents, "policy/mappa_policy.json: checkpoint has agents ['analyst', 'critic']"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_resume_of_a_damaged_checkpoint_is_one_line_and_changes_nothing(
    damage: str, finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mappa.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    harm, message = DAMAGE[damage]
    harm(run_dir / "checkpoints" / "step-000002")
    before = tree(run_dir)
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=3"]) == 2
    line = error_line(capsys.readouterr().err)
    assert message in line and str(run_dir) in line, line
    assert tree(run_dir) == before  # not a log line dropped, config.yaml not rewritten, no checkpoint written


def test_resume_with_an_incompatible_set_is_one_line_and_changes_nothing(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mappa.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = tree(run_dir)
    # The run trained one adapter per agent; the shared baseline cannot continue from its checkpoint.
    assert main(["train", "--resume", str(run_dir), "--set", "model.agent_weights=shared"]) == 2
    line = error_line(capsys.readouterr().err)
    assert "step-000002/policy/mappa_policy.json" in line and "(lora)" in line and "(shared)" in line, line
    assert main(["train", "--resume", str(run_dir), "--set", "train.stepz=3"]) == 2
    assert "train.stepz" in error_line(capsys.readouterr().err)
    assert tree(run_dir) == before  # config.yaml keeps the run's own settings


def test_resume_checks_the_coach_before_training_on_it(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume runs the self-test again: a coach endpoint that is down stops it at once, not after hours of
    unscored steps, and the run is left as it was (its config.yaml keeps the working coach)."""
    from mappa.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = tree(run_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    down = [
        "train.steps=3", "coach.backend=openai", "coach.model=judge", f"coach.base_url=http://127.0.0.1:{port}/v1",
        "coach.max_retries=0",
    ]  # fmt: skip
    assert main(["train", "--resume", str(run_dir), *[a for o in down for a in ("--set", o)]]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"mappa: error: self-test: the coach did not answer (request failed: cannot connect to "
                           f"http://127.0.0.1:{port}/v1")  # fmt: skip
    assert tree(run_dir) == before


def test_a_coach_that_goes_down_mid_run_stops_it_resumable(tmp_path: Path) -> None:
    """Without the self-test to catch it, `train.max_unscored_steps` consecutive steps in which the coach scored
    nothing stop the run with one line, after those steps are logged and checkpointed."""
    from mappa.config import load_config
    from mappa.errors import MappaError
    from mappa.training.trainer import train

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    coach = [f"coach.base_url={url}", "coach.backend=openai", "coach.model=judge", "coach.max_retries=0"]
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [*TINY, *coach, "train.self_test=false", "train.steps=5", "train.max_unscored_steps=2", f"run_dir={run_dir}"],
    )
    with pytest.raises(MappaError) as info:
        train(cfg, run_dir)
    message = str(info.value)
    assert message.startswith("coach: no action scored in 2 consecutive steps (last: request failed: cannot connect")
    assert message.endswith(f"stopped after step 2, checkpointed: fix the coach, then mappa train --resume {run_dir}")
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2]
    assert all(r["coach/failures"] > 0 for r in _train_rows(run_dir))
    assert latest_checkpoint(run_dir).name == "step-000002"


@pytest.mark.slow  # two `mappa train` processes: over a minute on a busy 2-core CPU
def test_ctrl_c_exits_130_and_the_run_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [*TINY, "train.steps=2", f"run_dir={run_dir}"]
    log = tmp_path / "first.log"
    proc = _mappa(["train", *[a for o in overrides for a in ("--set", o)]], log)
    try:
        wait_for(lambda: latest_checkpoint(run_dir) is not None, proc, log, "the first checkpoint")
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and text.strip().splitlines()[-1] == "mappa: interrupted", text[-3000:]
    assert {r["step"] for r in _train_rows(run_dir)} <= {1, 2} and latest_checkpoint(run_dir).name == "step-000001"

    resumed = _mappa(["train", "--resume", str(run_dir)], tmp_path / "resume.log")
    assert resumed.wait(timeout=240) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2]
    assert latest_checkpoint(run_dir).name == "step-000002"


@pytest.mark.slow  # two `mappa train` processes: over a minute on a busy 2-core CPU
def test_a_run_killed_before_its_first_checkpoint_starts_over_on_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [*TINY, "train.steps=1", f"run_dir={run_dir}"]
    log = tmp_path / "first.log"
    proc = _mappa(["train", *[a for o in overrides for a in ("--set", o)]], log)
    try:  # killed while step 1 plays, after the start evaluation was written
        evals = run_dir / "eval" / "summary.jsonl"  # its line written whole, not just the file opened
        wait_for(lambda: evals.is_file() and evals.read_text().endswith("\n"), proc, log, "the start evaluation")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert latest_checkpoint(run_dir) is None and (run_dir / "config.yaml").is_file()

    resumed = _mappa(["train", "--resume", str(run_dir)], tmp_path / "resume.log")
    assert resumed.wait(timeout=240) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert [r["step"] for r in _train_rows(run_dir)] == [1]
    summary = [json.loads(x)["tag"] for x in (run_dir / "eval" / "summary.jsonl").read_text().splitlines()]
    assert summary == ["start", "final"]  # the start evaluation of the killed attempt is not counted twice
    episode_steps = [json.loads(x)["meta"]["step"] for x in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert episode_steps == [1, 1]


def test_resume_with_set_extends_the_run_and_keeps_the_setting(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mappa.cli import main
    from mappa.config import load_config

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=3"]) == 0
    assert [r["step"] for r in _train_rows(run_dir)] == [1, 2, 3]
    assert load_config(run_dir / "config.yaml").train.steps == 3  # a later plain --resume continues to 3
    assert latest_checkpoint(run_dir).name == "step-000003"


def test_a_run_made_by_mappa_train_is_taken_by_every_command_that_writes_into_it(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The marker `mappa train` writes is what report and eval's default --out ask for (and probe, whose own
    tests mark their run so); eval finds the run from the checkpoint or from its policy/ alike."""
    from mappa.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    assert json.loads((run_dir / "run.json").read_text())["mappa_run"] == 1
    assert main(["report", str(run_dir)]) == 0 and (run_dir / "report.html").is_file()
    config = str(run_dir / "config.yaml")
    assert main(["eval", config, "--checkpoint", str(run_dir / "checkpoints" / "step-000002" / "policy")]) == 0
    assert (run_dir / "eval" / "step-000002.jsonl").is_file() and not (run_dir / "checkpoints" / "eval").exists()
    capsys.readouterr()


@pytest.mark.parametrize(("keep", "left"), [(2, [3, 4]), (1, [4]), (0, [1, 2, 3, 4])])
def test_checkpoint_rotation_keeps_the_newest(tmp_path: Path, keep: int, left: list[int]) -> None:
    """`train.keep_checkpoints`: the newest `keep` complete checkpoints stay (0: all, for `mappa probe`)."""
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, policy=ToyPolicy(), optimizers={}, state={}, keep=keep)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [f"step-{s:06d}" for s in left]
    assert latest_checkpoint(tmp_path).name == "step-000004"
