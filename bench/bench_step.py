"""One MathChat training step, this code against an earlier commit's, back to back in one run.

Each arm runs `mappa train configs/demo.yaml` for one training step (evaluations cut to one task, so the step is
what is timed) from its own source tree: this checkout, and a git worktree of `--against` made in a temp dir
(both import with the same virtual environment). The arms alternate `--repeats` times at each size (the demo's
4 prompts x 2 samples, and `--scale` times the prompts), so a busy machine slows both alike. Read from each run's
metrics.jsonl: the rollout's and the update's seconds and tokens per second, and the step's wall time (rollout +
update + coach). Sampling makes the two arms' replies differ, so tokens per second is the figure to compare;
the ratio printed is earlier / this of the medians (time) and this / earlier (tokens per second).

    .venv/bin/python bench/bench_step.py [--against bbc323e] [--repeats 2] [--scale 4] [--threads 2]

The default `--against` is the last commit before the step's speed work (bfloat16 autocast in the update, the
shared-prefix prefill, decoding into reserved KV room).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("time/rollout_s", "time/update_s", "time/rollout_tokens_per_s", "time/update_tokens_per_s")


def worktree(rev: str, where: Path) -> Path:
    path = where / "earlier"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def one_step(src: Path, prompts: int, run_dir: Path, threads: int) -> dict[str, float]:
    """One training step of the demo from the tree at `src`; the step's metrics row."""
    env = {**os.environ, "PYTHONPATH": str(src / "src"), "OMP_NUM_THREADS": str(threads)}
    sets = ["train.steps=1", f"train.prompts_per_step={prompts}", "eval.max_tasks=1", f"run_dir={run_dir}"]
    cmd = [sys.executable, "-m", "mappa.cli", "train", str(src / "configs" / "demo.yaml")]
    for s in sets + ["logging.report_to=[]"]:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{src}: mappa train failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "time/rollout_s" in r)
    out = {k: float(step[k]) for k in FIELDS}
    out["step_s"] = out["time/rollout_s"] + out["time/update_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="bbc323e", help="the earlier commit (default: before the speed work)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--scale", type=int, default=4, help="the larger size: this many times the demo's prompts")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        earlier = worktree(a.against, Path(tmp))
        try:
            for prompts in (4, 4 * a.scale):
                res: dict[str, list[dict[str, float]]] = {"this": [], "earlier": []}
                for r in range(a.repeats):
                    for arm, src in (("this", ROOT), ("earlier", earlier)):
                        res[arm].append(one_step(src, prompts, Path(tmp) / f"{arm}-{prompts}-{r}", a.threads))
                        print(
                            f"  {prompts} prompts, {arm}, repeat {r + 1}: step {res[arm][-1]['step_s']:.1f} s",
                            flush=True,
                        )
                med = {arm: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for arm, rows in res.items()}
                print(f"== {prompts} prompts x 2 samples (median of {a.repeats}; this vs {a.against})")
                for key, better in (
                    ("step_s", "lower"),
                    *((k, "higher" if "per_s" in k else "lower") for k in FIELDS),
                ):
                    t, e = med["this"][key], med["earlier"][key]
                    ratio = e / t if better == "lower" else t / e
                    print(f"  {key:28s} this {t:8.1f}   earlier {e:8.1f}   speed-up {ratio:.2f}x")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(earlier)], check=False)


if __name__ == "__main__":
    main()
