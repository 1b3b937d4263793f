"""Generation throughput with the embedded model: one batched call vs one sequence at a time, side by side.

16 conversations x up to 128 new tokens, the same sampling settings (temperature 1.0, top-p 1.0) and the
same seeds in both ways; each sequence stops at its own EOS. Prints generated tokens per second for each
way and their ratio (target: batched >= 4x).

    .venv/bin/python bench/bench_generation.py [--n 16] [--new-tokens 128] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from mappa.models import EMBEDDED_NAME, load_base_model
from mappa.policy import Policy
from mappa.types import Message

TOPICS = [
    "a lighthouse",
    "prime numbers",
    "a desert city",
    "the moon",
    "a chess game",
    "rainforests",
    "a robot",
    "tea",
]


def conversations(n: int) -> list[list[Message]]:
    return [
        [Message(role="user", content=f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]} (part {i}).")]
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_base_model(EMBEDDED_NAME, device="auto")
    policy = Policy.from_model(model, tok, ["agent"], base_name=EMBEDDED_NAME)
    convs = conversations(args.n)
    settings = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.new_tokens}
    policy.generate("agent", convs[:2], max_new_tokens=4, seed=0)  # warm-up (allocator, kernels)

    start = time.perf_counter()
    batched = policy.generate("agent", convs, seed=0, batch_size=args.n, **settings)
    t_batched = time.perf_counter() - start

    start = time.perf_counter()
    single = [policy.generate("agent", [c], seed=i, **settings)[0] for i, c in enumerate(convs)]
    t_single = time.perf_counter() - start

    n_b = sum(len(g.response_ids) for g in batched)
    n_s = sum(len(g.response_ids) for g in single)
    print(
        f"device {policy.device}, torch threads {torch.get_num_threads()}, {args.n} sequences, <= {args.new_tokens} new tokens"
    )
    print(f"batched:       {n_b:5d} tokens in {t_batched:7.2f} s = {n_b / t_batched:7.1f} tokens/s")
    print(f"one at a time: {n_s:5d} tokens in {t_single:7.2f} s = {n_s / t_single:7.1f} tokens/s")
    print(f"ratio batched/one-at-a-time: {(n_b / t_batched) / (n_s / t_single):.1f}x (target >= 4x)")


if __name__ == "__main__":
    main()
