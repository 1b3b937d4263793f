"""The RL math, three ways: hand-computed tensors, invariances, degenerate inputs."""

from __future__ import annotations

import math

import pytest
import torch

from mappa.training.rl import (
    clipped_pg_loss,
    lr_factor,
    masked_whiten,
    minibatches,
    reinforce_pp_advantages,
    returns_to_go,
    token_rewards,
)

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)


def test_token_rewards_hand_computed() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0, 9.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0, 9.0], [-2.0, -1.0, -1.0, -0.5]])
    scores = torch.tensor([0.7, 0.2])
    r = token_rewards(scores, logp, ref, MASK, kl_coef=0.1)
    expected = torch.tensor([[-0.05, 0.0, 0.1 + 0.7, 0.0], [-0.1, 0.0, 0.0, 0.05 + 0.2]])
    torch.testing.assert_close(r, expected)


def test_returns_to_go_hand_computed() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, 100.0], [1.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(
        returns_to_go(rewards, MASK), torch.tensor([[6.0, 5.0, 3.0, 0.0], [2.0, 1.0, 1.0, 1.0]])
    )
    torch.testing.assert_close(
        returns_to_go(rewards, MASK, gamma=0.5), torch.tensor([[2.75, 3.5, 3.0, 0.0], [1.125, 0.25, 0.5, 1.0]])
    )


def test_returns_loop_equals_vectorised_at_gamma_one() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 9, generator=g)
    mask = (torch.rand(5, 9, generator=g) > 0.2).float()
    fast = returns_to_go(rewards, mask, gamma=1.0)
    slow = returns_to_go(rewards, mask, gamma=1.0 - 1e-12)
    torch.testing.assert_close(fast, slow)


def test_masked_whiten_hand_computed() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, 5.0, 6.0, 7.0]])
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    expected_valid = (valid - 4.0) / math.sqrt(4.0 + 1e-8)  # biased var of 1..7 = 4
    out = masked_whiten(x, MASK)
    torch.testing.assert_close(out[MASK.bool()], expected_valid)
    assert out[0, 3] == 0.0


def test_reinforce_pp_advantages_composes_the_three() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = logp - 0.3
    scores = torch.tensor([1.0, 0.0])
    adv = reinforce_pp_advantages(scores, logp, ref, MASK, kl_coef=0.01)
    # rewards: -0.003 per token, +1 on row 0's 3rd token; returns then whitened
    ret = torch.tensor([[1.0 - 0.009, 1.0 - 0.006, 1.0 - 0.003, 0.0], [-0.012, -0.009, -0.006, -0.003]])
    torch.testing.assert_close(adv, masked_whiten(ret, MASK))
    # the better-scored action gets positive advantages on every token
    assert (adv[0, :3] > 0).all() and (adv[1] < 0).all()


def test_clipped_pg_loss_hand_computed() -> None:
    old = torch.zeros(2, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 7.0], [1.1, 0.9, 1.0, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0], [-1.0, 1.0, 0.0, 3.0]])
    loss, stats = clipped_pg_loss(logp, old, adv, MASK, clip_eps=0.2)
    # per token -min(r*A, clip(r)*A): row0: -1.2, +0.8, -2 ; row1: 1.1, -0.9, 0, -3
    expected = (-1.2 + 0.8 - 2.0 + 1.1 - 0.9 + 0.0 - 3.0) / 7
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 7)  # tokens (0,0) and (0,1)
    assert stats["tokens"] == 7


def test_the_two_loss_aggregations_weigh_actions_differently() -> None:
    """2x4, ratio 1 (per-token loss -A): a one-token action with A=4 and a four-token action with A=-1.
    token: one mean over the 5 tokens, (-4 + 1 + 1 + 1 + 1) / 5 = 0; action: each action's mean, then the mean
    over the two, (-4 + 1) / 2 = -1.5 (the short action weighs as much as the long one)."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([[4.0, 9.0, 9.0, 9.0], [-1.0, -1.0, -1.0, -1.0]])
    logp = torch.zeros(2, 4, requires_grad=True)
    token, _ = clipped_pg_loss(logp, torch.zeros(2, 4), adv, mask, aggregation="token")
    action, stats = clipped_pg_loss(logp, torch.zeros(2, 4), adv, mask, aggregation="action")
    assert token.item() == pytest.approx(0.0, abs=1e-7)
    assert action.item() == pytest.approx(-1.5)
    assert stats["tokens"] == 5  # the diagnostics stay token means
    action.backward()
    # d loss / d logp = -A / (tokens of the action * actions): -4/2 on the short one, 1/8 on each long token
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, 0, 0, 0], [0.125, 0.125, 0.125, 0.125]]))
    with pytest.raises(ValueError, match="aggregation"):
        clipped_pg_loss(logp, torch.zeros(2, 4), adv, mask, aggregation="sequence")


def test_clipped_pg_loss_gradient_flows_only_where_unclipped() -> None:
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = clipped_pg_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0] == 0.0  # ratio 1.5 > 1.2 with A > 0: clipped, no gradient
    assert logp.grad[0, 1] == pytest.approx(-1.1 / 2)


def test_padding_values_are_ignored() -> None:
    g = torch.Generator().manual_seed(1)
    logp, ref, old = (torch.randn(2, 4, generator=g) for _ in range(3))
    scores = torch.tensor([0.3, 0.9])
    adv = reinforce_pp_advantages(scores, logp, ref, MASK, kl_coef=0.05)
    loss, _ = clipped_pg_loss(logp, old, adv, MASK)
    garbage = [t.clone() for t in (logp, ref, old)]
    for t in garbage:
        t[0, 3] = float("nan") if t is garbage[0] else 1e30
    adv2 = reinforce_pp_advantages(scores, garbage[0], garbage[1], MASK, kl_coef=0.05)
    loss2, _ = clipped_pg_loss(garbage[0], garbage[2], adv2, MASK)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(loss, loss2)


def test_minibatches_small_batch_is_one_step() -> None:
    (only,) = minibatches(3, 16, seed=0)
    assert sorted(only) == [0, 1, 2]
    assert minibatches(0, 4) == []


def test_lr_factor_warms_up_then_decays_to_the_floor() -> None:
    # 10 rollout steps x 4 optimizer steps: each optimizer step ends at progress (s + (j + 1) / 4) / 10
    values = [lr_factor((s + (j + 1) / 4) / 10, 0.05, 0.1) for s in range(10) for j in range(4)]
    assert values[0] == pytest.approx(0.025 / 0.05) and values[1] == pytest.approx(1.0)  # warm-up: first 5%
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[1:], values[2:], strict=False))  # cosine never rises
    assert lr_factor(0.05 + 0.95 / 2, 0.05, 0.1) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_factor(0.0, 0.0, 0.1) == 1.0 and lr_factor(2.0, 0.0, 0.1) == pytest.approx(0.1)
