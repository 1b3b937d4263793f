"""Benchmark: the fastest setting found on this machine in which mappa's training raises held-out accuracy beyond noise.

The setting (SETTINGS["qwen-0.5b"], found by the levers measured in docs/learning.md): configs/demo.yaml with every
agent on Qwen2.5-Coder-0.5B-Instruct (`make models`), one training step of 4 problems x 2 samples, rubric coach,
held-out generated arithmetic (levels 1-2). Each seed trains from the base and evaluates before and after on the
same held-out tasks; the figure is the paired gain in held-out accuracy per seed, with a Student t interval over
seeds (every source of noise: task draw, sampling and training differ from seed to seed), and the per-task
interval beside it (tasks x seeds pooled, seed variation left out).

    pilot  seeds 101, 102, ...: their per-seed gains size the benchmark (a power calculation: the fewest seeds, at
           least 5, whose t interval over seeds excludes 0 with 80% probability at the pilot's gain and spread).
           The pilot is reported on its own and its seeds are never reused.
    main   seeds 1..n at that size: start -> final held-out accuracy, the gain over seeds and per task, the
           episodes ending with an answer (the format) beside it, and the wall and CPU hours it took.
    arms   (--arms) the paper's question at the same setting, seeds and tasks, with bench_process_vs_outcome's
           runs and analysis: process rewards (the main runs) vs outcome-only rewards vs one shared policy, on the
           first --arm-seeds main seeds, with the smallest difference between two arms that size finds (80% power).

`--quick` runs 2 seeds x 16 held-out tasks, no pilot, no arms: the direction in about 30 minutes. Runs go under
--out (pilot/, quick/, <arm>-seed<S>); a finished run is reused and a killed one resumed, and `--so-far` trains
nothing and summarises the main seeds finished so far (interim.json) while a long benchmark runs.

    .venv/bin/python bench/bench_learning.py --quick                      # ~30 min: the direction
    .venv/bin/python bench/bench_learning.py                              # pilot, power, main (~2 h)
    .venv/bin/python bench/bench_learning.py --arms process,outcome,shared --arm-seeds 4  # + the paper's question
                                                                          # on seeds 1-4 (~1 h more; 38 pp detectable)
    .venv/bin/python bench/bench_learning.py --setting smollm-demo --seeds 5  # the 135M demo, for contrast
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import resource
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from mappa.analysis.stats import paired_t_power
from mappa.config import load_config
from mappa.tasks.answers import check_answer
from mappa.types import Episode

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "bench_pvo_for_learning", ROOT / "bench" / "bench_process_vs_outcome.py"
)
pvo = importlib.util.module_from_spec(_spec)  # the arms, their runs and their analysis live there
_spec.loader.exec_module(pvo)


class Setting(NamedTuple):
    config: str
    overrides: tuple[str, ...]
    eval_size: int | None  # held-out tasks per seed (None: the config's own held-out file)
    what: str


SETTINGS = {
    "qwen-0.5b": Setting(
        "configs/demo.yaml",
        (
            "model.name=qwen2.5-coder-0.5b-instruct",
            "generation.temperature=1.0",  # training rollouts explore; evaluation stays at eval.temperature 0.6
            "train.steps=2",
            "train.samples_per_prompt=4",
        ),
        32,
        "the demo's team and rubric on Qwen2.5-Coder-0.5B-Instruct, 2 steps of 4 problems x 4 samples at "
        "temperature 1.0",
    ),
    "smollm-demo": Setting("configs/demo.yaml", (), 32, "the demo as it is: SmolLM2-135M, 3 steps"),
    "coder-review": Setting(
        "examples/coder_review/config.yaml", (), None, "examples/coder_review: two SmolLM2-135M agents, 4 steps"
    ),
}
PILOT_FIRST, MAIN_FIRST, MIN_SEEDS, MAX_SEEDS = 101, 1, 5, 40
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def right_number(episode: Episode) -> bool:
    """The final reply's last number is the gold answer, in whatever form it was said. Beside accuracy it tells
    how much of a gain is form (a right number now said as asked) and how much a right number where there was none."""
    if not episode.actions:
        return False
    found = _NUMBER.findall(episode.actions[-1].text.replace(",", ""))
    return bool(found) and check_answer(f"The answer is {found[-1]}", episode.task.answer, episode.task.problem)


def cpu_seconds() -> float:
    """CPU time of every finished child process so far (the training runs are children)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train(setting: Setting, run_dir: Path, seed: int, common: list[str], extra: tuple[str, ...] = ()) -> dict:
    """One seed from the base (reused when finished); its wall and CPU seconds, kept beside the run."""
    stamp = run_dir.parent / f"{run_dir.name}.time.json"
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    seconds = pvo.train_arm(str(ROOT / setting.config), run_dir, [f"seed={seed}", *common, *extra])
    if seconds or not stamp.is_file():
        stamp.write_text(json.dumps({"wall_s": time.perf_counter() - wall0, "cpu_s": cpu_seconds() - cpu0}))
    took = json.loads(stamp.read_text())
    minutes = took["wall_s"] / 60
    print(f"== {run_dir.name}: {f'{minutes:.1f} min' if seconds else 'reused'}", flush=True)
    return took


def learning(runs: dict[int, Path], label: str) -> dict:
    """Start -> final held-out accuracy over the seeds' runs (per seed, over seeds, per task), with the answered
    share and the right number in any form beside it."""
    by_arm = {("process", s): d for s, d in runs.items()}
    start, final = pvo.evals(by_arm, "start")["process"], pvo.evals(by_arm, "final")["process"]
    measures = (*pvo.MEASURES, ("right_number", right_number))
    tasks = len(next(iter(final.values())))
    return {"seeds": sorted(runs), "tasks_per_seed": tasks, **pvo.learned(start, final, label, measures)}


def power(pilot: dict, target: float = 0.8) -> dict:
    """The fewest seeds (at least MIN_SEEDS) whose t interval over seeds excludes 0 with probability `target`, at
    the pilot's mean gain and per-seed spread. The spread is floored at the binomial noise of one seed's paired
    gain at the pilot's accuracies: two or three pilot seeds can agree by luck, and the floor keeps that luck
    from shrinking the plan."""
    gains = pilot["accuracy"]["per_seed"]
    gap = statistics.fmean(gains)
    sample_sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    p0, p1, n = pilot["accuracy"]["start"], pilot["accuracy"]["final"], pilot["tasks_per_seed"]
    floor = math.sqrt((p0 * (1 - p0) + p1 * (1 - p1)) / n)
    sd = max(sample_sd, floor)
    seeds = next((k for k in range(MIN_SEEDS, MAX_SEEDS + 1) if paired_t_power(gap, sd, k) >= target), None)
    return {"gap": gap, "sample_sd": sample_sd, "sd_floor": floor, "sd": sd, "target": target, "seeds": seeds,
            "power": paired_t_power(gap, sd, seeds or MAX_SEEDS)}  # fmt: skip


def arms_power(main: dict, seeds: int, target: float = 0.8) -> dict:
    """The smallest difference in held-out accuracy between two arms that `seeds` paired seeds find with
    probability `target`. Arms train apart from the same base and tasks, so one seed's difference between two
    arms' finals has about sqrt(2) times the spread of one arm's per-seed gain, taken from the main runs."""
    sd = math.sqrt(2) * statistics.stdev(main["accuracy"]["per_seed"])
    steps = (k / 1000 for k in range(1, 1001))
    detectable = next((d for d in steps if paired_t_power(d, sd, seeds) >= target), float("nan"))
    return {"seeds": seeds, "difference_sd": sd, "target": target, "detectable": detectable}


def hours(took: list[dict]) -> dict:
    """Wall and CPU hours of the runs; CPU over the runs that recorded it (one trained elsewhere may not have)."""
    cpu = [t["cpu_s"] for t in took if t.get("cpu_s") is not None]
    return {"runs": len(took), "wall_h": sum(t["wall_s"] for t in took) / 3600, "cpu_h": sum(cpu) / 3600,
            "cpu_runs": len(cpu)}  # fmt: skip


def hours_line(label: str, part: dict) -> str:
    h = part["hours"]
    cpu = f"{h['cpu_h']:.2f} CPU-hours" + (f" (of {h['cpu_runs']} runs)" if h["cpu_runs"] < h["runs"] else "")
    return (f"  {label}: {len(part['seeds'])} seeds x {part['tasks_per_seed']} held-out tasks, {h['runs']} runs trained "
            f"or reused: {h['wall_h']:.2f} wall-hours, {cpu}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=SETTINGS, default="qwen-0.5b")
    ap.add_argument("--out", default=str(ROOT / "runs" / "learning"))
    ap.add_argument("--quick", action="store_true", help="2 seeds x 16 held-out tasks, no pilot: the direction")
    ap.add_argument("--pilot-seeds", type=int, default=2, help="seeds of the pilot that sizes the benchmark")
    ap.add_argument("--seeds", type=int, default=None, help="main seeds (default: the power calculation's)")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out tasks per seed (default: the setting's)")
    ap.add_argument("--arms", default="", help="e.g. process,outcome,shared: the paper's question at this setting")
    ap.add_argument(
        "--arm-seeds",
        type=int,
        default=None,
        help="the arms on the first K main seeds only (default: all); the smallest difference they can detect is printed",
    )
    ap.add_argument(
        "--so-far", action="store_true",
        help="train nothing: summarise the pilot and the main seeds finished so far (interim.json), e.g. while it runs",
    )  # fmt: skip
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="every run")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    setting, out = SETTINGS[a.setting], Path(a.out)
    eval_size = a.eval_size or (16 if a.quick else setting.eval_size)
    common = [*setting.overrides, *a.overrides]
    if eval_size is not None:
        common.append(f"tasks.arithmetic_eval_size={eval_size}")
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if unknown := [x for x in arms if x not in pvo.ARMS]:
        raise SystemExit(f"--arms: unknown arm(s) {unknown} (known: {', '.join(pvo.ARMS)})")
    if a.arm_seeds is not None and (not arms or a.arm_seeds < 2):
        raise SystemExit(f"--arm-seeds {a.arm_seeds}: needs --arms and at least 2 seeds (an interval over seeds)")
    load_config(str(ROOT / setting.config), common)  # a bad --set fails here, before an hour of training
    tasks = f"{eval_size} held-out tasks" if eval_size else "the config's held-out tasks"
    print(f"setting {a.setting}: {setting.what}; {tasks} per seed", flush=True)
    summary: dict = {"setting": a.setting, "what": setting.what, "overrides": common}
    if a.quick:
        runs = {s: out / "quick" / f"process-seed{s}" for s in (MAIN_FIRST, MAIN_FIRST + 1)}
        took = [train(setting, d, s, common) for s, d in runs.items()]
        summary.update(quick=learning(runs, "quick"), hours=hours(took))
        print(hours_line("quick", {**summary["quick"], "hours": summary["hours"]}), flush=True)
        return write(out / "quick" / "summary.json", summary)
    pilot_runs = {s: out / "pilot" / f"process-seed{s}" for s in range(PILOT_FIRST, PILOT_FIRST + a.pilot_seeds)}
    if a.so_far:
        return so_far(out, pilot_runs, a.seeds, summary)
    took = [train(setting, d, s, common) for s, d in pilot_runs.items()]
    summary["pilot"] = {**learning(pilot_runs, "pilot"), "hours": hours(took)}
    print(hours_line("pilot", summary["pilot"]), flush=True)
    plan = summary["power"] = power(summary["pilot"])
    per_run_h = summary["pilot"]["hours"]["wall_h"] / len(took)
    print(f"power (t over seeds, alpha 0.05): the pilot's gain {plan['gap'] * 100:+.1f} pp, per-seed SD "
          f"{plan['sd'] * 100:.1f} pp (sample {plan['sample_sd'] * 100:.1f}, binomial floor {plan['sd_floor'] * 100:.1f}) "
          f"-> {plan['seeds'] or f'more than {MAX_SEEDS}'} seeds for {plan['target']:.0%} power; "
          f"~{per_run_h * 60:.0f} min a run", flush=True)  # fmt: skip
    n = a.seeds or plan["seeds"] or MAX_SEEDS
    if n < MIN_SEEDS:
        print(f"  --seeds {n}: below the {MIN_SEEDS} the benchmark asks for; the interval is for this size only")
    main_runs = {s: out / f"process-seed{s}" for s in range(MAIN_FIRST, MAIN_FIRST + n)}
    took = [train(setting, d, s, common) for s, d in main_runs.items()]
    summary["main"] = {**learning(main_runs, "main"), "hours": hours(took)}
    print(hours_line("main", summary["main"]), flush=True)
    if arms:
        arm_seeds = list(main_runs)[: a.arm_seeds or n]
        plan = summary["arms_power"] = arms_power(summary["main"], len(arm_seeds))
        print(f"arms on seeds {arm_seeds[0]}-{arm_seeds[-1]}: a difference between two arms of "
              f"{plan['detectable'] * 100:.1f} pp or more is found with {plan['target']:.0%} power", flush=True)  # fmt: skip
        for arm in (x for x in arms if x != "process"):
            took += [train(setting, out / f"{arm}-seed{s}", s, common, tuple(pvo.ARMS[arm])) for s in arm_seeds]
        names = list(dict.fromkeys(["process", *arms]))
        arm_runs = {(arm, s): out / f"{arm}-seed{s}" for arm in names for s in arm_seeds}
        summary["arms"] = pvo.summarise(out, names, arm_seeds, arm_runs, name="arms.json")
    summary["main"]["hours_with_arms"] = hours(took)
    return write(out / "summary.json", summary)


def finished(run_dir: Path) -> bool:
    return (run_dir / "eval" / "final.jsonl").is_file()


def recorded(run_dir: Path) -> dict:
    """The wall and CPU seconds `train` kept beside a finished run."""
    return json.loads((run_dir.parent / f"{run_dir.name}.time.json").read_text())


def so_far(out: Path, pilot_runs: dict[int, Path], seeds: int | None, summary: dict) -> dict:
    """Train nothing: the pilot, its power calculation and the main seeds finished so far, into interim.json,
    saying on how many of the planned seeds the figures rest."""
    if not all(finished(d) for d in pilot_runs.values()):
        raise SystemExit(f"{out}: the pilot has not finished; nothing to summarise yet")
    summary["pilot"] = {**learning(pilot_runs, "pilot"), "hours": hours([recorded(d) for d in pilot_runs.values()])}
    plan = summary["power"] = power(summary["pilot"])
    planned = seeds or plan["seeds"] or MAX_SEEDS
    done = {s: out / f"process-seed{s}" for s in range(MAIN_FIRST, MAIN_FIRST + planned)}
    done = {s: d for s, d in done.items() if finished(d)}
    if len(done) < 2:
        raise SystemExit(f"{out}: {len(done)} of {planned} planned main seeds finished; an interval needs two")
    print(f"interim: {len(done)} of {planned} planned main seeds finished; the figures below rest on them")
    summary["main"] = {**learning(done, "main"), "hours": hours([recorded(d) for d in done.values()])}
    print(hours_line("main", summary["main"]), flush=True)
    summary.update(planned_seeds=planned, interim=True)
    return write(out / "interim.json", summary)


def write(path: Path, summary: dict) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"summary: {path}")
    return summary


if __name__ == "__main__":
    main()
