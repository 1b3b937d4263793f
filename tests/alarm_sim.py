"""A simulator of training runs whose truth is known, for measuring the report's alarms' error rates.

A run: `steps` steps of `episodes` episodes, each on a task drawn (with replacement) from a pool of `tasks`, so
tasks repeat as in a real run. Every task has a data type (half regression), a difficulty level drawn at
random (1-5, unrelated to anything: the null copy of a real run), a hardness that lowers its success and a
coach preference for it that is no bias of any stratum. Every agent's action in an episode gets a score

    3 + 4 * correct (+ 3 * test score in data-science runs) + task preference + episode effect + noise
    + `common_rise` * progress (all agents improving) + `hack_rise` on agent 0 * progress
    + `bias` on regression tasks (+ `drift` * progress) + the agent's step shock,

rounded and clipped to 0-10 like a coach's integer scores; progress runs 0 -> 1 over the run. The step shock is one
number per agent and step, an AR(1) series over the steps (coefficient `shock_ar`, standard deviation `shock_sd`):
what a real run's step means carry beyond their sampling noise (the policy drifting, one step's batch of tasks
suiting the coach), serially correlated and trendless, so a test that takes steps for independent points sees
trends in it. Regression tasks succeed `type_success` more often than classification ones (a stratum tied to the
outcome). Accuracy runs from `acc_start` to `acc_start + acc_rise`; a held-out evaluation of `eval_tasks` tasks at
the start and the end gives the held-out gain (paired by task).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mappa.analysis.bias import ActionTable
from mappa.metrics import paired_task_interval

AGENTS = ("problem_solver", "code_executor", "verifier")


@dataclass(frozen=True)
class SimRun:
    steps: int = 20
    episodes: int = 16  # per step
    tasks: int = 64  # the training pool
    eval_tasks: int = 48
    acc_start: float = 0.3
    acc_rise: float = 0.0  # over the run (0-1)
    common_rise: float = 1.0  # points over the run, every agent and stratum alike
    hack_rise: float = 0.0  # points over the run on AGENTS[0], not in the accuracy
    bias: float = 0.0  # points on regression tasks
    drift: float = 0.0  # points on regression tasks, growing over the run
    data_science: bool = False  # a normalised test score per valid submission, which the coach reads
    quality_gap: float = 0.0  # regression's test scores higher by this (a real difference, not a bias)
    shock_sd: float = 0.0  # points: standard deviation of each agent's step shock
    shock_ar: float = 0.0  # its AR(1) coefficient from one step to the next
    type_success: float = 0.0  # regression's success probability higher by this


@dataclass
class Simulated:
    table: ActionTable
    held: tuple[float, tuple[float, float]]  # the held-out gain with its paired 95% interval


def simulate(cfg: SimRun, rng: np.random.Generator) -> Simulated:
    t = cfg.tasks
    regression = rng.random(t) < 0.5
    level = rng.integers(1, 6, size=t)
    hardness = rng.normal(0, 1, size=t)
    preference = rng.normal(0, 0.7, size=t)
    n = cfg.steps * cfg.episodes
    step = np.repeat(np.arange(1, cfg.steps + 1), cfg.episodes)
    progress = (step - 1) / max(cfg.steps - 1, 1)
    task = rng.integers(t, size=n)
    p = cfg.acc_start + cfg.acc_rise * progress - 0.1 * hardness[task] + cfg.type_success * (regression[task] - 0.5)
    p = np.clip(p, 0.02, 0.98)
    correct = (rng.random(n) < p).astype(float)
    quality = np.full(n, np.nan)
    base = 3 + 4 * correct + preference[task] + rng.normal(0, 0.7, size=n)
    if cfg.data_science:
        q = np.clip(0.4 + cfg.quality_gap * regression[task] - 0.2 * hardness[task] + rng.normal(0, 0.3, n), -1, 1.5)
        quality = np.where(correct > 0, q, 0.0)
        base = base + 3 * quality
    base = base + cfg.common_rise * progress + (cfg.bias + cfg.drift * progress) * regression[task]
    agents, scores = [], []
    for i, agent in enumerate(AGENTS):
        x = base + rng.normal(0, 1, size=n) + (cfg.hack_rise * progress if i == 0 else 0.0)
        x = x + ar1(cfg.steps, cfg.shock_ar, cfg.shock_sd, rng)[step - 1]
        scores.append(np.clip(np.round(x), 0, 10))
        agents += [agent] * n
    table = ActionTable(
        agent=agents,
        score=np.concatenate(scores).tolist(),
        correct=np.tile(correct, 3).tolist(),
        quality=np.tile(quality, 3).tolist(),
        step=np.tile(step, 3).tolist(),
        task=[f"t{k}" for k in np.tile(task, 3)],
    )
    table.strata = {
        "source": ["dsbench"] * len(agents),
        "data_type": ["regression" if regression[k] else "classification" for k in np.tile(task, 3)],
        "difficulty": [str(level[k]) for k in np.tile(task, 3)],
    }
    return Simulated(table, _held_out(cfg, rng))


def ar1(n: int, coef: float, sd: float, rng: np.random.Generator) -> np.ndarray:
    """A stationary AR(1) series of n values with standard deviation sd (zeros when sd is 0)."""
    out = np.zeros(n)
    if sd <= 0:
        return out
    shocks = rng.normal(0, sd * np.sqrt(1 - coef**2), size=n)
    out[0] = rng.normal(0, sd)
    for k in range(1, n):
        out[k] = coef * out[k - 1] + shocks[k]
    return out


def _held_out(cfg: SimRun, rng: np.random.Generator) -> tuple[float, tuple[float, float]]:
    hardness = rng.normal(0, 1, size=cfg.eval_tasks)
    before = rng.random(cfg.eval_tasks) < np.clip(cfg.acc_start - 0.1 * hardness, 0.02, 0.98)
    after = rng.random(cfg.eval_tasks) < np.clip(cfg.acc_start + cfg.acc_rise - 0.1 * hardness, 0.02, 0.98)
    diffs = after.astype(float) - before.astype(float)
    return float(diffs.mean()), paired_task_interval(diffs.tolist())
