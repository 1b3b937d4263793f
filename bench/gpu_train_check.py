"""Device check: one training step of each paper preset's shape, LoRA and full, on one GPU; tokens/s and MFU.

    python bench/gpu_train_check.py                  # every paper preset x {lora, full}: one step each, CUDA
    python bench/gpu_train_check.py --dry-run        # the same at tiny shapes on a CPU, seconds (the tests run it)
    python bench/gpu_train_check.py --team           # 3 steps of three Qwen3-0.6B-shaped agents (below)
    python bench/gpu_train_check.py --tiny --steps 1 # that team at 2 layers on a CPU
    python bench/gpu_train_check.py --team --ranks 4 # the team sharded over 4 GPUs (FSDP2, mappa.policy.sharding)

**Presets** (the default). For each paper preset (`PRESETS`: configs/mathchat.yaml, ds_pipeline.yaml,
mathchat_r1_1p5b.yaml) a model of its `model.name`'s architecture and size (`SHAPES`: layers, widths, heads and
vocabulary; random weights, nothing downloaded) holds three agents in bfloat16 as one trainer does, and each weight
mode takes one step: `lora` at the preset's rank and learning rate, `full` as the paper fine-tuned (a copy per
agent, lr 1e-6, float32 masters: `mappa.training.update.MasterAdamW`). A step is one agent's: `--batch` responses of up to
`--tokens` tokens (rollout), then its update on them (`mappa.training.update.apply_update`), after an untimed warm-up step of
2 x 4 tokens (kernel selection, allocations). Before each case the memory it needs is estimated (`memory_estimate`);
one that would not fit the GPU is not run, and its record says so with the estimate (a full fine-tune of a 4B
preset needs ~100 GB: more than an 80 GB GPU; docs/models.md). Writes `gpu_train_check.json` under $OUT (or the
working directory): `records`, one per (preset, weight mode).

**Team** (`--team`, `--tiny`, `--ranks`). 3 steps of three randomly initialised Qwen3-0.6B-shaped agents with
LoRA (r=16), bf16 and gradient checkpointing on CUDA, fp32 on a CPU; per step and agent one batched generation and
the update on it. With `--ranks N` the agents' weights are sharded over N processes, one GPU each (on a CPU, N
processes over gloo), as `train.fsdp_ranks` shards a trainer; the actions are then synthetic (64 prompt and
--tokens response tokens), since sharded ranks do not generate, and the figures are the whole group's. Writes the
summary (not `records`) to `gpu_train_check.json`. The tokenizer is mappa's small test tokenizer (512 tokens).

Model FLOPs utilisation (MFU): model FLOPs / (seconds x the device's peak bf16 FLOP/s). Model FLOPs per sequence of
S tokens (prompt + response), N = the parameters in the layers' matmuls: a forward pass is 2*N*S + attention
2*layers*heads*head_dim*S^2, plus the LM head on the response tokens. A rollout is one forward pass per sequence
(prefill and decoding together); an update is the reference forward, the old log-probs' forward (when recomputed:
`mappa.training.update.recomputes_old_logprobs`), the training forward and the backward through the activations (one more
pass), plus, for full weights, the weight gradients (2*N*S and the LM head's). Recomputation from gradient
checkpointing is not counted (hardware, not model, FLOPs). Peak: looked up from the device name (H100/H200 989,
A100 312 TFLOP/s), or --peak-tflops; on a CPU without it MFU is not reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from pathlib import Path

import torch

from mappa.config import Config, load_config
from mappa.policy import sharding
from mappa.policy.models import tiny_tokenizer
from mappa.policy.policy import Policy
from mappa.training.trainer import update_settings
from mappa.training.update import UpdateJob, apply_update, build_optimizer, recomputes_old_logprobs
from mappa.types import Action, Message

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("mathchat", "ds_pipeline", "mathchat_r1_1p5b")  # configs/<name>.yaml: the paper's systems
WEIGHT_MODES = ("lora", "full")
FULL_LR = 1e-6  # the paper's full fine-tune
# model.name -> (architecture, its config's shape): what the presets' models are, read from their config.json
SHAPES = {
    "Qwen/Qwen3-4B": ("qwen3", {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                "vocab_size": 151936, "tie_word_embeddings": True}),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ("qwen2", {"hidden_size": 1536, "intermediate_size": 8960,
                                                            "num_hidden_layers": 28, "num_attention_heads": 12,
                                                            "num_key_value_heads": 2, "vocab_size": 151936,
                                                            "tie_word_embeddings": False}),
}  # fmt: skip

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


def forward_flops(model: torch.nn.Module, actions: list[Action]) -> tuple[float, float]:
    """(one forward pass's model FLOPs over `actions`, the weight gradients' FLOPs of a full backward pass)."""
    c = model.config
    layers = sum(
        p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2 and "lora_" not in n
    )
    head = c.vocab_size * c.hidden_size
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Qwen2's config has none
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * head_dim
    forward = weights = 0.0
    for a in actions:
        s, r = len(a.prompt_ids) + len(a.response_ids), len(a.response_ids)
        forward += 2 * layers * s + attn * s * s + 2 * head * r
        weights += 2 * layers * s + 2 * head * r
    return forward, weights


def update_flops(
    model: torch.nn.Module, actions: list[Action], *, recompute: bool = True, full: bool = False
) -> float:
    """Model FLOPs of one update on `actions` (see the module docstring): reference, old log-probs (`recompute`),
    training forward and backward, and the weight gradients with `full` weights."""
    forward, weights = forward_flops(model, actions)
    return (3 + recompute) * forward + (weights if full else 0.0)


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


# ---------------------------------------------------------------------------------------------------------------
# Presets: one step of each paper preset's shape, LoRA and full


def preset_model(preset: str, dry_run: bool, device: torch.device) -> tuple[torch.nn.Module, object, Config]:
    """A bfloat16 model of the preset's architecture with random weights (tiny on a dry run), its tokenizer, and
    the preset's config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg = load_config(ROOT / "configs" / f"{preset}.yaml")
    family, shape = SHAPES[cfg.model.name]
    tok = tiny_tokenizer()
    if dry_run:  # the architecture at the tiny shape: 2 layers, the tokenizer's vocabulary
        shape = {**shape, **TINY, "vocab_size": len(tok)}
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = config_cls(max_position_embeddings=4096, **ids, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=torch.bfloat16)
    return model.eval(), tok, cfg


def memory_estimate(params: int, mode: str, lora_params: int, cfg: Config, vocab: int, a: argparse.Namespace) -> float:
    """Bytes one trainer needs for a step: the base and (full) three copies in bfloat16; the trained agent's float32
    masters, AdamW moments and gradients (full: 4 + 8 + 4 bytes per weight; LoRA: the adapters in float32, three
    agents'); the LM head's float32 log-softmax over a micro-batch's responses (logits, log-probs and their
    gradients: ~4 copies); a margin of 15% for activations, the KV cache and the allocator."""
    weights = 2 * params * (4 if mode == "full" else 1)
    trained = 16 * params if mode == "full" else 4 * 3 * lora_params + 12 * lora_params
    logits = 4 * 4 * cfg.train.micro_batch_size * a.tokens * vocab
    return 1.15 * (weights + trained + logits)


def lora_parameters(cfg: Config, model: torch.nn.Module) -> int:
    """One adapter's parameters: r x (in + out) for every targeted projection."""
    targets = set(cfg.model.lora_target_modules)
    linears = [m for n, m in model.named_modules() if n.rpartition(".")[2] in targets]
    return sum(cfg.model.lora_r * (m.in_features + m.out_features) for m in linears)


def preset_case(preset: str, mode: str, device: torch.device, peak: float | None, a: argparse.Namespace) -> dict:
    """One step of `preset` in weight `mode` (one agent's rollout and update), or why it was not run."""
    meta, _, cfg = preset_model(preset, a.dry_run, torch.device("meta"))  # shapes only, no memory
    params = sum(p.numel() for p in meta.parameters())
    need = memory_estimate(params, mode, lora_parameters(cfg, meta), cfg, meta.config.vocab_size, a)
    record = {"preset": preset, "model": cfg.model.name, "weights": mode, "parameters": params,
              "memory_estimate_gib": need / 2**30, "ran": False}  # fmt: skip
    if device.type == "cuda" and need > 0.95 * torch.cuda.mem_get_info()[1]:
        record["why_not"] = f"needs ~{need / 2**30:.0f} GiB by estimate, more than this GPU's memory"
        return record
    try:
        return record | run_preset(preset, mode, device, peak, a) | {"ran": True}
    except torch.OutOfMemoryError:
        record["why_not"] = f"out of memory (estimated {need / 2**30:.0f} GiB)"
        return record
    finally:
        if device.type == "cuda":  # the next case's room (a CPU run needs none: 0.3 s a collection)
            gc.collect()
            torch.cuda.empty_cache()


def run_preset(preset: str, mode: str, device: torch.device, peak: float | None, a: argparse.Namespace) -> dict:
    model, tok, cfg = preset_model(preset, a.dry_run, device)
    m = cfg.model
    policy = Policy.from_model(model, tok, AGENTS, agent_weights=mode, lora_r=m.lora_r, lora_alpha=m.lora_alpha,
                               target_modules=m.lora_target_modules, generation_batch_size=a.batch, seed=0)  # fmt: skip
    if m.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    cfg.train.lr = FULL_LR if mode == "full" else cfg.train.lr
    agent, rng = AGENTS[0], random.Random(0)
    optimizer = build_optimizer(policy, agent, agent, cfg.train)
    settings = update_settings(cfg, policy.samples_exactly)
    warm = argparse.Namespace(batch=2, tokens=4)  # kernel selection and the optimizer's state: not timed
    apply_update(
        policy, optimizer, UpdateJob(rollout(policy, agent, rng, warm), [1.0, 9.0], 0, cfg.train.lr, 0, settings)
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    actions = rollout(policy, agent, rng, a)
    _sync(device)
    t1 = time.perf_counter()
    scores = [rng.uniform(0, 10) for _ in actions]
    update = apply_update(policy, optimizer, UpdateJob(actions, scores, 1, cfg.train.lr, 1, settings)).update
    _sync(device)
    t2 = time.perf_counter()
    if update is None or not torch.isfinite(torch.tensor(update.loss)):
        raise SystemExit(f"{preset} {mode}: no update or a non-finite loss ({update})")
    forward, _ = forward_flops(policy.model, actions)
    flops = update_flops(policy.model, actions, recompute=recomputes_old_logprobs(settings, None), full=mode == "full")
    row = {"rollout_tokens_per_s": sum(len(x.response_ids) for x in actions) / (t1 - t0),
           "update_tokens_per_s": update.tokens / (t2 - t1), "rollout_tflops_per_s": forward / (t1 - t0) / 1e12,
           "update_tflops_per_s": flops / (t2 - t1) / 1e12, "rollout_s": t1 - t0, "update_s": t2 - t1,
           "lr": cfg.train.lr, "trained_dtypes": sorted({str(p.dtype) for p in optimizer.param_groups[0]["params"]})}  # fmt: skip
    for phase in ("rollout", "update"):
        row[f"{phase}_mfu"] = None if peak is None else row[f"{phase}_tflops_per_s"] * 1e12 / peak
    if device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def presets(a: argparse.Namespace) -> dict:
    """Every preset x weight mode; prints a line per record and writes them all."""
    device = torch.device("cpu" if a.dry_run or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = peak_flops(name, a.peak_tflops)
    print(f"device {name}, {'tiny shapes (dry run)' if a.dry_run else 'the presets shapes'}, bfloat16, one agent's "
          f"step of {a.batch} x {a.tokens} tokens per case")  # fmt: skip
    records = []
    for preset in PRESETS:
        for mode in WEIGHT_MODES:
            records.append(preset_case(preset, mode, device, peak, a))
            print(describe(records[-1]), flush=True)
    summary = {"device": name, "peak_tflops": None if peak is None else peak / 1e12, "dry_run": a.dry_run,
               "batch": a.batch, "tokens": a.tokens, "records": records}  # fmt: skip
    (Path(os.environ.get("OUT", ".")) / "gpu_train_check.json").write_text(json.dumps(summary, indent=1))
    return summary


def describe(r: dict) -> str:
    head = (
        f"{r['preset']} {r['weights']} ({r['parameters'] / 1e9:.2f}B, ~{r['memory_estimate_gib']:.0f} GiB estimated)"
    )
    if not r["ran"]:
        return f"{head}: not run: {r['why_not']}"
    mfu = {k: "n/a" if r[f"{k}_mfu"] is None else f"{r[f'{k}_mfu']:.1%}" for k in ("rollout", "update")}
    memory = f", peak {r['max_memory_gib']:.1f} GiB" if "max_memory_gib" in r else ""
    return (f"{head}: rollout {r['rollout_tokens_per_s']:.0f} tok/s (MFU {mfu['rollout']}), update "
            f"{r['update_tokens_per_s']:.0f} tok/s (MFU {mfu['update']}){memory}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Team: three Qwen3-0.6B-shaped agents, several steps, optionally sharded


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the presets at tiny shapes on a CPU (seconds)")
    ap.add_argument("--team", action="store_true", help="3 steps of three Qwen3-0.6B-shaped agents instead")
    ap.add_argument("--tiny", action="store_true", help="the team at 2 layers (CPU smoke run)")
    ap.add_argument("--steps", type=int, default=3, help="the team's steps")
    ap.add_argument("--batch", type=int, default=None, help="responses per agent per step (presets 16, team 32)")
    ap.add_argument("--tokens", type=int, default=None, help="response token cap (presets 512, team 256)")
    ap.add_argument("--micro-batch", type=int, default=8, help="the team's micro-batch (presets: their own)")
    ap.add_argument("--no-checkpointing", action="store_true", help="keep activations (no gradient checkpointing)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s (for MFU)")
    ap.add_argument("--ranks", type=int, default=1, help="shard the team over this many GPUs (or CPU processes)")
    a = ap.parse_args(argv)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    team = a.team or a.tiny or a.ranks > 1
    a.batch = a.batch or (32 if team else 2 if a.dry_run else 16)
    a.tokens = a.tokens or (256 if team else 6 if a.dry_run else 512)
    if not team:
        return presets(a)
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
