"""Resident memory of the embedded model: 1 model vs 3 agents as LoRA adapters vs 3 agents as full copies.

Each setup runs in its own fresh subprocess (so freed memory cannot hide in the allocator), builds the
policy, runs one forward pass per agent and reports its resident set size (RSS). Prints the three RSS
figures and the ratios (target: 3 LoRA agents <= 1.2x one model). The `full` figure includes the frozen
reference copy the KL term needs, so it holds 4 copies of the weights.

    .venv/bin/python bench/bench_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys

AGENTS = ["solver", "coder", "verifier"]


def child(setup: str) -> None:
    import psutil
    import torch

    from mappa.models import EMBEDDED_NAME, load_base_model
    from mappa.policy import Policy

    model, tok = load_base_model(EMBEDDED_NAME)
    ids = [[1, 9690, 198, 2683, 359, 253]]
    if setup == "base":
        with torch.no_grad():
            model(input_ids=torch.tensor(ids))
    else:
        policy = Policy.from_model(model, tok, AGENTS, agent_weights=setup, lora_r=16, lora_alpha=32)
        for agent in (*AGENTS, None):
            policy.sequence_logprobs(agent, ids, [[2]])
    print(json.dumps({"rss": psutil.Process().memory_info().rss}))


def measure(setup: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", setup], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["rss"] / 2**20


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    rss = {setup: measure(setup) for setup in ("base", "lora", "full")}
    print(f"1 model:                 {rss['base']:7.0f} MiB")
    print(
        f"3 agents, LoRA (r=16):   {rss['lora']:7.0f} MiB  ({rss['lora'] / rss['base']:.2f}x one model; target <= 1.2x)"
    )
    print(f"3 agents, full copies:   {rss['full']:7.0f} MiB  ({rss['full'] / rss['base']:.2f}x one model)")


if __name__ == "__main__":
    main()
