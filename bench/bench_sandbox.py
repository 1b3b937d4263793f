"""Sandbox latency and throughput: warm pool vs a cold `python -c` subprocess per snippet, side by side.

The snippet is what a data-science agent runs: import pandas and scikit-learn, fit a small model, print a
score. Prints the median latency of each way, their ratio (target: warm pool >= 5x lower), and the
throughput of 64 snippets at concurrency 2 through the pool (and of 8 cold ones, for comparison).

    .venv/bin/python bench/bench_sandbox.py [--cold-runs 5] [--warm-runs 20] [--many 64] [--confinement fallback]

Runs at the default limits (memory_mb=1024: the pandas/scikit-learn snippet must pass there); the first line
names the confinement measured.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold-runs", type=int, default=5)
    ap.add_argument("--warm-runs", type=int, default=20)
    ap.add_argument("--many", type=int, default=64)
    ap.add_argument("--confinement", choices=["auto", "bwrap", "fallback"], default="auto")
    args = ap.parse_args()

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
