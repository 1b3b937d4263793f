"""Sandbox latency and throughput: warm pool vs a cold `python -c` subprocess per snippet, side by side.

The snippet is what a data-science agent runs: import pandas and scikit-learn, fit a small model, print a
score. Prints the median latency of each way, their ratio (target: warm pool >= 5x lower), and the
throughput of 64 snippets at concurrency 2 through the pool (and of 8 cold ones, for comparison).

    .venv/bin/python bench/bench_sandbox.py [--cold-runs 5] [--warm-runs 20] [--many 64] [--confinement fallback]
    .venv/bin/python bench/bench_sandbox.py --against REV [--rounds 6]

Runs at the default limits (memory_mb=1024: the pandas/scikit-learn snippet must pass there); the first line
names the confinement measured. `--against REV` measures what a change to the sandbox costs per snippet: the warm
pool's latency for a bare `print(1)` and for the data-science snippet, this checkout against a `git worktree` of
REV, in alternating rounds of separate processes (so load from other processes hits both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mappa.config import SandboxConfig
from mappa.sandbox import Sandbox, describe_confinement, new_workspace, remove_workspace, run_python

SNIPPET = """
import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
rng = np.random.default_rng(0)
df = pd.DataFrame(rng.normal(size=(200, 4)), columns=list("abcd"))
y = (df.a + df.b > 0).astype(int)
model = LogisticRegression().fit(df, y)
print(round(model.score(df, y), 3))
"""


def cold_once() -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return time.perf_counter() - start


def warm_latencies(runs: int, confinement: str) -> dict[str, list[float]]:
    """Warm-pool latency of a bare snippet and of the data-science one, `runs` each, interleaved."""
    ws = new_workspace()
    out: dict[str, list[float]] = {"bare": [], "data-science": []}
    cfg = SandboxConfig(pool=True, concurrency=1, timeout_s=60, confinement=confinement)
    with Sandbox(cfg) as sb:
        assert sb.run(SNIPPET, ws).ok  # starts the pool
        for _ in range(runs):
            for name, code in (("bare", "print(1)"), ("data-science", SNIPPET)):
                t = time.perf_counter()
                r = sb.run(code, ws)
                assert r.ok, r.stderr
                out[name].append(time.perf_counter() - t)
    remove_workspace(ws)
    return out


def against(rev: str, rounds: int, runs: int, confinement: str) -> None:
    """This checkout's warm pool against REV's, alternating rounds of fresh processes; medians and their ratio."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="mappa-bench-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            sides = {"this checkout": repo / "src", rev: tree / "src"}
            seen: dict[str, dict[str, list[float]]] = {k: {"bare": [], "data-science": []} for k in sides}
            for i in range(rounds):
                for side, src in sides.items() if i % 2 == 0 else reversed(sides.items()):
                    env = {**os.environ, "PYTHONPATH": str(src)}
                    cmd = [sys.executable, __file__, "--latency-json", str(runs), "--confinement", confinement]
                    done = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, check=True)
                    for name, xs in json.loads(done.stdout.strip().splitlines()[-1]).items():
                        seen[side][name] += xs
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
    print(describe_confinement(confinement))
    for name in ("bare", "data-science"):
        new, old = (statistics.median(seen[k][name]) for k in sides)
        print(
            f"warm pool, {name:12s}: this checkout {new * 1000:6.1f} ms, {rev} {old * 1000:6.1f} ms, "
            f"ratio {new / old:.2f}x, {(new - old) * 1000:+.1f} ms per snippet (n={len(seen[rev][name])} each)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold-runs", type=int, default=5)
    ap.add_argument("--warm-runs", type=int, default=20)
    ap.add_argument("--many", type=int, default=64)
    ap.add_argument("--confinement", choices=["auto", "bwrap", "fallback"], default="auto")
    ap.add_argument("--against", metavar="REV", help="compare the warm pool's latency with this git revision's")
    ap.add_argument("--rounds", type=int, default=6, help="--against: alternating rounds per side")
    ap.add_argument("--latency-json", type=int, metavar="RUNS", help=argparse.SUPPRESS)  # one round of --against
    args = ap.parse_args()
    if args.latency_json:
        print(json.dumps(warm_latencies(args.latency_json, args.confinement)))
        return
    if args.against:
        against(args.against, args.rounds, args.warm_runs, args.confinement)
        return

    print(describe_confinement(args.confinement))
    ws = new_workspace()
    cfg = SandboxConfig(pool=True, concurrency=2, timeout_s=60, confinement=args.confinement)
    with Sandbox(cfg) as sb:
        t = time.perf_counter()
        first = sb.run(SNIPPET, ws)  # starts the pool: pays the imports once
        assert first.ok, first.stderr
        startup = time.perf_counter() - t
        # Interleave cold and warm runs so that load from other processes hits both alike.
        cold, warm, cold_sandboxed = [], [], []
        for i in range(max(args.cold_runs, args.warm_runs)):
            if i < args.cold_runs:
                cold.append(cold_once())
                r = run_python(SNIPPET, ws, timeout_s=60, confinement=args.confinement)
                assert r.ok, r.stderr
                cold_sandboxed.append(r.duration_s)
            t = time.perf_counter()
            r = sb.run(SNIPPET, ws)
            assert r.ok and r.stdout.strip() == first.stdout.strip(), r.stderr
            warm.append(time.perf_counter() - t)

        wss = [new_workspace() for _ in range(args.many)]
        t = time.perf_counter()
        results = sb.run_many([(SNIPPET, w) for w in wss])
        pool_wall = time.perf_counter() - t
        assert all(r.ok for r in results)
        for w in wss:
            remove_workspace(w)
    n_cold = 8
    t = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda _: cold_once(), range(n_cold)))
    cold_wall = time.perf_counter() - t
    remove_workspace(ws)

    med_cold, med_warm = statistics.median(cold), statistics.median(warm)
    print(f"pool start-up (imports numpy, pandas, sklearn once): {startup:.2f} s")
    print(f"median latency, cold `python -c` per snippet:        {med_cold * 1000:.0f} ms  (n={len(cold)})")
    print(f"median latency, cold sandboxed run_python:            {statistics.median(cold_sandboxed) * 1000:.0f} ms")
    print(f"median latency, warm pool:                            {med_warm * 1000:.0f} ms  (n={len(warm)})")
    print(f"ratio cold / warm median latency:                     {med_cold / med_warm:.1f}x  (target >= 5x)")
    print(f"throughput, {args.many} snippets at concurrency 2, pool:     {args.many / pool_wall:.2f} snippets/s")
    print(f"throughput, {n_cold} snippets at concurrency 2, cold:       {n_cold / cold_wall:.2f} snippets/s")
    print(
        f"throughput ratio pool / cold:                         {(args.many / pool_wall) / (n_cold / cold_wall):.1f}x"
    )


if __name__ == "__main__":
    main()
