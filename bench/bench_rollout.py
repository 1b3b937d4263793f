"""Lockstep batched rollouts vs one episode at a time: MathChat on the embedded SmolLM2-135M.

Both arms play the same 16 arithmetic tasks with the same model, sandbox and token caps, in one process,
side by side: arm A hands all 16 episodes to one `workflow.run` call (each stage is one batched generate
and one concurrent sandbox batch); arm B calls `workflow.run` once per episode. Sampling makes the two
arms' replies differ, so generated tokens are printed too: the throughput ratio is tokens/s as well as
episodes/min. Target: >= 3x episodes per minute.

    .venv/bin/python bench/bench_rollout.py [--episodes 16] [--max-new-tokens 96] [--threads N]

On a CPU shared with other busy processes, run it with OMP_NUM_THREADS=1 (or --threads 1): spinning OpenMP
threads on oversubscribed cores make single matmuls take seconds and the figures meaningless.
"""

from __future__ import annotations

import argparse
import time

import torch

from mappa.config import GenerationConfig, SandboxConfig, TasksConfig, WorkflowConfig
from mappa.models import load_base_model
from mappa.policy import Policy
from mappa.protocols import Runtime
from mappa.rollout import pick_tasks
from mappa.sandbox import Sandbox
from mappa.tasks import load_tasks
from mappa.workflows import MathChat


def arm(name: str, workflow: MathChat, rt: Runtime, tasks: list, *, one_at_a_time: bool) -> dict[str, float]:
    start = time.perf_counter()
    if one_at_a_time:
        episodes = [e for i, t in enumerate(tasks) for e in workflow.run([t], rt, seed=i)]
    else:
        episodes = workflow.run(tasks, rt, seed=0)
    seconds = time.perf_counter() - start
    tokens = sum(len(a.response_ids) for e in episodes for a in e.actions)
    actions = sum(len(e.actions) for e in episodes)
    row = {
        "seconds": seconds,
        "episodes_per_min": len(episodes) / seconds * 60,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "actions": actions,
        "success": sum(bool(e.correct) for e in episodes) / len(episodes),
    }
    print(
        f"{name:<22} {seconds:7.1f} s  {row['episodes_per_min']:6.2f} episodes/min  {row['tokens_per_s']:6.1f} tok/s  "
        f"{tokens:5d} tokens  {actions:3d} actions  success {row['success']:.0%}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_base_model("smollm2-135m-instruct", device="cpu")
    gen = GenerationConfig(
        temperature=1.0, max_new_tokens=args.max_new_tokens, max_context_tokens=1024, batch_size=args.episodes
    )
    sandbox_cfg = SandboxConfig(timeout_s=5, concurrency=2, preload=[])
    workflow = MathChat(WorkflowConfig(coder_max_turns=2), gen, sandbox_cfg)
    policy = Policy.from_model(model, tokenizer, workflow.agents, generation_batch_size=args.episodes)
    tasks = pick_tasks(
        load_tasks(["arithmetic"], TasksConfig(arithmetic_levels=[1, 2, 3]), "train", 0), args.episodes, 0
    )
    print(f"MathChat, {args.episodes} episodes, SmolLM2-135M on CPU ({torch.get_num_threads()} threads), "
          f"max_new_tokens {args.max_new_tokens}")  # fmt: skip
    with Sandbox(sandbox_cfg) as sandbox:
        rt = Runtime(policy, sandbox)
        workflow.run(tasks[:2], rt, seed=0)  # warm-up
        batched = arm("lockstep batched", workflow, rt, tasks, one_at_a_time=False)
        single = arm("one episode at a time", workflow, rt, tasks, one_at_a_time=True)
    print(
        f"speed-up: {batched['episodes_per_min'] / single['episodes_per_min']:.2f}x episodes/min, "
        f"{batched['tokens_per_s'] / single['tokens_per_s']:.2f}x tokens/s (target >= 3x episodes/min)"
    )


if __name__ == "__main__":
    main()
