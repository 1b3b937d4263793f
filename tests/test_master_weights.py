"""Trained weights on a bfloat16 base keep float32 masters: at the paper's full fine-tune lr (1e-6) an AdamW step is
far below bfloat16's rounding, so stepped in place the weights would not move at all. Three steps must move them
by about what Adam intends (mean |delta| per element within a factor of 3 of steps x lr), full copies and LoRA
adapters alike, sharded or not; a checkpoint holds the masters, so a resumed run takes the very next step the
uninterrupted one takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import AGENTS, free_port, sampled_actions, train_cfg, update_policy

from mappa.config import Config
from mappa.policy import sharding
from mappa.policy.policy import Policy
from mappa.training.checkpoint import load_checkpoint, save_checkpoint
from mappa.training.trainer import update_settings
from mappa.training.update import build_optimizer, update_group
from mappa.types import Action

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
LR, STEPS = 1e-6, 3
SCORES = [9.0, 1.0, 6.0, 3.0, 10.0, 0.0]
CFG = train_cfg(lr=LR, mini_batch_size=2, micro_batch_size=1)  # 6 actions: 3 optimizer steps


def bf16_policy(agent_weights: str) -> Policy:
    from mappa.policy.models import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=0)
    return Policy.from_model(
        model.to(torch.bfloat16), tok, AGENTS, agent_weights=agent_weights, lora_r=4, lora_alpha=8, seed=0
    )


def actions() -> list[Action]:
    return sampled_actions(update_policy(), "solver", len(SCORES), seed=11)


def train(policy: Policy, optimizer: torch.optim.Optimizer, batch: list[Action], cfg: Config = CFG) -> None:
    # sampled by a float32 policy: the old log-probs are recomputed by the trained one (samples_exactly false)
    update_group(policy, optimizer, batch, SCORES, update_settings(cfg, False), seed=3)


def stepped(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The weights the optimizer steps, in its order (a half-precision weight's float32 master)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def mean_moved(before: list[torch.Tensor], params: list[torch.Tensor]) -> float:
    moved = [(sharding.host(p).float() - b.float()).abs().flatten() for b, p in zip(before, params, strict=True)]
    return float(torch.cat(moved).mean())


@pytest.mark.parametrize("agent_weights", ["full", "lora"])
def test_three_steps_at_lr_1e_6_from_a_bf16_base_move_the_weights_as_adam_intends(agent_weights: str) -> None:
    policy = bf16_policy(agent_weights)
    params = policy.trainable_parameters("solver")
    before = [p.detach().clone() for p in params]
    optimizer = build_optimizer(policy, "solver", "solver", CFG.train)
    train(policy, optimizer, actions())
    # Adam moves each element by about lr per step (less where the gradient's sign flips between steps). The
    # weights as the optimizer holds them (and a checkpoint keeps them) must show it; a bfloat16 weight the policy
    # computes with is their rounding, which moves only once a weight's steps add up to half its rounding step.
    moved = mean_moved(before, stepped(optimizer))
    assert STEPS * LR / 3 <= moved <= STEPS * LR * 3, moved
    assert all(p.dtype == (torch.bfloat16 if agent_weights == "full" else torch.float32) for p in params)
    for p, q in zip(params, stepped(optimizer), strict=True):
        assert torch.equal(p, q.to(p.dtype))  # what the policy computes with is what the optimizer holds
    if agent_weights == "lora":  # the adapters' A matrices too, not only B (which starts at 0, exact in any dtype)
        is_a = [".lora_A." in n for n, p in policy.model.named_parameters() if any(p is q for q in params)]
        a_before = [b for b, a in zip(before, is_a, strict=True) if a]
        a_now = [p for p, a in zip(params, is_a, strict=True) if a]
        assert mean_moved(a_before, a_now) >= LR / 3


def test_resume_from_a_checkpoint_takes_the_uninterrupted_runs_next_step_bit_for_bit(tmp_path: Path) -> None:
    cfg = train_cfg(lr=1e-5, mini_batch_size=2, micro_batch_size=1)
    batch = actions()
    policy = bf16_policy("full")
    optimizer = build_optimizer(policy, "solver", "solver", cfg.train)
    train(policy, optimizer, batch, cfg)
    ckpt = save_checkpoint(tmp_path, 1, policy=policy, optimizers={"solver": optimizer}, state={"cursor": 0})
    train(policy, optimizer, batch, cfg)

    resumed = bf16_policy("full")
    again = build_optimizer(resumed, "solver", "solver", cfg.train)
    load_checkpoint(ckpt, policy=resumed, optimizers={"solver": again})
    train(resumed, again, batch, cfg)
    for p, q in zip(policy.trainable_parameters("solver"), resumed.trainable_parameters("solver"), strict=True):
        assert torch.equal(p, q)
    want, got = optimizer.state_dict(), again.state_dict()
    assert all(torch.equal(m, n) for m, n in zip(want["masters"], got["masters"], strict=True))
    for i, moments in want["state"].items():
        assert all(torch.equal(v, got["state"][i][k]) for k, v in moments.items()), i


def test_optimizer_state_without_masters_starts_them_from_the_weights_and_wrong_masters_are_refused() -> None:
    policy = bf16_policy("full")
    params = policy.trainable_parameters("solver")
    optimizer = build_optimizer(policy, "solver", "solver", CFG.train)
    state = {k: v for k, v in optimizer.state_dict().items() if k != "masters"}  # as saved before masters were kept
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # the weights an older checkpoint loaded: the masters must follow them
    optimizer.load_state_dict(state)
    assert all(torch.equal(m, p.float()) for m, p in zip(stepped(optimizer), params, strict=True))
    with pytest.raises(ValueError, match="master weights do not fit"):
        optimizer.load_state_dict({**state, "masters": [torch.zeros(3)]})


def _sharded_rank(rank: int, port: int, agent_weights: str, batch: list[Action], out: Path) -> None:
    torch.set_num_threads(1)
    sharding.init(rank, 2, f"127.0.0.1:{port}", "cpu")
    try:
        policy = bf16_policy(agent_weights)
        before = [p.detach().clone() for p in policy.trainable_parameters("solver")]
        sharding.shard_modules(policy.shardable_modules(), "cpu")
        params = policy.trainable_parameters("solver")
        dtypes = {str(p.dtype) for p in params}
        optimizer = build_optimizer(policy, "solver", "solver", CFG.train)
        train(policy, optimizer, batch)
        moved = mean_moved(before, stepped(optimizer))
        if rank == 0:
            (out / "rank0.json").write_text(json.dumps({"moved": moved, "dtypes": sorted(dtypes)}))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("agent_weights", ["full", "lora"])
def test_sharded_bf16_weights_keep_float32_shards_and_move_as_adam_intends(agent_weights: str, tmp_path: Path) -> None:
    """FSDP2 over 2 CPU processes (gloo): the trained shards are float32, gathered for compute in bfloat16."""
    mp.start_processes(
        _sharded_rank, args=(free_port(), agent_weights, actions(), tmp_path), nprocs=2, start_method="spawn"
    )
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["dtypes"] == ["torch.float32"]
    assert STEPS * LR / 3 <= got["moved"] <= STEPS * LR * 3, got


def test_gpu_train_check_dry_run_writes_one_record_per_preset_and_weights_mode(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train_check.py"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((tmp_path / "gpu_train_check.json").read_text())["records"]
    want = {(p, w) for p in ("mathchat", "ds_pipeline", "mathchat_r1_1p5b") for w in ("lora", "full")}
    assert {(r["preset"], r["weights"]) for r in records} == want and len(records) == len(want)
    for r in records:
        assert r["rollout_tokens_per_s"] > 0 and r["update_tokens_per_s"] > 0, r
        assert r["memory_estimate_gib"] > 0 and r["ran"], r
