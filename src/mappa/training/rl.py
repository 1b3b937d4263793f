"""The RL math of MAPPA (method.md section 2) as small pure torch functions.

REINFORCE++ as in OpenRLHF, applied per agent:
  reward_t  = -kl_coef * (log pi(a_t) - log pi_ref(a_t))          on every valid token (k1 estimator)
            + score                                                 on the last valid token of the action
  return_t  = sum_{k >= t} gamma^(k-t) reward_k                     within one action (no cross-action credit)
  advantage = whiten(return) over every valid token of one agent's batch
  loss      = PPO clipped surrogate against the rollout-time logprobs, averaged over a mini-batch's tokens
              (`token`) or over each action's tokens, then over its actions (`action`, as published)

The update schedule around it: advantages are whitened once over the agent's whole rollout batch, which
`minibatches` then splits (shuffled, seeded) into optimizer steps; `lr_factor` gives the learning rate of
each optimizer step from its position in the whole run (warm-up, then cosine to a floor).

Tensors are `[B, T]` (one row per action, response tokens only); `mask` is 1 on valid tokens. Values
under `mask == 0` are never read, so padding may hold anything (even inf/nan). No config objects, no
logging, no mutation: importing this module costs nothing beyond torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

# Log-ratios are clamped before exp() so a stale or corrupted old_logp cannot overflow the loss; at
# |log ratio| = 20 the ratio is far outside any clip range, so the clamp never changes a sane update.
_MAX_LOG_RATIO = 20.0


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.to(torch.bool)


def token_rewards(
    scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token rewards `[B, T]`: k1 KL penalty on every valid token plus `scores[b]` on the last valid token.

    scores: (B,) one scalar per action (already scaled, e.g. coach score / 10).
    Rows without any valid token get all-zero rewards.
    """
    valid = _valid(mask)
    kl = torch.where(valid, logp - ref_logp, torch.zeros_like(logp))
    rewards = -kl_coef * kl
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values  # (B,) -1 if empty
    has_any = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_any]
    rewards = rewards.clone()
    rewards[rows, last[has_any]] += scores.to(rewards.dtype)[has_any]
    return rewards


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted sum of the rewards from t to the end of the row `[B, T]`; zero on padding."""
    valid = _valid(mask)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    if gamma == 1.0:
        # A reversed cumulative sum is exact for gamma 1 and avoids a Python loop over T.
        out = r.flip(1).cumsum(1).flip(1)
    else:
        out = torch.zeros_like(r)
        running = torch.zeros_like(r[:, 0])
        for t in range(r.shape[1] - 1, -1, -1):
            running = r[:, t] + gamma * running
            out[:, t] = running
    return torch.where(valid, out, torch.zeros_like(out))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and (biased) variance over all valid tokens of the batch.

    Computed in float64 so huge rewards do not overflow when squared; padding comes back as 0. An empty
    mask returns zeros, a constant batch returns zeros.
    """
    valid = _valid(mask)
    x64 = torch.where(valid, x.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    count = valid.sum().clamp(min=1).to(torch.float64)
    mean = x64.sum() / count
    centered = torch.where(valid, x64 - mean, torch.zeros_like(x64))
    var = (centered * centered).sum() / count
    out = centered * torch.rsqrt(var + eps)
    return out.to(x.dtype)


def reinforce_pp_advantages(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++ advantages `[B, T]` for one agent's batch: token rewards -> returns -> whitening."""
    rewards = token_rewards(scores, logp, ref_logp, mask, kl_coef)
    return masked_whiten(returns_to_go(rewards, mask, gamma), mask)


# How the clipped surrogate is averaged over a batch: `token`, one mean over all its valid tokens (a long action
# weighs in proportion to its length); `action`, each row's token mean, then the mean over the rows (every action
# weighs the same). The published code's effect is `action`: micro-batches of one action, averaged by gradient
# accumulation (docs/method.md section 2).
LOSS_AGGREGATIONS = ("token", "action")


def clipped_pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    aggregation: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, averaged as `aggregation` says (`LOSS_AGGREGATIONS`): over the valid tokens of the
    batch (`token`), or over each row's valid tokens and then over the rows (`action`; a row without any counts
    as 0).

    logp: (B, T) log pi_theta, differentiable; old_logp: (B, T) rollout-time log-probs; advantages: (B, T).
    Returns the scalar loss and detached stats: clip_frac, ratio_mean, approx_kl (k3, old -> new), tokens; the
    stats are token means whatever the aggregation.
    """
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")
    valid = _valid(mask)
    zeros = torch.zeros_like(logp)
    log_ratio = torch.where(valid, logp - old_logp, zeros).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, advantages, zeros)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(surr, surr_clipped)
    count = valid.sum().clamp(min=1)
    summed = torch.where(valid, per_token, zeros)
    if aggregation == "token":
        loss = summed.sum() / count
    else:
        loss = (summed.sum(dim=1) / valid.sum(dim=1).clamp(min=1)).sum() / max(logp.shape[0], 1)
    with torch.no_grad():
        clipped = (surr_clipped < surr) & valid
        k3 = torch.exp(-log_ratio) - 1 + log_ratio  # KL(old || new) estimate, >= 0
        stats = {
            "clip_frac": float(clipped.sum() / count),
            "ratio_mean": float(torch.where(valid, ratio, zeros).sum() / count),
            "approx_kl": float(torch.where(valid, k3, zeros).sum() / count),
            "tokens": float(valid.sum()),
        }
    return loss, stats


def minibatches(n: int, size: int, epochs: int = 1, seed: int = 0) -> list[list[int]]:
    """Row indices of `n` actions, shuffled (seeded) into optimizer steps of at most `size`, `epochs` passes.

    Each pass is a fresh permutation; its last mini-batch holds the remainder. `n == 0` gives no steps.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        out.extend(order[i : i + size] for i in range(0, n, size))
    return out


def lr_factor(progress: float, warmup_ratio: float, min_ratio: float) -> float:
    """Multiplier of the peak lr at `progress` in [0, 1] of the run (where an optimizer step ends).

    Linear warm-up over the first `warmup_ratio` of the run, then cosine from 1 down to `min_ratio` at the
    end. Reading the position from the run's progress, not an optimizer-step counter, keeps the curve right
    when the number of optimizer steps per rollout batch varies (agents act a varying number of times).
    """
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup_ratio:
        return progress / warmup_ratio
    span = 1.0 - warmup_ratio
    done = (progress - warmup_ratio) / span if span > 0 else 1.0
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))


def logprob_gap(logp: torch.Tensor, other: Sequence[Sequence[float]]) -> float:
    """Mean |logp - other| per token over the tokens `other` gives a log-prob for; 0.0 when it gives none.

    logp: (B, T) one side's log-probs (the trainer's); other[b]: the other side's (a generation server's) for
    the first len(other[b]) <= T tokens of row b. Both at the sampling temperature: a side reporting raw
    (temperature-1) log-probs shows as a gap of the two distributions' difference, not of kernel rounding.
    """
    gaps = [
        (logp[b, : len(row)].float() - torch.tensor(row, dtype=torch.float32, device=logp.device)).abs()
        for b, row in enumerate(other)
        if len(row)
    ]
    return float(torch.cat(gaps).mean()) if gaps else 0.0
