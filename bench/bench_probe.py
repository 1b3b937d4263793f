"""`mappa probe` on one run, this code against an earlier commit's, back to back in one run.

Each arm probes its own copy of the run directory (base + every checkpoint, `--force`) from its own source tree:
this checkout, and a git worktree of `--against` in a temp dir (both import with the same virtual environment).
The arms alternate `--repeats` times; the ratio printed is earlier / this of the median wall times. The rows
both arms wrote are compared too: the same probe set and seed give the same values up to float noise.

    .venv/bin/python bench/bench_probe.py RUN_DIR [--against 02117b4] [--repeats 1] [--prompts 16] [--threads 2]

RUN_DIR: a run with checkpoints, e.g. the one `make demo` leaves under runs/. The default `--against` is the
last commit before the probe scored the KL's replies in batches and stopped computing the base's KL to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_step import worktree

ROOT = Path(__file__).resolve().parents[1]


def probe_once(src: Path, run_dir: Path, copy: Path, prompts: int, threads: int) -> tuple[float, list[dict]]:
    """Probe a fresh copy of `run_dir` with the tree at `src`; the wall time and the rows written."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("probe.jsonl", "probe_settings.json"))
    env = {**os.environ, "PYTHONPATH": str(src / "src"), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "mappa.cli", "probe", str(copy), "--force", "--prompts", str(prompts)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=src, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return wall, [json.loads(x) for x in (copy / "probe.jsonl").read_text().splitlines() if x.strip()]


def largest_gap(a: list[dict], b: list[dict]) -> float:
    """The largest |difference| between the values of rows both arms wrote, keyed by checkpoint, agent, probe and
    role (the base's KL: 0 written against 0 computed)."""

    def key(r: dict) -> tuple:
        return r["checkpoint"], r["agent"], r["probe"], r["role"]

    other = {key(r): r["value"] for r in b}
    gaps = [abs(r["value"] - other[key(r)]) for r in a if key(r) in other]
    return max(gaps, default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--against", default="02117b4")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not any((a.run_dir / "checkpoints").glob("step-*")):
        raise SystemExit(f"error: {a.run_dir}: no checkpoints/step-*/ to probe (run `make demo` first)")
    walls: dict[str, list[float]] = {"this": [], "earlier": []}
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT, "earlier": worktree(a.against, Path(tmp))}
        try:
            for i in range(a.repeats):
                for arm in ("earlier", "this") if i % 2 == 0 else ("this", "earlier"):
                    wall, rows[arm] = probe_once(trees[arm], a.run_dir, Path(tmp) / f"run-{arm}", a.prompts, a.threads)
                    walls[arm].append(wall)
                    print(f"{arm}: {wall:.0f} s", flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees["earlier"])], check=False
            )
    this, earlier = statistics.median(walls["this"]), statistics.median(walls["earlier"])
    print(f"mappa probe {a.run_dir} (--prompts {a.prompts}, {a.threads} threads, {a.repeats} repeat(s) each):")
    print(f"  this {this:.0f} s, {a.against} {earlier:.0f} s: {earlier / this:.2f}x")
    print(f"  largest difference between the arms' values: {largest_gap(rows['this'], rows['earlier']):.2e}")


if __name__ == "__main__":
    main()
