"""Sweep: which demo recipe learns? Held-out gain per recipe over several seeds, side by side in one run.

Each cell is a recipe (a set of `--set` overrides of the demo config); every cell runs once per seed with
`mappa train`, and the held-out gain (final evaluation minus the first) is given two ways, as `mappa compare`
does: over seeds (one paired gain per seed, Student t on seeds - 1 degrees of freedom: task sampling and
seed-to-seed variation both counted) and per task pooled over seeds (paired by task, t on the
per-task differences; seed variation left out).
A finished run is reused, so a killed sweep resumes where it stopped.

    .venv/bin/python bench/sweep_demo.py --out /tmp/sweep --seeds 1 2 3 \\
        --cell base: --cell lr1e-3:train.lr=1e-3 --cell keep:train.lr=1e-3,train.drop_truncated=false
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mappa.analysis.compare import over_seeds_text, per_task_text, seed_gain
from mappa.errors import MappaError
from mappa.types import Episode, read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def parse_cell(text: str) -> tuple[str, list[str]]:
    """`NAME:KEY=VALUE,KEY=VALUE` -> (name, overrides); a value holding a comma goes in brackets (`[1,2]`)."""
    name, _, rest = text.partition(":")
    overrides: list[str] = []
    depth = 0
    part = ""
    for ch in rest:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            overrides.append(part)
            part = ""
        else:
            part += ch
    if part:
        overrides.append(part)
    if not name or any("=" not in o for o in overrides):
        raise MappaError(f"--cell {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
    return name, overrides


def finished(run_dir: Path) -> bool:
    summary = run_dir / "eval" / "summary.jsonl"
    if not summary.is_file():
        return False
    return any(json.loads(x).get("tag") == "final" for x in summary.read_text().splitlines() if x.strip())


def answered_rates(run_dir: Path) -> tuple[float, float]:
    """The share of held-out episodes with a final answer (right or wrong) at the first and the last evaluation."""
    rows = [json.loads(x) for x in (run_dir / "eval" / "summary.jsonl").read_text().splitlines() if x.strip()]
    start = next(r for r in rows if r["tag"] == "start")
    final = next(r for r in reversed(rows) if r["tag"] == "final")
    return start.get("eval/answered_rate", float("nan")), final.get("eval/answered_rate", float("nan"))


def run_one(config: str, run_dir: Path, seed: int, overrides: list[str]) -> float:
    """Train one seed of one cell (reused when finished); the wall time in seconds (0 when reused)."""
    if finished(run_dir):
        return 0.0
    shutil.rmtree(run_dir, ignore_errors=True)  # a killed run restarts clean: its evaluations must pair
    cmd = [sys.executable, "-m", "mappa.cli", "train", config, "--set", f"run_dir={run_dir}", "--set", f"seed={seed}"]
    for o in overrides:
        cmd += ["--set", o]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (run_dir.parent / f"seed-{seed}.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode not in (0, 3):  # 3: trained nothing, still a data point
        raise SystemExit(f"{run_dir}: mappa train exited {proc.returncode} (see {run_dir.parent}/seed-{seed}.log)")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--out", required=True, help="one run directory per cell and seed: OUT/CELL/seed-S")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--cell", action="append", required=True, metavar="NAME:KEY=VALUE,...")
    ap.add_argument("--set", dest="common", action="append", default=[], help="an override every cell gets")
    a = ap.parse_args()
    try:
        cells = [parse_cell(c) for c in a.cell]
    except MappaError as e:
        raise SystemExit(f"error: {e}") from None
    out = Path(a.out)
    walls: dict[str, list[float]] = {}
    for name, overrides in cells:
        for seed in a.seeds:
            wall = run_one(a.config, out / name / f"seed-{seed}", seed, a.common + overrides)
            walls.setdefault(name, []).append(wall)
            print(f"{name} seed {seed}: {'reused' if not wall else f'{wall / 60:.1f} min'}", flush=True)
    print(f"\nheld-out gain (final - start evaluation), seeds {a.seeds}, config {a.config}")
    for name, overrides in cells:
        start: dict[int, list[Episode]] = {}
        final: dict[int, list[Episode]] = {}
        for seed in a.seeds:
            eval_dir = out / name / f"seed-{seed}" / "eval"
            start[seed] = read_jsonl(eval_dir / "start.jsonl", Episode)
            final[seed] = read_jsonl(eval_dir / "final.jsonl", Episode)
        g = seed_gain(start, final)
        ran = [w for w in walls[name] if w]
        wall = f"{sum(ran) / len(ran) / 60:.1f} min/run" if ran else "reused"
        per_seed = " ".join(f"{x * 100:+.1f}" for x in g.per_seed)
        print(f"{name} ({', '.join(overrides) or 'the config as is'}; {wall})")
        print(f"  over seeds: {over_seeds_text(g)}; per seed {per_seed}")
        print(f"  per task:   {per_task_text(g)}")
        answered = [answered_rates(out / name / f"seed-{seed}") for seed in a.seeds]
        print("  answered (a final answer given, right or wrong), start -> final per seed: "
              + ", ".join(f"{x:.0%} -> {y:.0%}" for x, y in answered))  # fmt: skip


if __name__ == "__main__":
    main()
