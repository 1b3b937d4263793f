"""Log-probs refer to the distribution sampled from: generation at temperature T reports log-softmax(logits / T),
the forward pass at T computes the same numbers, the update takes every log-prob (reference, rollout-time,
current) at `generation.temperature`, and the self-test samples at a temperature other than 1 so log-probs of
the raw logits cannot pass it. Tiny random Llama, in-process."""

from __future__ import annotations

import pytest
import torch
from helpers import AGENTS, RawLogprobs, convs, first_update_step, make_policy, perturb, solver_actions

from mappa.config import Config
from mappa.errors import MappaError
from mappa.policy.decoding import scaled_logits
from mappa.training.selftest import check_agents
from mappa.training.trainer import update_settings
from mappa.training.update import update_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T = 0.7


def test_generation_logprobs_are_the_forward_pass_at_the_sampling_temperature() -> None:
    policy = make_policy(eos_scale=5.0)
    perturb(policy, "solver", seed=1)
    gens = policy.generate("solver", convs(5), max_new_tokens=16, temperature=T, seed=2, top_logprobs=3)
    prompts, responses = [g.prompt_ids for g in gens], [g.response_ids for g in gens]
    with torch.no_grad():
        at_t, mask = policy.forward_logprobs("solver", prompts, responses, temperature=T)
        raw, _ = policy.forward_logprobs("solver", prompts, responses)
    for i, g in enumerate(gens):
        n = len(g.logprobs)
        # cached decode and the full forward round differently on this perturbed model's large logits (3e-4
        # at temperature 1 on these samples), and dividing by T < 1 scales that up
        torch.testing.assert_close(at_t[i, :n], torch.tensor(g.logprobs), atol=2e-3, rtol=0)
    # temperature-1 log-probs are another distribution's: far apart on this model, so the check above has teeth
    assert float((at_t - raw)[mask].abs().mean()) > 0.05
    seq, _ = policy.sequence_logprobs("solver", prompts, responses, temperature=T, micro_batch_size=2)
    torch.testing.assert_close(seq, at_t, atol=1e-5, rtol=0)


def test_top_logprobs_are_those_of_the_scaled_distribution() -> None:
    policy = make_policy()
    gen = policy.generate("solver", convs(1), max_new_tokens=4, temperature=T, seed=0, top_logprobs=5)[0]
    ids = list(gen.prompt_ids)
    with torch.no_grad(), policy.active("solver") as module:
        logits = module(input_ids=torch.tensor([ids])).logits[0, -1].float()
    expected = torch.log_softmax(logits / T, dim=-1).topk(5)
    got = gen.top_logprobs[0]
    assert [t for t, _ in got] == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in got]), expected.values, atol=1e-4, rtol=0)


def test_scaled_logits_leave_greedy_and_temperature_one_alone() -> None:
    logits = torch.randn(2, 7)
    assert scaled_logits(logits, 0.0) is logits and scaled_logits(logits, 1.0) is logits
    torch.testing.assert_close(scaled_logits(logits, 0.5), logits * 2)


@pytest.mark.parametrize("recompute", [False, True])
def test_the_first_update_step_has_ratio_one_at_the_sampling_temperature(recompute: bool) -> None:
    policy = make_policy()
    perturb(policy, "solver", scale=0.3, seed=3)
    actions = solver_actions(policy, 6, T)
    step = first_update_step(actions, T, recompute)
    assert step["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert step["clip_frac"] == 0.0 and abs(step["approx_kl"]) < 1e-6


def test_stored_logprobs_against_another_temperature_move_the_ratio() -> None:
    """What the update would see if the trainer's forward ignored the sampling temperature: the stored
    log-probs (at T) against a forward at 1 give a ratio away from 1 with no weight change."""
    policy = make_policy()
    perturb(policy, "solver", scale=0.3, seed=3)
    step = first_update_step(solver_actions(policy, 6, T), 1.0, recompute=False)
    assert abs(step["ratio_mean"] - 1.0) > 1e-2 or step["clip_frac"] > 0


def test_the_self_test_catches_logprobs_of_another_temperature() -> None:
    assert len(check_agents(make_policy(), AGENTS, temperature=T)) == 3
    with pytest.raises(MappaError, match="temperature 0.7"):
        check_agents(RawLogprobs(make_policy()), AGENTS, temperature=T)


def test_the_reward_scale_reaches_the_update() -> None:
    """The score's scale matters after whitening only through the KL term's weight: with the KL live, the raw
    0-10 score and score / 10 give different gradients; with kl_coef 0 the same."""
    policy = make_policy()
    perturb(policy, "solver", scale=0.3, seed=3)
    actions = solver_actions(policy, 6, 1.0)

    def grad_norm(scale: float, kl_coef: float) -> float:
        cfg = Config()
        cfg = cfg.model_copy(
            update={
                "workflow": cfg.workflow.model_copy(update={"reward_scale": scale}),
                "train": cfg.train.model_copy(update={"mini_batch_size": 6, "kl_coef": kl_coef}),
            }
        )
        p = make_policy()
        perturb(p, "solver", scale=0.3, seed=3)
        opt = torch.optim.SGD(p.trainable_parameters("solver"), lr=0.0)
        return update_group(p, opt, actions, [10.0, 0.0, 5.0, 3.0, 8.0, 1.0], update_settings(cfg, True)).grad_norm

    assert grad_norm(0.1, 0.0) == pytest.approx(grad_norm(1.0, 0.0), rel=1e-4)
    assert grad_norm(0.1, 0.5) != pytest.approx(grad_norm(1.0, 0.5), rel=1e-2)
