"""Start-up self-test: three cheap checks that catch a silently broken run before it costs hours.

1. Each agent generates with its own trainable weights: its trainable parameters are perturbed (and
   restored), and (a) its log-probs of a fixed sequence must move, (b) no other agent's log-probs may
   move, (c) the log-probs `generate` reports for a fresh sample must equal `forward_logprobs` under
   that agent (so PPO's old_logp and the update see the same policy), and differ from the base model.
   A LoRA adapter that is not hooked into the forward pass, an adapter shared by mistake, or
   generation that runs on the base model each fail here.
2. The code tool is reached: `print(6 * 7)` runs in the sandbox and prints 42.
3. The coach's reply parses: one judgment of a trivial action comes back with a score.
Any failure raises MappaError with the reason; the run stops before its first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mappa.errors import MappaError
from mappa.types import CoachContext, Message

_PROBE = [Message(role="user", content="What is 2 + 3? Put the answer in \\boxed{}.")]


def _perturb(params: Sequence[torch.nn.Parameter], seed: int) -> list[torch.Tensor]:
    """Add noise sized to each tensor (zero-initialised LoRA B matrices get a fixed scale); returns backups."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    backups = []
    with torch.no_grad():
        for p in params:
            backups.append(p.detach().clone())
            scale = float(p.float().std()) if p.numel() > 1 else 0.0
            noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            p.add_(noise * (0.5 * scale + 0.05))
    return backups


def _restore(params: Sequence[torch.nn.Parameter], backups: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, b in zip(params, backups, strict=True):
            p.copy_(b)


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    return float((a[m] - b[m]).abs().mean()) if m.any() else 0.0


def check_agents(policy: Any, agents: Sequence[str], seed: int = 0) -> list[str]:
    """Check 1 for every update group; returns one line per agent checked."""
    prompt = policy.chat_ids(_PROBE)
    fixed = prompt[-8:]  # any token sequence works as the probe response
    lines = []
    groups: dict[int, str] = {}
    for agent in agents:  # agents that share one parameter set (shared mode) are checked once
        groups.setdefault(id(policy.trainable_parameters(agent)[0]), agent)
    with torch.no_grad():
        before = {a: policy.forward_logprobs(a, [prompt], [fixed])[0] for a in agents}
    for key, agent in groups.items():
        params = policy.trainable_parameters(agent)
        if not params:
            raise MappaError(f"self-test: agent {agent!r} has no trainable parameters")
        backups = _perturb(params, seed)
        try:
            with torch.no_grad():
                after = {a: policy.forward_logprobs(a, [prompt], [fixed]) for a in agents}
                mask = after[agent][1]
                moved = _mean_abs(after[agent][0], before[agent], mask)
                if moved < 1e-4:
                    raise MappaError(
                        f"self-test: perturbing agent {agent!r}'s trainable weights did not change its outputs "
                        "(adapter not active in the forward pass)"
                    )
                for other in agents:
                    same_group = id(policy.trainable_parameters(other)[0]) == key
                    if not same_group and _mean_abs(after[other][0], before[other], mask) > 1e-6:
                        raise MappaError(f"self-test: agent {other!r} changed when only {agent!r}'s weights did")
                gen = policy.generate(agent, [_PROBE], max_new_tokens=8, temperature=1.0, seed=seed)[0]
                if not gen.response_ids:
                    raise MappaError(f"self-test: agent {agent!r} generated no tokens")
                own, m = policy.forward_logprobs(agent, [gen.prompt_ids], [gen.response_ids])
                ref, _ = policy.forward_logprobs(None, [gen.prompt_ids], [gen.response_ids])
                reported = torch.tensor(gen.logprobs, dtype=own.dtype, device=own.device)[None]
                # bf16 kernels differ between the batched generate and the forward pass; fp32 agrees closely
                tol = 0.05 if own.dtype == torch.float32 else 0.25
                gap_own = _mean_abs(reported, own, m)
                if gap_own > tol:
                    raise MappaError(
                        f"self-test: agent {agent!r}: generate's log-probs differ from the forward pass by "
                        f"{gap_own:.3f} nats/token (generation does not use the agent's weights)"
                    )
                if _mean_abs(reported, ref, m) < 1e-4:
                    raise MappaError(f"self-test: agent {agent!r} generates with the base weights, not its own")
        finally:
            _restore(params, backups)
        lines.append(f"agent {agent}: own trainable weights in forward and generate (|dlogp| {moved:.3f})")
    return lines


def check_sandbox(sandbox: Any) -> str:
    from mappa.sandbox import new_workspace, remove_workspace

    ws = new_workspace()
    try:
        result = sandbox.run_many([("print(6 * 7)", ws)])[0]
    finally:
        remove_workspace(ws)
    if result.infra_error or not result.ok or result.stdout.strip() != "42":
        why = result.infra_error or result.stderr.strip()[-200:] or f"stdout {result.stdout[:50]!r}"
        raise MappaError(f"self-test: the code tool failed on print(6 * 7): {why}")
    return f"code tool: print(6 * 7) -> 42 in {result.duration_s:.2f} s"


def check_coach(score_many: Any, workflow_name: str, agent: str) -> str:
    messages = (Message(role="user", content="What is 2 + 3? Answer in \\boxed{}."),)
    ctx = CoachContext(
        task="What is 2 + 3?",
        workflow=workflow_name,
        agent=agent,
        role="Verifier: checks the work and states the final answer in \\boxed{}.",
        is_final=True,
        messages=messages,
        output="2 + 3 = 5, so the answer is \\boxed{5}.",
        ground_truth="5",
    )
    score = score_many([ctx])[0]
    if score.score is None:
        raise MappaError(
            f"self-test: the coach's reply did not parse ({score.error or 'no PROCESS_SCORE line'}): "
            f"{score.raw_reply.strip()[:120]!r}"
        )
    return f"coach: reply parsed, score {score.score:g} for a correct trivial answer"


def run_self_test(policy: Any, agents: Sequence[str], sandbox: Any, score_many: Any, workflow_name: str) -> list[str]:
    """All three checks; raises MappaError on the first failure, else returns a line per check."""
    lines = check_agents(policy, agents)
    lines.append(check_sandbox(sandbox))
    lines.append(check_coach(score_many, workflow_name, agents[-1]))
    return lines
