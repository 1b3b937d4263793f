"""Self-test before the first step (and on every resume): cheap checks that catch a silently broken run
before it costs hours. Each failure raises MappaError with its own one-line reason; the run stops there.

1. Each agent generates with its own trainable weights (on its own base model: each base of a heterogeneous team,
   `mappa.policy.team`, is checked over its agents). Outside `shared` mode no two agents may hold the same
   trainable tensors (aliased adapters). Each agent's trainable parameters are perturbed (and restored), and
   (a) its log-probs of a fixed sequence must move (the adapter is in the forward pass), (b) no other agent's
   may move, (c) a fresh sample at the sampling temperature must report log-probs equal to `forward_logprobs`
   under that agent at that temperature (so PPO's old_logp and the update see the same distribution), not
   the base model's. A temperature other than 1 also catches log-probs taken from the raw logits.
2. The code tool is reached: `print(6 * 7)` runs in the sandbox and prints 42.
3. The coach answers (an endpoint that is down or refuses is its own error) and its reply parses into a score. A
   plug-in coach is only asked once, on a synthetic context of a math answer: an error there says that it came from
   the self-test and what the context held, since a reward function written for its own workflow's evidence meets
   a context it was not written for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mappa.coach.judge import REQUEST_FAILED
from mappa.errors import MappaError
from mappa.plugins import UserCodeError
from mappa.types import CoachContext, Message

_PROBE = [Message(role="user", content="What is 2 + 3? Put the answer in \\boxed{}.")]
# When the caller does not name the run's temperature: any value but 1 (where scaled and raw logits agree)
# and 0 (greedy, raw logits) checks that generation and the forward pass divide by the same temperature.
PROBE_TEMPERATURE = 0.7
# The perturbation stands in for training. Noise the size of the weights can wreck a model instead (Qwen2.5-Coder-0.5B:
# 14 nats/token from the base, against 1.6 for SmolLM2-135M), and a wrecked model is chaotic under any bfloat16
# arithmetic, its sampling copy's and the update's autocast alike; shrunk until it moves the agent at most this far,
# it stays a change an update could make. Every check below is relative to how far it moved.
MAX_MOVED = 2.0


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


def _shrink(params: Sequence[torch.nn.Parameter], backups: Sequence[torch.Tensor], factor: float) -> None:
    """Scale each perturbation (parameter minus its backup) by `factor`."""
    with torch.no_grad():
        for p, b in zip(params, backups, strict=True):
            p.copy_(b + factor * (p - b))


def _restore(params: Sequence[torch.nn.Parameter], backups: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, b in zip(params, backups, strict=True):
            p.copy_(b)


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    return float((a[m] - b[m]).abs().mean()) if m.any() else 0.0


def _groups(policy: Any, agents: Sequence[str]) -> dict[int, str]:
    """One agent per set of trainable weights (all of them in `shared` mode); aliased weights are an error."""
    groups: dict[int, str] = {}
    owner: dict[int, str] = {}
    for agent in agents:
        params = policy.trainable_parameters(agent)
        if not params:
            raise MappaError(f"self-test: agent {agent!r} has no trainable parameters")
        ids = {id(p) for p in params}
        if policy.agent_weights != "shared" and (shared := ids & set(owner)):
            raise MappaError(
                f"self-test: agents {owner[next(iter(shared))]!r} and {agent!r} share trainable weights although "
                f"model.agent_weights is {policy.agent_weights!r} (aliased adapters: one would train the other)"
            )
        owner.update(dict.fromkeys(ids, agent))
        groups.setdefault(id(params[0]), agent)
    return groups


def _check_generation(policy: Any, agent: str, seed: int, temperature: float) -> None:
    """Check 1c, with the agent's weights perturbed: generate's log-probs are the agent's at `temperature`,
    not the base's, and not those of another temperature.

    A policy that samples from bfloat16 copies (`Policy.samples_exactly` false) is held to the copy's own forward
    pass: on the perturbed weights the copy's rounding alone moves log-probs by up to ~0.3 nats/token from the
    float32 forward (measured on SmolLM2-135M over 30 seeds x 3 agents), as far as a temperature bug does, while
    cached decoding against the copy's full forward stays below 0.10 and a temperature-1 report is above 0.16; that
    the copy holds the agent's weights is checked apart, against the distance the perturbation moved them."""
    gen = policy.generate(agent, [_PROBE], max_new_tokens=8, temperature=temperature, seed=seed)[0]
    if not gen.response_ids:
        raise MappaError(f"self-test: agent {agent!r} generated no tokens")
    prompt, response = [gen.prompt_ids], [gen.response_ids]
    own, m = policy.forward_logprobs(agent, prompt, response, temperature=temperature)
    ref, _ = policy.forward_logprobs(None, prompt, response, temperature=temperature)
    exact = policy.samples_exactly
    sampled = (
        own if exact else policy.forward_logprobs(agent, prompt, response, temperature=temperature, sampler=True)[0]
    )
    reported = torch.tensor(gen.logprobs, dtype=own.dtype, device=own.device)[None]
    # float32 kernels agree closely; a bfloat16 copy's decoding differs from its forward (measured above); a model
    # held in half precision (a GPU's) keeps the wider margin its kernels had before copies existed
    tol = 0.25 if own.dtype != torch.float32 else 0.05 if exact else 0.15
    gap_own, gap_ref, moved = _mean_abs(reported, own, m), _mean_abs(reported, ref, m), _mean_abs(own, ref, m)
    if gap_ref < min(gap_own, tol) and moved >= 1e-4:  # closer to the base than to the agent
        raise MappaError(f"self-test: agent {agent!r} generates with the base weights, not its own")
    if not exact and _mean_abs(sampled, own, m) > 0.5 * moved:
        raise MappaError(
            f"self-test: agent {agent!r}'s sampling copy does not hold its weights (its log-probs are "
            f"{_mean_abs(sampled, own, m):.3f} nats/token from the agent's, which the test moved {moved:.3f} from the base)"
        )
    if (gap := _mean_abs(reported, sampled, m)) > tol:
        raise MappaError(
            f"self-test: agent {agent!r}: generate's log-probs differ from the forward pass at temperature "
            f"{temperature:g} by {gap:.3f} nats/token (generation does not use the agent's weights, or "
            "reports log-probs misaligned or of another temperature)"
        )


def check_agents(
    policy: Any, agents: Sequence[str], seed: int = 0, temperature: float = PROBE_TEMPERATURE
) -> list[str]:
    """Check 1 for every update group, sampling at `temperature` (the run's); returns one line per agent."""
    prompt = policy.chat_ids(_PROBE)
    fixed = prompt[-8:]  # any token sequence works as the probe response
    lines = []
    groups = _groups(policy, agents)
    with torch.no_grad():
        before = {a: policy.forward_logprobs(a, [prompt], [fixed])[0] for a in agents}
    for key, agent in groups.items():
        params = policy.trainable_parameters(agent)
        backups = _perturb(params, seed)
        try:
            with torch.no_grad():
                for shrunk in range(6):
                    after = {a: policy.forward_logprobs(a, [prompt], [fixed]) for a in agents}
                    mask = after[agent][1]
                    moved = _mean_abs(after[agent][0], before[agent], mask)
                    if moved <= MAX_MOVED or shrunk == 5:
                        break
                    _shrink(params, backups, 0.25)
                if moved < 1e-4:
                    raise MappaError(
                        f"self-test: perturbing agent {agent!r}'s trainable weights did not change its outputs "
                        "(adapter not active in the forward pass)"
                    )
                for other in agents:
                    same_group = id(policy.trainable_parameters(other)[0]) == key
                    if not same_group and _mean_abs(after[other][0], before[other], mask) > 1e-6:
                        raise MappaError(f"self-test: agent {other!r} changed when only {agent!r}'s weights did")
                _check_generation(policy, agent, seed, temperature if temperature > 0 else PROBE_TEMPERATURE)
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
        limit = "timed out" if result.timed_out else "memory limit exceeded" if result.memory_exceeded else ""
        why = result.infra_error or limit or result.stderr.strip()[-200:] or f"stdout {result.stdout[:50]!r}"
        raise MappaError(f"self-test: the code tool failed on print(6 * 7): {why}")
    return f"code tool: print(6 * 7) -> 42 in {result.duration_s:.2f} s"


def check_coach(score_many: Any, workflow_name: str, agent: str, plugin: bool = False) -> str:
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
    try:
        score = score_many([ctx])[0]
    except MappaError as e:
        if plugin:
            raise _on_synthetic(e, ctx) from e
        raise
    if plugin:  # a plug-in may leave a context of another workflow unscored; its range is checked on every score
        shown = "unscored" if score.score is None else f"score {score.score:g}"
        return f"coach: the plug-in answered a trivial context ({shown})"
    if score.score is None and score.error is not None and score.error.startswith(REQUEST_FAILED):
        raise MappaError(f"self-test: the coach did not answer ({score.error})")
    if score.score is None:
        raise MappaError(
            f"self-test: the coach's reply did not parse ({score.error or 'no PROCESS_SCORE line'}): "
            f"{score.raw_reply.strip()[:120]!r}"
        )
    return f"coach: reply parsed, score {score.score:g} for a correct trivial answer"


def _on_synthetic(e: MappaError, ctx: CoachContext) -> MappaError:
    """A plug-in's failure on the self-test's context, saying so and what the context held (one line)."""
    held = (
        f"workflow {ctx.workflow!r}, agent {ctx.agent!r}{' (final)' if ctx.is_final else ''}, task {ctx.task!r}, "
        f"output {ctx.output!r}, ground_truth {ctx.ground_truth!r}, extra {ctx.extra}, no tool call"
    )
    if isinstance(e, UserCodeError):
        note = f" (it held: {held}; return None, unscored, for a context your {e.role} has no rule for)"
        return e.during(" on the self-test's synthetic context", note)
    return MappaError(f"self-test: {e}, on the self-test's synthetic context (it held: {held})")


def run_self_test(
    policies: Iterable[Any], agents: Sequence[str], sandbox: Any, score_many: Any, workflow_name: str,
    temperature: float = PROBE_TEMPERATURE, plugin_coach: bool = False,
) -> list[str]:  # fmt: skip
    """All three checks; raises MappaError on the first failure, else returns a line per check (check 1: per agent,
    base by base). `policies`: one policy per base model (`mappa.policy.team.Policies`); `temperature`: the run's
    `generation.temperature`, which check 1 samples at."""
    lines = []
    for policy in policies:
        mine = [a for a in agents if a in policy.agents]
        lines += check_agents(policy, mine, temperature=temperature) if mine else []
    lines.append(check_sandbox(sandbox))
    lines.append(check_coach(score_many, workflow_name, agents[-1], plugin=plugin_coach))
    return lines
