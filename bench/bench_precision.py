"""One training step's update phase, a prefill and a few decode steps on a SmolLM2-135M-shaped model: float32
against CPU bfloat16 autocast (`mappa.policy.precision`), side by side.

The model is built from a LlamaConfig of SmolLM2-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads,
3 KV heads, vocabulary 49152, tied embeddings) with random weights, so nothing is downloaded; LoRA r=16 on every
projection as `model.lora_r`'s default, and the adapters' B matrices drawn small so the adapters (and the KL to
the reference) are not zero. The two variants alternate `--repeats` times on the same weights, actions and seed,
so a busy machine slows both alike; medians are printed, with the ratio float32 / bfloat16 of the times.

Accuracy: per-token |log-prob difference| of the policy (bfloat16 autocast against float32) on the actions, the
response tokens' mean NLL of each, and the update's per-step loss and gradient norm in each.

    .venv/bin/python bench/bench_precision.py [--actions 8] [--prompt 48] [--response 32] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the mappa CLI sets it (docs/models.md), before torch loads

import torch  # noqa: E402

from mappa.config import Config  # noqa: E402
from mappa.policy import precision  # noqa: E402
from mappa.policy.decoding import prefill  # noqa: E402
from mappa.policy.models import tiny_tokenizer  # noqa: E402
from mappa.policy.policy import Policy  # noqa: E402
from mappa.training.update import UpdateSettings, update_group  # noqa: E402
from mappa.types import Action, Message  # noqa: E402

VARIANTS = {"float32": "off", "bf16 autocast": "bf16"}


def smollm_shaped_policy(seed: int) -> Policy:
    """SmolLM2-135M's shape with random weights, wrapped as one LoRA agent with nonzero adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    policy = Policy.from_model(model, tiny_tokenizer(), ["solver"], lora_r=16, lora_alpha=32, seed=seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.01)
    return policy


def random_actions(n: int, prompt: int, response: int, seed: int) -> tuple[list[Action], list[float]]:
    """`n` actions of random tokens (ragged responses, as sampling gives) and random coach scores."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = response - (i % 4) * response // 8
        ids = torch.randint(100, 49152, (prompt + length,), generator=gen).tolist()
        out.append(
            Action(agent="solver", turn=0, messages=(Message(role="user", content="x"),), text="",
                   prompt_ids=tuple(ids[:prompt]), response_ids=tuple(ids[prompt:]), logprobs=(0.0,) * length)
        )  # fmt: skip
    return out, (torch.rand(n, generator=gen) * 10).tolist()


def run_update(
    policy: Policy, start: list[torch.Tensor], actions: list[Action], scores: list[float], mode: str, micro: int
) -> tuple[float, list[dict[str, float]]]:
    """The update phase (reference and old log-probs, then two mini-batches) from the adapters' `start` state."""
    params = policy.trainable_parameters("solver")
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            p.copy_(s)
    update = {"mini_batch_size": len(actions) // 2, "micro_batch_size": micro, "cpu_autocast": mode}
    settings = UpdateSettings(Config().train.model_copy(update=update), 1.0, 0.1, samples_exactly=True)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    steps: list[dict[str, float]] = []
    t0 = time.perf_counter()
    update_group(policy, optimizer, actions, scores, settings, seed=0, on_step=steps.append)
    return time.perf_counter() - t0, steps


def run_prefill(policy: Policy, prompts: list[list[int]], dtype: torch.dtype | None) -> float:
    """One prefill of the prompts (an evaluation batch's first forward) under `dtype`'s autocast."""
    t0 = time.perf_counter()
    with torch.no_grad(), policy.active("solver") as module, precision.autocast(dtype):
        prefill(module, prompts, policy.pad_id)
    return time.perf_counter() - t0


def run_decode(policy: Policy, prompts: list[list[int]], dtype: torch.dtype | None, steps: int) -> float:
    """`steps` one-token forwards of the batch after a float32 prefill (decoding's shape: one row per sequence)."""
    with torch.no_grad(), policy.active("solver") as module:
        cache, logits, attn, pos = prefill(module, prompts, policy.pad_id)
        tok = logits.argmax(-1)
        t0 = time.perf_counter()
        with precision.autocast(dtype):
            for _ in range(steps):
                attn = torch.cat([attn, attn.new_ones(len(prompts), 1)], dim=1)
                out = module(input_ids=tok[:, None], attention_mask=attn, position_ids=pos[:, None],
                             past_key_values=cache, use_cache=True)  # fmt: skip
                cache, tok, pos = out.past_key_values, out.logits[:, -1].argmax(-1), pos + 1
        return time.perf_counter() - t0


def side_by_side(repeats: int, run: Callable[[str], float]) -> dict[str, float]:
    """Median seconds of each variant, alternating them `repeats` times (the median also drops a first call's
    one-time set-up)."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for v in VARIANTS:
            times[v].append(run(v))
    return {v: statistics.median(ts) for v, ts in times.items()}


def report(label: str, tokens: int, med: dict[str, float]) -> None:
    f32, bf = med["float32"], med["bf16 autocast"]
    print(f"{label}: float32 {f32:.2f} s ({tokens / f32:.0f} tok/s), bf16 autocast {bf:.2f} s "
          f"({tokens / bf:.0f} tok/s): {f32 / bf:.2f}x")  # fmt: skip


def accuracy(policy: Policy, actions: list[Action]) -> None:
    """Per-token log-prob differences between the two precisions, and each one's mean NLL of the responses."""
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    f32, mask = policy.sequence_logprobs("solver", prompts, responses, micro_batch_size=4)
    with precision.autocast(torch.bfloat16):
        bf, _ = policy.sequence_logprobs("solver", prompts, responses, micro_batch_size=4)
    diff = (bf - f32).abs()[mask]
    nll32, nll16 = float(-f32[mask].mean()), float(-bf[mask].mean())
    print(f"log-prob |bf16 - fp32| per token: mean {float(diff.mean()):.4f}, max {float(diff.max()):.4f}; "
          f"mean NLL fp32 {nll32:.4f}, bf16 {nll16:.4f} (rel. diff {abs(nll16 - nll32) / nll32:.1e})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", type=int, default=8, help="actions in the update (two mini-batches)")
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens per action")
    ap.add_argument("--response", type=int, default=32, help="longest response, tokens")
    ap.add_argument("--micro", type=int, default=4, help="train.micro_batch_size")
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu bf16 instructions (AMX or AVX-512 BF16): {precision.cpu_has_native_bf16()}; threads {args.threads}")
    policy = smollm_shaped_policy(seed=0)
    start = [p.detach().clone() for p in policy.trainable_parameters("solver")]
    actions, scores = random_actions(args.actions, args.prompt, args.response, seed=1)
    stats: dict[str, list[dict[str, float]]] = {}

    def update(v: str) -> float:
        seconds, stats[v] = run_update(policy, start, actions, scores, VARIANTS[v], args.micro)
        return seconds

    tokens = sum(len(a.prompt_ids) + len(a.response_ids) for a in actions)
    report(
        f"update phase ({args.actions} actions, {tokens} tokens, 3 passes)", tokens, side_by_side(args.repeats, update)
    )
    for i in range(len(stats["float32"])):
        a, b = stats["float32"][i], stats["bf16 autocast"][i]
        gap = abs(a["loss"] - b["loss"])
        print(f"  step {i + 1}: loss fp32 {a['loss']:+.6f} bf16 {b['loss']:+.6f} (|diff| {gap:.1e}); grad_norm fp32 "
              f"{a['grad_norm']:.4f} bf16 {b['grad_norm']:.4f}; ratio_mean - 1: fp32 {a['ratio_mean'] - 1:+.1e} "
              f"bf16 {b['ratio_mean'] - 1:+.1e}")  # fmt: skip
    accuracy(policy, actions)

    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(100, 49152, (args.prefill_batch, args.prefill_len), generator=gen).tolist()
    dtypes = {"float32": None, "bf16 autocast": torch.bfloat16}
    med = side_by_side(args.repeats, lambda v: run_prefill(policy, prompts, dtypes[v]))
    report(f"prefill ({args.prefill_batch} x {args.prefill_len} tokens)", args.prefill_batch * args.prefill_len, med)
    med = side_by_side(args.repeats, lambda v: run_decode(policy, prompts, dtypes[v], args.decode_steps))
    report(
        f"decode ({args.prefill_batch} rows x {args.decode_steps} steps)", args.prefill_batch * args.decode_steps, med
    )


if __name__ == "__main__":
    main()
