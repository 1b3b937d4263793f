"""Full fine-tuning from a bfloat16 base at lr 1e-6: how far three AdamW steps move the weights, and what a step costs.

    python bench/bench_master_weights.py            # hidden 512, 2 layers (~5M parameters), 2 threads

Arms, each on a full copy per agent of the same random bfloat16 model, one update of 6 actions in 3 optimizer steps
(`mappa.training.update.update_group`):
- `bf16 AdamW`: torch's AdamW on the bfloat16 weights, as mappa stepped them before (its moments in bfloat16 too);
- `fp32 masters`: `mappa.training.update.MasterAdamW`, what `build_optimizer` picks for weights in a half dtype;
- `Kahan bf16`: AdamW moments in float32, the bfloat16 weights updated with Kahan summation (a bfloat16
  compensation buffer carries what each step's rounding lost), 2 bytes per weight less than masters.

Moved: mean |delta| per element of the weights as the optimizer holds them (the masters; for Kahan, weight plus
compensation), against steps x lr = 3e-6 (what Adam intends when each step moves an element by about lr). Time:
the update's seconds (forward, backward and the three steps) and the optimizer steps' alone, medians of 3 repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mappa.config import Config
from mappa.policy.models import tiny_model_and_tokenizer
from mappa.policy.policy import Policy
from mappa.training.trainer import update_settings
from mappa.training.update import MasterAdamW, update_group
from mappa.types import Action, Message

LR, SCORES = 1e-6, [9.0, 1.0, 6.0, 3.0, 10.0, 0.0]


class KahanAdamW(torch.optim.Optimizer):
    """AdamW with float32 moments whose update is added to bfloat16 weights by Kahan summation."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, betas: tuple[float, float]) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": 1e-8})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    s.update(t=0, m=torch.zeros_like(p, dtype=torch.float32), v=torch.zeros_like(p, dtype=torch.float32),
                             comp=torch.zeros_like(p))  # fmt: skip
                g = p.grad.float()
                s["t"] += 1
                s["m"].lerp_(g, 1 - b1)
                s["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                u = -lr * (s["m"] / (1 - b1 ** s["t"])) / ((s["v"] / (1 - b2 ** s["t"])).sqrt() + eps)
                y = u + s["comp"].float()
                new = (p.float() + y).to(p.dtype)
                s["comp"].copy_(y - (new.float() - p.float()))
                p.copy_(new)

    def effective(self) -> list[torch.Tensor]:
        return [p.detach().float() + self.state[p]["comp"].float() for g in self.param_groups for p in g["params"]]


def held(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    if isinstance(optimizer, KahanAdamW):
        return optimizer.effective()
    return [p.detach().float() for g in optimizer.param_groups for p in g["params"]]


def arm(name: str, hidden: int, actions: list[Action], cfg: Config) -> tuple[float, float, float]:
    model, tok = tiny_model_and_tokenizer(seed=0, hidden_size=hidden)
    policy = Policy.from_model(model.to(torch.bfloat16), tok, ["solver"], agent_weights="full", seed=0)
    params = policy.trainable_parameters("solver")
    optimizer = {"bf16 AdamW": lambda: torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95)),
                 "fp32 masters": lambda: MasterAdamW(params, lr=LR, betas=(0.9, 0.95)),
                 "Kahan bf16": lambda: KahanAdamW(params, lr=LR, betas=(0.9, 0.95))}[name]()  # fmt: skip
    before = [p.detach().float().clone() for p in params]
    step_s = []
    original = optimizer.step

    def timed(*a: object) -> object:
        t = time.perf_counter()
        out = original(*a)
        step_s.append(time.perf_counter() - t)
        return out

    optimizer.step = timed
    t0 = time.perf_counter()
    update_group(policy, optimizer, actions, SCORES, update_settings(cfg, False), seed=3)
    total = time.perf_counter() - t0
    moved = torch.cat([(a - b).abs().flatten() for a, b in zip(held(optimizer), before, strict=True)]).mean()
    return float(moved), total, sum(step_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = Config()
    cfg.train.mini_batch_size, cfg.train.micro_batch_size = 2, 2
    model, tok = tiny_model_and_tokenizer(seed=0)
    sampler = Policy.from_model(model, tok, ["solver"], seed=0)
    convs = [[Message(role="user", content=f"What is {i} + {i}?")] for i in range(len(SCORES))]
    actions = [Action.sampled("solver", 0, c, g) for c, g in
               zip(convs, sampler.generate("solver", convs, max_new_tokens=16, seed=1), strict=True)]  # fmt: skip
    runs: dict[str, list[tuple[float, float, float]]] = {}
    for _ in range(3):
        for name in ("bf16 AdamW", "fp32 masters", "Kahan bf16"):
            runs.setdefault(name, []).append(arm(name, a.hidden, actions, cfg))
    print(f"hidden {a.hidden}, 3 steps at lr {LR:g}: steps x lr = {3 * LR:g}")
    for name, rows in runs.items():
        moved, total, step = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"{name:13s} moved {moved:.3g} ({moved / (3 * LR):.2f} x steps x lr), update {total:.2f} s, "
              f"optimizer steps {step * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
