"""Benchmark: per-action process rewards vs outcome-only rewards vs one shared policy, trained side by side.

Three arms on the demo's settings (configs/demo.yaml: the embedded SmolLM2-135M, generated arithmetic, and by
default the rubric coach: rule-based process rewards, no LLM), each trained from the same seeds, on the same
tasks, for the same steps, with the same rollouts per step, and evaluated on the same held-out tasks with the
rule-based check:

    process   configs/demo.yaml as it is: each action scored by the coach, one LoRA adapter per agent
    outcome   coach.backend=outcome (as configs/mathchat_outcome.yaml): every action scored 10 or 0 by the answer
    shared    model.agent_weights=shared: the coach's per-action scores, one adapter for every agent

`--coach-set KEY=VALUE` sets coach.KEY in the coached arms (process, shared), so the same comparison runs with an
LLM coach behind any OpenAI-compatible endpoint (`--coach-set backend=openai --coach-set model=gpt-4o-mini`).

It first prints a power calculation: from the last measured run (3 seeds x 32 tasks), the gap between arms and
how much it moves between seeds, the seeds and held-out tasks that tell such a gap from noise 80% of the time,
the hours that takes, and the power of the size about to run (`--powered` runs at the calculated size,
`--power-only` stops after it). Then each arm's final held-out accuracy (Wilson 95%) with the coach that scored
it and what the arm's own training changed (start -> final on the same tasks, one paired gain per seed, t over
seeds: right answers, and episodes ending with an answer at all), and the gaps process - outcome and process -
shared: first over seeds (one paired gain per seed, Student t
interval on seeds - 1 degrees of freedom, the number of seeds named), then per task (tasks x seeds pooled,
paired by task, t on the per-task differences), which leaves the variation between seeds out; with one seed it says so. Then `mappa compare` and
`mappa report` over the runs. Runs go under --out as <arm>-seed<S>; a finished run is reused and a killed one is
resumed, so the benchmark can be stopped and started again; `--so-far` (with the same size flags) trains nothing and
summarises the seeds every arm has finished, into interim.json, while a long benchmark runs.

    .venv/bin/python bench/bench_process_vs_outcome.py --power-only   # the power calculation alone
    .venv/bin/python bench/bench_process_vs_outcome.py       # 3 arms x 3 seeds into runs/process-vs-outcome
    .venv/bin/python bench/bench_process_vs_outcome.py --powered --out runs/pvo-powered   # the calculated size
    .venv/bin/python bench/bench_process_vs_outcome.py --powered --out runs/pvo-powered --so-far   # while it runs
    .venv/bin/python bench/bench_process_vs_outcome.py --seeds 1 --steps 1 --eval-size 4 --out /tmp/pvo   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from mappa.analysis.compare import (
    ONE_SEED_WARNING,
    ArmGain,
    coach_label,
    keyed_by_seed,
    over_seeds_text,
    per_task_text,
    seed_gain,
)
from mappa.analysis.stats import paired_t_power
from mappa.cli.train import NOTHING_TRAINED
from mappa.config import load_config
from mappa.metrics import answered, correct, wilson_interval
from mappa.training.tracking import is_run_dir
from mappa.types import Episode, read_jsonl

ROOT = Path(__file__).resolve().parents[1]

ARMS = {
    "process": [],
    "outcome": ["coach.backend=outcome"],
    "shared": ["model.agent_weights=shared"],
}
FIRST_SEED = 42  # the demo's own seed, then 43, 44, ...
COACHED = ("process", "shared")  # the arms whose per-action scores come from the coach (--coach-set applies)

# The last measured run at the demo's size (seeds 42-44, 32 held-out tasks per seed, 3 steps): right answers per
# seed on the final evaluation. They size the next run: the gap between arms, how much it moves from seed to seed.
MEASURED_CORRECT = {"process": (4, 1, 0), "outcome": (1, 0, 1), "shared": (1, 0, 0)}
MEASURED_TASKS, MEASURED_STEPS = 32, 3
# Wall time of one run on the 2-core CPU, fitted to the measured 7-10 min per run at 32 tasks and 3 steps: loading
# and writing, each training step (8 episodes, coach, update), and each held-out task (played twice: start, final).
RUN_MIN_FIXED, RUN_MIN_PER_STEP, RUN_MIN_PER_TASK = 1.0, 1.5, 0.094


class PowerPlan(NamedTuple):  # not a dataclass: the tests load this script without registering it as a module
    gap: float  # the process - outcome gap to detect
    seed_sd: float  # between-seed SD of the per-seed gap, task noise taken out
    task_sd: Callable[[int], float]  # SD of one seed's gap from task sampling alone, at n tasks
    seeds: int
    tasks: int
    steps: int
    arms: int
    power: float

    def sd(self, tasks: int) -> float:
        return math.hypot(self.seed_sd, self.task_sd(tasks))

    def hours(self, seeds: int | None = None, tasks: int | None = None) -> float:
        per_run = RUN_MIN_FIXED + RUN_MIN_PER_STEP * self.steps + RUN_MIN_PER_TASK * (tasks or self.tasks)
        return self.arms * (seeds or self.seeds) * per_run / 60


def power_plan(target: float = 0.8, gap: float | None = None, arms: int = 3, alpha: float = 0.05) -> PowerPlan:
    """The cheapest (seeds, held-out tasks) at the measured steps whose paired t test over seeds detects the
    process - outcome gap with probability `target`.

    One seed's gap = the true gap + a seed effect + task sampling noise. The measured per-seed gaps' variance,
    less the binomial variance of a paired difference at 32 tasks (the arms' correlation on a task ignored,
    which overstates it), is the seed effect's variance; more tasks shrink only the binomial part, so past a
    point only more seeds help. Steps stay at the measured 3: no run measured how the gap grows with steps."""
    proc, outc = MEASURED_CORRECT["process"], MEASURED_CORRECT["outcome"]
    per_seed = [(a - b) / MEASURED_TASKS for a, b in zip(proc, outc, strict=True)]
    n_all = MEASURED_TASKS * len(per_seed)
    p1, p2 = (sum(MEASURED_CORRECT[k]) / n_all for k in ("process", "outcome"))
    mean = sum(per_seed) / len(per_seed)
    var = sum((d - mean) ** 2 for d in per_seed) / (len(per_seed) - 1)

    def task_sd(n: int) -> float:
        return math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / n)

    seed_sd = math.sqrt(max(0.0, var - task_sd(MEASURED_TASKS) ** 2))
    gap = mean if gap is None else gap
    plan = PowerPlan(gap, seed_sd, task_sd, 0, 0, MEASURED_STEPS, arms, 0.0)
    best: PowerPlan | None = None
    for tasks in range(32, 2049, 32):  # the demo evaluates in batches of 32
        seeds = next((s for s in range(2, 501) if paired_t_power(gap, plan.sd(tasks), s, alpha) >= target), None)
        if seeds is not None and (best is None or plan.hours(seeds, tasks) < best.hours()):
            power = paired_t_power(gap, plan.sd(tasks), seeds, alpha)
            best = PowerPlan(gap, seed_sd, task_sd, seeds, tasks, MEASURED_STEPS, arms, power)
    if best is None:
        raise SystemExit(f"no size up to 500 seeds x 2048 tasks reaches power {target}")
    return best


def power_lines(plan: PowerPlan, seeds: int, tasks: int, target: float, given: bool = False) -> list[str]:
    """The calculation, its assumptions and the power of the size about to run."""
    now = paired_t_power(plan.gap, plan.sd(tasks), seeds, 0.05)
    source = "given with --gap" if given else "the measured mean over seeds 42-44; --gap sets another"
    return [
        f"power calculation (two-sided paired t test over seeds, alpha 0.05, target power {target:.0%}):",
        f"  gap to detect: process - outcome {plan.gap * 100:+.1f} pp ({source})",
        f"  noise of one seed's gap: {plan.seed_sd * 100:.1f} pp between seeds (SD), plus task sampling "
        f"(binomial): {plan.task_sd(MEASURED_TASKS) * 100:.1f} pp at {MEASURED_TASKS} tasks, "
        f"{plan.task_sd(plan.tasks) * 100:.1f} pp at {plan.tasks}; both from 3 seeds, so themselves uncertain",
        f"  size: {plan.seeds} seeds x {plan.tasks} held-out tasks x {plan.steps} steps per arm "
        f"({plan.arms * plan.seeds} runs, power {plan.power:.0%}), about {plan.hours():.0f} h on a 2-core CPU "
        f"(assumed {RUN_MIN_FIXED + RUN_MIN_PER_STEP * plan.steps:.1f} min per run + "
        f"{RUN_MIN_PER_TASK * 60:.1f} s per held-out task); run it with --powered",
        f"  this run: {seeds} seeds x {tasks} tasks: power {now:.0%} to tell that gap from noise"
        if seeds >= 2
        else f"  this run: {seeds} seed x {tasks} tasks: no test over seeds",
    ]


def train_arm(config: str, run_dir: Path, overrides: list[str]) -> float:
    """Train one arm into `run_dir` (reused when finished, resumed when killed); returns the seconds it took."""
    overrides = [f"run_dir={run_dir}", *overrides]
    if is_run_dir(run_dir):  # a run from an earlier call: only if it has exactly these settings
        if load_config(run_dir / "config.yaml") != load_config(config, overrides):
            raise SystemExit(f"{run_dir}: holds a run with other settings; give another --out")
        if (run_dir / "eval" / "final.jsonl").is_file():
            return 0.0
        cmd = [sys.executable, "-m", "mappa.cli", "train", "--resume", str(run_dir)]
    else:
        cmd = [sys.executable, "-m", "mappa.cli", "train", config]
        for o in overrides:
            cmd += ["--set", o]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    # A run that moved no weight (exit 3) is still its arm's result, not a failure: an outcome-only coach at a low
    # base accuracy scores every action of a step alike when every episode is wrong. Its final evaluation is the
    # start model's; the run's own warning line says so.
    if proc.returncode not in (0, NOTHING_TRAINED):
        raise SystemExit(f"{run_dir.name}: training failed with exit code {proc.returncode}")
    return time.perf_counter() - t0


def evals(runs: dict[tuple[str, int], Path], tag: str) -> dict[str, dict[int, list[Episode]]]:
    """Per arm and seed, the `tag` evaluation's episodes, task ids keyed by seed (each seed draws its own tasks)."""
    out: dict[str, dict[int, list[Episode]]] = {}
    for (arm, seed), run_dir in runs.items():
        eps = read_jsonl(run_dir / "eval" / f"{tag}.jsonl", Episode)
        out.setdefault(arm, {})[seed] = keyed_by_seed(eps, seed)
    return out


def pct(k: int, n: int) -> str:
    lo, hi = wilson_interval(k, n)
    return f"{k / n:.1%} [{lo:.1%}, {hi:.1%}]"


def gap_lines(name: str, gain: ArmGain) -> list[str]:
    """The gap over seeds first (it holds seed-to-seed variation), the per-task figure second."""
    m, (lo, hi) = gain.over_seeds
    if gain.one_seed:
        verdict = "no interval over seeds"
    else:
        verdict = "beyond noise" if lo > 0 or hi < 0 else "within noise: the interval includes 0"
    lines = [f"{name}: {over_seeds_text(gain)}: {verdict}", f"  per task: {per_task_text(gain)}"]
    return [*lines, f"  WARNING: {ONE_SEED_WARNING}"] if gain.one_seed else lines


def start_differences(
    start: dict[str, dict[int, list[Episode]]], arms: list[str], seeds: list[int]
) -> dict[int, tuple[int, list[int]]]:
    """Seeds whose start-of-training evaluation is not the same in every arm: how many episodes differ from the
    first arm's (task, answer, verdict), and each arm's right answers."""

    def outcomes(arm: str, seed: int) -> list[tuple[str, str | None, bool | None]]:
        return [(e.task.id, e.final_answer, e.correct) for e in start[arm][seed]]

    out = {}
    for s in seeds:
        ref = outcomes(arms[0], s)
        n = max(sum(a != b for a, b in zip(ref, outcomes(arm, s), strict=True)) for arm in arms)
        if n:
            out[s] = (n, [sum(bool(e.correct) for e in start[arm][s]) for arm in arms])
    return out


Measure = tuple[str, Callable[[Episode], bool]]
MEASURES: tuple[Measure, ...] = (("accuracy", correct), ("answered", answered))


def learned(
    start: dict[int, list[Episode]],
    final: dict[int, list[Episode]],
    label: str = "learned,",
    measures: tuple[Measure, ...] = MEASURES,
) -> dict[str, dict]:
    """What training changed, start -> final on the same held-out tasks, for each measure (the right answers, the
    episodes that end with an answer at all, ...): the two rates, the paired gain per seed, its t interval over
    seeds and the per-task interval beside it."""
    out = {}
    for what, hit in measures:
        g = seed_gain(start, final, hit)
        (m, ci), p = g.over_seeds, g.per_task
        rate = {t: sum(hit(e) for eps in d.values() for e in eps) / sum(map(len, d.values())) for t, d in
                (("start", start), ("final", final))}  # fmt: skip
        verdict = "" if g.one_seed else ("  beyond noise" if ci[0] > 0 or ci[1] < 0 else "  within noise")
        print(f"  {label} {what}: {rate['start']:.1%} -> {rate['final']:.1%}; gain {over_seeds_text(g)}{verdict}")
        print(f"    per seed {' '.join(f'{x * 100:+.1f}' for x in g.per_seed)} pp; per task: {per_task_text(g)}")
        out[what] = {**rate, "gain": m, "ci_over_seeds": None if g.one_seed else list(ci),
                     "per_seed": list(g.per_seed), "ci_per_task": list(p.gain_ci) if p else None}  # fmt: skip
    return out


def run_analysis(command: str, args: list[str]) -> None:
    """`mappa compare` / `mappa report` over the runs; a checkout without the command gets one line, not a crash."""
    env = {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "160")}  # captured output: rich would wrap at 80
    proc = subprocess.run(
        [sys.executable, "-m", "mappa.cli", command, *args], cwd=ROOT, capture_output=True, text=True, env=env
    )
    if proc.returncode == 2 and "invalid choice" in proc.stderr:
        print(f"mappa {command}: not available in this checkout; skipped")
        return
    print(proc.stdout + proc.stderr, end="")
    if proc.returncode != 0:
        print(f"mappa {command} failed with exit code {proc.returncode}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument(
        "--out", default=str(ROOT / "runs" / "process-vs-outcome"), help="runs, report.html and summary.json go here"
    )
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds per arm ({FIRST_SEED}, ...; default 3)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}; process first")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: the config's)")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out tasks per seed (default: the config's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="every arm")
    ap.add_argument(
        "--coach-set", action="append", default=[], metavar="KEY=VALUE",
        help=f"coach.KEY=VALUE for the coached arms ({', '.join(COACHED)}), e.g. backend=openai model=NAME",
    )  # fmt: skip
    ap.add_argument("--powered", action="store_true", help="seeds and held-out tasks from the power calculation")
    ap.add_argument("--power-only", action="store_true", help="print the power calculation and stop")
    ap.add_argument("--power", type=float, default=0.8, help="target power of the calculation (default 0.8)")
    ap.add_argument("--gap", type=float, default=None, help="gap to detect in pp (default: the measured one)")
    ap.add_argument(
        "--so-far", action="store_true",
        help="train nothing: summarise the seeds every arm has finished (into interim.json), e.g. while it runs",
    )  # fmt: skip
    return ap.parse_args(argv)


def coach_overrides(pairs: list[str]) -> list[str]:
    """`backend=openai` -> `coach.backend=openai`, for every --coach-set argument (several per flag allowed)."""
    items = [x for p in pairs for x in p.split()]
    if bad := [x for x in items if "=" not in x]:
        raise SystemExit(f"--coach-set {bad[0]}: expected KEY=VALUE")
    return [x if x.startswith("coach.") else f"coach.{x}" for x in items]


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if unknown := [x for x in arms if x not in ARMS]:
        raise SystemExit(f"unknown arm(s) {unknown} (known: {', '.join(ARMS)})")
    plan = power_plan(a.power, None if a.gap is None else a.gap / 100, len(arms))
    n_seeds = a.seeds or (plan.seeds if a.powered else 3)
    eval_size = a.eval_size or (plan.tasks if a.powered else None)
    if a.powered and a.steps is None:
        a.steps = plan.steps
    tasks = eval_size or load_config(a.config, a.overrides).tasks.arithmetic_eval_size
    print("\n".join(power_lines(plan, n_seeds, tasks, a.power, a.gap is not None)), flush=True)
    if a.power_only:
        return {"power": plan_dict(plan)}
    common = list(a.overrides)
    if a.steps is not None:
        common.append(f"train.steps={a.steps}")
    if eval_size is not None:
        common.append(f"tasks.arithmetic_eval_size={eval_size}")
    coach = coach_overrides(a.coach_set)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [FIRST_SEED + i for i in range(n_seeds)]
    runs = {(arm, s): out / f"{arm}-seed{s}" for s in seeds for arm in arms}  # seed-major: arms alternate
    if a.so_far:
        return interim(out, arms, seeds, runs, plan)
    for (arm, seed), run_dir in runs.items():
        extra = coach if arm in COACHED else []
        seconds = train_arm(a.config, run_dir, [f"seed={seed}", *common, *extra, *ARMS[arm]])
        print(f"== {run_dir.name}: {'reused' if seconds == 0 else f'{seconds / 60:.1f} min'}", flush=True)
    runs = {k: runs[k] for k in sorted(runs, key=lambda k: (arms.index(k[0]), k[1]))}  # arm-major for reading
    summary = summarise(out, arms, seeds, runs)
    summary["power"] = plan_dict(plan)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def interim(out: Path, arms: list[str], seeds: list[int], runs: dict[tuple[str, int], Path], plan: PowerPlan) -> dict:
    """The summary over the seeds whose runs have finished in every arm (a partly run seed would unpair the arms),
    saying on how many of the planned seeds it rests; `mappa report` is left for the finished benchmark."""
    done = [s for s in seeds if all((runs[(arm, s)] / "eval" / "final.jsonl").is_file() for arm in arms)]
    if not done:
        raise SystemExit(f"{out}: no seed has finished in every arm yet ({', '.join(arms)})")
    print(f"interim: {len(done)} of {len(seeds)} planned seeds finished in every arm; the figures below rest on them")
    kept = {(arm, s): runs[(arm, s)] for arm in arms for s in done}
    summary = summarise(out, arms, done, kept, name="interim.json", analyses=("compare",))
    summary.update(power=plan_dict(plan), planned_seeds=len(seeds), interim=True)
    (out / "interim.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def plan_dict(plan: PowerPlan) -> dict:
    keys = ("gap", "seed_sd", "seeds", "tasks", "steps", "arms", "power")
    return {**{k: getattr(plan, k) for k in keys}, "hours": plan.hours()}


def arm_coach(run_dir: Path) -> str:
    return coach_label(load_config(run_dir / "config.yaml").model_dump(mode="json"))


def summarise(
    out: Path,
    arms: list[str],
    seeds: list[int],
    runs: dict[tuple[str, int], Path],
    name: str = "summary.json",
    analyses: tuple[str, ...] = ("compare", "report"),
) -> dict:
    start, final = evals(runs, "start"), evals(runs, "final")

    n_tasks = len(final[arms[0]][seeds[0]])
    print(f"\n{len(arms)} arms x {len(seeds)} seeds ({', '.join(map(str, seeds))}), {n_tasks} held-out tasks per seed")
    differ = start_differences(start, arms, seeds)
    print("start-of-training evaluation identical across arms: " + ("yes" if not differ else "no"))
    for seed, (n, right) in differ.items():
        print(f"  WARNING: seed {seed}: {n} of {n_tasks} start episodes differ between arms (right answers "
              f"{' vs '.join(map(str, right))}); the same base, tasks and seed should give the same episodes "
              "unless an agent's program printed something that differs between processes (docs/analysis.md)")  # fmt: skip
    summary: dict = {"seeds": seeds, "tasks_per_seed": n_tasks, "same_start": not differ, "arms": {}, "gaps": {},
                     "start_differs": {s: n for s, (n, _) in differ.items()}}  # fmt: skip
    for arm in arms:
        s0, s1 = (sum(by_seed.values(), []) for by_seed in (start[arm], final[arm]))
        k0, k1, n = sum(bool(e.correct) for e in s0), sum(bool(e.correct) for e in s1), len(s1)
        per_seed = [sum(bool(e.correct) for e in final[arm][s]) / len(final[arm][s]) for s in seeds]
        coach = arm_coach(runs[(arm, seeds[0])])
        print(f"  {arm:8s} {coach}: start {pct(k0, n)} -> final {pct(k1, n)}; per seed "
              f"{', '.join(f'{p:.0%}' for p in per_seed)}")  # fmt: skip
        summary["arms"][arm] = {"coach": coach, "start": k0 / n, "final": k1 / n, "episodes": n,
                                "final_per_seed": per_seed,
                                **{f"learned_{k}": v for k, v in learned(start[arm], final[arm]).items()}}  # fmt: skip
    if "process" in arms:
        for other in (x for x in arms if x != "process"):
            gain = seed_gain(final[other], final["process"])  # other minus reference: process - other
            print("\n".join(gap_lines(f"process - {other}", gain)))
            (m, ci), p = gain.over_seeds, gain.per_task
            # "ci"/"paired": the per-task figure, under the names it had before the over-seeds one existed
            summary["gaps"][f"process-{other}"] = {
                "gain": m, "ci_over_seeds": None if gain.one_seed else list(ci), "seeds": len(gain.seeds), "per_seed": list(gain.per_seed),
                "ci": list(p.gain_ci) if p else None, "paired": bool(p and p.paired),
            }  # fmt: skip
    (out / name).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    paths = [str(p) for p in runs.values()]
    if "compare" in analyses:
        run_analysis("compare", paths)
    if "report" in analyses:
        run_analysis("report", [*paths, "--out", str(out / "report.html")])
    print(f"runs and {name}{' and report.html' if 'report' in analyses else ''} under {out}")
    return summary


if __name__ == "__main__":
    main()
