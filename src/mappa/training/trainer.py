"""`mappa train`: REINFORCE++ per agent from per-action coach scores (method.md section 2).

Read top to bottom: `setup()` builds the run state (or restores it from the last checkpoint), `train_step()`
is one step, `train()` is the loop. The work runs on the run's engine (`mappa.protocols.Engine`): in this
process (`mappa.training.engine.LocalEngine`), or on Ray actors with `--ray` (`mappa.distributed`); the loop is the
same either way. One step:
  1. draw `prompts_per_step` tasks (`mappa.tasks.sampler.pick_tasks`: a seeded permutation per pass; the cursor is
     checkpointed) and play `samples_per_prompt` episodes of each, all at once (`mappa.workflows.runtime`), sampling
     from the seed `seed + step` (`generation.backend`: the policy itself, or a LoRA server sent each step's adapters);
     the coach scores every action as it lands;
  2. rewards (`mappa.training.rewards`): each action's coach score, or with `coach.backend: outcome` the episode's
     10/0 for every action; per update group (one per agent, or one for all with `model.agent_weights:
     shared`) keep the actions that are scored, not truncated and whose tool call did not hit an infra_error;
  3. per group (`mappa.training.update.update_group`): reference log-probs from the base model (adapters off) and old
  log-probs
     from the policy as it was at rollout time (recomputed unless generation's are the training forward's own:
     always with a server or bfloat16 sampling copies, `mappa.training.update.recomputes_old_logprobs`), both before
     the first optimizer step; token rewards
     -kl_coef * (logp_old - logp_ref) + score/10 on the last token, returns, advantages whitened once over
     the group's whole batch (`mappa.training.rl`);
  4. the batch shuffled (seeded) into mini-batches of `train.mini_batch_size` actions, `train.epochs` passes:
     one optimizer step per mini-batch (PPO clip against the old log-probs, token mean within the
     mini-batch, micro-batches of `train.micro_batch_size` with gradient accumulation, grad-norm clip,
     AdamW); from the second step on the ratio leaves 1 and the clip acts. The learning rate of each step
     follows warm-up then cosine to a floor over the run's progress (`rl.lr_factor`); each group has its
     own optimizer and learning rate (`train.agent_lr`);
  5. the new weights to whatever samples the next episodes (`Engine.step_sync`: a server gets the adapters, Ray's
     rollout workers a copy); log the step's typed results (`StepResult`, named only by the tracker), write every
     episode to episodes.jsonl, checkpoint atomically, note each group whose rewards had no spread (nothing to learn
     from), evaluate every `eval_every` steps (always at start and end) with the rule-based answer check; at the end
     the gain over the start with its 95% interval.

Where this departs from the paper / published code:
  - the coach's score is by default its expected score (probability-weighted over the score tokens, when
    the backend returns log-probs; `coach.expected_score: false` reads the sampled number);
  - none in the reward scale: `workflow.reward_scale` is the paper's per workflow (MathChat's scores / 10, the
    data-science team's raw 0-10), and log-probs are those of the distribution sampled from (temperature);
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

from mappa.config import Config, dump_config
from mappa.errors import MappaError
from mappa.metrics import Gain, answered, episode_metrics
from mappa.paths import atomic_write
from mappa.plugins import check_instance, qualified_name
from mappa.protocols import Engine, ProgressFn, Workflow
from mappa.tasks.sampler import pick_tasks, train_tasks
from mappa.training.checkpoint import kept_rng
from mappa.training.engine import Place, open_engine
from mappa.training.evaluate import eval_gain, eval_tasks, gain_metrics, write_eval
from mappa.training.rewards import RewardMode, per_action_scores, reward_mode, select_actions
from mappa.training.tracking import StepResult, Tracker, append_episodes, read_metrics
from mappa.training.update import GroupResult, UpdateJob, UpdateSettings, config_groups
from mappa.types import Episode, Task


@dataclass(frozen=True)
class Event:
    """What the run reports as it goes; the CLI turns these into console lines."""

    # status: work starting; note: a line to show; run: the run directory (text), named as the run starts
    kind: Literal["status", "note", "run", "eval", "step"]
    step: int
    text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # eval: the evaluation's metrics
    result: StepResult | None = None  # step: what the step did


# ---------------------------------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class Parts:
    """What a run may be handed from Python instead of building it from the config (`mappa.train`)."""

    workflow: Workflow | None = None
    coach: Any = None  # a coach instance, class, factory or reward function (`mappa.coach.plugin`)
    train_tasks: Sequence[Task] | None = None
    eval_tasks: Sequence[Task] | None = None

    def names(self) -> dict[str, str]:
        """The objects handed in, by role, as `module:qualname` (what run.json records)."""
        objects = {"workflow": self.workflow, "coach": self.coach}
        out = {role: qualified_name(obj) for role, obj in objects.items() if obj is not None}
        out.update({role: f"{len(tasks)} tasks" for role, tasks in self._tasks().items()})
        return out

    def _tasks(self) -> dict[str, Sequence[Task]]:
        return {k: v for k, v in (("train_tasks", self.train_tasks), ("eval_tasks", self.eval_tasks)) if v is not None}


def _held_out(cfg: Config, tasks: Sequence[Task] | None) -> list[Task]:
    if tasks is None:
        return eval_tasks(cfg)
    held_out = list(tasks)[: cfg.eval.max_tasks]
    if not held_out:
        raise MappaError("eval_tasks: no evaluation tasks given")
    return held_out


@dataclass
class Run:
    """Everything a training run holds between steps."""

    cfg: Config
    run_dir: Path
    workflow: Workflow
    groups: dict[str, list[str]]  # update group -> its agents: one per agent, or "shared" for all
    engine: Engine  # where episodes play and weights update: this process, or a Ray cluster (`mappa.training.engine`)
    tracker: Tracker
    train_set: list[Task]
    held_out: list[Task]
    reward: RewardMode
    emit: Callable[[Event], None]
    progress: ProgressFn | None = None  # (actions done, total) while episodes play
    step: int = 0
    cursor: int = 0  # tasks drawn so far from the training stream
    unscored_steps: int = 0  # consecutive steps in which the coach scored no action (`train.max_unscored_steps`)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.tracker.close()


def setup(
    cfg: Config, run_dir: Path, *, resume: bool = False, emit: Callable[[Event], None] | None = None,
    progress: ProgressFn | None = None, place: Place | None = None, parts: Parts = Parts(),
) -> Run:  # fmt: skip
    """Build the run: tasks, agents, its engine (weights, optimizers, sandbox, coach), logs; restore the last
    checkpoint on resume.

    `place(cfg, run_dir, agents, groups)` (`mappa.distributed.placement`): the engine of a Ray cluster whose
    rollout workers hold sandboxes and coaches and whose trainer actors hold the weights and optimizers; None:
    all in this process (`mappa.training.engine.LocalEngine`). `parts`: objects handed in from Python, used instead of
    what the config names (a workflow or coach object: in-process runs only)."""
    from mappa.workflows import build_workflow

    emit = emit or (lambda event: None)
    torch.manual_seed(cfg.seed)  # LoRA dropout, if on; sampling is seeded per rollout, init by the policy
    if place is not None and (parts.workflow is not None or parts.coach is not None):
        raise MappaError(
            "--ray: a workflow or coach object passed from Python cannot reach the cluster's actors; name it by "
            "import path in the config (workflow.name / coach.backend: 'module:name')"
        )
    workflow = parts.workflow if parts.workflow is not None else build_workflow(cfg)
    check_instance(workflow, "workflow")
    groups = config_groups(cfg, workflow.agents)
    train_set = list(parts.train_tasks) if parts.train_tasks is not None else train_tasks(cfg)
    held_out = _held_out(cfg, parts.eval_tasks)
    if not train_set:
        raise MappaError("train_tasks: no training tasks given")
    for task in [*train_set, *held_out]:  # a task the team cannot play fails now, not after minutes of evaluation
        workflow.check_task(task)
    emit(Event("status", 0, f"loading {cfg.model.name} ({len(workflow.agents)} agents, {cfg.model.agent_weights})"))
    engine = open_engine(cfg, run_dir, workflow, groups, place=place, coach=parts.coach)
    try:
        tracker = Tracker(
            run_dir, report_to=cfg.logging.report_to, project=cfg.logging.project, run_name=run_dir.name,
            config=cfg.model_dump(mode="json"),
        )  # fmt: skip
    except BaseException:
        engine.close()
        raise
    for warning in tracker.warnings:
        emit(Event("note", 0, warning))
    run = Run(
        cfg, run_dir, workflow, groups, engine, tracker, train_set, held_out, reward_mode(cfg.coach.backend), emit,
        progress,
    )  # fmt: skip
    try:
        restored = engine.restore_checkpoint(run_dir) if resume else None
        engine.step_sync(restored[1]["step"] if restored else 0)  # a generation server starts from these weights
    except BaseException:
        run.close()
        raise
    if restored is not None:
        ckpt, state = restored
        run.step, run.cursor = state["step"], state["cursor"]
        emit(Event("note", run.step, f"resumed from {ckpt} at step {run.step}"))
    return run


def update_settings(cfg: Config, samples_exactly: bool) -> UpdateSettings:
    """What the update reads: the run's config, and what the engine says of its generation (`samples_exactly`:
    a server, or a bfloat16 sampling copy, is not the training forward pass). Whether that means recomputing the
    old log-probs is the update's one rule (`mappa.training.update.recomputes_old_logprobs`)."""
    return UpdateSettings(cfg.train, cfg.generation.temperature, cfg.workflow.score_scale, samples_exactly)


def _update_groups(run: Run, episodes: list[Episode], scores: list[list[float | None]]) -> dict[str, GroupResult]:
    """Select each group's actions and have the engine update each group's weights (one group after another in
    this process, all at once on their trainer actors with --ray); each group's result."""
    cfg, t, step, jobs = run.cfg, run.cfg.train, run.step, {}
    settings = update_settings(cfg, run.engine.samples_exactly)
    for i, (g, members) in enumerate(run.groups.items()):
        actions, kept, dropped = select_actions(episodes, scores, members, cfg.coach.on_unscored, t.drop_truncated)
        seed = cfg.seed * 1_000_003 + step * 101 + i
        jobs[g] = UpdateJob(actions, kept, seed, t.agent_lr.get(g, t.lr), step, settings, dropped)
    done = run.engine.update(jobs, status=lambda text: run.emit(Event("status", step + 1, f"step {step + 1}: {text}")))
    return {g: done[g] for g in run.groups}


def train_step(run: Run) -> StepResult:
    """One step: rollouts -> rewards -> per-group updates -> log and checkpoint; returns what the step did (also
    reported as a "step" event, then a note per group whose rewards had no spread)."""
    cfg, t = run.cfg, run.cfg.train
    t0 = time.perf_counter()
    run.emit(Event("status", run.step + 1, f"step {run.step + 1}: rollouts"))
    tasks = pick_tasks(run.train_set, t.prompts_per_step, cfg.seed, start=run.cursor, stratify_by=t.stratify_by)
    batch, seed = [task for task in tasks for _ in range(t.samples_per_prompt)], cfg.seed + run.step + 1
    episodes = run.engine.play(batch, seed, progress=run.progress)
    t_rollout = time.perf_counter() - t0
    scores = per_action_scores(episodes, run.reward, cfg.coach.outcome_weight)
    groups = _update_groups(run, episodes, scores)
    run.step += 1
    run.cursor += t.prompts_per_step
    generation = run.engine.step_sync(run.step)  # the new weights to whatever samples; its counters
    result = StepResult(
        run.step, tuple(run.workflow.agents), episode_metrics(episodes, run.workflow.agents, "train"), groups,
        generation, dict(run.engine.stats()), t_rollout, time.perf_counter() - t0 - t_rollout,
        sum(len(a.response_ids) for e in episodes for a in e.actions),
    )  # fmt: skip
    append_episodes(run.run_dir / "episodes.jsonl", episodes, run.step)
    run.tracker.log_step(result)
    if run.step % t.checkpoint_every == 0 or run.step == t.steps:
        run.engine.save_checkpoint(run.run_dir, run.step, {"cursor": run.cursor}, keep=t.keep_checkpoints)
    run.emit(Event("step", run.step, result=result))
    for line in no_spread_lines(result):
        run.emit(Event("note", run.step, line))
    _stop_if_unscored(run, episodes, scores)
    return result


def no_spread_lines(result: StepResult) -> list[str]:
    """A line per update group whose trained actions all scored alike in the step: whitening their rewards leaves
    no signal from the coach (TRL reports the share of such groups as `frac_reward_zero_std`), which a mean score
    alone does not show."""
    out = []
    for g, r in result.groups.items():
        if r.reward_zero_std:
            n = r.actions_trained
            what = f"its {n} trained actions all scored" if n > 1 else "its one trained action scored"
            out.append(
                f"step {result.step}: {g}: {what} {r.reward_mean:.2f}, no spread: nothing to learn from, not updated"
            )
    return out


def _stop_if_unscored(run: Run, episodes: list[Episode], scores: list[list[float | None]]) -> None:
    """Stop after `train.max_unscored_steps` consecutive steps in which the coach scored no action: an endpoint
    that went down must not leave hours of steps that train nothing. Called after the step is logged and
    checkpointed, so the run resumes where it stopped once the coach answers again."""
    flat = [s for row in scores for s in row]
    if run.reward != "coach" or not flat or any(s is not None for s in flat):
        run.unscored_steps = 0
        return
    run.unscored_steps += 1
    limit = run.cfg.train.max_unscored_steps
    if limit and run.unscored_steps >= limit:
        errors = [a.coach.error for e in episodes for a in e.actions if a.coach is not None and a.coach.error]
        why = " ".join((errors[-1] if errors else "no coach score").split())[:200]
        raise MappaError(
            f"coach: no action scored in {run.unscored_steps} consecutive steps (last: {why}); stopped after step "
            f"{run.step}, checkpointed: fix the coach, then mappa train --resume {run.run_dir}"
        )


def run_eval(run: Run, tag: str) -> dict[str, float]:
    """Evaluate on the held-out tasks; written to eval/<tag>.jsonl and eval/summary.jsonl, and logged."""
    cfg = run.cfg
    what = f"{len(run.held_out)} held-out tasks x {cfg.eval.samples} at T={cfg.eval.temperature}"
    run.emit(Event("status", run.step, f"evaluating ({tag}): {what}"))
    metrics, episodes = run.engine.evaluate(run.held_out, progress=run.progress)
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
    actions_trained: dict[str, int] = field(default_factory=dict)  # per update group, over all the run's steps
    steps_run: int = 0  # training steps this call ran (0: a resume of a finished run)
    answered: Gain | None = None  # as `gain`, for the share of episodes that end with a final answer, right or wrong
    optimizer_steps: dict[str, int] = field(default_factory=dict)  # per update group, over all the run's steps

    @property
    def trained_nothing(self) -> bool:
        """Steps ran and no group took an optimizer step in any step of the run (a resume counts the steps before
        it): every weight is where it started, so the run measured nothing (the CLI exits 3). Either every action
        was left out (`mappa.training.rewards.untrained_groups` says why) or, where some were kept, the coach
        scored each group's alike in every step (no spread: nothing to learn from, `apply_update`)."""
        return self.steps_run > 0 and not any(self.optimizer_steps.values())

    @property
    def why_nothing_trained(self) -> str:
        """What `trained_nothing` means for this run, as its warning says it."""
        if not any(self.actions_trained.values()):
            return "no agent trained on any action"
        return "no agent was updated: the coach scored each agent's kept actions alike in every step (no spread)"


def run_totals(run_dir: Path, groups: Sequence[str], name: str) -> dict[str, int]:
    """Each group's `agent/<g>/<name>` (actions_trained, optimizer_steps) summed over the steps metrics.jsonl holds:
    on a resume, those up to its checkpoint (the resume cut the file back there, `Tracker`)."""
    out = dict.fromkeys(groups, 0)
    for row in read_metrics(run_dir):
        for g in groups:
            out[g] += int(row.get(f"agent/{g}/{name}", 0))
    return out


def train(
    cfg: Config, run_dir: Path, *, resume: bool = False, emit: Callable[[Event], None] | None = None,
    progress: ProgressFn | None = None, place: Place | None = None, parts: Parts = Parts(),
) -> TrainResult:  # fmt: skip
    """Train per the module docstring: self-test, start eval, `train.steps` steps, final eval and gain (`place`:
    the Ray cluster, `parts`: objects from Python; see `setup`). `mappa.train` is the entry point that also makes
    the run directory and checks the sandbox first."""
    run = setup(cfg, run_dir, resume=resume, emit=emit, progress=progress, place=place, parts=parts)
    try:
        if cfg.train.self_test:  # on resume too: the coach or the sandbox may have broken while the run was stopped
            with kept_rng():  # ...and without moving the RNG that the resumed steps sample from
                for line in run.engine.self_test():  # with Ray: on a rollout worker, with its policy copy
                    run.emit(Event("note", run.step, f"self-test ok: {line}"))
        if resume:  # a resume's --set overrides are kept once its checkpoint loaded and the self-test passed
            atomic_write(run_dir / "config.yaml", dump_config(cfg))  # a kill here leaves the old one whole
        if run.step == 0:
            run_eval(run, "start")
        trained, moved = (
            run_totals(run_dir, run.groups, name) if run.step else dict.fromkeys(run.groups, 0)
            for name in ("actions_trained", "optimizer_steps")
        )
        first = run.step
        while run.step < cfg.train.steps:
            result = train_step(run)
            for g, r in result.groups.items():
                trained[g] += r.actions_trained
                moved[g] += r.optimizer_steps
            if cfg.train.eval_every and run.step % cfg.train.eval_every == 0 and run.step != cfg.train.steps:
                run_eval(run, f"step-{run.step:06d}")
        final = run_eval(run, "final")
        gain = eval_gain(run_dir / "eval")
        answers = eval_gain(run_dir / "eval", hit=answered)
        if gain is not None and math.isfinite(gain.gain):
            run.tracker.log(gain_metrics(gain), run.step)
    finally:
        run.close()
    return TrainResult(run_dir, run.step, final, gain, trained, run.step - first, answers, moved)
