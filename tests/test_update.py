"""The update's arithmetic on a tiny random Llama: gradient accumulation is exact (micro-batch 1 and N give the
gradient of the whole mini-batch's token-mean loss, which is `rl.clipped_pg_loss` on the whole batch), the
settings the trainer resolves (`mappa.training.trainer.update_settings`) are the ones the update acts on, whether the
old log-probs are recomputed is one rule fed by what the generator says of itself, each group's result is one typed
record, and the `shared` single-policy baseline goes through the real training loop."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import sampled_actions, tiny_cfg, train_cfg, update_policy

from mappa.config import Config
from mappa.generation import LocalGenerator, ServerGenerator
from mappa.training import rl
from mappa.training.trainer import update_settings
from mappa.training.update import (
    GroupResult,
    UpdateJob,
    UpdateSettings,
    apply_update,
    recomputes_old_logprobs,
    update_group,
)
from mappa.types import Action

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCORES = [9.0, 1.0, 6.0, 3.0, 10.0, 0.0, 4.0]


def ragged_actions() -> list[Action]:
    """Seven sampled actions cut to different lengths (a prefix of a sample is a sample), with generation-time
    log-probs that are off by a seeded noise, so the PPO ratio leaves 1 and the clip acts."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for i, a in enumerate(sampled_actions(update_policy(), "solver", len(SCORES), seed=11)):
        k = 2 + i % 5
        noise = (torch.randn(k, generator=gen) * 0.3).tolist()
        logprobs = tuple(lp + d for lp, d in zip(a.logprobs[:k], noise, strict=True))
        out.append(a.model_copy(update={"response_ids": a.response_ids[:k], "logprobs": logprobs}))
    assert len({len(a.response_ids) for a in out}) > 2
    return out


def one_step(
    actions: list[Action], micro: int, aggregation: str = "token"
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One optimizer step over the whole batch; returns its stats and the gradient (SGD at lr 1: the step)."""
    policy = update_policy()
    params = policy.trainable_parameters("solver")
    before = [p.detach().clone() for p in params]
    cfg = train_cfg(
        mini_batch_size=len(actions), micro_batch_size=micro, grad_clip=1e9, recompute_old_logprobs=False,
        loss_aggregation=aggregation,
    )  # fmt: skip
    steps: list[dict[str, float]] = []
    optimizer = torch.optim.SGD(params, lr=1.0)
    stats = update_group(policy, optimizer, actions, SCORES, update_settings(cfg, True), seed=0, on_step=steps.append)
    assert stats.optimizer_steps == 1
    return steps[0], [b - p.detach() for b, p in zip(before, params, strict=True)]


def whole_batch(
    actions: list[Action], aggregation: str = "token"
) -> tuple[torch.Tensor, dict[str, float], list[torch.Tensor]]:
    """The same update written out: advantages over the batch, one forward, `rl.clipped_pg_loss`, backward."""
    cfg = train_cfg().train
    policy = update_policy()
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    ref, mask = policy.sequence_logprobs(None, prompts, responses)
    old = torch.nn.utils.rnn.pad_sequence([torch.tensor(a.logprobs) for a in actions], batch_first=True)
    adv = rl.reinforce_pp_advantages(torch.tensor(SCORES) / 10, old, ref.float(), mask.float(), cfg.kl_coef)
    with torch.enable_grad():
        logp, m = policy.forward_logprobs("solver", prompts, responses)
        loss, stats = rl.clipped_pg_loss(logp.float(), old, adv, m.float(), cfg.clip_eps, aggregation)
        loss.backward()
    return loss.detach(), stats, [p.grad for p in policy.trainable_parameters("solver")]


def test_micro_batches_accumulate_the_whole_batch_gradient() -> None:
    actions = ragged_actions()
    loss, stats, grads = whole_batch(actions)
    assert abs(loss.item()) > 1e-3 and 0 < stats["clip_frac"] < 1  # a real loss, with clipped and free tokens
    for micro in (1, 3, len(actions)):
        step, step_grads = one_step(actions, micro)
        assert step["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), micro
        assert step["tokens"] == stats["tokens"] == sum(len(a.response_ids) for a in actions)
        for k in ("clip_frac", "ratio_mean", "approx_kl"):
            assert step[k] == pytest.approx(stats[k], rel=1e-5, abs=1e-7), (micro, k)
        for g, s in zip(grads, step_grads, strict=True):
            torch.testing.assert_close(s, g, rtol=1e-4, atol=1e-7)


def test_the_action_mean_is_the_same_whatever_the_micro_batches_and_differs_from_the_token_mean() -> None:
    """train.loss_aggregation: action (the published code's weighting): each action's token mean, then the mean over
    the mini-batch's actions, whatever the micro-batches; on ragged actions not the token mean's gradient."""
    actions = ragged_actions()
    loss, _, grads = whole_batch(actions, "action")
    token_loss, _, token_grads = whole_batch(actions)
    assert abs(loss.item() - token_loss.item()) > 1e-4
    assert any(not torch.allclose(g, t, rtol=1e-3, atol=1e-6) for g, t in zip(grads, token_grads, strict=True))
    for micro in (1, 3, len(actions)):
        step, step_grads = one_step(actions, micro, "action")
        assert step["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), micro
        for g, s in zip(grads, step_grads, strict=True):
            torch.testing.assert_close(s, g, rtol=1e-4, atol=1e-7)


def test_the_trainer_resolves_what_the_update_reads_from_the_config() -> None:
    """The run's config gives the update its settings; where the actions came from is the engine's answer
    (`samples_exactly`), never the config's backend."""
    cfg = train_cfg(recompute_old_logprobs=False)
    cfg = cfg.model_copy(
        update={
            "generation": cfg.generation.model_copy(update={"temperature": 0.7, "backend": "server"}),
            "workflow": cfg.workflow.model_copy(update={"reward_scale": 0.5}),
        }
    )
    for exact in (True, False):
        assert update_settings(cfg, exact) == UpdateSettings(cfg.train, 0.7, 0.5, samples_exactly=exact)


def _bf16_copies() -> Any:
    policy = update_policy()
    policy.sample_from_copies(torch.bfloat16)
    return policy


@pytest.mark.parametrize(
    ("generator", "asked", "recomputes"),
    [
        ("float32 local", False, False),  # the trainer's own forward pass: used as generated
        ("float32 local", True, True),  # train.recompute_old_logprobs asks for it
        ("bfloat16 copies", False, True),  # another dtype's kernels
        ("server", False, True),  # another engine's kernels
    ],
)
def test_one_rule_decides_whether_the_old_logprobs_are_recomputed(
    generator: str, asked: bool, recomputes: bool
) -> None:
    """`mappa.training.update.recomputes_old_logprobs`, fed what the run's generator says of itself: a server always
    recomputes, bfloat16 sampling copies recompute, float32 local generation does not unless asked; under the
    update's own bfloat16 autocast every one recomputes."""
    if generator == "server":
        exact = ServerGenerator.samples_exactly
    else:
        policy = _bf16_copies() if generator == "bfloat16 copies" else update_policy()
        engine = LocalGenerator(policy)
        try:
            exact = engine.samples_exactly
        finally:
            engine.close()
    settings = update_settings(train_cfg(recompute_old_logprobs=asked), exact)
    assert recomputes_old_logprobs(settings, None) is recomputes
    assert recomputes_old_logprobs(settings, torch.bfloat16) is True


@pytest.mark.parametrize("exact", [True, False])
def test_the_update_acts_on_the_resolved_decisions(exact: bool) -> None:
    """Generation-time log-probs off by noise, `train.recompute_old_logprobs` off: from a generator that does not
    sample exactly they are recomputed, the first step's ratio is 1 and nothing clips, and the reported gap is the
    noise; from one that does they are taken as they are, the ratio leaves 1 and the clip acts."""
    actions, policy = ragged_actions(), update_policy()
    exact_lp, _ = policy.sequence_logprobs(
        "solver", [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    )
    noise = [abs(lp - float(exact_lp[i, j])) for i, a in enumerate(actions) for j, lp in enumerate(a.logprobs)]
    train = Config().train.model_copy(update={"mini_batch_size": len(actions), "recompute_old_logprobs": False})
    settings = UpdateSettings(train, 1.0, 0.1, samples_exactly=exact)
    steps: list[dict[str, float]] = []
    optimizer = torch.optim.SGD(policy.trainable_parameters("solver"), lr=0.1)
    stats = update_group(policy, optimizer, actions, SCORES, settings, on_step=steps.append)
    if not exact:
        assert steps[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and steps[0]["clip_frac"] == 0.0
        assert stats.logprob_gap == pytest.approx(sum(noise) / len(noise), rel=1e-4)
        assert stats.logprob_gap > 0.1
    else:
        assert steps[0]["clip_frac"] > 0 and stats.logprob_gap is None


def test_a_groups_result_holds_its_selection_rewards_and_update() -> None:
    """`apply_update` returns one typed record per group: what trained, what was left out and why, the rewards'
    mean and spread, and the update's numbers; a group with nothing to train takes no optimizer step."""
    actions, policy = ragged_actions()[:4], update_policy()
    optimizer = torch.optim.AdamW(policy.trainable_parameters("solver"), lr=1e-3)
    settings = update_settings(train_cfg(mini_batch_size=2), True)
    dropped = {"empty": 0, "infra_error": 1, "truncated": 2, "unscored": 0}
    job = UpdateJob(actions, [6.0, 6.0, 2.0, 2.0], seed=0, peak_lr=1e-3, step=0, settings=settings, dropped=dropped)
    result = apply_update(policy, optimizer, job)
    assert isinstance(result, GroupResult) and result.update is not None
    assert (result.actions_trained, result.dropped) == (4, dropped)
    assert (result.reward_mean, result.reward_std, result.reward_zero_std) == (4.0, 2.0, False)
    assert result.update.optimizer_steps == result.optimizer_steps == 2
    assert result.update.tokens == sum(len(a.response_ids) for a in actions) and result.lr > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.actions_trained = 0  # type: ignore[misc]

    before = [p.detach().clone() for p in policy.trainable_parameters("solver")]
    state = {k: v["exp_avg"].clone() for k, v in enumerate(optimizer.state.values())}
    same = apply_update(policy, optimizer, dataclasses.replace(job, scores=[7.0] * 4))
    assert same.reward_std == 0.0 and same.reward_zero_std  # every action scored alike: nothing to learn from
    # and nothing is learned: whitening would have turned the KL term's noise into unit advantages, Adam into a
    # full-size step (momentum included), so the weights and the optimizer's state stay exactly as they were
    assert same.update is None and same.optimizer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.trainable_parameters("solver"), strict=True))
    assert all(torch.equal(state[k], v["exp_avg"]) for k, v in enumerate(optimizer.state.values()))
    # scores alike as floats whose mean rounds (0.1 * 3 / 3 is not 0.1): still alike, still no step
    tenths = apply_update(policy, optimizer, dataclasses.replace(job, actions=actions[:3], scores=[0.1] * 3))
    assert tenths.reward_std == 0.0 and tenths.reward_zero_std and tenths.update is None
    idle = apply_update(policy, optimizer, dataclasses.replace(job, actions=[], scores=[]))
    assert idle.update is None and idle.optimizer_steps == 0 and idle.actions_trained == 0
    assert idle.reward_mean is None and idle.reward_zero_std is None and idle.lr == same.lr


def test_logprob_gap_counts_only_the_tokens_given() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, float("nan"), float("nan")]])
    # row 0: a server that left the stop token out (2 of 3 tokens); row 1: one token, padding never read
    assert rl.logprob_gap(logp, [[-1.5, -2.0], [-0.25]]) == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert rl.logprob_gap(logp, [[], []]) == 0.0


def test_shared_weights_train_two_steps_through_the_loop(tmp_path: Path) -> None:
    """`model.agent_weights: shared`: one adapter and one optimizer for all three agents, fed every agent's
    actions; the checkpoint reloads as one set of weights that moved."""
    from mappa.policy.policy import Policy
    from mappa.training.trainer import train

    cfg = tiny_cfg(tmp_path, "model.agent_weights=shared", "logging.report_to=[]")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/rollout_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    episodes = [json.loads(x) for x in (run_dir / "episodes.jsonl").read_text().splitlines()]
    for r in steps:
        groups = {k.split("/")[1] for k in r if k.startswith("agent/")}
        assert groups == {"shared"}
        actions = sum(len(e["actions"]) for e in episodes if e["meta"]["step"] == r["step"])
        dropped = sum(v for k, v in r.items() if k.startswith("agent/shared/dropped_"))
        assert r["agent/shared/actions_trained"] + dropped == actions  # every agent's actions, in one group
        assert r["agent/shared/optimizer_steps"] >= 1 and r["agent/shared/tokens"] > 0
    trained = Policy.from_checkpoint(run_dir / "checkpoints" / "step-000002" / "policy", device="cpu")
    assert trained.agent_weights == "shared"
    first, *others = (trained.trainable_parameters(a) for a in trained.agents)
    assert all(all(p is q for p, q in zip(first, o, strict=True)) for o in others)  # one set of weights
    fresh = Policy.from_config(cfg.model, trained.agents, seed=cfg.seed)
    assert any(
        not torch.equal(p, q) for p, q in zip(first, fresh.trainable_parameters(trained.agents[0]), strict=True)
    )


def test_each_update_group_whitens_its_own_batch() -> None:
    """Two groups updated one after the other, as a step does (`apply_update` per group): the solver's update is
    the same whatever the coder's scores were, while one group holding both batches would have changed it."""
    cfg = train_cfg(mini_batch_size=8, lr=1e-2)
    settings = update_settings(cfg, True)

    def solver_after(coder_scores: list[float], pooled: bool = False) -> tuple[float, list[torch.Tensor]]:
        policy = update_policy()
        solver, coder = sampled_actions(policy, "solver", 4, seed=1), sampled_actions(policy, "coder", 4, seed=2)
        scores = [9.0, 1.0, 6.0, 3.0]
        opt = {a: torch.optim.AdamW(policy.trainable_parameters(a), lr=1e-2) for a in ("solver", "coder")}
        if pooled:  # the coder's actions whitened with the solver's, in one group
            stats = update_group(policy, opt["solver"], solver + coder, scores + coder_scores, settings)
            return stats.advantage_abs, [p.detach().clone() for p in policy.trainable_parameters("solver")]
        apply_update(policy, opt["coder"], UpdateJob(coder, coder_scores, 0, 1e-2, 0, settings))
        result = apply_update(policy, opt["solver"], UpdateJob(solver, scores, 0, 1e-2, 0, settings))
        return result.update.advantage_abs, [p.detach().clone() for p in policy.trainable_parameters("solver")]

    calm, moved = solver_after([5.0, 5.0, 5.0, 5.0]), solver_after([10.0, 0.0, 10.0, 0.0])
    assert calm[0] == moved[0]
    assert all(torch.equal(a, b) for a, b in zip(calm[1], moved[1], strict=True))
    assert solver_after([10.0, 0.0, 10.0, 0.0], pooled=True)[0] != calm[0]
