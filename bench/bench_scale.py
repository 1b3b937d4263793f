"""Scale-out overhead: one 16-episode MathChat rollout through (a) the local policy, (b) `mappa serve` as a remote
LoRA server (a subprocess, over HTTP, adapters loaded by name), (c) 2 Ray rollout workers against that server;
plus the cost of an adapter reload.

All arms play the same tasks with the same sampling settings (configs/demo.yaml: SmolLM2-135M, LoRA r=16,
3 agents, 48 tokens per action), the same sandbox and the rubric coach, one after the other on the same
machine. Sampling makes their replies differ, so tokens/s is printed next to episodes/min. Reload: every
agent's adapter published (`mappa.generation.publish_adapters`) and loaded into the server
(`ServerPolicy.load_adapters`: load the new version, switch, unload the old one), median of `--reloads`.
Targets on the 2-core machine: remote >= 0.8x the local episodes/min, Ray >= 0.75x, a reload (r=16, 135M)
<= 1 s.

    .venv/bin/python bench/bench_scale.py [--arms local,server,ray] [--episodes 16] [--threads 2]

On a CPU shared with other busy processes the figures are noise: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# As `mappa.cli` does before torch loads: sleeping OpenMP waiters (the server subprocess gets the same setting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
import torch  # noqa: E402

from mappa.coach import build_coach  # noqa: E402
from mappa.config import Config, load_config  # noqa: E402
from mappa.generation import ServerPolicy, publish_adapters  # noqa: E402
from mappa.policy.policy import Policy  # noqa: E402
from mappa.protocols import PolicyLike, Runtime  # noqa: E402
from mappa.sandbox import Sandbox  # noqa: E402
from mappa.tasks.sampler import pick_tasks, train_tasks  # noqa: E402
from mappa.types import Task  # noqa: E402
from mappa.workflows import build_workflow  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start_serve(
    model: str, threads: int, max_batch: int, log: Path, adapter_root: Path
) -> tuple[subprocess.Popen, str]:
    """`mappa serve` in a subprocess on a free port, loading adapters from under `adapter_root`; returns
    (process, base URL) once it listens."""
    cmd = [sys.executable, "-m", "mappa.cli", "serve", "--model", model, "--port", "0", "--threads", str(threads)]
    cmd += ["--adapter-root", str(adapter_root)]
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*cmd, "--max-batch", str(max_batch)], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            cwd=ROOT, env=env)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (found := re.search(r"http://\S+/v1", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"mappa serve did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, found.group(0)


def play(name: str, cfg: Config, generator: PolicyLike, sandbox: Sandbox, coach: object, tasks: list[Task]) -> dict:
    """One rollout of `tasks` (after a 2-task warm-up) with `generator`; prints and returns its figures."""
    workflow = build_workflow(cfg)
    rt = Runtime(generator, sandbox, coach)
    workflow.run(tasks[:2], rt, seed=1)  # warm-up: first-call costs (threads, sockets, caches)
    start = time.perf_counter()
    episodes = workflow.run(tasks, rt, seed=cfg.seed)
    seconds = time.perf_counter() - start
    tokens = sum(len(a.response_ids) for e in episodes for a in e.actions)
    row = {"arm": name, "seconds": round(seconds, 2), "episodes_per_min": round(len(episodes) / seconds * 60, 2),
           "tokens_per_s": round(tokens / seconds, 1), "tokens": tokens,
           "actions": sum(len(e.actions) for e in episodes)}  # fmt: skip
    print(f"{name:<28} {seconds:7.1f} s  {row['episodes_per_min']:6.2f} episodes/min  "
          f"{row['tokens_per_s']:6.1f} tok/s  {tokens:5d} tokens  {row['actions']:3d} actions", flush=True)  # fmt: skip
    return row


def reload_cost(policy: Policy, generator: ServerPolicy, root: Path, repeats: int) -> dict:
    """Median seconds to publish every agent's adapter and to have the server load it (new version in, old out)."""
    publish, load = [], []
    for version in range(1, repeats + 1):
        t0 = time.perf_counter()
        paths = publish_adapters(policy, root, version)
        publish.append(time.perf_counter() - t0)
        load.append(generator.load_adapters(paths, version))
    agents = len(policy.agents)
    row = {"publish_s": statistics.median(publish), "load_s": statistics.median(load), "agents": agents}
    row["reload_s"] = row["publish_s"] + row["load_s"]
    print(f"adapter reload (r={policy.lora['r']}, {agents} agents): publish {row['publish_s']:.3f} s + load "
          f"{row['load_s']:.3f} s = {row['reload_s']:.3f} s per step, {row['reload_s'] / agents:.3f} s per adapter "
          "(target <= 1 s)", flush=True)  # fmt: skip
    return row


def arm_ray(cfg: Config, tasks: list[Task], base_url: str, version: int) -> dict | None:
    """(c) 2 Ray rollout workers playing `tasks` against the server at `base_url`, which serves every agent's
    adapter of `version` (`<agent>-v<version>`, loaded by the server arm): a new local Ray cluster, each worker
    (`mappa.distributed.actors.RolloutWorker`, with its own sandbox and coach) a contiguous half of the tasks,
    as `mappa train --ray` plays a batch; timed after each worker's 2-task warm-up. Same figures as `play`."""
    import ray

    from mappa.distributed.actors import RolloutWorker
    from mappa.distributed.cluster import get, split

    cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"backend": "server"})})
    agents = build_workflow(cfg).agents
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(RolloutWorker).options(num_cpus=1)
        with tempfile.TemporaryDirectory() as run_dir:
            workers = [actor.remote(cfg, agents, run_dir, "cpu", 1, base_url) for _ in range(2)]
            get([w.use_version.remote(version) for w in workers])
            get([w.play.remote(tasks[:2], 1) for w in workers])  # warm-up: first-call costs
            start = time.perf_counter()
            shares = enumerate(zip(workers, split(tasks, len(workers)), strict=True))
            results = get([w.play.remote(share, cfg.seed + 1_000_003 * i) for i, (w, share) in shares])
            seconds = time.perf_counter() - start
            get([w.close.remote() for w in workers])
    finally:
        ray.shutdown()
    episodes = [e for part, _ in results for e in part]
    tokens = sum(len(a.response_ids) for e in episodes for a in e.actions)
    row = {"arm": "(c) 2 Ray rollout workers", "seconds": round(seconds, 2),
           "episodes_per_min": round(len(episodes) / seconds * 60, 2), "tokens_per_s": round(tokens / seconds, 1),
           "tokens": tokens, "actions": sum(len(e.actions) for e in episodes)}  # fmt: skip
    print(f"{row['arm']:<28} {seconds:7.1f} s  {row['episodes_per_min']:6.2f} episodes/min  "
          f"{row['tokens_per_s']:6.1f} tok/s  {tokens:5d} tokens  {row['actions']:3d} actions", flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="local,server,ray")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads, here and in the server")
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    arms = args.arms.split(",")
    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["coach.cache=false", *args.overrides])
    cfg.generation.batch_size = max(cfg.generation.batch_size, args.episodes)
    workflow = build_workflow(cfg)
    tasks = [t for t in pick_tasks(train_tasks(cfg), args.episodes // 2, cfg.seed) for _ in range(2)]
    policy = Policy.from_config(cfg.model, workflow.agents, seed=cfg.seed, generation_batch_size=args.episodes)
    print(f"MathChat, {len(tasks)} episodes, {cfg.model.name} (LoRA r={cfg.model.lora_r}, {len(workflow.agents)} "
          f"agents), {args.threads} threads, max_new_tokens {cfg.generation.max_new_tokens}", flush=True)  # fmt: skip
    rows: list[dict] = []
    coach = build_coach(cfg.coach, workflow.name, policy=policy)
    with Sandbox(cfg.sandbox) as sandbox, tempfile.TemporaryDirectory() as tmp:
        if "local" in arms:
            rows.append(play("(a) local policy", cfg, policy, sandbox, coach, tasks))
        if "server" in arms or "ray" in arms:
            proc, url = start_serve(
                cfg.model.name, args.threads, args.episodes * 2, Path(tmp) / "serve.log", Path(tmp)
            )
            try:
                cfg.generation.base_url = url
                root = Path(tmp) / "adapters"
                generator = ServerPolicy.from_policy(policy, cfg.generation, adapter_root=root)
                generator.load_adapters(publish_adapters(policy, root, 0), 0)
                if "server" in arms:
                    rows.append(play("(b) mappa serve, remote", cfg, generator, sandbox, coach, tasks))
                    stats = httpx.get(url.removesuffix("/v1") + "/stats").json()
                    print("    server:", ", ".join(f"{k} {v}" for k, v in stats.items()), flush=True)
                    rows.append({"arm": "reload", **reload_cost(policy, generator, root, args.reloads)})
                if "ray" in arms and (ray := arm_ray(cfg, tasks, url, generator.version or 0)) is not None:
                    rows.append(ray)
                generator.close()
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    coach.close()
    local = next((r for r in rows if r["arm"].startswith("(a)")), None)
    for r in rows:
        if local is not None and "episodes_per_min" in r and r is not local:
            target = 0.75 if "ray" in r["arm"].lower() else 0.8
            ratio = r["episodes_per_min"] / local["episodes_per_min"]
            print(f"{r['arm']}: {ratio:.2f}x the local episodes/min (target >= {target}x), "
                  f"overhead {(1 / ratio - 1) * 100:+.0f}% time", flush=True)  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
