"""`mappa train`: REINFORCE++ per agent from per-action coach scores (method.md section 2).

Read top to bottom: `setup()` builds the run state (or restores it from the last checkpoint), `train_step()`
is one step, `train()` is the loop. One step:
  1. draw `prompts_per_step` tasks (`rollout.pick_tasks`: a seeded permutation per pass; the cursor is
     checkpointed) and play `samples_per_prompt` episodes of each in lockstep, sampling from the seed
     `seed + step`; the coach scores every action as it lands;
  2. rewards (`mappa.rewards`): each action's coach score, or with `coach.backend: outcome` the episode's
     10/0 for every action; per update group (one per agent, or one for all with `model.agent_weights:
     shared`) keep the actions that are scored, not truncated and whose tool call did not hit an infra_error;
  3. per group (`update_group`): reference log-probs from the base model (adapters off) and old log-probs
     from the policy as it was at rollout time, both before the first optimizer step; token rewards
     -kl_coef * (logp_old - logp_ref) + score/10 on the last token, returns, advantages whitened once over
     the group's whole batch (`mappa.rl`);
  4. the batch shuffled (seeded) into mini-batches of `train.mini_batch_size` actions, `train.epochs` passes:
     one optimizer step per mini-batch (PPO clip against the old log-probs, token mean within the
     mini-batch, micro-batches of `train.micro_batch_size` with gradient accumulation, grad-norm clip,
     AdamW); from the second step on the ratio leaves 1 and the clip acts. The learning rate of each step
     follows warm-up then cosine to a floor over the run's progress (`rl.lr_factor`); each group has its
     own optimizer and learning rate (`train.agent_lr`);
  5. log metrics, write every episode to episodes.jsonl, checkpoint atomically, evaluate every
     `eval_every` steps (always at start and end) with the rule-based answer check; at the end the gain
     over the start with its 95% interval.

Where this departs from the paper / published code:
  - the coach's score is by default its expected score (probability-weighted over the score tokens, when
    the backend returns log-probs; `coach.expected_score: false` reads the sampled number);
  - scores are divided by 10 for every workflow (the published code skipped it for data science);
  - an action's state is its full multi-turn context, not an earlier fragment;
  - unscored actions are dropped rather than given a first-number-in-text or 5.0 fallback;
  - actions whose tool call failed for infrastructure reasons are dropped, not blamed;
  - evaluation accuracy is rule-based, never the coach's verdict;
  - the reference model is the base with adapters disabled (LoRA) rather than a separate copy;
  - LoRA adapters by default (full weights with `model.agent_weights: full`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from mappa import rl
from mappa.checkpoint import restore_run, save_checkpoint
from mappa.config import Config
from mappa.errors import MappaError
from mappa.evaluate import eval_gain, eval_tasks, evaluate, gain_metrics, write_eval
from mappa.metrics import Gain, episode_metrics
from mappa.protocols import ProgressFn, Runtime, Workflow
from mappa.rewards import RewardMode, per_action_scores, reward_mode, select_actions
from mappa.rollout import pick_tasks, train_tasks
from mappa.tracking import Tracker, append_episodes
from mappa.types import Action, Episode, Task

STEP_STATS = ("loss", "grad_norm", "clip_frac", "ratio_mean", "approx_kl")  # per optimizer step


@dataclass(frozen=True)
class Event:
    """What the run reports as it goes; the CLI turns these into console lines."""

    kind: Literal["status", "note", "eval", "step"]  # status: work starting; note: a line to show
    step: int
    text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- the update
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
    if t.recompute_old_logprobs:
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
    }


# ---------------------------------------------------------------------------------------------------- the run
@dataclass
class Run:
    """Everything a training run holds between steps."""

    cfg: Config
    run_dir: Path
    workflow: Workflow
    groups: dict[str, list[str]]  # update group -> its agents: one per agent, or "shared" for all
    policy: Any
    optimizers: dict[str, torch.optim.Optimizer]
    sandbox: Any
    coach: Any
    tracker: Tracker
    train_set: list[Task]
    held_out: list[Task]
    reward: RewardMode
    emit: Callable[[Event], None]
    progress: ProgressFn | None = None  # (actions done, total) while episodes play
    step: int = 0
    cursor: int = 0  # tasks drawn so far from the training stream

    def close(self) -> None:
        self.sandbox.close()
        self.coach.close()
        self.tracker.close()


def update_groups(agents: Sequence[str], agent_weights: str) -> dict[str, list[str]]:
    """Which agents share one optimizer: each its own, or all in one ('shared' weights baseline)."""
    return {"shared": list(agents)} if agent_weights == "shared" else {a: [a] for a in agents}


def setup(
    cfg: Config, run_dir: Path, *, resume: bool = False, emit: Callable[[Event], None] | None = None,
    progress: ProgressFn | None = None,
) -> Run:  # fmt: skip
    """Build the run: tasks, agents, optimizers, sandbox, coach, logs; restore the last checkpoint on resume."""
    from mappa.coach import build_coach
    from mappa.policy import Policy
    from mappa.sandbox import Sandbox
    from mappa.workflows import build_workflow

    emit = emit or (lambda event: None)
    torch.manual_seed(cfg.seed)  # LoRA dropout, if on; sampling is seeded per rollout, init by the policy
    workflow = build_workflow(cfg)
    groups = update_groups(workflow.agents, cfg.model.agent_weights)
    if unknown := set(cfg.train.agent_lr) - set(groups):
        raise MappaError(f"train.agent_lr: unknown agent(s) {sorted(unknown)} (agents: {', '.join(groups)})")
    train_set, held_out = train_tasks(cfg), eval_tasks(cfg)
    emit(Event("status", 0, f"loading {cfg.model.name} ({len(workflow.agents)} agents, {cfg.model.agent_weights})"))
    policy = Policy.from_config(
        cfg.model, workflow.agents, seed=cfg.seed, generation_batch_size=cfg.generation.batch_size
    )
    t = cfg.train
    optimizers = {
        g: torch.optim.AdamW(
            policy.trainable_parameters(members[0]),
            lr=t.agent_lr.get(g, t.lr),
            betas=tuple(t.adam_betas),
            weight_decay=t.weight_decay,
        )  # fmt: skip
        for g, members in groups.items()
    }
    tracker = Tracker(
        run_dir, tensorboard=cfg.logging.tensorboard, wandb_project=cfg.logging.wandb_project,
        run_name=run_dir.name, config=cfg.model_dump(mode="json"),
    )  # fmt: skip
    for warning in tracker.warnings:
        emit(Event("note", 0, warning))
    coach = build_coach(cfg.coach, cfg.workflow.name, policy=policy)
    sandbox = Sandbox(cfg.sandbox)
    run = Run(
        cfg, run_dir, workflow, groups, policy, optimizers, sandbox, coach, tracker, train_set, held_out,
        reward_mode(cfg.coach.backend), emit, progress,
    )  # fmt: skip
    try:
        restored = restore_run(run_dir, policy=policy, optimizers=optimizers) if resume else None
    except BaseException:
        run.close()
        raise
    if restored is not None:
        ckpt, state = restored
        run.step, run.cursor = state["step"], state["cursor"]
        emit(Event("note", run.step, f"resumed from {ckpt} at step {run.step}"))
    return run


def _train_group(run: Run, group: str, episodes: list[Episode], scores: list[list[float | None]]) -> dict[str, float]:
    """Select the group's actions and update its weights; returns its `agent/<group>/...` metrics."""
    t = run.cfg.train
    actions, kept, dropped = select_actions(
        episodes, scores, run.groups[group], run.cfg.coach.on_unscored, t.drop_truncated
    )
    out = {f"dropped_{why}": float(n) for why, n in dropped.items()}
    out.update(actions_trained=float(len(actions)), optimizer_steps=0.0)
    peak, step = t.agent_lr.get(group, t.lr), run.step

    def lr(fraction: float) -> float:  # where this optimizer step ends in the whole run
        return peak * rl.lr_factor((step + fraction) / max(t.steps, 1), t.warmup_ratio, t.min_lr_ratio)

    if actions:
        run.emit(Event("status", step + 1, f"step {step + 1}: updating {group} on {len(actions)} actions"))
        seed = run.cfg.seed * 1_000_003 + step * 101 + list(run.groups).index(group)
        out.update(update_group(run.policy, run.optimizers[group], actions, kept, run.cfg, seed=seed, lr=lr))
        out["reward_mean"] = sum(kept) / len(kept)
    out["lr"] = run.optimizers[group].param_groups[0]["lr"]
    return {f"agent/{group}/{k}": v for k, v in out.items()}


def train_step(run: Run) -> dict[str, float]:
    """One step: rollouts -> rewards -> per-group updates -> log and checkpoint; returns the step's metrics."""
    cfg, t = run.cfg, run.cfg.train
    t0 = time.perf_counter()
    run.emit(Event("status", run.step + 1, f"step {run.step + 1}: rollouts"))
    tasks = pick_tasks(run.train_set, t.prompts_per_step, cfg.seed, start=run.cursor)
    episodes = run.workflow.run(
        [task for task in tasks for _ in range(t.samples_per_prompt)], Runtime(run.policy, run.sandbox, run.coach),
        seed=cfg.seed + run.step + 1, progress=run.progress,
    )  # fmt: skip
    t_rollout = time.perf_counter() - t0
    metrics = episode_metrics(episodes, run.workflow.agents, "train")
    scores = per_action_scores(episodes, run.reward)
    for group in run.groups:
        metrics.update(_train_group(run, group, episodes, scores))
    run.step += 1
    run.cursor += t.prompts_per_step
    t_total = time.perf_counter() - t0
    rollout_tokens = sum(len(a.response_ids) for e in episodes for a in e.actions)
    update_tokens = sum(v for k, v in metrics.items() if k.startswith("agent/") and k.endswith("/tokens"))
    metrics.update(
        {
            "time/rollout_s": t_rollout,
            "time/update_s": t_total - t_rollout,
            "time/rollout_tokens_per_s": rollout_tokens / max(t_rollout, 1e-9),
            "time/update_tokens_per_s": update_tokens / max(t_total - t_rollout, 1e-9),
            **{f"coach/{k}": float(v) for k, v in run.coach.stats().items()},
        }
    )
    append_episodes(run.run_dir / "episodes.jsonl", episodes, run.step)
    run.tracker.log(metrics, run.step)
    if run.step % t.checkpoint_every == 0 or run.step == t.steps:
        state = {"cursor": run.cursor}
        save_checkpoint(run.run_dir, run.step, policy=run.policy, optimizers=run.optimizers, state=state)
    return metrics


def run_eval(run: Run, tag: str) -> dict[str, float]:
    """Evaluate on the held-out tasks; written to eval/<tag>.jsonl and eval/summary.jsonl, and logged."""
    cfg = run.cfg
    what = f"{len(run.held_out)} held-out tasks x {cfg.eval.samples} at T={cfg.eval.temperature}"
    run.emit(Event("status", run.step, f"evaluating ({tag}): {what}"))
    metrics, episodes = evaluate(cfg, run.policy, run.sandbox, run.held_out, progress=run.progress)
    write_eval(run.run_dir / "eval", tag, {"step": run.step, **metrics}, episodes)
    run.tracker.log(metrics, run.step)
    run.emit(Event("eval", run.step, tag, metrics))
    return metrics


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    final: dict[str, float]  # the final evaluation's metrics
    gain: Gain | None  # final eval vs the start eval (None when the start eval is missing)


def train(
    cfg: Config, run_dir: Path, *, resume: bool = False, emit: Callable[[Event], None] | None = None,
    progress: ProgressFn | None = None,
) -> TrainResult:  # fmt: skip
    """Train per the module docstring: self-test, start eval, `train.steps` steps, final eval and gain."""
    from mappa.selftest import run_self_test

    run = setup(cfg, run_dir, resume=resume, emit=emit, progress=progress)
    try:
        if run.step == 0:
            if cfg.train.self_test:
                agents = run.workflow.agents
                for line in run_self_test(run.policy, agents, run.sandbox, run.coach.score_many, cfg.workflow.name):
                    run.emit(Event("note", 0, f"self-test ok: {line}"))
            run_eval(run, "start")
        while run.step < cfg.train.steps:
            run.emit(Event("step", run.step + 1, metrics=train_step(run)))
            if cfg.train.eval_every and run.step % cfg.train.eval_every == 0 and run.step != cfg.train.steps:
                run_eval(run, f"step-{run.step:06d}")
        final = run_eval(run, "final")
        gain = eval_gain(run_dir / "eval")
        if gain is not None and math.isfinite(gain.gain):
            run.tracker.log(gain_metrics(gain), run.step)
    finally:
        run.close()
    return TrainResult(run_dir, run.step, final, gain)
