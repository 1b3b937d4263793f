"""Device check: 3 training steps of three randomly initialised Qwen3-0.6B-shaped agents; update tokens/s and MFU.

On CUDA it runs the GPU settings of docs/scale.md: bf16 weights, gradient checkpointing, one LoRA adapter
(r=16) per agent on the shared base. On a CPU it runs in fp32 (use --tiny there: a 2-layer model, seconds).
Per step and per agent: one batched generation of `--batch` responses up to `--tokens` tokens with the agent's
adapter (rollout), then the trainer's own update on them (`mappa.training.update.apply_update`: reference and old
log-probs, then REINFORCE++ / PPO-clip with micro-batches). Nothing is downloaded: the weights are random and
the tokenizer is mappa's small test tokenizer (512 tokens); layers, widths and heads are Qwen3-0.6B's.

Model FLOPs utilisation (MFU) of the update: model FLOPs / (update seconds x the device's peak bf16 FLOP/s).
Model FLOPs per sequence of S tokens (prompt + response), N = the parameters in the layers' matmuls:
four passes (reference forward, old-log-prob forward, training forward, backward through the activations;
LoRA freezes the base, so no weight-gradient pass over it) of 2*N*S + attention 2*layers*heads*head_dim*S^2,
plus the LM head on the response tokens. Recomputation from gradient checkpointing is not counted (it is
hardware, not model, FLOPs). Peak: looked up from the device name (H100/H200 989, A100 312 TFLOP/s), or
--peak-tflops; on a CPU without it MFU is not reported.

Writes `gpu_train_check.json` under $OUT (or the working directory); one line per step plus a summary.

    python bench/gpu_train_check.py                          # Qwen3-0.6B shape, CUDA if available
    python bench/gpu_train_check.py --tiny --steps 1          # seconds on a CPU
    python bench/gpu_train_check.py --ranks 4                 # the agents sharded over 4 GPUs (FSDP2,
    mappa.policy.sharding)

With `--ranks N` the agents' weights are sharded over N processes, one GPU each (on a CPU, N processes over
gloo), as `train.fsdp_ranks` shards a trainer; the actions are then synthetic (64 prompt and --tokens response
tokens), since sharded ranks do not generate, and the figures are the whole group's.
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
from mappa.policy import sharding
from mappa.policy.models import tiny_tokenizer
from mappa.policy.policy import Policy
from mappa.training.trainer import update_settings
from mappa.training.update import UpdateJob, apply_update, build_optimizer
from mappa.types import Action, Message

AGENTS = ("problem_solver", "code_executor", "verifier")
QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense bf16


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


def update_flops(model: torch.nn.Module, actions: list[Action]) -> float:
    """Model FLOPs of one update on `actions` (see the module docstring)."""
    c = model.config
    layers = sum(
        p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2 and "lora_" not in n
    )
    head = c.vocab_size * c.hidden_size
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim
    per_pass = 0.0
    for a in actions:
        s = len(a.prompt_ids) + len(a.response_ids)
        per_pass += 2 * layers * s + attn * s * s + 2 * head * len(a.response_ids)
    return 4 * per_pass


def peak_flops(name: str, override: float | None) -> float | None:
    if override is not None:
        return override * 1e12
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rollout(policy: Policy, agent: str, rng: random.Random, a: argparse.Namespace) -> list[Action]:
    convs = [[Message(role="user", content=f"What is {rng.randint(1, 99)} * {rng.randint(1, 99)}?")]
             for _ in range(a.batch)]  # fmt: skip
    gens = policy.generate(agent, convs, max_new_tokens=a.tokens, temperature=1.0)
    return [Action.sampled(agent, 0, c, g) for g, c in zip(gens, convs, strict=True)]


def synthetic(agent: str, rng: random.Random, a: argparse.Namespace, vocab: int) -> list[Action]:
    """`--batch` actions of 64 prompt and `--tokens` response tokens drawn from `rng` (sharded ranks do not
    generate: every rank must hold the same actions, and sampling would end at different lengths per rank)."""
    return [
        Action(agent=agent, turn=0, messages=(), text="", prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(64)),
               response_ids=tuple(rng.randrange(3, vocab) for _ in range(a.tokens)), logprobs=(0.0,) * a.tokens)
        for _ in range(a.batch)
    ]  # fmt: skip


def run_step(
    policy: Policy, optimizers: dict, cfg: Config, step: int, rng: random.Random, a: argparse.Namespace
) -> dict:
    device = policy.device
    roll_tok = upd_tok = 0
    roll_s = upd_s = flops = 0.0
    for ag in AGENTS:
        _sync(device)
        t0 = time.perf_counter()
        actions = synthetic(ag, rng, a, len(policy.tokenizer)) if a.ranks > 1 else rollout(policy, ag, rng, a)
        _sync(device)
        t1 = time.perf_counter()
        scores = [rng.uniform(0, 10) for _ in actions]
        settings = update_settings(cfg, policy.samples_exactly)
        job = UpdateJob(actions, scores, seed=step, peak_lr=1e-5, step=step - 1, settings=settings)
        update = apply_update(policy, optimizers[ag], job).update
        _sync(device)
        t2 = time.perf_counter()
        if update is None or not torch.isfinite(torch.tensor(update.loss)):
            raise SystemExit(f"step {step} agent {ag}: no update or a non-finite loss ({update})")
        roll_tok += sum(len(x.response_ids) for x in actions)
        upd_tok += int(update.tokens)
        roll_s, upd_s = roll_s + t1 - t0, upd_s + t2 - t1
        flops += update_flops(policy.model, actions)
    row = {"step": step, "rollout_tokens_per_s": roll_tok / roll_s if a.ranks == 1 else None, "update_tokens_per_s": upd_tok / upd_s,
           "update_tflops_per_s": flops / upd_s / 1e12, "rollout_s": roll_s, "update_s": upd_s, "tokens": roll_tok}  # fmt: skip
    if device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="responses per agent per step")
    ap.add_argument("--tokens", type=int, default=256, help="response token cap")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--no-checkpointing", action="store_true", help="keep activations (no gradient checkpointing)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s (for MFU)")
    ap.add_argument("--ranks", type=int, default=1, help="shard the agents over this many GPUs (or CPU processes)")
    a = ap.parse_args(argv)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    if a.ranks == 1:
        return run(0, a, "")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    mp.start_processes(run, args=(a, address), nprocs=a.ranks, start_method="spawn")
    return json.loads((out / "gpu_train_check.json").read_text())


def run(rank: int, a: argparse.Namespace, address: str) -> dict:
    """One process's run (rank 0 of 1 unsharded); rank 0 prints and writes the summary."""
    if a.ranks > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # before CUDA starts: each rank sees its one GPU as cuda:0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.ranks > 1:
        sharding.init(rank, a.ranks, address, device.type)
    model, tok = build(a.tiny, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    policy = Policy.from_model(model, tok, AGENTS, lora_r=16, lora_alpha=32, generation_batch_size=a.batch, seed=0)
    if not a.no_checkpointing:
        policy.enable_gradient_checkpointing()
    if a.ranks > 1:
        sharding.shard_modules(policy.shardable_modules(), device.type)
    cfg = Config()
    cfg.train.micro_batch_size = a.micro_batch
    optimizers = {ag: build_optimizer(policy, ag, ag, cfg.train) for ag in AGENTS}
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = peak_flops(name, a.peak_tflops)
    say = print if rank == 0 else (lambda *_: None)
    say(f"device {name} x {a.ranks}, {dtype}, {n_params / 1e6:.1f}M parameters, 3 agents x {a.batch} x {a.tokens} "
        f"tokens, gradient checkpointing {'off' if a.no_checkpointing else 'on'}")  # fmt: skip
    rng = random.Random(0)  # the same on every rank: sharded ranks must update on the same actions
    steps = []
    for step in range(1, a.steps + 1):
        steps.append(run_step(policy, optimizers, cfg, step, rng, a))
        say(json.dumps(steps[-1]))
    summary = summarise(steps, a, name, dtype, n_params, peak)
    if rank == 0:
        (Path(os.environ.get("OUT", ".")) / "gpu_train_check.json").write_text(json.dumps(summary, indent=1))
        mfu = "n/a (no peak known: --peak-tflops)" if peak is None else f"{summary['update_mfu']:.1%}"
        roll = "n/a (sharded: synthetic actions)" if a.ranks > 1 else f"{summary['rollout_tokens_per_s']:.0f} tok/s"
        print(f"rollout {roll}, update {summary['update_tokens_per_s']:.0f} tok/s, "
              f"update {summary['update_tflops_per_s']:.3g} TFLOP/s, MFU {mfu}")  # fmt: skip
    if a.ranks > 1:
        torch.distributed.destroy_process_group()
    return summary


def summarise(steps: list[dict], a: argparse.Namespace, name: str, dtype: torch.dtype, n_params: int,
              peak: float | None) -> dict:  # fmt: skip
    """The steps after the first (kernel warm-up, optimizer allocation) averaged. Sharded, tokens/s and
    TFLOP/s are the whole group's and MFU is against the peak of all its GPUs."""
    rest = steps[1:] or steps

    def mean(key: str) -> float | None:
        return None if rest[0][key] is None else sum(r[key] for r in rest) / len(rest)

    peak = None if peak is None else peak * a.ranks
    return {
        "device": name, "ranks": a.ranks, "dtype": str(dtype), "parameters": n_params,
        "shape": "tiny" if a.tiny else "qwen3-0.6b", "gradient_checkpointing": not a.no_checkpointing,
        "steps": steps, "rollout_tokens_per_s": mean("rollout_tokens_per_s"),
        "update_tokens_per_s": mean("update_tokens_per_s"), "update_tflops_per_s": mean("update_tflops_per_s"),
        "peak_tflops": None if peak is None else peak / 1e12,
        "update_mfu": None if peak is None else mean("update_tflops_per_s") * 1e12 / peak,
    }  # fmt: skip


if __name__ == "__main__":
    main()
