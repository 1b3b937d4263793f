"""Benchmark: `make demo` as a user runs it: wall time and held-out accuracy before vs after training.

Runs `mappa train configs/demo.yaml` in a subprocess (a fresh run directory under a temp dir, or
--run-dir), then reads the run's own files: eval/summary.jsonl for the before/after accuracy and
metrics.jsonl for where the time went (rollout, update, evaluation).

    .venv/bin/python bench/bench_demo.py [--config configs/demo.yaml] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--run-dir", default=None, help="keep the run here (default: a temp dir, deleted)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(a.run_dir or Path(tmp) / "demo")
        cmd = [sys.executable, "-m", "mappa.cli", "train", a.config, "--set", f"run_dir={run_dir}"]
        for o in a.overrides:
            cmd += ["--set", o]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"demo run failed with exit code {proc.returncode}")
        evals = [json.loads(x) for x in (run_dir / "eval" / "summary.jsonl").read_text().splitlines()]
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before = next(r for r in evals if r["tag"] == "start")
    after = next(r for r in reversed(evals) if r["tag"] == "final")
    steps = [r for r in rows if "time/rollout_s" in r]
    rollout = sum(r["time/rollout_s"] for r in steps)
    update = sum(r["time/update_s"] for r in steps)
    evaluation = sum(r["eval/seconds"] for r in evals)
    print(f"demo wall time {wall:.0f} s ({wall / 60:.1f} min): {len(steps)} steps, rollout {rollout:.0f} s, "
          f"update {update:.0f} s, evaluation {evaluation:.0f} s, start-up and self-test {wall - rollout - update - evaluation:.0f} s")  # fmt: skip
    print(f"held-out accuracy before {before['eval/accuracy']:.1%} -> after {after['eval/accuracy']:.1%} "
          f"({(after['eval/accuracy'] - before['eval/accuracy']) * 100:+.1f} pp over {after['eval/episodes']:.0f} episodes)")  # fmt: skip
    for key in sorted(k for k in after if k.endswith("/tool_use_rate")):
        print(f"  {key}: {before[key]:.0%} -> {after[key]:.0%}")


if __name__ == "__main__":
    main()
