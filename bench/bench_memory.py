"""Resident memory of the embedded model: 1 model vs 3 agents as LoRA adapters vs 3 agents as full copies; and a
heterogeneous team (two agents on the embedded model, the verifier on a second base) vs the sum of its parts.

Each setup runs in its own fresh subprocess (so freed memory cannot hide in the allocator), builds the
policy, runs one forward pass per agent and reports its resident set size (RSS). Prints the three RSS
figures and the ratios (target: 3 LoRA agents <= 1.2x one model). The `full` figure includes the frozen
reference copy the KL term needs, so it holds 4 copies of the weights.

The heterogeneous team (`model.agent_models`, `mappa.policy.team`) holds each base once, with its agents' adapters:
its RSS is compared with each base's part measured alone, summed, less the one interpreter (python, torch and
transformers imported, no model) that every process but one adds to the sum. A ratio near 1 says the team costs
what its bases cost apart, nothing more. Weights load from memory-mapped safetensors, whose pages count only once
read and which the kernel may drop again (clean file pages, under a shared machine's memory limit: the team's RSS
came out 250 MiB below its own weights that way), so here each weight is first copied into memory of its own. The second base defaults to the packaged Qwen2.5-Coder-0.5B (`make
models`); without it the case is skipped with one line.

    .venv/bin/python bench/bench_memory.py [--second MODEL]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

AGENTS = ["solver", "coder", "verifier"]
SECOND = "qwen2.5-coder-0.5b-instruct"


def child(setup: str, second: str) -> None:
    import psutil
    import torch

    from mappa.config import ModelConfig
    from mappa.policy.models import EMBEDDED_NAME, load_base_model
    from mappa.policy.policy import Policy
    from mappa.policy.team import Policies
    from mappa.types import Message

    weights = 0
    if setup in ("team", "part-a", "part-b"):  # the heterogeneous team, or one of its bases alone
        agents = {"team": AGENTS, "part-a": AGENTS[:2], "part-b": AGENTS[2:]}[setup]
        name = second if setup == "part-b" else EMBEDDED_NAME
        cfg = ModelConfig(name=name, device="cpu", agent_models={"verifier": second} if setup == "team" else {})
        for policy in Policies.from_config(cfg, agents):
            for p in policy.model.parameters():  # out of the memory-mapped file (see the docstring)
                p.data = p.data.clone()
            ids = policy.chat_ids([Message(role="user", content="What is 2 + 3?")])
            for agent in (*policy.agents, None):
                policy.sequence_logprobs(agent, [ids], [ids[-1:]])
            weights += sum(p.numel() * p.element_size() for p in policy.model.parameters())
    elif setup != "empty":  # empty: the interpreter and its libraries, no model
        model, tok = load_base_model(EMBEDDED_NAME)
        ids = [[1, 9690, 198, 2683, 359, 253]]
        if setup == "base":
            with torch.no_grad():
                model(input_ids=torch.tensor(ids))
        else:
            policy = Policy.from_model(model, tok, AGENTS, agent_weights=setup, lora_r=16, lora_alpha=32)
            for agent in (*AGENTS, None):
                policy.sequence_logprobs(agent, ids, [[2]])
    print(json.dumps({"rss": psutil.Process().memory_info().rss, "weights": weights}))


def measure(setup: str, second: str = SECOND) -> dict[str, float]:
    """`setup`'s resident set ("rss") and its models' parameters ("weights", heterogeneous setups only), in MiB."""
    cmd = [sys.executable, __file__, "--child", setup, "--second", second]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {k: v / 2**20 for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def heterogeneous(second: str) -> None:
    """The team on two bases against its parts (see the module docstring)."""
    from mappa.policy.models import PACKAGED_MODELS, packaged_model_path

    if second in PACKAGED_MODELS and not packaged_model_path(second).is_file():
        print(f"heterogeneous team: skipped, {second} is not on this machine (make models)")
        return
    got = {setup: measure(setup, second) for setup in ("empty", "part-a", "part-b", "team")}
    rss, weights = {k: v["rss"] for k, v in got.items()}, {k: v["weights"] for k, v in got.items()}
    parts = rss["part-a"] + rss["part-b"] - rss["empty"]
    print(f"heterogeneous team: solver and coder on the embedded model, verifier on {second}")
    for label, setup in (("the embedded model's part alone", "part-a"), ("the second base's part alone", "part-b")):
        print(f"  {label + ':':34} {rss[setup]:7.0f} MiB  (weights {weights[setup]:.0f} MiB)")
    print(f"  sum of the parts, one interpreter: {parts:7.0f} MiB  (the interpreter alone: {rss['empty']:.0f} MiB)")
    print(
        f"  the team:                          {rss['team']:7.0f} MiB  ({rss['team'] / parts:.2f}x the parts; weights "
        f"{weights['team']:.0f} MiB, the parts' {weights['part-a'] + weights['part-b']:.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--second", default=SECOND, help=f"the heterogeneous team's second base (default {SECOND})")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.second)
        return
    rss = {setup: measure(setup)["rss"] for setup in ("base", "lora", "full")}
    print(f"1 model:                 {rss['base']:7.0f} MiB")
    print(
        f"3 agents, LoRA (r=16):   {rss['lora']:7.0f} MiB  ({rss['lora'] / rss['base']:.2f}x one model; target <= 1.2x)"
    )
    print(f"3 agents, full copies:   {rss['full']:7.0f} MiB  ({rss['full'] / rss['base']:.2f}x one model)")
    heterogeneous(args.second)


if __name__ == "__main__":
    main()
