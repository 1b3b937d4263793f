"""The report's alarms on null runs: how often they fire where there is nothing to find.

    .venv/bin/python bench/bench_alarms_null.py runs/RUN [--copies 200] [--seed 0] [--block L]
    .venv/bin/python bench/bench_alarms_null.py --sim [--copies 200] [--seed 0]

On a real run, two kinds of null copy of its recorded episodes, each `--copies` times:
  - bias: every task's difficulty level replaced by a random one (drawn once per task from the levels the run
    has, at least two), so no stratum can differ from another except by chance; the calibrated monitor side by
    side with the naive test the report used before (an unclustered normal-quantile interval on each stratum's
    raw mean score against the others', no correction for the number of strata);
  - hacking: a moving-block bootstrap of the training steps (blocks of `--block` consecutive steps, by default
    the cube root of the number of steps rounded up, drawn at random and laid end to end as steps 1..T), so the
    run's own step-to-step correlation stays inside each block while no trend over the run can exist; the alarm
    as it is (`serial_trend`) side by side with the same alarm taking the steps for independent points
    (`trend_through_points`, as it did before). Permuting single steps, as this benchmark once did, destroys
    exactly the correlation that makes the second anti-conservative.
Also printed: the per-step residual series of each agent (scores beyond what the outcomes explain), its
autocorrelation and spread, the figures that size the simulator's step shocks.

With `--sim`: the simulated runs of tests/alarm_sim.py with a trendless AR(1) shock per agent and step, over a grid
of run lengths and shock sizes, the same two alarms on the same runs.

Every rate is printed with its Wilson 95% interval and n. Which coach scored the run is printed with it.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mappa.analysis.bias import bias_monitor, quality_of, truth_design
from mappa.analysis.hacking import Trend, check_arrays, hacking_checks
from mappa.analysis.runs import RunData, load_run, scored_actions, step_of
from mappa.analysis.stats import least_squares_residuals, serial_rho, serial_trend, trend_through_points
from mappa.config import AnalysisConfig
from mappa.metrics import wilson_interval
from mappa.types import Episode

TRENDS: dict[str, Trend] = {"serial": serial_trend, "independent": trend_through_points}


def with_levels(episodes: Sequence[Episode], levels: dict[str, str]) -> list[Episode]:
    out = []
    for e in episodes:
        meta = {**e.task.meta, "level": levels[e.task.id], "difficulty": levels[e.task.id]}
        out.append(e.model_copy(update={"task": e.task.model_copy(update={"meta": meta})}))
    return out


def block_steps(steps: Sequence[int], block: int, rng: random.Random) -> list[int]:
    """A moving-block bootstrap of the steps: len(steps) source steps, in blocks of `block` consecutive ones."""
    out: list[int] = []
    while len(out) < len(steps):
        start = rng.randrange(len(steps) - block + 1)
        out += steps[start : start + block]
    return out[: len(steps)]


def with_block_steps(by_step: dict[int, list[Episode]], sources: Sequence[int]) -> list[Episode]:
    """Step k of the copy holds the episodes of step sources[k-1] (ids made unique: a step may be drawn twice)."""
    return [
        e.model_copy(update={"id": f"{e.id}@{k}", "meta": {**e.meta, "step": k}})
        for k, src in enumerate(sources, start=1)
        for e in by_step[src]
    ]


def naive_bias_alarm(episodes: Sequence[Episode], th: AnalysisConfig) -> bool:
    """The old monitor: raw mean score of a level against the others, unclustered, z = 1.96, no correction."""
    rows = [(a.agent, str(e.task.meta.get("level")), s) for e, a, s in scored_actions(episodes)]
    for agent in {r[0] for r in rows}:
        mine = [r for r in rows if r[0] == agent]
        for level in {r[1] for r in mine}:
            inside = np.array([s for _, lv, s in mine if lv == level])
            outside = np.array([s for _, lv, s in mine if lv != level])
            if len(inside) < 2 or len(outside) < 2:
                continue
            gap = inside.mean() - outside.mean()
            se = np.sqrt(inside.var(ddof=1) / len(inside) + outside.var(ddof=1) / len(outside))
            if abs(gap) >= th.bias_gap and se > 0 and abs(gap) / se > 1.96:
                return True
    return False


def rate(k: int, n: int) -> str:
    lo, hi = wilson_interval(k, n)
    return f"{k}/{n} = {k / n:.1%} [{lo:.1%}, {hi:.1%}]"


def residual_series(run: RunData) -> dict[str, tuple[list[int], np.ndarray]]:
    """Agent -> (steps, per-step mean of score/10 less what the outcomes predict), as the hacking alarm fits it."""
    out = {}
    for agent in run.agents:
        rows = [(step_of(e), s / 10, float(bool(e.correct)), quality_of(e)) for e, a, s in scored_actions(run.episodes)
                if a.agent == agent and e.correct is not None]  # fmt: skip
        if not rows:
            continue
        steps, score, correct, quality = (np.array(c) for c in zip(*rows, strict=True))
        _, resid = least_squares_residuals(score, truth_design(correct, quality))
        uniq, index = np.unique(steps, return_inverse=True)
        out[agent] = (uniq.tolist(), np.bincount(index, weights=resid) / np.bincount(index))
    return out


def describe_series(run: RunData) -> None:
    for agent, (steps, means) in residual_series(run).items():
        if len(means) < 4:
            continue
        x = np.asarray(steps, dtype=float)
        _, resid = least_squares_residuals(means, np.column_stack([np.ones_like(x), x]))
        rho = float(resid[1:] @ resid[:-1] / (resid @ resid)) if resid @ resid > 0 else 0.0
        print(f"  {agent}: {len(means)} steps; per-step residual means sd {means.std(ddof=1) * 10:.2f} points "
              f"(after a line: {resid.std(ddof=2) * 10:.2f}); lag-1 autocorrelation {rho:+.2f} (raw; the "
              f"interval assumes {serial_rho(resid):.2f})")  # fmt: skip


def run_copies(run: RunData, copies: int, seed: int, block: int) -> dict[str, int]:
    th = AnalysisConfig.model_validate(run.config.get("analysis", {}))
    episodes = [e for e in run.episodes if e.correct is not None]
    tasks = sorted({e.task.id for e in episodes})
    levels = sorted({str(e.task.meta.get("level", 1)) for e in episodes} | {"1", "2"})
    by_step: dict[int, list[Episode]] = {}
    for e in episodes:
        by_step.setdefault(step_of(e), []).append(e)
    steps = sorted(by_step)
    evals = list(run.evals.values())
    counts = dict.fromkeys(("bias", "naive_bias", *TRENDS), 0)
    for k in range(copies):
        rng = random.Random(seed * 1_000_003 + k)
        null = with_levels(episodes, {t: rng.choice(levels) for t in tasks})
        counts["bias"] += any(r.alarm for r in bias_monitor(null, th) if r.dimension == "difficulty")
        counts["naive_bias"] += naive_bias_alarm(null, th)
        shuffled = with_block_steps(by_step, block_steps(steps, block, rng))
        for name, trend in TRENDS.items():
            counts[name] += any(c.alarm for c in hacking_checks(shuffled, run.agents, th, evals, trend))
    return counts


def real_run(args: argparse.Namespace) -> int:
    run = load_run(args.run)
    if not run.episodes:
        print(f"{args.run}: no episodes", file=sys.stderr)
        return 2
    coach = run.config.get("coach", {}).get("backend", "?")
    th = AnalysisConfig.model_validate(run.config.get("analysis", {}))
    own_bias = [r.alarm for r in bias_monitor(run.episodes, th) if r.alarm]
    own_hack = [c.alarm for c in hacking_checks(run.episodes, run.agents, th, list(run.evals.values())) if c.alarm]
    steps = len({step_of(e) for e in run.episodes})
    block = args.block or math.ceil(steps ** (1 / 3))
    print(f"run {run.name}: {len(run.episodes)} episodes over {steps} steps, coach: {coach}; held-out evals: "
          f"{len(run.evals)}; its own alarms: bias {len(own_bias)}, hacking {len(own_hack)}")  # fmt: skip
    describe_series(run)
    counts = run_copies(run, args.copies, args.seed, block)
    n = args.copies
    print(f"bias monitor on {n} copies with random difficulty levels: calibrated {rate(counts['bias'], n)}; "
          f"naive {rate(counts['naive_bias'], n)}")  # fmt: skip
    print(f"hacking alarm on {n} block-bootstrap copies (blocks of {block} steps): serial_trend "
          f"{rate(counts['serial'], n)}; steps as independent points {rate(counts['independent'], n)}")  # fmt: skip
    print(f"alpha per run: {th.alarm_alpha:g} (each alarm's false-alarm rate should be at most this)")
    return 0


SIM_GRID = [  # (steps, episodes per step, shock sd in points, AR(1) coefficient)
    (10, 16, 0.0, 0.0), (10, 16, 0.3, 0.5), (10, 16, 0.5, 0.7), (20, 16, 0.0, 0.0), (20, 16, 0.3, 0.5),
    (20, 16, 0.5, 0.5), (20, 16, 0.5, 0.7), (20, 16, 0.8, 0.7), (40, 16, 0.5, 0.7), (40, 8, 0.3, 0.5),
]  # fmt: skip


def simulated(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from alarm_sim import AGENTS, SimRun, simulate

    th = AnalysisConfig()
    level = th.alarm_alpha / len(AGENTS)
    print(f"simulated null runs (tests/alarm_sim.py, rubric-like integer scores, 3 agents, flat accuracy, "
          f"held-out evaluation of 48 tasks): hacking alarm per run, {args.copies} runs per line")  # fmt: skip
    for steps, episodes, sd, ar in SIM_GRID:
        cfg = SimRun(steps=steps, episodes=episodes, common_rise=0.0, shock_sd=sd, shock_ar=ar)
        rng = np.random.default_rng(args.seed)
        counts = dict.fromkeys(TRENDS, 0)
        for _ in range(args.copies):
            sim = simulate(cfg, rng)
            t = sim.table
            who, steps_a = np.asarray(t.agent), np.asarray(t.step)
            score, correct, quality = np.asarray(t.score) / 10, np.asarray(t.correct), np.asarray(t.quality)
            for name, trend in TRENDS.items():
                counts[name] += any(
                    check_arrays(a, steps_a[who == a], score[who == a], correct[who == a], quality[who == a],
                                 sim.held, th, level, trend).alarm is not None
                    for a in AGENTS
                )  # fmt: skip
        serial, independent = (rate(counts[name], args.copies) for name in TRENDS)
        print(f"  {steps} steps x {episodes} episodes, shock sd {sd:g} points, AR {ar:g}: serial_trend {serial}; "
              f"independent points {independent}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?")
    p.add_argument("--sim", action="store_true", help="simulated runs with AR(1) step shocks instead of a run")
    p.add_argument("--copies", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block", type=int, default=0, help="steps per bootstrap block (default: cube root, rounded up)")
    args = p.parse_args(argv)
    if args.sim:
        return simulated(args)
    if not args.run:
        p.error("a run directory, or --sim")
    return real_run(args)


if __name__ == "__main__":
    sys.exit(main())
