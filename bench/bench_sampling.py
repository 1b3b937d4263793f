"""Sampling from LoRA adapters vs from sampling copies (`mappa.policy.sampling_copies`), side by side, embedded model.

Three agents with rank-16 adapters (B drawn small so the adapters are not zero) on SmolLM2-135M. For each batch
size, the same conversations (MathChat-like prompts, `--prompt-repeats` sentences) and the same seed go through
`Policy.generate` three ways, alternating `--repeats` times so a busy machine slows all alike: through the
adapters (float32, what training samples without copies), from a float32 copy with the adapter folded in, and
from a bfloat16 copy. Prints each way's median seconds and tokens/s, the ratios to the adapters' way, and how far
each way's reported log-probs are from the float32 forward pass and from the update's bfloat16-autocast forward
(mean |d| per token and a KL estimate), i.e. what the sampler departs from.

    .venv/bin/python bench/bench_sampling.py [--batches 4 8 32] [--new-tokens 48] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the mappa CLI sets it (docs/models.md), before torch loads

import torch  # noqa: E402

from mappa.policy import precision  # noqa: E402
from mappa.policy.models import EMBEDDED_NAME, load_base_model  # noqa: E402
from mappa.policy.policy import Generation, Policy  # noqa: E402
from mappa.types import Message  # noqa: E402

AGENTS = ("solver", "coder", "verifier")
WAYS = {"adapters float32": None, "folded float32": torch.float32, "folded bfloat16": torch.bfloat16}
SENTENCE = "A baker makes {a} loaves in the morning and {b} in the afternoon and sells {c} of them. "


def conversations(n: int, repeats: int) -> list[list[Message]]:
    system = "You are the Code Executor. Write Python code that computes the answer and prints it."
    return [
        [
            Message(role="system", content=system),
            Message(role="user", content=SENTENCE.format(a=17 + i, b=30 + 2 * i, c=9 + i) * repeats + "How many?"),
        ]
        for i in range(n)
    ]


def build_policy(seed: int) -> Policy:
    model, tokenizer = load_base_model(EMBEDDED_NAME, device="cpu")
    policy = Policy.from_model(model, tokenizer, AGENTS, lora_r=16, lora_alpha=32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for agent in AGENTS:
            for p in policy.trainable_parameters(agent):
                if p.abs().sum() == 0:  # LoRA B starts at zero: an adapter that changes nothing would flatter folding
                    p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return policy


def departure(policy: Policy, gens: list[Generation], temperature: float) -> dict[str, tuple[float, float]]:
    """Mean |d| and the k3 KL estimate between the reported log-probs and the forward pass's, in float32 and under
    the update's bfloat16 autocast."""
    prompts, responses = [g.prompt_ids for g in gens], [g.response_ids for g in gens]
    reported = torch.nn.utils.rnn.pad_sequence([torch.tensor(g.logprobs) for g in gens], batch_first=True)
    out = {}
    for name, dtype in (("float32 forward", None), ("bf16-autocast forward", torch.bfloat16)):
        with precision.autocast(dtype):
            lp, mask = policy.sequence_logprobs(
                "coder", prompts, responses, micro_batch_size=4, temperature=temperature
            )
        log_ratio = (lp - reported[:, : lp.shape[1]])[mask]
        out[name] = (float(log_ratio.abs().mean()), float((log_ratio.exp() - 1 - log_ratio).mean()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = build_policy(seed=0)
    print(f"native bfloat16 on this CPU: {precision.cpu_has_native_bf16()}; {args.threads} threads")
    for batch in args.batches:
        convs = conversations(batch, args.prompt_repeats)
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        tokens: dict[str, int] = {}
        last: dict[str, list[Generation]] = {}
        for _ in range(args.repeats):
            for way, dtype in WAYS.items():
                policy.sample_from_copies(dtype)
                policy.generate("coder", convs[:1], max_new_tokens=1, seed=0)  # build the copy outside the clock
                start = time.perf_counter()
                gens = policy.generate("coder", convs, max_new_tokens=args.new_tokens, temperature=args.temperature,
                                       seed=1, batch_size=batch)  # fmt: skip
                times[way].append(time.perf_counter() - start)
                tokens[way], last[way] = sum(len(g.response_ids) for g in gens), gens
        base = statistics.median(times["adapters float32"])
        print(f"\n{batch} rows x {args.new_tokens} new tokens (prompt {len(last['adapters float32'][0].prompt_ids)})")
        for way in WAYS:
            median = statistics.median(times[way])
            policy.sample_from_copies(WAYS[way])
            gap = departure(policy, last[way], args.temperature)
            gaps = "; ".join(f"vs {k}: |d| {d:.4f}, KL {kl:.5f}" for k, (d, kl) in gap.items())
            print(f"  {way:17s} {median:6.2f} s  {tokens[way] / median:6.1f} tok/s  {base / median:4.2f}x  ({gaps})")


if __name__ == "__main__":
    main()
