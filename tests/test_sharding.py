"""An update group sharded over 2 processes with FSDP2 (`mappa.policy.sharding`, gloo between CPU processes) takes the
same optimizer steps as one process: the same weights, AdamW moments and metrics after a whole update of
several mini-batches (uneven micro-batch counts, so some passes are idle), and a checkpoint the unsharded policy
loads. Both weight modes: LoRA adapters on a sharded base, and full copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import free_port, sampled_actions, train_cfg, update_policy

from mappa.config import Config
from mappa.policy import sharding
from mappa.policy.policy import Policy
from mappa.training.trainer import update_settings
from mappa.training.update import build_optimizer, update_group
from mappa.types import Action

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

SCORES = [9.0, 1.0, 6.0, 3.0, 10.0, 0.0, 4.0]
# 7 actions in mini-batches of 3 (3, 3, 1), one action per micro-batch: the two ranks make 2 and 1 passes, then
# 1 and an idle one; the log-probs before the update take 4 and 3 (+1 idle) passes.
CFG = train_cfg(mini_batch_size=3, micro_batch_size=1, grad_clip=0.5, lr=0.05)


def update(policy: Policy, actions: list[Action], cfg: Config) -> tuple[dict[str, float], torch.optim.Optimizer]:
    optimizer = build_optimizer(policy, "solver", "solver", cfg.train)
    return asdict(update_group(policy, optimizer, actions, SCORES, update_settings(cfg, True), seed=3)), optimizer


def _rank(rank: int, port: int, mode: str, actions: list[Action], out: Path) -> None:
    """One rank: shard, update, save a checkpoint (rank 0 writes), gather the optimizer state, load both back."""
    torch.set_num_threads(1)
    sharding.init(rank, 2, f"127.0.0.1:{port}", "cpu")
    try:
        policy = update_policy(mode)
        sharding.shard_modules(policy.shardable_modules(), "cpu")
        stats, optimizer = update(policy, actions, CFG)
        policy.save(out / "checkpoint", write=rank == 0)
        state = sharding.host_state(optimizer.state_dict())
        policy.load_weights(out / "checkpoint")
        optimizer.load_state_dict(sharding.optimizer_state_like(optimizer, state))
        again = sharding.host_state(optimizer.state_dict())
        weights = [sharding.host(p) for p in policy.trainable_parameters("solver")]
        sharded = all(isinstance(p, torch.distributed.tensor.DTensor) for p in policy.trainable_parameters("coder"))
        if rank == 0:
            torch.save({"stats": stats, "state": state, "again": again, "weights": weights, "sharded": sharded},
                       out / "rank0.pt")  # fmt: skip
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_ranks_take_the_single_process_steps(mode: str, tmp_path: Path) -> None:
    actions = sampled_actions(update_policy(), "solver", len(SCORES), seed=11)
    policy = update_policy(mode)
    before = [p.detach().clone() for p in policy.trainable_parameters("solver")]
    stats, optimizer = update(policy, actions, CFG)
    assert stats["optimizer_steps"] == 3 and stats["clip_frac"] > 0  # several steps, the clip acting

    mp.start_processes(_rank, args=(free_port(), mode, actions, tmp_path), nprocs=2, start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["sharded"]  # the other agents' weights were sharded too, not only the trained group's

    keys = ("loss", "grad_norm", "clip_frac", "ratio_mean", "kl", "advantage_abs", "tokens", "optimizer_steps")
    for k in (*keys, "entropy"):
        assert got["stats"][k] == pytest.approx(stats[k], rel=1e-4, abs=1e-6), k
    trained = policy.trainable_parameters("solver")
    assert any(not torch.equal(b, p) for b, p in zip(before, trained, strict=True))
    for p, q in zip(trained, got["weights"], strict=True):
        # Two ranks sum gradients in another order than one process; AdamW's division by sqrt(v) can carry
        # that last-bit difference to ~1e-5 on a weight whose second moment is tiny (seen on 1 of 32,768).
        torch.testing.assert_close(q, p.detach(), rtol=1e-4, atol=5e-5)
    want = optimizer.state_dict()["state"]
    for i, moments in got["state"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[k], want[i][k], rtol=1e-4, atol=1e-8)
            torch.testing.assert_close(got["again"]["state"][i][k], moments[k])  # loaded back into the shards

    # The sharded ranks' checkpoint is an ordinary one: an unsharded policy loads the trained weights from it.
    fresh = update_policy(mode)
    fresh.load_weights(tmp_path / "checkpoint")
    for p, q in zip(trained, fresh.trainable_parameters("solver"), strict=True):
        torch.testing.assert_close(q, p.detach(), rtol=1e-4, atol=5e-5)  # the same tolerance as above


def test_without_a_process_group_nothing_is_sharded() -> None:
    t = torch.arange(6.0)
    assert sharding.rank_world() == (0, 1)
    assert sharding.like(t, t + 1).tolist() == (t + 1).tolist()
    assert sharding.all_sum(t.clone()).tolist() == t.tolist()
    assert sharding.shares(7, 2, 1) == [1, 3, 5] and sharding.passes(7, 3) == 3


def test_sharding_without_ray_is_a_one_line_error(tmp_path: Path) -> None:
    from helpers import mappa, one_line_error

    run_dir = tmp_path / "run"
    line = one_line_error(
        mappa("train", "configs/demo.yaml", "--set", "train.gpus_per_agent=2", "--set", f"run_dir={run_dir}")
    )
    assert "train.fsdp_ranks: sharding each agent over 2 processes needs --ray" in line
    assert not run_dir.exists()  # refused before the run directory is made


def test_gpu_train_check_runs_sharded(tmp_path: Path) -> None:
    """`bench/gpu_train_check.py --ranks 2`, the multi-GPU device check, on 2 CPU processes (gloo)."""
    root = Path(__file__).resolve().parents[1]
    argv = ["--tiny", "--ranks", "2", "--steps", "2", "--batch", "3", "--tokens", "5", "--micro-batch", "1"]
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "bench" / "gpu_train_check.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update" in proc.stdout.splitlines()[-1]
    summary = json.loads((tmp_path / "gpu_train_check.json").read_text())
    assert summary["ranks"] == 2 and len(summary["steps"]) == 2
    assert summary["rollout_tokens_per_s"] is None  # synthetic actions: nothing generated
    assert all(s["tokens"] == 3 * 3 * 5 for s in summary["steps"])  # 3 agents x 3 actions x 5 tokens
    assert summary["update_tokens_per_s"] > 0 and summary["update_tflops_per_s"] > 0
