"""Coach throughput through `mappa serve`: concurrency 8 vs 1 (server-side batching) and a cached re-run.

    .venv/bin/python bench/bench_coach.py [--model tiny-random] [--actions 64] [--max-tokens 64]

Starts `mappa serve` as a subprocess on loopback, builds coach contexts for recorded MathChat
actions, and scores them with the `openai` coach three times in one run:
  1. concurrency 1, no cache      (one request at a time: no batching possible)
  2. concurrency 8, fresh cache   (the server batches concurrent requests into one generate call)
  3. concurrency 8, same cache    (every judgment a cache hit: zero requests)
Prints judgments/s for each and the ratios 2/1 (target >= 2.5x) and 3/2 (target >= 50x).
The tiny random model writes no score lines, so every judgment also takes the follow-up: both
runs do the same work (2 requests per action), which is what the ratio compares. Replies are capped
at 64 tokens, about what the template asks for ("a few sentences" of analysis and the score line);
the random model never stops early, so every reply is exactly that long. /stats of the server
gives decode steps, mean batch, prefill calls and the time spent in each.
Client and server share the machine: on <= 2 cores the server runs one torch thread so the
coach client keeps a core (`--server-threads` to change it; both phases use the same server).
With two threads on two cores, every op of the tiny model waits on a thread the client has
pre-empted, which slows the busy concurrency-8 phase far more than the serial one.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mappa.coach import build_coach
from mappa.config import CoachConfig, GenerationConfig
from mappa.types import Action, CoachContext, ExecResult, Message, Task
from mappa.workflows.mathchat import CODER, SOLVER, VERIFIER, MathChat

GEN = GenerationConfig(max_new_tokens=256)


def recorded_contexts(n: int) -> list[CoachContext]:
    """Coach contexts of `n` MathChat actions (solver, coder with a tool run, verifier), all distinct."""
    wf = MathChat()
    out: list[CoachContext] = []
    i = 0
    while len(out) < n:
        a, b = 17 + i, 23 + 2 * i
        task = Task(id=f"t{i}", problem=f"What is {a} * {b}?", answer=str(a * b), source="arithmetic")
        actions = [
            Action(
                agent=SOLVER.name,
                turn=0,
                messages=tuple(wf.solver_messages(task, GEN.max_new_tokens)),
                text=f"{a}*{b} is about {a * b}.",
            ),
            Action(
                agent=CODER.name,
                turn=0,
                messages=(
                    Message(role="system", content=wf.role(wf.coder, GEN.max_new_tokens)),
                    Message(role="user", content=task.problem),
                ),
                text=f"```python\nprint({a} * {b})\n```",
                exec_result=ExecResult(ok=True, exit_code=0, stdout=f"{a * b}\n"),
            ),
            Action(
                agent=VERIFIER.name,
                turn=0,
                messages=(
                    Message(role="system", content=wf.role(VERIFIER, GEN.max_new_tokens)),
                    Message(role="user", content=str(a * b)),
                ),
                text=f"The code printed {a * b}. \\boxed{{{a * b}}}",
            ),
        ]
        out.extend(wf.context(task, x) for x in actions)
        i += 1
    return out[:n]


def start_server(model: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mappa.cli", "serve", "--model", model, "--port", str(port), "--max-batch", "8"]
    proc = subprocess.Popen(
        cmd + (["--threads", str(threads)] if threads else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"mappa serve exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("mappa serve did not come up")
        time.sleep(0.5)


def timed(cfg: CoachConfig, contexts: list[CoachContext]) -> tuple[float, dict[str, float]]:
    with build_coach(cfg, "mathchat") as runner:
        t0 = time.perf_counter()
        runner.score_many(contexts)
        elapsed = time.perf_counter() - t0
        return elapsed, runner.stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random", help="served model (tiny-random or smollm2-135m-instruct)")
    ap.add_argument("--actions", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--server-threads",
        type=int,
        default=1 if (os.cpu_count() or 1) <= 2 else None,
        help="torch threads of the server (default: 1 on a machine with <= 2 cores, else torch's default)",
    )
    args = ap.parse_args()

    contexts = recorded_contexts(args.actions)
    proc, base = start_server(args.model, args.server_threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            common = dict(
                backend="openai",
                model=args.model,
                base_url=base + "/v1",
                api_key_env="MAPPA_BENCH_UNSET_KEY",
                max_tokens=args.max_tokens,
                timeout_s=600,
                cache_path=str(Path(tmp) / "coach.sqlite"),
            )
            # Warm-up: first-request costs (allocator, kernels) stay out of the comparison.
            timed(CoachConfig(**common, concurrency=8, cache=False), contexts[:8])
            stats0 = httpx.get(base + "/stats").json()
            t1, s1 = timed(CoachConfig(**common, concurrency=1, cache=False), contexts)
            stats1 = httpx.get(base + "/stats").json()
            t8, s8 = timed(CoachConfig(**common, concurrency=8, cache=True), contexts)
            stats8 = httpx.get(base + "/stats").json()
            tc, sc = timed(CoachConfig(**common, concurrency=8, cache=True), contexts)
            stats_c = httpx.get(base + "/stats").json()
    finally:
        proc.terminate()
        proc.wait(30)

    n = len(contexts)

    def batching(before: dict, after: dict) -> str:
        steps = after["steps"] - before["steps"]
        rows = after["row_steps"] - before["row_steps"]
        prefill_s, decode_s = (after[k] - before[k] for k in ("prefill_s", "decode_s"))
        return (
            f"decode steps {steps}, mean batch {rows / max(steps, 1):.2f}, "
            f"prefills {after['prefills'] - before['prefills']} ({prefill_s:.1f} s), decoding {decode_s:.1f} s"
        )

    threads = args.server_threads or "torch default"
    print(
        f"model {args.model}, {n} actions, max_tokens {args.max_tokens}, {os.cpu_count()} cores, server threads {threads}"
    )
    print(
        f"concurrency 1 : {t1:8.2f} s  {n / t1:8.2f} judgments/s  requests {s1['calls']:g}, {batching(stats0, stats1)}"
    )
    print(
        f"concurrency 8 : {t8:8.2f} s  {n / t8:8.2f} judgments/s  requests {s8['calls']:g}, {batching(stats1, stats8)}"
    )
    print(f"cached re-run : {tc:8.3f} s  {n / tc:8.1f} judgments/s  requests {sc['calls']:g}, cache hits {sc['cache_hits']:g}, "
          f"server requests during it {stats_c['requests'] - stats8['requests']}")  # fmt: skip
    print(f"batching speed-up (8 vs 1): {t1 / t8:.2f}x   (target >= 2.5x)")
    print(f"cache speed-up (cached vs concurrency 8): {t8 / tc:.0f}x   (target >= 50x)")


if __name__ == "__main__":
    main()
