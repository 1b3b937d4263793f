"""Checkpoint and resume: atomic checkpoints, and a real `mappa train` process killed mid-run and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mappa.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.name=tiny-random",
    "model.lora_r=4",
    "model.lora_alpha=8",
    "generation.max_new_tokens=10",
    "sandbox.pool=false",
    "coach.backend=rubric",
    "coach.cache=false",
    "tasks.arithmetic_train_size=32",
    "tasks.arithmetic_eval_size=2",
    "train.prompts_per_step=2",
    "train.samples_per_prompt=1",
    "train.mini_batch_size=1",  # several optimizer steps per agent and step: the schedule and shuffle resume too
    "train.drop_truncated=false",
    "train.lr=1e-2",
    "logging.tensorboard=false",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Toy:
    """The two methods of Policy that checkpointing uses, over one tensor."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.zeros(3))

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        torch.save(self.w.detach(), directory / "w.pt")

    def load_weights(self, directory: Path) -> None:
        with torch.no_grad():
            self.w.copy_(torch.load(directory / "w.pt"))


def test_checkpoint_round_trip_restores_weights_optimizer_rng(tmp_path: Path) -> None:
    toy = _Toy()
    opt = torch.optim.AdamW([toy.w], lr=0.1)
    for _ in range(2):
        toy.w.grad = torch.ones(3)
        opt.step()
    opt.param_groups[0]["lr"] = 0.05  # the schedule's value at the step saved
    torch.manual_seed(5)
    save_checkpoint(tmp_path, 2, policy=toy, optimizers={"a": opt}, state={"cursor": 8})
    expected_next = torch.rand(4)
    w_saved = toy.w.detach().clone()

    toy2 = _Toy()
    opt2 = torch.optim.AdamW([toy2.w], lr=0.1)
    state = load_checkpoint(latest_checkpoint(tmp_path), policy=toy2, optimizers={"a": opt2})
    assert state == {"step": 2, "cursor": 8}
    assert torch.equal(toy2.w, w_saved)
    assert torch.equal(torch.rand(4), expected_next)  # RNG continues where it was saved
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_half_written_checkpoints_are_ignored(tmp_path: Path) -> None:
    toy = _Toy()
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
        [sys.executable, "-m", "mappa.cli", *args], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env
    )


def test_sigkill_mid_run_then_resume_continues_exactly(tmp_path: Path) -> None:
    from mappa.config import load_config
    from mappa.policy import Policy
    from mappa.train import train

    steps = 4
    killed_dir = tmp_path / "killed"
    overrides = [*TINY, f"train.steps={steps}", f"run_dir={killed_dir}"]
    proc = _mappa(["train", *[a for o in overrides for a in ("--set", o)]], tmp_path / "first.log")
    deadline = time.monotonic() + 240
    try:
        while True:  # kill as soon as step 2 is checkpointed: step 3 is then under way
            ckpt = latest_checkpoint(killed_dir) if killed_dir.exists() else None
            if ckpt is not None and ckpt.name == "step-000002":
                break
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    interrupted = {r["step"] for r in _train_rows(killed_dir)}
    assert 2 in interrupted and steps not in interrupted

    resumed = _mappa(["train", "--resume", str(killed_dir)], tmp_path / "resume.log")
    assert resumed.wait(timeout=240) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    log = (tmp_path / "resume.log").read_text()
    assert "resumed from" in log and "at step 2" in log and "self-test" not in log
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
