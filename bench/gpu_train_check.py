"""Device check: 3 training steps of three randomly initialised Qwen3-0.6B-shaped agents; rollout and update tokens/s.

Runs on CUDA in bf16 when a GPU is present, else on CPU in fp32 (use --tiny there). Per step and per
agent: one batched generation of `--batch` responses up to `--tokens` tokens with the agent's LoRA
adapter (rollout), then one REINFORCE++ / PPO-clip update on those responses with reference log-probs
(`mappa.train.update_group`, the trainer's own update). Nothing is downloaded: the weights are random
and the tokenizer is mappa's small in-process test tokenizer, so the vocabulary is that tokenizer's
(512 tokens) while layers, widths and heads are Qwen3-0.6B's. Writes `gpu_train_check.json` under $OUT
(or the working directory) and prints one line per step plus a summary.

    python bench/gpu_train_check.py                 # Qwen3-0.6B shape, CUDA if available
    python bench/gpu_train_check.py --tiny --steps 1  # seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from mappa.config import Config
from mappa.models import tiny_tokenizer
from mappa.policy import Policy
from mappa.train import update_group
from mappa.types import Action, Message

AGENTS = ("problem_solver", "code_executor", "verifier")
QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def build(tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tiny_tokenizer()
    shape = TINY if tiny else QWEN3_0_6B
    config = Qwen3Config(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype)
    return model, tok


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="responses per agent per step")
    ap.add_argument("--tokens", type=int, default=256, help="response token cap")
    ap.add_argument("--micro-batch", type=int, default=8)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tok = build(a.tiny, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    policy = Policy.from_model(model, tok, AGENTS, lora_r=16, lora_alpha=32, generation_batch_size=a.batch, seed=0)
    cfg = Config()
    cfg.train.micro_batch_size = a.micro_batch
    optimizers = {ag: torch.optim.AdamW(policy.trainable_parameters(ag), lr=1e-5, betas=(0.9, 0.95)) for ag in AGENTS}
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device {name}, {dtype}, {n_params / 1e6:.1f}M parameters, 3 agents x {a.batch} x {a.tokens} tokens")
    rng = random.Random(0)
    steps = []
    for step in range(1, a.steps + 1):
        roll_tok = upd_tok = 0
        roll_s = upd_s = 0.0
        for ag in AGENTS:
            convs = [[Message(role="user", content=f"What is {rng.randint(1, 99)} * {rng.randint(1, 99)}?")]
                     for _ in range(a.batch)]  # fmt: skip
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            gens = policy.generate(ag, convs, max_new_tokens=a.tokens, temperature=1.0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            actions = [
                Action(
                    agent=ag,
                    turn=0,
                    messages=tuple(c),
                    text=g.text,
                    prompt_ids=g.prompt_ids,
                    response_ids=g.response_ids,
                    logprobs=g.logprobs,
                    truncated=g.truncated,
                )  # fmt: skip
                for g, c in zip(gens, convs, strict=True)
            ]
            stats = update_group(policy, optimizers[ag], actions, [rng.uniform(0, 10) for _ in actions], cfg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if not torch.isfinite(torch.tensor(stats["loss"])):
                raise SystemExit(f"step {step} agent {ag}: non-finite loss {stats['loss']}")
            roll_tok += sum(len(g.response_ids) for g in gens)
            upd_tok += int(stats["tokens"])
            roll_s += t1 - t0
            upd_s += t2 - t1
        row = {"step": step, "rollout_tokens_per_s": roll_tok / roll_s, "update_tokens_per_s": upd_tok / upd_s,
               "rollout_s": roll_s, "update_s": upd_s, "tokens": roll_tok}  # fmt: skip
        if device.type == "cuda":
            row["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        steps.append(row)
        print(json.dumps(row))
    summary = {
        "device": name,
        "dtype": str(dtype),
        "parameters": n_params,
        "shape": "tiny" if a.tiny else "qwen3-0.6b",
        "steps": steps,
        # the first step includes CUDA/kernel warm-up and optimizer allocation; report the rest
        "rollout_tokens_per_s": sum(r["rollout_tokens_per_s"] for r in steps[1:] or steps) / len(steps[1:] or steps),
        "update_tokens_per_s": sum(r["update_tokens_per_s"] for r in steps[1:] or steps) / len(steps[1:] or steps),
    }
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_train_check.json").write_text(json.dumps(summary, indent=1))
    print(f"rollout {summary['rollout_tokens_per_s']:.0f} tok/s, update {summary['update_tokens_per_s']:.0f} tok/s")
    return summary


if __name__ == "__main__":
    main()
