"""Generation throughput with the embedded model: one batched call vs one sequence at a time, side by side.

16 conversations x up to 128 new tokens, the same sampling settings (temperature 1.0, top-p 1.0) and the
same seeds in both ways; each sequence stops at its own EOS. Prints generated tokens per second for each
way and their ratio (target: batched >= 4x).

`--serving` also decodes the same batch with `mappa.serving`'s decoder (KV layers with reserved room instead
of one concatenation per token), alternating with `Policy.generate` for `--rounds` rounds and printing the
best of each: what the training path gives up by staying plain. `--prompt-words` lengthens the prompts
(a rollout's later agents see a few hundred tokens), where the copy per token matters more.

    .venv/bin/python bench/bench_generation.py [--n 16] [--new-tokens 128] [--threads N]
    .venv/bin/python bench/bench_generation.py --serving [--rounds 3] [--prompt-words 400]
"""

from __future__ import annotations

import argparse
import time

import torch

from mappa.policy.models import EMBEDDED_NAME, load_base_model
from mappa.policy.policy import Generation, Policy
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


def conversations(n: int, words: int = 0) -> list[list[Message]]:
    filler = " ".join(f"note{j}" for j in range(words))
    return [
        [
            Message(
                role="user",
                content=f"{filler}\nWrite a long, detailed story about {TOPICS[i % len(TOPICS)]} (part {i}).".lstrip(),
            )
        ]
        for i in range(n)
    ]


def decoder_vs_generate(policy: Policy, convs: list[list[Message]], new_tokens: int, rounds: int) -> None:
    """Best-of-`rounds` tokens/s of `Policy.generate` and of the serving decoder on the same batch, alternating."""
    from mappa.policy.decoder import decoding

    prompts = [policy.chat_ids(c) for c in convs]

    def served() -> list[Generation]:
        out: dict[int, Generation] = {}
        with decoding(policy, "agent", seed=0) as decoder:
            decoder.add(prompts, new_tokens, keys=list(range(len(prompts))))
            while len(decoder):
                out.update(decoder.step())
        return list(out.values())

    def plain() -> list[Generation]:
        return policy.generate("agent", convs, seed=0, batch_size=len(convs), max_new_tokens=new_tokens)

    best = {"Policy.generate": 0.0, "serving decoder": 0.0}
    for _ in range(rounds):
        for name, run in (("Policy.generate", plain), ("serving decoder", served)):
            start = time.perf_counter()
            gens = run()
            best[name] = max(best[name], sum(len(g.response_ids) for g in gens) / (time.perf_counter() - start))
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    print(f"{len(prompts)} prompts of {mean_prompt:.0f} tokens on average, best of {rounds} rounds, alternating:")
    for name, rate in best.items():
        print(f"  {name}: {rate:7.1f} tokens/s")
    print(f"  Policy.generate / serving decoder: {best['Policy.generate'] / best['serving decoder']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--serving", action="store_true", help="compare with the serving decoder instead")
    ap.add_argument("--rounds", type=int, default=3, help="with --serving: alternating rounds")
    ap.add_argument("--prompt-words", type=int, default=0, help="filler words before each request")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_base_model(EMBEDDED_NAME, device="auto")
    policy = Policy.from_model(model, tok, ["agent"], base_name=EMBEDDED_NAME)
    convs = conversations(args.n, args.prompt_words)
    settings = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.new_tokens}
    policy.generate("agent", convs[:2], max_new_tokens=4, seed=0)  # warm-up (allocator, kernels)
    if args.serving:
        decoder_vs_generate(policy, convs, args.new_tokens, args.rounds)
        return

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
