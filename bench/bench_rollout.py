"""Rollouts on the per-episode runtime vs the lockstep batches it replaced, side by side, on the demos' settings.

Each arm plays the same tasks with the same config, model, sandbox and seed, in a fresh process: this checkout (its
runtime plays every episode as a program and batches what the live episodes ask for, a request joining the running
decode batch at the next token) against a `git worktree` of REV (default `d65533a`, the last commit before it: one
batched generate per stage, every episode waiting for the slowest at each stage). Rounds alternate the arms, so load
from other processes hits both alike. Sampling makes the arms' replies differ, so the fair figure is generated
tokens per second; episodes per minute is printed beside it. Also checked, per arm: the log-probs recorded at
sampling against the policy's own forward pass on a sample of actions (what the update's ratio starts from).

    .venv/bin/python bench/bench_rollout.py [--config configs/demo.yaml] [--episodes 16 64] [--rounds 2]
    .venv/bin/python bench/bench_rollout.py --config configs/ds_demo.yaml --episodes 8
    .venv/bin/python bench/bench_rollout.py --episodes 16 --set generation.max_new_tokens=256   # lengths that vary

Goal: >= 1.3x episodes/min at equal tokens.
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
from pathlib import Path

BASE = "d65533a"


def one_arm(config: str, episodes: int, seed: int, overrides: list[str]) -> dict[str, float]:
    """Play `episodes` training episodes of `config` with whichever mappa is importable; time and tokens."""
    import torch

    import mappa.workflows as workflows
    from mappa.config import load_config
    from mappa.rollout import build_kit

    try:
        from mappa.tasks.sampler import pick_tasks, train_tasks
    except ImportError:  # the lockstep revision kept the task sampler in mappa.rollout
        from mappa.rollout import pick_tasks, train_tasks

    cfg = load_config(config, [*overrides, f"seed={seed}"])
    workflow = workflows.build_workflow(cfg)
    tasks = pick_tasks(train_tasks(cfg), episodes, seed)
    with build_kit(cfg, workflow.agents, workflow=workflow.name, coach=False) as kit:
        play = (lambda ts, s: kit.play(workflow, ts, s)) if hasattr(workflows, "play") else (
            lambda ts, s: workflow.run(ts, kit.runtime(), seed=s))  # fmt: skip
        play(tasks[:2], seed + 1)  # warm-up: first-call costs (threads, copies, the pool)
        start = time.perf_counter()
        eps = play(tasks, seed)
        seconds = time.perf_counter() - start
        actions = [a for e in eps for a in e.actions if a.response_ids][:16]
        gap = 0.0
        temperature = cfg.generation.temperature
        for a in actions:  # the recorded log-probs against a forward pass through what sampled them
            logp, _ = kit.policy.forward_logprobs(
                a.agent, [a.prompt_ids], [a.response_ids], temperature=temperature, sampler=True
            )
            recorded = torch.tensor(a.logprobs)
            gap = max(gap, float(torch.max(torch.abs(recorded - logp[0, : len(recorded)].float()))))
    tokens = sum(len(a.response_ids) for e in eps for a in e.actions)
    return {"seconds": seconds, "episodes": len(eps), "tokens": tokens, "actions": sum(len(e.actions) for e in eps),
            "logprob_gap": gap, "exact": float(kit.policy.samples_exactly)}  # fmt: skip


def compare(config: str, episodes: int, rounds: int, rev: str, overrides: list[str]) -> None:
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="mappa-bench-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            sides = {"per-episode runtime": repo / "src", f"lockstep ({rev})": tree / "src"}
            seen: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
            for r in range(rounds):
                for side, src in sides.items() if r % 2 == 0 else reversed(sides.items()):
                    # as `mappa` runs: OpenMP threads that spin on a shared, oversubscribed CPU slow every matmul
                    env = {**os.environ, "PYTHONPATH": str(src), "OMP_WAIT_POLICY": "PASSIVE"}
                    cmd = [
                        sys.executable,
                        __file__,
                        "--arm",
                        config,
                        str(episodes),
                        str(r),
                        *(f"--set={o}" for o in overrides),
                    ]
                    done = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise SystemExit(f"{side}: {done.stderr[-2000:]}")
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    seen[side].append(row)
                    print(f"  round {r} {side:<22} {row['seconds']:7.1f} s  {row['tokens']:6d} tokens  "
                          f"{row['tokens'] / row['seconds']:6.1f} tok/s  log-prob gap {row['logprob_gap']:.2e}", flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
    new, old = (seen[k] for k in sides)
    tok = [n["tokens"] / n["seconds"] / (o["tokens"] / o["seconds"]) for n, o in zip(new, old, strict=True)]
    epm = [n["episodes"] / n["seconds"] / (o["episodes"] / o["seconds"]) for n, o in zip(new, old, strict=True)]
    print(f"{config} {' '.join(overrides)}, {episodes} episodes, {rounds} rounds: tokens/s ratio median {statistics.median(tok):.2f}x "
          f"(rounds {', '.join(f'{x:.2f}' for x in tok)}), episodes/min ratio median {statistics.median(epm):.2f}x "
          f"(rounds {', '.join(f'{x:.2f}' for x in epm)}); goal >= 1.3x", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--episodes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--against", default=BASE, metavar="REV", help="the lockstep revision to compare with")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--arm", nargs=3, metavar=("CONFIG", "EPISODES", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        config, n, seed = args.arm
        print(json.dumps(one_arm(config, int(n), int(seed), args.set)))
        return
    for n in args.episodes:
        compare(args.config, n, args.rounds, args.against, args.set)


if __name__ == "__main__":
    main()
