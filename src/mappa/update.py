"""The update: REINFORCE++ / PPO-clip on one update group's rollout batch, in mini-batches.

    metrics = update_group(policy, optimizer, actions, scores, cfg, seed=step_seed)

Log-probs of the reference and of the rollout-time policy come first (both before any optimizer step), the
advantages are whitened once over the group's whole batch, then the batch is shuffled into mini-batches of
`train.mini_batch_size` actions, each one optimizer step, split into micro-batches for memory. The math
lives in `mappa.rl`; this module holds the weights' side of it and is what a trainer (this process, or a
trainer actor with --ray) runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mappa import rl
from mappa.config import Config, TrainConfig
from mappa.errors import MappaError
from mappa.generation import logprob_gap
from mappa.types import Action

STEP_STATS = ("loss", "grad_norm", "clip_frac", "ratio_mean", "approx_kl")  # per optimizer step


def _optimizer_step(
    policy: Any, optimizer: torch.optim.Optimizer, actions: Sequence[Action], idx: Sequence[int],
    old_logp: torch.Tensor, adv: torch.Tensor, cfg: Config,
) -> dict[str, float]:  # fmt: skip
    """One optimizer step on the mini-batch `idx`: micro-batches (sorted by length to pad less), each weighted
    by its share of the mini-batch's tokens, so the loss is the mini-batch's token mean."""
    t = cfg.train
    order = sorted(idx, key=lambda i: len(actions[i].response_ids))
    micro = [order[i : i + t.micro_batch_size] for i in range(0, len(order), t.micro_batch_size)]
    total = float(sum(len(actions[i].response_ids) for i in idx))
    sums = dict.fromkeys(STEP_STATS, 0.0)
    optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad():
        for rows in micro:
            logp, m = policy.forward_logprobs(
                actions[0].agent, [actions[i].prompt_ids for i in rows], [actions[i].response_ids for i in rows]
            )
            sel, width = torch.tensor(rows, device=old_logp.device), m.shape[1]
            loss, stats = rl.clipped_pg_loss(
                logp.float(), old_logp[sel, :width], adv[sel, :width], m.float(), t.clip_eps
            )
            weight = float(m.sum()) / total
            (loss * weight).backward()
            sums["loss"] += float(loss.detach()) * weight
            for k in ("clip_frac", "ratio_mean", "approx_kl"):
                sums[k] += stats[k] * weight
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sums["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**sums, "tokens": total, "lr": optimizer.param_groups[0]["lr"]}


def update_group(
    policy: Any, optimizer: torch.optim.Optimizer, actions: Sequence[Action], scores: Sequence[float], cfg: Config,
    *, seed: int = 0, lr: Callable[[float], float] | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:  # fmt: skip
    """REINFORCE++ / PPO-clip on one group's rollout batch, in mini-batches; returns the update's metrics.

    The group's agents share their trainable weights (that is what a group is: one optimizer), so the first
    action's agent stands for all of them in every forward pass.

    `lr(f)`: the learning rate of the optimizer step that ends at fraction `f` of this update (None: leave
    the optimizer's). `on_step(stats)` after each optimizer step (loss, grad_norm, clip_frac, ratio_mean, ...).
    """
    t = cfg.train
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    # Both before the first optimizer step: the reference, and the rollout-time policy every ratio is against.
    ref_logp, mask = policy.sequence_logprobs(None, prompts, responses, micro_batch_size=t.micro_batch_size)
    mask, ref_logp = mask.float(), ref_logp.float()
    if t.recompute_old_logprobs or cfg.generation.backend == "server":  # a server: other kernels, maybe dtype
        old_logp, _ = policy.sequence_logprobs(
            actions[0].agent, prompts, responses, micro_batch_size=t.micro_batch_size
        )
        old_logp = old_logp.float()
    else:
        rows = [torch.tensor(a.logprobs, dtype=torch.float32) for a in actions]
        old_logp = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(mask.device)
    score_t = torch.tensor(scores, dtype=torch.float32, device=mask.device) / 10.0  # reward scale: every workflow
    adv = rl.reinforce_pp_advantages(score_t, old_logp, ref_logp, mask, t.kl_coef, t.gamma)  # whitened once
    batches = rl.minibatches(len(actions), t.mini_batch_size, t.epochs, seed)
    steps = []
    for j, idx in enumerate(batches):
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr((j + 1) / len(batches))
        steps.append(_optimizer_step(policy, optimizer, actions, idx, old_logp, adv, cfg))
        if on_step is not None:
            on_step(steps[-1])
    tokens = sum(s["tokens"] for s in steps)
    valid = mask.bool()
    return {
        **{k: sum(s[k] * s["tokens"] for s in steps) / max(tokens, 1.0) for k in STEP_STATS},  # token-weighted
        "optimizer_steps": float(len(steps)),
        "kl": float((old_logp - ref_logp)[valid].mean()) if valid.any() else 0.0,
        "advantage_abs": float(adv[valid].abs().mean()) if valid.any() else 0.0,
        "tokens": float(mask.sum()),
        **({"logprob_gap": logprob_gap(actions, old_logp)} if cfg.generation.backend == "server" else {}),
    }


@dataclass(frozen=True)
class UpdateJob:
    """One group's share of a step, for its trainer: this process, or its trainer actor with --ray."""

    actions: list[Action]
    scores: list[float]  # coach scores 0-10, one per action
    seed: int  # the mini-batch shuffle
    peak_lr: float
    step: int  # steps done before this one: where the learning-rate schedule stands


def apply_update(policy: Any, optimizer: torch.optim.Optimizer, job: UpdateJob, cfg: Config) -> dict[str, float]:
    """`update_group` on the job (nothing without actions); returns its metrics and the learning rate after it."""
    t = cfg.train

    def lr(fraction: float) -> float:  # where this optimizer step ends in the whole run
        return job.peak_lr * rl.lr_factor((job.step + fraction) / max(t.steps, 1), t.warmup_ratio, t.min_lr_ratio)

    out = update_group(policy, optimizer, job.actions, job.scores, cfg, seed=job.seed, lr=lr) if job.actions else {}
    return {**out, "lr": optimizer.param_groups[0]["lr"]}


def build_optimizer(policy: Any, agent: str, group: str, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over `agent`'s trainable weights (those of its update group) at the group's peak learning rate."""
    lr, betas = t.agent_lr.get(group, t.lr), tuple(t.adam_betas)
    return torch.optim.AdamW(policy.trainable_parameters(agent), lr=lr, betas=betas, weight_decay=t.weight_decay)


def update_groups(agents: Sequence[str], agent_weights: str) -> dict[str, list[str]]:
    """Which agents share one optimizer: each its own, or all in one ('shared' weights baseline)."""
    return {"shared": list(agents)} if agent_weights == "shared" else {a: [a] for a in agents}


def config_groups(cfg: Config, agents: Sequence[str]) -> dict[str, list[str]]:
    """The run's update groups; a `train.agent_lr` key that names none is an error (the CLI checks this before
    it creates a run directory)."""
    groups = update_groups(agents, cfg.model.agent_weights)
    if unknown := set(cfg.train.agent_lr) - set(groups):
        raise MappaError(f"train.agent_lr: unknown agent(s) {sorted(unknown)} (agents: {', '.join(groups)})")
    return groups
