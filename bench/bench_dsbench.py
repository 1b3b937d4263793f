"""The mini-DSBench's scripted reference team over every task, through the sandbox's warm pool.

For each task (train and eval splits) the reference team's three snippets (Data Engineer -> Modeler -> Analyst)
run in a fresh workspace at the default sandbox limits, `sandbox.concurrency` tasks at a time. Prints the
success rate (a valid submission that scores the task's reference score; target 100%), the median and the
slowest sandbox time per task (target: median <= 30 s on 2 cores), the wall time and the machine's load average
(other processes on the cores slow every snippet). With `--cold N` it also runs N tasks without the pool and
prints the ratio of their sandbox times, pool vs cold.

    .venv/bin/python bench/bench_dsbench.py [--dir DIR] [--cold 4] [--confinement fallback]

`--dir` defaults to the benchmark the presets use (`mappa.tasks.tabular.dsbench_dir`; built there if absent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from mappa.config import SandboxConfig
from mappa.sandbox import Sandbox, describe_confinement, new_workspace, remove_workspace
from mappa.tasks.dsbench.reference import ReferenceRun, run_reference
from mappa.tasks.tabular import dsbench_dir, load_dsbench
from mappa.types import Task


def solved(task: Task, run: ReferenceRun) -> bool:
    return run.score is not None and run.score.valid and abs(run.score.score - task.meta["reference_score"]) < 1e-4


def run_all(tasks: list[Task], cfg: SandboxConfig) -> tuple[list[ReferenceRun], float]:
    """The reference runs and their wall time; a warm pool is started first, so no task pays for it."""
    with Sandbox(cfg) as sandbox, ThreadPoolExecutor(cfg.concurrency) as pool:
        ws = new_workspace()
        sandbox.run("pass", ws)
        remove_workspace(ws)
        start = time.perf_counter()
        runs = list(pool.map(lambda t: run_reference(sandbox, t), tasks))
        return runs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="benchmark directory (default: the presets' one)")
    ap.add_argument("--cold", type=int, default=4, help="tasks also run without the pool (0: skip)")
    ap.add_argument("--confinement", choices=["auto", "bwrap", "fallback"], default="auto")
    args = ap.parse_args()

    print(describe_confinement(args.confinement))
    root = dsbench_dir(args.dir)
    tasks = load_dsbench(root, "train") + load_dsbench(root, "eval")
    cfg = SandboxConfig(confinement=args.confinement)  # the default limits: what the build requires
    load_before = os.getloadavg()[0]
    runs, wall = run_all(tasks, cfg)
    ok = [solved(t, r) for t, r in zip(tasks, runs, strict=True)]
    times = [r.sandbox_s for r in runs]
    print(f"tasks: {len(tasks)} in {root} (timeout {cfg.timeout_s:g} s, memory {cfg.memory_mb} MB per snippet)")
    print(f"load average before: {load_before:.1f}, after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"success: {sum(ok)}/{len(ok)} = {sum(ok) / len(ok):.1%}")
    slowest = max(range(len(tasks)), key=lambda i: times[i])
    print(f"sandbox time per task: median {statistics.median(times):.2f} s, slowest {times[slowest]:.2f} s "
          f"({tasks[slowest].id}); wall {wall:.0f} s for all at concurrency {cfg.concurrency}")  # fmt: skip
    for task, run, good in zip(tasks, runs, ok, strict=True):
        if not good:
            print(f"  FAILED {task.id}: {run.failure or (run.score.reason if run.score else '')}")
    if args.cold:
        picked = sorted(range(len(tasks)), key=lambda i: times[i])[:: max(1, len(tasks) // args.cold)][: args.cold]
        cold_runs, _ = run_all([tasks[i] for i in picked], cfg.model_copy(update={"pool": False}))
        pool_s = sum(times[i] for i in picked)
        cold_s = sum(r.sandbox_s for r in cold_runs)
        print(f"pool vs cold on {len(picked)} tasks: {pool_s:.1f} s vs {cold_s:.1f} s of sandbox time "
              f"(cold / pool = {cold_s / pool_s:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
