"""The report's alarms on null copies of a real run: how often they fire where there is nothing to find.

    .venv/bin/python bench/bench_alarms_null.py runs/RUN [--copies 200] [--seed 0]

Two kinds of null copy of the run's recorded episodes, each `--copies` times:
  - bias: every task's difficulty level replaced by a random one (drawn once per task from the levels the run
    has, at least two), so no stratum can differ from another except by chance;
  - hacking: the training steps' labels permuted among the steps, so neither the scores nor the outcomes can
    trend over the run except by chance.
On each copy the report's calibrated monitors run at the run's settings (`analysis.*`), side by side with the
naive test the report used before (an unclustered normal-quantile interval on each stratum's raw mean score
against the others', no correction for the number of strata). Prints each false-alarm rate with its Wilson 95%
interval and the naive/calibrated ratio. Which coach scored the run is printed with it.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

import numpy as np

from mappa.analysis.bias import bias_monitor
from mappa.analysis.hacking import hacking_checks
from mappa.analysis.runs import RunData, load_run, scored_actions, step_of
from mappa.config import AnalysisConfig
from mappa.metrics import wilson_interval
from mappa.types import Episode


def with_levels(episodes: Sequence[Episode], levels: dict[str, str]) -> list[Episode]:
    out = []
    for e in episodes:
        meta = {**e.task.meta, "level": levels[e.task.id], "difficulty": levels[e.task.id]}
        out.append(e.model_copy(update={"task": e.task.model_copy(update={"meta": meta})}))
    return out


def with_steps(episodes: Sequence[Episode], order: dict[int, int]) -> list[Episode]:
    return [e.model_copy(update={"meta": {**e.meta, "step": order[step_of(e)]}}) for e in episodes]


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


def run_copies(run: RunData, copies: int, seed: int) -> dict[str, int]:
    th = AnalysisConfig.model_validate(run.config.get("analysis", {}))
    episodes = [e for e in run.episodes if e.correct is not None]
    tasks = sorted({e.task.id for e in episodes})
    levels = sorted({str(e.task.meta.get("level", 1)) for e in episodes} | {"1", "2"})
    steps = sorted({step_of(e) for e in episodes})
    evals = list(run.evals.values())
    counts = dict.fromkeys(("bias", "naive_bias", "hacking"), 0)
    for k in range(copies):
        rng = random.Random(seed * 1_000_003 + k)
        null = with_levels(episodes, {t: rng.choice(levels) for t in tasks})
        counts["bias"] += any(r.alarm for r in bias_monitor(null, th) if r.dimension == "difficulty")
        counts["naive_bias"] += naive_bias_alarm(null, th)
        shuffled = rng.sample(steps, len(steps))
        permuted = with_steps(episodes, dict(zip(steps, shuffled, strict=True)))
        counts["hacking"] += any(c.alarm for c in hacking_checks(permuted, run.agents, th, evals))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("--copies", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    run = load_run(args.run)
    if not run.episodes:
        print(f"{args.run}: no episodes", file=sys.stderr)
        return 2
    coach = run.config.get("coach", {}).get("backend", "?")
    th = AnalysisConfig.model_validate(run.config.get("analysis", {}))
    own_bias = [r.alarm for r in bias_monitor(run.episodes, th) if r.alarm]
    own_hack = [c.alarm for c in hacking_checks(run.episodes, run.agents, th, list(run.evals.values())) if c.alarm]
    steps = len({step_of(e) for e in run.episodes})
    print(f"run {run.name}: {len(run.episodes)} episodes over {steps} steps, coach: {coach}; held-out evals: "
          f"{len(run.evals)}; its own alarms: bias {len(own_bias)}, hacking {len(own_hack)}")  # fmt: skip
    counts = run_copies(run, args.copies, args.seed)
    n = args.copies
    print(f"bias monitor on {n} copies with random difficulty levels: calibrated {rate(counts['bias'], n)}; "
          f"naive {rate(counts['naive_bias'], n)}")  # fmt: skip
    ratio = counts["naive_bias"] / counts["bias"] if counts["bias"] else float("inf")
    print(f"naive / calibrated false alarms: {ratio:.1f}x" if counts["bias"] else
          f"naive / calibrated false alarms: {counts['naive_bias']} vs 0")  # fmt: skip
    print(f"hacking alarm on {n} copies with permuted steps: {rate(counts['hacking'], n)}")
    print(f"alpha per run: {th.alarm_alpha:g} (each alarm's false-alarm rate should be at most this)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
