"""Benchmark: mappa's training step against TRL's GRPOTrainer, side by side in one process.

Both sides train one LoRA adapter (same rank, alpha and target modules) on the embedded SmolLM2-135M
(the cached fp32 safetensors copy), on CPU, with a reference-model KL (TRL beta = our kl_coef = 0.01).

(a) update phase on one fixed batch of sequences: reference log-probs + loss + backward + grad clip +
    optimizer step. TRL: `_get_per_token_logps_and_entropies` under the disabled adapter, `compute_loss`,
    backward, AdamW. Ours: `mappa.training.update.update_group`. Repeats alternate between the two sides so that
    load from other processes hits both alike.
(b) a whole step with generation: one TRL step (`trainer.train()` with max_steps 1: generate, reward,
    reference, loss, optimizer step) alternating with one of ours (`Policy.generate` -> reward ->
    `update_group`), same batch size and token cap; prompts ask for long answers so both run to the cap.
Prints tokens/s (completion tokens) for each side and the ratio ours / TRL.

    .venv/bin/python bench/bench_trl.py [--batch 4] [--tokens 32] [--repeats 3] [--trl-bf16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

from mappa.config import Config
from mappa.policy.models import EMBEDDED_NAME, embedded_gguf_path, gguf_cache_path, load_base_model
from mappa.policy.policy import Policy
from mappa.rollout import sample_as_configured
from mappa.training.trainer import update_settings
from mappa.training.update import update_group
from mappa.types import Action, Message

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["a lighthouse keeper", "the history of bridges", "a city under the sea", "how bread is made", "a robot gardener",
          "the first trip to Mars", "a forgotten library", "winter in the mountains"]  # fmt: skip
LR, R, ALPHA, KL = 1e-5, 16, 32, 0.01


def prompts(n: int) -> list[str]:
    return [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def reward(completions: list, **_: object) -> list[float]:
    """Any deterministic reward works for timing; both sides use this one."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(set(t.split()))) / 50.0 for t in texts]


def make_trl(model_dir: str, batch: int, tokens: int, steps: int, out_dir: str, bf16: bool = False):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        num_generations=batch,
        gradient_accumulation_steps=1,
        max_completion_length=tokens,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        adam_beta2=0.95,
        max_grad_norm=1.0,
        beta=KL,
        temperature=1.0,
        activation_checkpointing=False,  # ours does not checkpoint by default either
        use_cpu=True,
        bf16=bf16,  # --trl-bf16: autocast to bfloat16 (HF Trainer's CPU mixed precision)
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts(batch)] * (steps + 1))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    lora = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM", lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(
            model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok, peft_config=lora
        )


def make_ours(batch: int) -> tuple[Policy, torch.optim.Optimizer, Config]:
    model, tok = load_base_model(EMBEDDED_NAME, device="cpu")
    policy = Policy.from_model(model, tok, ["agent"], lora_r=R, lora_alpha=ALPHA, target_modules=TARGETS, seed=0)
    opt = torch.optim.AdamW(policy.trainable_parameters("agent"), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    cfg = Config()
    cfg.train.micro_batch_size = batch
    cfg.train.mini_batch_size = batch  # one optimizer step per batch, as TRL takes here
    cfg.train.kl_coef = KL
    sample_as_configured(policy, cfg)  # as a run samples: from folded copies where the update runs in bfloat16
    return policy, opt, cfg


def actions_from(gens, convs) -> list[Action]:
    return [Action.sampled("agent", 0, c, g) for g, c in zip(gens, convs, strict=True)]


def trl_update(trainer, batch: dict) -> None:
    """TRL's update on a prepared batch: reference log-probs, loss, backward, clip, AdamW step."""
    from trl.trainer.utils import use_adapter

    model = trainer.model
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad(), use_adapter(trainer.accelerator.unwrap_model(model), adapter_name=None):
        ref, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attn, batch["completion_ids"].size(1))
    inputs = {**batch, "ref_per_token_logps": ref}
    loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def trl_batch(actions: list[Action], pad_id: int, scores: list[float]) -> dict:
    P = max(len(a.prompt_ids) for a in actions)
    T = max(len(a.response_ids) for a in actions)
    B = len(actions)
    prompt_ids = torch.full((B, P), pad_id)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion_ids = torch.full((B, T), pad_id)
    completion_mask = torch.zeros(B, T, dtype=torch.long)
    for i, a in enumerate(actions):
        prompt_ids[i, P - len(a.prompt_ids) :] = torch.tensor(a.prompt_ids)
        prompt_mask[i, P - len(a.prompt_ids) :] = 1
        completion_ids[i, : len(a.response_ids)] = torch.tensor(a.response_ids)
        completion_mask[i, : len(a.response_ids)] = 1
    s = torch.tensor(scores)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": (s - s.mean()) / (s.std() + 1e-4),
        "num_items_in_batch": completion_mask.sum(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--trl-bf16", action="store_true", help="TRL with bf16=True (its CPU autocast; ours picks its own)"
    )
    a = ap.parse_args()
    load_base_model(EMBEDDED_NAME)  # builds the safetensors cache once
    model_dir = str(gguf_cache_path(embedded_gguf_path()))
    print(f"model {model_dir}\nbatch {a.batch} x {a.tokens} completion tokens, {a.repeats} timed repeats, "
          f"{torch.get_num_threads()} torch threads")  # fmt: skip

    policy, opt, cfg = make_ours(a.batch)
    convs = [[Message(role="user", content=p)] for p in prompts(a.batch)]
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trl(model_dir, a.batch, a.tokens, 1, out, bf16=a.trl_bf16)
        trainer.create_optimizer()
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); compute_loss reads it

        # (a) update phase, one fixed batch, alternating sides
        gens = policy.generate("agent", convs, max_new_tokens=a.tokens, temperature=1.0, seed=0)
        fixed = actions_from(gens, convs)
        scores = [float(i % 3) * 4.0 for i in range(a.batch)]
        batch = trl_batch(fixed, policy.pad_id, scores)
        n_tok = sum(len(x.response_ids) for x in fixed)
        # Our default recomputes log pi_old with the training forward (one more forward pass than TRL, which at
        # num_iterations=1 takes the loss forward's own values); the third side skips it to compare like work.
        plain = cfg.model_copy(deep=True)
        plain.train.recompute_old_logprobs = False
        times: dict[str, list[float]] = {"trl": [], "ours": [], "ours_plain": []}
        for rep in range(a.repeats + 1):  # the first round warms up (optimizer state allocation)
            t0 = time.perf_counter()
            trl_update(trainer, batch)
            t1 = time.perf_counter()
            update_group(policy, opt, fixed, scores, update_settings(cfg, policy.samples_exactly))
            t2 = time.perf_counter()
            update_group(policy, opt, fixed, scores, update_settings(plain, policy.samples_exactly))
            t3 = time.perf_counter()
            if rep:
                times["trl"].append(t1 - t0)
                times["ours"].append(t2 - t1)
                times["ours_plain"].append(t3 - t2)
        trl_a, ours_a, plain_a = (n_tok / statistics.median(times[k]) for k in ("trl", "ours", "ours_plain"))
        print(f"(a) update phase, {n_tok} tokens: TRL {trl_a:.1f} tok/s, mappa {ours_a:.1f} tok/s "
              f"(recomputed old log-probs), ratio {ours_a / trl_a:.2f}x; without the recompute {plain_a:.1f} tok/s, "
              f"ratio {plain_a / trl_a:.2f}x")  # fmt: skip

        # (b) whole step with generation
        step_times: list[float] = []
        lengths: list[float] = []

        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                step_times.append(time.perf_counter() - self.t0)

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "completions/mean_length" in logs:
                    lengths.append(logs["completions/mean_length"])

        trainer.add_callback(Clock())
        # Alternate one TRL step (a 1-step `train()`, timed inside by the callback) with one of ours.
        ours_times, ours_tok = [], []
        for rep in range(a.repeats + 1):
            trainer.train()
            t0 = time.perf_counter()
            gens = policy.generate("agent", convs, max_new_tokens=a.tokens, temperature=1.0)
            acts = actions_from(gens, convs)
            rewards = [r * 10 for r in reward([g.text for g in gens])]
            update_group(policy, opt, acts, rewards, update_settings(cfg, policy.samples_exactly))
            if rep:
                ours_times.append(time.perf_counter() - t0)
                ours_tok.append(sum(len(g.response_ids) for g in gens))
        trl_tok = statistics.mean(lengths[1:]) * a.batch
        trl_b = trl_tok / statistics.median(step_times[1:])
        ours_b = statistics.mean(ours_tok) / statistics.median(ours_times)
        print(f"(b) whole step: TRL {trl_b:.1f} tok/s ({trl_tok:.0f} tokens/step, {statistics.median(step_times[1:]):.2f} s), "
              f"mappa {ours_b:.1f} tok/s ({statistics.mean(ours_tok):.0f} tokens/step, {statistics.median(ours_times):.2f} s), "
              f"ratio {ours_b / trl_b:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
