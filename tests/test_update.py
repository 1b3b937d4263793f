"""The update's arithmetic on a tiny random Llama: gradient accumulation is exact (micro-batch 1 and N give the
gradient of the whole mini-batch's token-mean loss, which is `rl.clipped_pg_loss` on the whole batch), the
decisions the trainer resolves from the config (`mappa.trainer.update_settings`) are the ones the update acts
on, and the `shared` single-policy baseline goes through the real training loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_smoke import make_policy, sampled_actions, tiny_cfg, train_cfg

from mappa import rl
from mappa.config import Config
from mappa.trainer import update_settings
from mappa.types import Action
from mappa.update import UpdateSettings, update_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCORES = [9.0, 1.0, 6.0, 3.0, 10.0, 0.0, 4.0]


def ragged_actions() -> list[Action]:
    """Seven sampled actions cut to different lengths (a prefix of a sample is a sample), with generation-time
    log-probs that are off by a seeded noise, so the PPO ratio leaves 1 and the clip acts."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for i, a in enumerate(sampled_actions(make_policy(), "solver", len(SCORES), seed=11)):
        k = 2 + i % 5
        noise = (torch.randn(k, generator=gen) * 0.3).tolist()
        logprobs = tuple(lp + d for lp, d in zip(a.logprobs[:k], noise, strict=True))
        out.append(a.model_copy(update={"response_ids": a.response_ids[:k], "logprobs": logprobs}))
    assert len({len(a.response_ids) for a in out}) > 2
    return out


def one_step(actions: list[Action], micro: int) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One optimizer step over the whole batch; returns its stats and the gradient (SGD at lr 1: the step)."""
    policy = make_policy()
    params = policy.trainable_parameters("solver")
    before = [p.detach().clone() for p in params]
    cfg = train_cfg(mini_batch_size=len(actions), micro_batch_size=micro, grad_clip=1e9, recompute_old_logprobs=False)
    steps: list[dict[str, float]] = []
    optimizer = torch.optim.SGD(params, lr=1.0)
    stats = update_group(policy, optimizer, actions, SCORES, update_settings(cfg), seed=0, on_step=steps.append)
    assert stats["optimizer_steps"] == 1
    return steps[0], [b - p.detach() for b, p in zip(before, params, strict=True)]


def whole_batch(actions: list[Action]) -> tuple[torch.Tensor, dict[str, float], list[torch.Tensor]]:
    """The same update written out: advantages over the batch, one forward, `rl.clipped_pg_loss`, backward."""
    cfg = train_cfg().train
    policy = make_policy()
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]
    ref, mask = policy.sequence_logprobs(None, prompts, responses)
    old = torch.nn.utils.rnn.pad_sequence([torch.tensor(a.logprobs) for a in actions], batch_first=True)
    adv = rl.reinforce_pp_advantages(torch.tensor(SCORES) / 10, old, ref.float(), mask.float(), cfg.kl_coef)
    with torch.enable_grad():
        logp, m = policy.forward_logprobs("solver", prompts, responses)
        loss, stats = rl.clipped_pg_loss(logp.float(), old, adv, m.float(), cfg.clip_eps)
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


def test_the_trainer_resolves_what_the_update_reads_from_the_config() -> None:
    """A generation server's log-probs are always recomputed and their gap reported; the local backend's are
    used as they are when `train.recompute_old_logprobs` is off."""
    cfg = train_cfg(recompute_old_logprobs=False)
    cfg = cfg.model_copy(
        update={
            "generation": cfg.generation.model_copy(update={"temperature": 0.7}),
            "workflow": cfg.workflow.model_copy(update={"reward_scale": 0.5}),
        }
    )
    local = update_settings(cfg)
    assert local == UpdateSettings(cfg.train, 0.7, 0.5, recompute_old_logprobs=False, report_logprob_gap=False)
    served = update_settings(
        cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"backend": "server"})})
    )
    assert (served.recompute_old_logprobs, served.report_logprob_gap) == (True, True)
    assert update_settings(train_cfg(recompute_old_logprobs=True)).recompute_old_logprobs


@pytest.mark.parametrize("recompute", [True, False])
def test_the_update_acts_on_the_resolved_decisions(recompute: bool) -> None:
    """Generation-time log-probs off by noise: recomputed, the first step's ratio is 1 and nothing clips, and the
    reported gap is the noise; taken as they are, the ratio leaves 1 and the clip acts."""
    actions, policy = ragged_actions(), make_policy()
    exact, _ = policy.sequence_logprobs("solver", [a.prompt_ids for a in actions], [a.response_ids for a in actions])
    noise = [abs(lp - float(exact[i, j])) for i, a in enumerate(actions) for j, lp in enumerate(a.logprobs)]
    train = Config().train.model_copy(update={"mini_batch_size": len(actions)})
    settings = UpdateSettings(train, 1.0, 0.1, recompute_old_logprobs=recompute, report_logprob_gap=recompute)
    steps: list[dict[str, float]] = []
    optimizer = torch.optim.SGD(policy.trainable_parameters("solver"), lr=0.1)
    stats = update_group(policy, optimizer, actions, SCORES, settings, on_step=steps.append)
    if recompute:
        assert steps[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and steps[0]["clip_frac"] == 0.0
        assert stats["logprob_gap"] == pytest.approx(sum(noise) / len(noise), rel=1e-4)
        assert stats["logprob_gap"] > 0.1
    else:
        assert steps[0]["clip_frac"] > 0 and "logprob_gap" not in stats


def test_logprob_gap_counts_only_the_tokens_given() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, float("nan"), float("nan")]])
    # row 0: a server that left the stop token out (2 of 3 tokens); row 1: one token, padding never read
    assert rl.logprob_gap(logp, [[-1.5, -2.0], [-0.25]]) == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert rl.logprob_gap(logp, [[], []]) == 0.0


def test_shared_weights_train_two_steps_through_the_loop(tmp_path: Path) -> None:
    """`model.agent_weights: shared`: one adapter and one optimizer for all three agents, fed every agent's
    actions; the checkpoint reloads as one set of weights that moved."""
    from mappa.policy import Policy
    from mappa.trainer import train

    cfg = tiny_cfg(tmp_path, "model.agent_weights=shared", "logging.tensorboard=false")
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
