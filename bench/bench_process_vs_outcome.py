"""Benchmark: per-action process rewards vs outcome-only rewards vs one shared policy, trained side by side.

Three arms on the demo's settings (configs/demo.yaml: the embedded SmolLM2-135M, generated arithmetic, the offline
rubric coach), each trained from the same seeds, on the same tasks, for the same steps, with the same rollouts per
step, and evaluated on the same held-out tasks with the rule-based check:

    process   configs/demo.yaml as it is: each action scored by the coach, one LoRA adapter per agent
    outcome   coach.backend=outcome (as configs/mathchat_outcome.yaml): every action scored 10 or 0 by the answer
    shared    model.agent_weights=shared: the coach's per-action scores, one adapter for every agent

It prints each arm's final held-out accuracy (Wilson 95%) and the gaps process - outcome and process - shared, with
95% intervals paired over tasks x seeds (Agresti-Min, `mappa.metrics.accuracy_gain`), then runs `mappa compare` and
`mappa report` over the runs. Runs go under --out as <arm>-seed<S>; a finished run is reused and a killed one is
resumed, so the benchmark can be stopped and started again.

    .venv/bin/python bench/bench_process_vs_outcome.py       # 3 arms x 3 seeds into runs/process-vs-outcome
    .venv/bin/python bench/bench_process_vs_outcome.py --seeds 1 --steps 1 --eval-size 4 --out /tmp/pvo   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mappa.config import load_config
from mappa.metrics import Gain, accuracy_gain, wilson_interval
from mappa.types import Episode, read_jsonl

ROOT = Path(__file__).resolve().parents[1]

ARMS = {
    "process": [],
    "outcome": ["coach.backend=outcome"],
    "shared": ["model.agent_weights=shared"],
}
FIRST_SEED = 42  # the demo's own seed, then 43, 44, ...


def train_arm(config: str, run_dir: Path, overrides: list[str]) -> float:
    """Train one arm into `run_dir` (reused when finished, resumed when killed); returns the seconds it took."""
    overrides = [f"run_dir={run_dir}", *overrides]
    if (run_dir / "config.yaml").is_file():  # a run from an earlier call: only if it has exactly these settings
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
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name}: training failed with exit code {proc.returncode}")
    return time.perf_counter() - t0


def keyed(episodes: list[Episode], seed: int) -> list[Episode]:
    """Episodes with the seed in their task id: each seed draws its own held-out tasks, so pairs are (seed, task)."""
    return [
        e.model_copy(update={"task": e.task.model_copy(update={"id": f"seed{seed}/{e.task.id}"})}) for e in episodes
    ]


def evals(runs: dict[tuple[str, int], Path], tag: str) -> dict[str, list[Episode]]:
    """Per arm, the `tag` evaluation's episodes of every seed, in seed order."""
    out: dict[str, list[Episode]] = {}
    for (arm, seed), run_dir in runs.items():
        out.setdefault(arm, []).extend(keyed(read_jsonl(run_dir / "eval" / f"{tag}.jsonl", Episode), seed))
    return out


def pct(k: int, n: int) -> str:
    lo, hi = wilson_interval(k, n)
    return f"{k / n:.1%} [{lo:.1%}, {hi:.1%}]"


def gap_line(name: str, gain: Gain) -> str:
    lo, hi = gain.gain_ci
    verdict = "beyond noise" if gain.significant else "within noise: the interval includes 0"
    return (
        f"{name}: {gain.gain * 100:+.1f} pp, 95% CI [{lo * 100:+.1f}, {hi * 100:+.1f}] pp "
        f"(paired over {gain.n_after} task x seed episodes, Agresti-Min; {gain.improved} better, "
        f"{gain.worsened} worse): {verdict}"
    )


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument(
        "--out", default=str(ROOT / "runs" / "process-vs-outcome"), help="runs, report.html and summary.json go here"
    )
    ap.add_argument("--seeds", type=int, default=3, help=f"seeds per arm ({FIRST_SEED}, {FIRST_SEED + 1}, ...)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}; process first")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: the config's)")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out tasks per seed (default: the config's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="every arm")
    a = ap.parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if unknown := [x for x in arms if x not in ARMS]:
        ap.error(f"unknown arm(s) {unknown} (known: {', '.join(ARMS)})")
    common = list(a.overrides)
    if a.steps is not None:
        common.append(f"train.steps={a.steps}")
    if a.eval_size is not None:
        common.append(f"tasks.arithmetic_eval_size={a.eval_size}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [FIRST_SEED + i for i in range(a.seeds)]
    runs = {(arm, s): out / f"{arm}-seed{s}" for s in seeds for arm in arms}  # seed-major: arms alternate
    for (arm, seed), run_dir in runs.items():
        seconds = train_arm(a.config, run_dir, [f"seed={seed}", *common, *ARMS[arm]])
        print(f"== {run_dir.name}: {'reused' if seconds == 0 else f'{seconds / 60:.1f} min'}", flush=True)
    runs = {k: runs[k] for k in sorted(runs, key=lambda k: (arms.index(k[0]), k[1]))}  # arm-major for reading
    return summarise(out, arms, seeds, runs)


def summarise(out: Path, arms: list[str], seeds: list[int], runs: dict[tuple[str, int], Path]) -> dict:
    start, final = evals(runs, "start"), evals(runs, "final")

    def outcomes(episodes: list[Episode]) -> list[tuple[str, str | None, bool | None]]:
        return [(e.task.id, e.final_answer, e.correct) for e in episodes]

    same_start = all(outcomes(start[arm]) == outcomes(start[arms[0]]) for arm in arms)
    n_tasks = len(final[arms[0]]) // len(seeds)
    print(f"\n{len(arms)} arms x {len(seeds)} seeds ({', '.join(map(str, seeds))}), {n_tasks} held-out tasks per seed")
    print(
        "start-of-training evaluation identical across arms: yes"
        if same_start
        else "WARNING: the arms' start-of-training evaluations differ (same base, tasks and seed should give the "
        "same episodes): the comparison is not fair; check the runs"
    )
    summary: dict = {"seeds": seeds, "tasks_per_seed": n_tasks, "same_start": same_start, "arms": {}, "gaps": {}}
    for arm in arms:
        k0, k1, n = sum(bool(e.correct) for e in start[arm]), sum(bool(e.correct) for e in final[arm]), len(final[arm])
        per_seed = [
            sum(bool(e.correct) for e in final[arm][i * n_tasks : (i + 1) * n_tasks]) / n_tasks
            for i in range(len(seeds))
        ]
        print(
            f"  {arm:8s} start {pct(k0, n)} -> final {pct(k1, n)}; per seed {', '.join(f'{p:.0%}' for p in per_seed)}"
        )
        summary["arms"][arm] = {"start": k0 / n, "final": k1 / n, "episodes": n, "final_per_seed": per_seed}
    if "process" in arms:
        for other in (x for x in arms if x != "process"):
            gain = accuracy_gain(final[other], final["process"])  # after - before: process - other
            print(gap_line(f"process - {other}", gain))
            summary["gaps"][f"process-{other}"] = {"gain": gain.gain, "ci": list(gain.gain_ci), "paired": gain.paired}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    paths = [str(p) for p in runs.values()]
    run_analysis("compare", paths)
    run_analysis("report", [*paths, "--out", str(out / "report.html")])
    print(f"runs, summary.json and report.html under {out}")
    return summary


if __name__ == "__main__":
    main()
