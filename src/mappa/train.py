"""`mappa train`: REINFORCE++ per agent from per-action coach scores (method.md section 2).

One step, top to bottom:
  1. sample `prompts_per_step` tasks (a seeded permutation per pass; the cursor is checkpointed) and run
     `samples_per_prompt` episodes of each in lockstep; the coach scores every action as it lands;
  2. per update group (one per agent; one for all agents with `model.agent_weights: shared`):
     keep the group's actions that are scored, not truncated (`train.drop_truncated`) and whose tool
     call did not hit a sandbox infra_error; unscored actions become score 5 only with
     `coach.on_unscored: neutral`;
  3. reference log-probs from the base model (adapters off), old log-probs from generation time;
     token rewards = -kl_coef * (logp_old - logp_ref) + score/10 on the last token, returns with
     gamma, advantages whitened over that group's tokens only (`mappa.rl`);
  4. one PPO-clip epoch in micro-batches with gradient accumulation (token-level mean over the whole
     group batch), grad-norm clip, AdamW, cosine schedule with linear warm-up and a floor, each group
     with its own optimizer and learning rate (`train.agent_lr`);
  5. log metrics, write every episode to episodes.jsonl, checkpoint atomically, evaluate every
     `eval_every` steps (and always at start and end) with the rule-based answer check.

Where this departs from the paper / published code:
  - scores are divided by 10 for every workflow (the published code skipped it for data science);
  - an action's state is its full multi-turn context, not an earlier fragment;
  - unscored actions are dropped rather than given a first-number-in-text or 5.0 fallback;
  - actions whose tool call failed for infrastructure reasons are dropped, not blamed;
  - evaluation accuracy is rule-based, never the coach's verdict;
  - the reference model is the base with adapters disabled (LoRA) rather than a separate copy;
  - LoRA adapters by default (full weights with `model.agent_weights: full`).
"""

from __future__ import annotations

import json
import math
import platform
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from mappa import rl
from mappa.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mappa.config import Config, dump_config, load_config
from mappa.errors import MappaError
from mappa.evaluate import build_workflow, eval_tasks, evaluate, print_eval, write_eval
from mappa.tracking import Tracker
from mappa.types import Action, Episode, Task

VERSIONED = ("mappa-rl", "torch", "transformers", "peft", "pydantic", "openai", "math-verify", "numpy")


# ---------------------------------------------------------------------------------------------------- helpers
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """Multiplier of the peak lr: linear warm-up, then cosine from 1 to `min_ratio` at the last step."""
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def task_batch(tasks: Sequence[Task], cursor: int, k: int, seed: int) -> list[Task]:
    """Tasks `cursor .. cursor+k` of an endless stream of seeded permutations (one per pass)."""
    out = []
    for i in range(cursor, cursor + k):
        epoch, idx = divmod(i, len(tasks))
        order = list(range(len(tasks)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(tasks[order[idx]])
    return out


def update_groups(agents: Sequence[str], agent_weights: str) -> dict[str, list[str]]:
    """Which agents share one optimizer: each its own, or all in one ('shared' weights baseline)."""
    return {"shared": list(agents)} if agent_weights == "shared" else {a: [a] for a in agents}


def select_actions(
    episodes: Sequence[Episode], agents: Sequence[str], on_unscored: str, drop_truncated: bool
) -> tuple[list[Action], list[float], dict[str, int]]:
    """The trainable actions of `agents` and their scores in [0, 10]; counts of what was dropped and why."""
    kept, scores = [], []
    dropped = {"unscored": 0, "truncated": 0, "infra_error": 0, "empty": 0}
    for ep in episodes:
        for a in ep.actions:
            if a.agent not in agents:
                continue
            score = a.coach.score if a.coach is not None else None
            if not a.response_ids:
                dropped["empty"] += 1
            elif a.exec_result is not None and a.exec_result.infra_error:
                dropped["infra_error"] += 1
            elif drop_truncated and a.truncated:
                dropped["truncated"] += 1
            elif score is None and on_unscored == "skip":
                dropped["unscored"] += 1
            else:
                kept.append(a)
                scores.append(5.0 if score is None else score)
    return kept, scores, dropped


def _pad(rows: Sequence[Sequence[float]], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


def update_group(
    policy: Any, optimizer: torch.optim.Optimizer, actions: Sequence[Action], scores: Sequence[float], cfg: Config
) -> dict[str, float]:
    """One REINFORCE++ / PPO-clip epoch on one group's actions; returns its metrics."""
    t = cfg.train
    prompts = [a.prompt_ids for a in actions]
    responses = [a.response_ids for a in actions]
    ref_logp, mask = policy.sequence_logprobs(None, prompts, responses, micro_batch_size=t.micro_batch_size)
    mask = mask.float()
    old_logp = _pad([a.logprobs for a in actions], mask.shape[1], mask.device)
    ref_logp = ref_logp.float().to(mask.device)
    score_t = torch.tensor(scores, dtype=torch.float32, device=mask.device) / 10.0  # reward scale: every workflow
    adv = rl.reinforce_pp_advantages(score_t, old_logp, ref_logp, mask, t.kl_coef, t.gamma)
    total_tokens = float(mask.sum())
    optimizer.zero_grad(set_to_none=True)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    loss_sum, stats_sum = 0.0, {"clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
    # Micro-batches hold one agent each (forward_logprobs runs one agent) and are sorted by length to pad less.
    order = sorted(range(len(actions)), key=lambda i: (actions[i].agent, len(responses[i])))
    batches, current = [], []
    for i in order:
        if current and (len(current) == t.micro_batch_size or actions[current[0]].agent != actions[i].agent):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    with torch.enable_grad():
        for idx in batches:
            logp, m = policy.forward_logprobs(
                actions[idx[0]].agent, [prompts[i] for i in idx], [responses[i] for i in idx]
            )
            width = m.shape[1]
            sel = torch.tensor(idx, device=mask.device)
            loss, stats = rl.clipped_pg_loss(
                logp.float(), old_logp[sel, :width], adv[sel, :width], m.float(), t.clip_eps
            )
            weight = float(m.sum()) / total_tokens  # accumulate to the token mean of the whole group batch
            (loss * weight).backward()
            loss_sum += float(loss.detach()) * weight
            for k in stats_sum:
                stats_sum[k] += stats[k] * weight
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    valid = mask.bool()
    return {
        "loss": loss_sum,
        "grad_norm": grad_norm,
        "kl": float((old_logp - ref_logp)[valid].mean()),
        "advantage_abs": float(adv[valid].abs().mean()),
        "tokens": total_tokens,
        **stats_sum,
    }


# ---------------------------------------------------------------------------------------------------- run dir
def _git_commit() -> str:
    src = Path(__file__).resolve().parent  # the checkout mappa runs from, wherever the run directory is
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False, cwd=src
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5, check=False, cwd=src
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    commit = out.stdout.strip() or "unknown"
    return commit + ("-dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def new_run_dir(cfg: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run_dir.format(name=cfg.name, time=stamp))
    if (run_dir / "checkpoints").exists():
        raise MappaError(f"run_dir {run_dir} already holds a run; use --resume {run_dir} or another run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg), encoding="utf-8")
    meta = {"git_commit": _git_commit(), "versions": _versions(), "argv": sys.argv, "started": stamp}
    (run_dir / "run.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return run_dir


def _drop_lines_after(path: Path, step: int) -> None:
    """Forget log lines of steps after the checkpoint (the step a kill interrupted runs again)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        row_step = row.get("step", row.get("meta", {}).get("step", 0))
        if row_step <= step:
            keep.append(line)
    path.write_text("".join(k + "\n" for k in keep), encoding="utf-8")


def _log_episodes(path: Path, episodes: Sequence[Episode], step: int) -> None:
    with path.open("a", encoding="utf-8") as f:
        for ep in episodes:
            f.write(ep.model_copy(update={"meta": {**ep.meta, "step": step}}).model_dump_json() + "\n")


def _rollout_metrics(episodes: Sequence[Episode], agents: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {"train/accuracy": sum(bool(e.correct) for e in episodes) / max(len(episodes), 1)}
    actions = [a for e in episodes for a in e.actions]
    runs = [a.exec_result for a in actions if a.exec_result is not None]
    out["sandbox/runs"] = float(len(runs))
    out["sandbox/timeout_rate"] = sum(r.timed_out for r in runs) / max(len(runs), 1)
    out["sandbox/error_rate"] = sum(not r.ok for r in runs) / max(len(runs), 1)
    out["coach/unscored_rate"] = sum(a.coach is None or a.coach.score is None for a in actions) / max(len(actions), 1)
    for agent in agents:
        mine = [a for a in actions if a.agent == agent]
        scored = [a.coach.score for a in mine if a.coach is not None and a.coach.score is not None]
        n = max(len(mine), 1)
        out[f"agent/{agent}/actions"] = float(len(mine))
        out[f"agent/{agent}/score_mean"] = sum(scored) / len(scored) if scored else float("nan")
        out[f"agent/{agent}/response_tokens"] = sum(len(a.response_ids) for a in mine) / n
        out[f"agent/{agent}/truncation_rate"] = sum(a.truncated for a in mine) / n
        out[f"agent/{agent}/tool_use_rate"] = sum(a.exec_result is not None for a in mine) / n
    return out


# ---------------------------------------------------------------------------------------------------- the loop
def train(cfg: Config, run_dir: Path, *, resume: bool = False, console: Console | None = None) -> dict[str, float]:
    """Train per the module docstring; returns the last logged metrics (final eval included)."""
    from mappa.coach import build_coach
    from mappa.policy import Policy
    from mappa.rollout import run_episodes
    from mappa.sandbox import Sandbox
    from mappa.selftest import run_self_test
    from mappa.tasks import load_tasks

    console = console or Console(stderr=True)
    t = cfg.train
    seed_everything(cfg.seed)
    workflow = build_workflow(cfg)
    agents = tuple(workflow.agents)
    groups = update_groups(agents, cfg.model.agent_weights)
    unknown = set(t.agent_lr) - set(groups)
    if unknown:
        raise MappaError(f"train.agent_lr: unknown agent(s) {sorted(unknown)} (agents: {', '.join(groups)})")
    train_set = load_tasks(cfg.tasks.train, cfg.tasks, "train", cfg.seed)
    if not train_set:
        raise MappaError(f"tasks.train: no training tasks from {cfg.tasks.train}")
    held_out = eval_tasks(cfg)
    with console.status(f"loading {cfg.model.name} ({len(agents)} agents, {cfg.model.agent_weights})..."):
        policy = Policy.from_config(cfg.model, agents, seed=cfg.seed, generation_batch_size=cfg.generation.batch_size)
    optimizers = {
        g: torch.optim.AdamW(
            policy.trainable_parameters(members[0]),
            lr=t.agent_lr.get(g, t.lr),
            betas=tuple(t.adam_betas),
            weight_decay=t.weight_decay,
        )
        for g, members in groups.items()
    }
    schedulers = {
        g: torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: lr_lambda(s, max(t.steps, 1), t.warmup_ratio, t.min_lr_ratio)
        )
        for g, o in optimizers.items()
    }
    sandbox = Sandbox(cfg.sandbox)
    coach = build_coach(cfg.coach, cfg.workflow.name, policy=policy)
    tracker = Tracker(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        wandb_project=cfg.logging.wandb_project,
        run_name=run_dir.name,
        config=cfg.model_dump(mode="json"),
        console=console,
    )
    episodes_path = run_dir / "episodes.jsonl"
    step, cursor = 0, 0
    last: dict[str, float] = {}
    try:
        if resume and (ckpt := latest_checkpoint(run_dir)) is not None:
            state = load_checkpoint(ckpt, policy=policy, optimizers=optimizers, schedulers=schedulers)
            step, cursor = state["step"], state["cursor"]
            for name in ("episodes.jsonl", "metrics.jsonl", "eval/summary.jsonl"):
                _drop_lines_after(run_dir / name, step)
            console.print(f"resumed from {ckpt} at step {step}")
        elif resume:  # killed before the first checkpoint: start over cleanly
            for name in ("episodes.jsonl", "metrics.jsonl", "eval/summary.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
        if step == 0 and t.self_test:
            # Uses its own generator seeds, then the global RNG is re-seeded so a run without it samples the same.
            for line in run_self_test(policy, agents, sandbox, coach.score_many, cfg.workflow.name):
                console.print(f"[green]self-test ok[/] {line}")
            seed_everything(cfg.seed)
        if step == 0:
            last = _eval(cfg, workflow, policy, sandbox, held_out, run_dir, tracker, console, step=0, tag="start")
        console.print(f"{'step':>5} {'acc':>5} " + " ".join(f"{a[:12]:>12}" for a in agents) + "  loss/kl  s")
        while step < t.steps:
            t0 = time.perf_counter()
            batch = task_batch(train_set, cursor, t.prompts_per_step, cfg.seed)
            batch = [task for task in batch for _ in range(t.samples_per_prompt)]
            episodes = run_episodes(
                workflow,
                policy,
                batch,
                sandbox=sandbox,
                gen=cfg.generation,
                scorer=coach.score_many,
                show_coach_feedback=cfg.workflow.show_coach_feedback,
            )
            episodes = coach.finish_episodes(episodes)  # outcome-only: every action gets the episode's 10/0
            t_rollout = time.perf_counter() - t0
            metrics = _rollout_metrics(episodes, agents)
            rollout_tokens = sum(len(a.response_ids) for e in episodes for a in e.actions)
            update_tokens = 0.0
            for g, members in groups.items():
                actions, scores, dropped = select_actions(episodes, members, cfg.coach.on_unscored, t.drop_truncated)
                for why, n in dropped.items():
                    metrics[f"agent/{g}/dropped_{why}"] = float(n)
                metrics[f"agent/{g}/lr"] = optimizers[g].param_groups[0]["lr"]
                if actions:
                    with console.status(f"step {step + 1}: updating {g} on {len(actions)} actions"):
                        stats = update_group(policy, optimizers[g], actions, scores, cfg)
                    update_tokens += stats["tokens"]
                    metrics.update({f"agent/{g}/{k}": v for k, v in stats.items()})
                # The schedule follows the global step, also when this group had nothing to train on; torch
                # warns about a scheduler step before any optimizer step, which is exactly what is meant here.
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
                    schedulers[g].step()
            step += 1
            cursor += t.prompts_per_step
            t_total = time.perf_counter() - t0
            metrics.update(
                {
                    "time/rollout_s": t_rollout,
                    "time/update_s": t_total - t_rollout,
                    "time/rollout_tokens_per_s": rollout_tokens / max(t_rollout, 1e-9),
                    "time/update_tokens_per_s": update_tokens / max(t_total - t_rollout, 1e-9),
                    **{f"coach/{k}": float(v) for k, v in coach.stats().items()},
                }
            )
            _log_episodes(episodes_path, episodes, step)
            tracker.log(metrics, step)
            last = metrics
            cells = " ".join(f"{metrics.get(f'agent/{a}/score_mean', float('nan')):>12.2f}" for a in agents)
            losses = [metrics.get(f"agent/{g}/loss") for g in groups]
            kls = [metrics.get(f"agent/{g}/kl") for g in groups]
            loss_txt = f"{np.nanmean([x for x in losses if x is not None] or [np.nan]):+.3f}"
            kl_txt = f"{np.nanmean([x for x in kls if x is not None] or [np.nan]):.3f}"
            console.print(
                f"{step:>5} {metrics['train/accuracy']:>5.0%} {cells}  {loss_txt}/{kl_txt} {t_total:.0f}",
                highlight=False,
            )
            if step % t.checkpoint_every == 0 or step == t.steps:
                save_checkpoint(
                    run_dir,
                    step,
                    policy=policy,
                    optimizers=optimizers,
                    schedulers=schedulers,
                    state={"cursor": cursor},
                )
            if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                _eval(
                    cfg,
                    workflow,
                    policy,
                    sandbox,
                    held_out,
                    run_dir,
                    tracker,
                    console,
                    step=step,
                    tag=f"step-{step:06d}",
                )
        last = _eval(cfg, workflow, policy, sandbox, held_out, run_dir, tracker, console, step=step, tag="final")
    finally:
        sandbox.close()
        coach.close()
        tracker.close()
    _print_before_after(run_dir, console)
    return last


def _eval(
    cfg, workflow, policy, sandbox, tasks, run_dir, tracker, console, *, step: int, tag: str
) -> dict[str, float]:
    console.print(f"evaluating ({tag}): {len(tasks)} held-out tasks x {cfg.eval.samples} at T={cfg.eval.temperature}")
    metrics, episodes = evaluate(cfg, workflow, policy, sandbox, tasks)
    write_eval(run_dir / "eval", tag, {"step": step, **metrics}, episodes)
    tracker.log(metrics, step)
    print_eval(console, f"eval {tag} (step {step})", metrics, workflow.agents)
    return metrics


def _print_before_after(run_dir: Path, console: Console) -> None:
    path = run_dir / "eval" / "summary.jsonl"
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    start = next((r for r in rows if r["tag"] == "start"), None)
    final = next((r for r in reversed(rows) if r["tag"] == "final"), None)
    if start and final:
        console.print(
            f"[bold]held-out accuracy: {start['eval/accuracy']:.1%} (step 0) -> {final['eval/accuracy']:.1%} "
            f"(step {final['step']:.0f})[/]  run: {run_dir}"
        )


def train_command(cfg: Config | None, resume: str | None, overrides: list[str]) -> int:
    """`mappa train CONFIG [--set k=v]` or `mappa train --resume RUN_DIR [--set k=v]`."""
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").is_file():
            raise MappaError(f"--resume {run_dir}: not a run directory (config.yaml missing)")
        if cfg is None:  # the run's own config; --set may still extend it (e.g. train.steps=20)
            cfg = load_config(run_dir / "config.yaml", overrides)
        (run_dir / "config.yaml").write_text(dump_config(cfg), encoding="utf-8")
        train(cfg, run_dir, resume=True)
        return 0
    if cfg is None:
        raise MappaError("mappa train: give a CONFIG file or --resume RUN_DIR")
    train(cfg, new_run_dir(cfg))
    return 0
