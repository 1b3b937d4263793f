"""The update: REINFORCE++ / PPO-clip on one update group's rollout batch, in mini-batches.

    stats = update_group(policy, optimizer, actions, scores, settings, seed=step_seed)  # an UpdateStats

Log-probs of the reference and of the rollout-time policy come first (both before any optimizer step), the
advantages are whitened once over the group's whole batch, then the batch is shuffled into mini-batches of
`train.mini_batch_size` actions, each one optimizer step, split into micro-batches for memory. The math
lives in `mappa.training.rl`; this module holds the weights' side of it and is what a trainer (this process, or a
trainer actor with --ray) runs.

Every log-prob here (reference, rollout-time, current) is taken at `generation.temperature`, the
distribution the actions were sampled from (`mappa.policy.decoding.scaled_logits`), as generation reports them.

The update reads no run config: its caller resolves what it needs once into `UpdateSettings` (the trainer's
`mappa.training.trainer.update_settings`), so this module knows nothing of where the actions were generated beyond what
the generator said of its own log-probs (`UpdateSettings.samples_exactly`, asked of the run's engine). Whether
PPO's old log-probs are recomputed is decided here, by one rule (`recomputes_old_logprobs`).

What an update did comes back typed: `UpdateStats` from `update_group`, and a `GroupResult` per update group
from `apply_update` (with what the group trained on, what it left out and why, and its rewards' spread). Only
the tracker and the console give them metric names (`mappa.training.tracking.step_metrics`: `agent/<group>/<field>`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mappa.config import Config, TrainConfig
from mappa.errors import MappaError
from mappa.policy import precision, sharding
from mappa.training import rl
from mappa.types import Action

# per optimizer step; entropy: mean over the trained tokens of pi_T's entropy, from the loss's own logits
STEP_STATS = ("loss", "grad_norm", "clip_frac", "ratio_mean", "approx_kl", "entropy")
HALF = (torch.bfloat16, torch.float16)  # weights in these train on float32 masters (`MasterAdamW`)


@dataclass(frozen=True)
class UpdateSettings:
    """What the update reads, resolved by its caller from the run's config."""

    train: TrainConfig
    temperature: float  # generation.temperature: every log-prob is of the distribution the tokens came from
    score_scale: float  # workflow.score_scale: the coach's 0-10 score times this is the action's reward
    # the actions' generation-time log-probs are a training forward pass's own (`Generator.samples_exactly` of
    # whatever sampled them, asked of the run's engine): false for a server or a bfloat16 sampling copy
    samples_exactly: bool


def recomputes_old_logprobs(settings: UpdateSettings, autocast: torch.dtype | None) -> bool:
    """Whether PPO's old log-probs come from a training forward pass before the first optimizer step, rather than
    from generation: when asked for (`train.recompute_old_logprobs`), when generation's are not the training
    forward's (`samples_exactly` false: a server's kernels, a bfloat16 sampling copy), and when the update runs
    under `autocast` (its forward is not in the precision generation ran in). The one place this is decided."""
    return settings.train.recompute_old_logprobs or not settings.samples_exactly or autocast is not None


@dataclass(frozen=True)
class UpdateStats:
    """What one group's update did (`update_group`): token-weighted means over its optimizer steps, except where
    said otherwise."""

    loss: float  # the clipped surrogate, averaged as train.loss_aggregation says
    grad_norm: float  # before clipping
    clip_frac: float  # share of tokens whose ratio was clipped
    ratio_mean: float  # pi_new / pi_old; 1 on the first mini-batch
    approx_kl: float  # k3, rollout-time -> current policy
    entropy: float  # nats: pi_T's next-token entropy over the trained tokens, from the loss's own logits
    kl: float  # mean log pi_old - log pi_ref over the batch's tokens (the KL term of the token rewards)
    advantage_abs: float  # mean |whitened advantage| over the batch's tokens
    tokens: float  # response tokens in the batch (once, whatever the epochs)
    optimizer_steps: int  # mini-batches x epochs
    # mean |log pi_trainer - log pi_generator| per token: how far generation's log-probs were from the trainer's
    # (`rl.logprob_gap`); None when generation sampled exactly and they were not recomputed to compare
    logprob_gap: float | None = None


def scores_differ(scores: Sequence[float]) -> bool:
    """The coach scored the actions differently: the only case with anything to learn from (`apply_update`; a
    group's `reward_zero_std` is its negation)."""
    return len(set(scores)) > 1


@dataclass(frozen=True)
class GroupResult:
    """One update group's part of a training step (`apply_update`): which of its actions trained, how many were
    left out and why, their rewards, and what the update did (`update` None: nothing to train on, no step)."""

    actions_trained: int
    dropped: Mapping[str, int]  # actions left out of the update, by reason (`mappa.training.rewards.DROP_REASONS`)
    reward_mean: float | None  # of the trained actions' scores, 0-10 (`mappa.training.rewards`; None: none trained)
    reward_std: float | None  # their spread (population std): at 0, whitened advantages carry no coach signal
    lr: float  # the group's learning rate after the update
    update: UpdateStats | None = None

    @classmethod
    def of(cls, job: UpdateJob, update: UpdateStats | None, lr: float) -> GroupResult:
        """The result of `job` whose update (if it had actions) did `update` and left the learning rate at `lr`."""
        scores = job.scores
        mean = sum(scores) / len(scores) if scores else None
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores)) if mean is not None else None
        if scores and not scores_differ(scores):
            std = 0.0  # exactly: three scores of 0.1 have a float mean that is not 0.1, and a std of 1e-17
        return cls(len(job.actions), dict(job.dropped), mean, std, lr, update)

    @property
    def reward_zero_std(self) -> bool | None:
        """Every trained action scored alike (TRL's `frac_reward_zero_std` for one group): nothing to learn from
        the coach in this step. None when no action trained."""
        return None if self.reward_std is None else self.reward_std == 0.0

    @property
    def optimizer_steps(self) -> int:
        return self.update.optimizer_steps if self.update is not None else 0


def mean_logprob_gap(groups: Mapping[str, GroupResult]) -> float | None:
    """The token-weighted mean of the groups' `logprob_gap` (those that report one); None when none does."""
    pairs = [(u.logprob_gap, u.tokens) for g in groups.values() if (u := g.update) and u.logprob_gap is not None]
    tokens = sum(n for _, n in pairs)
    return sum(gap * n for gap, n in pairs) / tokens if tokens > 0 else None


def _optimizer_step(
    policy: Any, optimizer: torch.optim.Optimizer, actions: Sequence[Action], idx: Sequence[int],
    old_logp: torch.Tensor, adv: torch.Tensor, settings: UpdateSettings,
) -> dict[str, float]:  # fmt: skip
    """One optimizer step on the mini-batch `idx`: micro-batches (sorted by length to pad less), each weighted
    by its share of the mini-batch's tokens, so the loss is the mini-batch's token mean; with
    `train.loss_aggregation: action` by its share of the mini-batch's actions, so the loss is the mean over the
    actions of each one's token mean.

    Sharded weights (`mappa.policy.sharding`): each rank takes every world-th micro-batch, and one with no rows left
    makes an idle pass of weight 0, since every rank must run as many forward and backward passes (their
    gathers are collective). FSDP averages the ranks' gradients, so each rank's loss is scaled by their
    number; the sum over ranks is then the whole mini-batch's."""
    t = settings.train
    world = sharding.rank_world()[1]
    mine = _micro_batches(actions, idx, t.micro_batch_size)
    total = float(sum(len(actions[i].response_ids) for i in idx))
    sums = torch.zeros(len(STEP_STATS) - 1, dtype=torch.float64)  # loss, clip_frac, ratio_mean, approx_kl, entropy
    optimizer.zero_grad(set_to_none=True)
    dtype = precision.autocast_dtype(t.cpu_autocast, policy.model)  # the dtype old_logp was computed in
    with torch.enable_grad():
        for rows, share in mine:
            with precision.autocast(dtype):  # the backward runs each op in its forward's dtype
                logp, m, ent = policy.forward_logprobs(
                    actions[0].agent,
                    [actions[i].prompt_ids for i in rows],
                    [actions[i].response_ids for i in rows],
                    temperature=settings.temperature,
                    entropy=True,
                )
            sel, width = torch.tensor(rows, device=old_logp.device), m.shape[1]
            loss, stats = rl.clipped_pg_loss(
                logp.float(), old_logp[sel, :width], adv[sel, :width], m.float(), t.clip_eps, t.loss_aggregation
            )
            weight = share * float(m.sum()) / total  # the diagnostics stay token means
            loss_weight = share * len(rows) / len(idx) if t.loss_aggregation == "action" else weight
            (loss * (loss_weight * world)).backward()
            entropy = float(ent.sum()) / max(float(m.sum()), 1.0)  # this micro-batch's token mean
            sums += torch.tensor([float(loss.detach()) * loss_weight, stats["clip_frac"] * weight,
                                  stats["ratio_mean"] * weight, stats["approx_kl"] * weight, entropy * weight],
                                 dtype=torch.float64)  # fmt: skip
    sharding.all_sum(sums)
    if isinstance(optimizer, MasterAdamW):  # clip and step the float32 masters' gradients, not bfloat16 ones
        optimizer.take_grads()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = dict(zip(("loss", "clip_frac", "ratio_mean", "approx_kl", "entropy"), sums.tolist(), strict=True))
    return {
        **out,
        "grad_norm": float(sharding.host(grad_norm)),
        "tokens": total,
        "lr": optimizer.param_groups[0]["lr"],
    }


def _micro_batches(actions: Sequence[Action], idx: Sequence[int], size: int) -> list[tuple[list[int], float]]:
    """This rank's micro-batches of the mini-batch `idx` (sorted by length to pad less), each with its weight:
    1, or 0 for an idle pass (see `_optimizer_step`)."""
    rank, world = sharding.rank_world()
    order = sorted(idx, key=lambda i: len(actions[i].response_ids))
    micro = [order[i : i + size] for i in range(0, len(order), size)]
    mine = [(micro[j], 1.0) for j in sharding.shares(len(micro), world, rank)]
    return mine + [(micro[0][:1], 0.0)] * (sharding.passes(len(micro), world) - len(mine))


@torch.no_grad()
def _old_logprobs(
    policy: Any, actions: Sequence[Action], batches: list[list[int]], settings: UpdateSettings
) -> torch.Tensor:
    """(N, T) log-probs of the rollout-time policy, each row computed in the micro-batch its first training
    forward will use (the first pass over `batches`). A row's log-probs move with its micro-batch's padded
    length (other kernel blocking): by ~1e-6 in float32 but up to ~6e-3 under bfloat16 autocast on
    SmolLM2-135M, so only the same layout keeps the first optimizer step's ratio at exactly 1. Sharded, each
    rank computes its own micro-batches and the rows are summed over the ranks."""
    t = settings.train
    out = torch.zeros(len(actions), max(len(a.response_ids) for a in actions), device=policy.device)
    for idx in batches[: -(-len(actions) // t.mini_batch_size)]:  # the first epoch holds every row once
        for rows, share in _micro_batches(actions, idx, t.micro_batch_size):
            lp, _ = policy.forward_logprobs(
                actions[0].agent, [actions[i].prompt_ids for i in rows], [actions[i].response_ids for i in rows],
                temperature=settings.temperature,
            )  # fmt: skip
            if share:
                out[torch.tensor(rows, device=out.device), : lp.shape[1]] = lp.float()
    return sharding.all_sum(out)


def _logprobs(
    policy: Any, agent: str | None, prompts: list[Sequence[int]], responses: list[Sequence[int]], micro: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`Policy.sequence_logprobs` at the sampling `temperature` over the batch. Sharded, each rank computes
    every world-th row (with idle passes to make as many forward passes as the busiest rank) and the ranks'
    rows are summed into one."""
    rank, world = sharding.rank_world()
    if world == 1:
        return policy.sequence_logprobs(agent, prompts, responses, micro_batch_size=micro, temperature=temperature)
    rows = sharding.shares(len(prompts), world, rank)
    lp, m = policy.sequence_logprobs(
        agent, [prompts[i] for i in rows], [responses[i] for i in rows], micro_batch_size=micro,
        temperature=temperature,
    )  # fmt: skip
    for _ in range(sharding.passes(sharding.passes(len(prompts), world), micro) - sharding.passes(len(rows), micro)):
        policy.sequence_logprobs(agent, prompts[:1], responses[:1], temperature=temperature)
    width = max(len(r) for r in responses)
    logp = torch.zeros(len(prompts), width, device=lp.device)
    mask = torch.zeros(len(prompts), width, device=lp.device)
    if rows:
        index = torch.tensor(rows, device=lp.device)
        logp[index, : lp.shape[1]] = lp.float()
        mask[index, : m.shape[1]] = m.float()
    return sharding.all_sum(logp), sharding.all_sum(mask).bool()


def update_group(
    policy: Any, optimizer: torch.optim.Optimizer, actions: Sequence[Action], scores: Sequence[float],
    settings: UpdateSettings, *, seed: int = 0, lr: Callable[[float], float] | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> UpdateStats:  # fmt: skip
    """REINFORCE++ / PPO-clip on one group's rollout batch, in mini-batches; returns what the update did.

    The group's agents share their trainable weights (that is what a group is: one optimizer), so the first
    action's agent stands for all of them in every forward pass.

    `lr(f)`: the learning rate of the optimizer step that ends at fraction `f` of this update (None: leave
    the optimizer's). `on_step(stats)` after each optimizer step (loss, grad_norm, clip_frac, ratio_mean, ...).
    """
    t, temp = settings.train, settings.temperature
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    # Both before the first optimizer step: the reference, and the rollout-time policy every ratio is against.
    # All at the sampling temperature: the ratio and the KL must refer to the distribution the tokens came from.
    # Under CPU autocast (`mappa.policy.precision`) in the training forward's precision, so the first step's ratio is
    # 1: float32 generation-time log-probs would differ from bfloat16 ones by enough to trip the clip.
    dtype = precision.autocast_dtype(t.cpu_autocast, policy.model)
    with precision.autocast(dtype):
        ref_logp, mask = _logprobs(policy, None, prompts, responses, t.micro_batch_size, temp)
    mask, ref_logp = mask.float(), ref_logp.float()
    batches = rl.minibatches(len(actions), t.mini_batch_size, t.epochs, seed)
    # generation's log-probs are the ratio's reference only if they are this forward's (`recomputes_old_logprobs`)
    if recomputes_old_logprobs(settings, dtype):
        with precision.autocast(dtype):
            if dtype is not None and sharding.rank_world()[1] == 1:  # bf16 moves with the layout (`_old_logprobs`)
                old_logp = _old_logprobs(policy, actions, batches, settings)
            else:  # float32, or sharded: every rank takes every row in the length-sorted micro-batches
                old_logp = _logprobs(policy, actions[0].agent, prompts, responses, t.micro_batch_size, temp)[0]
                old_logp = old_logp.float()
    else:
        rows = [torch.tensor(a.logprobs, dtype=torch.float32) for a in actions]
        old_logp = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(mask.device)
    # the coach's 0-10 score at the workflow's scale (score / 10 for MathChat, raw for data science)
    scale = settings.score_scale  # scaled in float64, then rounded once: score / 10 as it always was
    score_t = torch.tensor([s * scale for s in scores], dtype=torch.float32, device=mask.device)
    adv = rl.reinforce_pp_advantages(score_t, old_logp, ref_logp, mask, t.kl_coef, t.gamma)  # whitened once
    steps = []
    for j, idx in enumerate(batches):
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr((j + 1) / len(batches))
        steps.append(_optimizer_step(policy, optimizer, actions, idx, old_logp, adv, settings))
        if on_step is not None:
            on_step(steps[-1])
    tokens = sum(s["tokens"] for s in steps)
    valid = mask.bool()
    return UpdateStats(
        **{k: sum(s[k] * s["tokens"] for s in steps) / max(tokens, 1.0) for k in STEP_STATS},  # token-weighted
        kl=float((old_logp - ref_logp)[valid].mean()) if valid.any() else 0.0,
        advantage_abs=float(adv[valid].abs().mean()) if valid.any() else 0.0,
        tokens=float(mask.sum()),
        optimizer_steps=len(steps),
        logprob_gap=None if settings.samples_exactly else _logprob_gap(actions, old_logp),
    )


def _logprob_gap(actions: Sequence[Action], old_logp: torch.Tensor) -> float:
    """Mean |log pi_trainer - log pi_generator| per token (`rl.logprob_gap`); a server that leaves the stop token's
    log-prob out covers one token fewer."""
    return rl.logprob_gap(old_logp, [a.logprobs[: len(a.response_ids)] for a in actions])


@dataclass(frozen=True)
class UpdateJob:
    """One group's share of a step, for its trainer: this process, or its trainer actor with --ray."""

    actions: list[Action]
    scores: list[float]  # coach scores 0-10, one per action
    seed: int  # the mini-batch shuffle
    peak_lr: float
    step: int  # steps done before this one: where the learning-rate schedule stands
    settings: UpdateSettings  # resolved once by the run, so a trainer actor needs no config to update
    dropped: dict[str, int] = field(default_factory=dict)  # the group's actions left out, by reason: for its result


def apply_update(policy: Any, optimizer: torch.optim.Optimizer, job: UpdateJob) -> GroupResult:
    """`update_group` on the job (nothing when its actions' scores have no spread, e.g. none or one action);
    returns the group's result, with the learning rate after it."""
    t = job.settings.train

    def lr(fraction: float) -> float:  # where this optimizer step ends in the whole run
        return job.peak_lr * rl.lr_factor((job.step + fraction) / max(t.steps, 1), t.warmup_ratio, t.min_lr_ratio)

    stats = None
    # Scores without spread leave only the KL penalty's per-token noise in the returns, and whitening scales any
    # noise up to unit advantages: Adam would then take a full-size step that no score asked for (measured on the
    # 0.5B team: one such step moved held-out answers 3% -> 44%). Such a group is left as it is.
    if scores_differ(job.scores):
        stats = update_group(policy, optimizer, job.actions, job.scores, job.settings, seed=job.seed, lr=lr)
    return GroupResult.of(job, stats, optimizer.param_groups[0]["lr"])


def build_optimizer(policy: Any, agent: str, group: str, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over `agent`'s trainable weights (those of its update group) at the group's peak learning rate; on
    float32 masters (`MasterAdamW`) when the weights are in a half dtype (a bfloat16 full copy on a GPU)."""
    lr, betas = t.agent_lr.get(group, t.lr), tuple(t.adam_betas)
    params = policy.trainable_parameters(agent)
    adamw = MasterAdamW if any(p.dtype in HALF for p in params) else torch.optim.AdamW
    return adamw(params, lr=lr, betas=betas, weight_decay=t.weight_decay)


class MasterAdamW(torch.optim.AdamW):
    """AdamW that steps float32 master copies of half-precision weights, then rounds them into the weights.

    At the full fine-tune's lr 1e-6 an AdamW step moves a weight by ~1e-6, far below bfloat16's rounding (a weight
    of 0.02 is stored to ~1e-4): stepped in place, nearly every update is lost. So the optimizer's parameters are
    the masters; forward and backward still run in the weights' dtype, and `take_grads` moves their gradients onto
    the masters (in float32) before clipping. `state_dict` carries the masters, so a resume continues from them
    exactly, not from their rounding. Memory: 4 bytes per weight more, and float32 gradients at the step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs: Any) -> None:
        self.weights = list(params)
        super().__init__([p.detach().float().clone() for p in self.weights], **kwargs)

    def masters(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def take_grads(self) -> None:
        """Each weight's gradient, cast to float32, becomes its master's (the weight's own is freed)."""
        for weight, master in zip(self.weights, self.masters(), strict=True):
            if weight.grad is not None:
                master.grad, weight.grad = weight.grad.float(), None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.take_grads()  # a no-op after the update's own call; here for a caller that steps without one
        loss = super().step(closure)
        for weight, master in zip(self.weights, self.masters(), strict=True):
            weight.copy_(master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for weight in self.weights:
            weight.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "masters": self.masters()}  # references, as AdamW's own state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state and the masters; a state without masters (saved before they were kept) starts them
        from the weights as they are, so load the weights first."""
        saved, masters = state_dict.get("masters"), self.masters()
        shapes = [tuple(s.shape) if isinstance(s, torch.Tensor) else None for s in saved or []]
        if saved is not None and (not isinstance(saved, list) or shapes != [tuple(m.shape) for m in masters]):
            raise ValueError(f"its master weights do not fit the {len(masters)} trained weights")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "masters"})
        for weight, master, value in zip(self.weights, masters, saved or self.weights, strict=True):
            master.copy_(value)
            weight.copy_(master)


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
