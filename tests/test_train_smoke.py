"""Training smoke tests on a tiny random Llama: real generation, real gradients, real optimizer steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import sampled_actions, tiny_cfg, train_cfg, update_policy

from mappa.config import Config
from mappa.training.trainer import update_settings
from mappa.training.update import update_group, update_groups

AGENTS = ("solver", "coder", "verifier")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def changed(before, params) -> bool:
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))


@pytest.mark.parametrize("agent_weights", ["lora", "full"])
def test_two_updates_touch_only_the_trained_agent(agent_weights: str) -> None:
    policy = update_policy(agent_weights)
    cfg = Config().model_copy(update={"train": Config().train.model_copy(update={"micro_batch_size": 2})})
    base = [p for n, p in policy.model.named_parameters() if ".lora_" not in n]
    base_before = snapshot(base)
    own = policy.trainable_parameters("coder")
    others = {a: policy.trainable_parameters(a) for a in ("solver", "verifier")}
    own_before = snapshot(own)
    others_before = {a: snapshot(p) for a, p in others.items()}
    opt = torch.optim.AdamW(own, lr=1e-2, betas=(0.9, 0.95))
    for step in range(2):
        actions = sampled_actions(policy, "coder", 5, seed=step)
        stats = update_group(policy, opt, actions, [0.0, 10.0, 3.0, 7.0, 5.0], update_settings(cfg, True))
        assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
        assert stats.tokens == sum(len(a.response_ids) for a in actions)
    assert changed(own_before, own)
    for a in others:
        assert not changed(others_before[a], others[a]), a
    assert not changed(base_before, base)


def test_update_raises_the_probability_of_the_high_scored_action() -> None:
    policy = update_policy()
    cfg = Config()
    actions = sampled_actions(policy, "solver", 2, seed=3)
    opt = torch.optim.AdamW(policy.trainable_parameters("solver"), lr=5e-3)
    prompts, responses = [a.prompt_ids for a in actions], [a.response_ids for a in actions]

    def seq_logp() -> torch.Tensor:
        lp, m = policy.sequence_logprobs("solver", prompts, responses)
        return (lp * m).sum(1)

    before = seq_logp()
    for _ in range(3):
        # old_logp must be the current policy's for a fresh on-policy step
        lp, m = policy.sequence_logprobs("solver", prompts, responses)
        fresh = [
            a.model_copy(update={"logprobs": tuple(lp[i, : len(a.response_ids)].tolist())})
            for i, a in enumerate(actions)
        ]
        update_group(policy, opt, fresh, [10.0, 0.0], update_settings(cfg, True))
    after = seq_logp()
    assert after[0] - before[0] > 0 and after[1] - before[1] < 0


@pytest.mark.parametrize("recompute", [True, False])
def test_second_mini_batch_leaves_ratio_one_and_a_large_lr_engages_the_clip(recompute: bool) -> None:
    """Two mini-batches of 4 actions: two optimizer steps on one rollout batch, both against the rollout-time
    log-probs. The first step sees the rollout weights (ratio 1, nothing clipped); the second sees weights one
    step later, so its ratio has moved, and after a large step the clip engages."""
    cfg = train_cfg(mini_batch_size=4, micro_batch_size=2, recompute_old_logprobs=recompute)
    actions = sampled_actions(update_policy(), "solver", 8, seed=4)
    steps: dict[float, list[dict[str, float]]] = {}
    for lr in (1e-3, 0.3):
        policy = update_policy()  # the same initial weights for each learning rate
        opt = torch.optim.AdamW(policy.trainable_parameters("solver"), lr=lr)
        steps[lr] = []
        scores = [10.0, 0.0, 7.0, 2.0] * 2
        stats = update_group(
            policy, opt, actions, scores, update_settings(cfg, True), seed=1, on_step=steps[lr].append
        )
        assert stats.optimizer_steps == 2 and len(steps[lr]) == 2
    small, large = steps[1e-3], steps[0.3]
    for first in (small[0], large[0]):  # fp32: generation-time log-probs agree with the forward pass to ~1e-7
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["clip_frac"] == 0.0
    assert abs(small[1]["ratio_mean"] - 1.0) > 1e-3 and small[1]["approx_kl"] > 0
    assert large[1]["clip_frac"] > 0.05 > small[1]["clip_frac"]


def test_update_shuffles_into_mini_batches_and_sets_each_steps_lr() -> None:
    policy = update_policy()
    actions = sampled_actions(policy, "coder", 5, seed=2)
    opt = torch.optim.AdamW(policy.trainable_parameters("coder"), lr=1.0)
    steps: list[dict[str, float]] = []
    settings = update_settings(train_cfg(mini_batch_size=2, epochs=2), True)
    stats = update_group(
        policy, opt, actions, [1.0, 9.0, 5.0, 3.0, 8.0], settings, lr=lambda f: f * 1e-3, on_step=steps.append
    )
    assert stats.optimizer_steps == 6  # ceil(5 / 2) per epoch, two epochs
    assert [s["lr"] for s in steps] == pytest.approx([(j + 1) / 6 * 1e-3 for j in range(6)])
    per_epoch = sum(s["tokens"] for s in steps[:3])
    assert per_epoch == sum(len(a.response_ids) for a in actions) == stats.tokens


def test_update_groups() -> None:
    assert update_groups(AGENTS, "lora") == {a: [a] for a in AGENTS}
    assert update_groups(AGENTS, "shared") == {"shared": list(AGENTS)}


# ---------------------------------------------------------------------------------------------------- end to end


def test_train_two_steps_end_to_end(tmp_path: Path) -> None:
    from mappa.policy.policy import Policy
    from mappa.training.trainer import train

    cfg = tiny_cfg(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = []
    result = train(cfg, run_dir, emit=events.append)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/rollout_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    losses = [v for r in steps for k, v in r.items() if k.endswith("/loss")]
    assert losses and all(math.isfinite(x) for x in losses)
    for r in steps:  # the update schedule is visible per agent that trained
        for group in {k.split("/")[1] for k in r if k.endswith("/loss")}:
            assert r[f"agent/{group}/optimizer_steps"] >= 1
            assert 0 <= r[f"agent/{group}/clip_frac"] <= 1 and r[f"agent/{group}/ratio_mean"] > 0
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2  # start and end
    assert all(
        r["eval/arithmetic/accuracy"] == r["eval/accuracy"] and r["eval/arithmetic/episodes"] == 2 for r in evals
    )
    assert result.gain is not None and result.gain.paired and result.gain.n_after == 2
    assert rows[-1]["eval/gain"] == pytest.approx(result.gain.gain)
    assert [e.kind for e in events].count("step") == 2 and any("self-test ok" in e.text for e in events)
    # a group whose trained actions all scored alike is named in a note after its step, and flagged in the metrics
    flat = {(r["step"], k.split("/")[1]) for r in steps for k, v in r.items() if k.endswith("/reward_zero_std") and v}
    notes, step = set(), 0
    for e in events:
        step = e.step if e.kind == "step" else step
        if e.kind == "note" and "no spread" in e.text:
            assert e.step == step and e.text.startswith(f"step {step}: "), e.text
            notes.add((step, e.text.split()[2].removesuffix(":")))
    assert flat and notes == flat
    assert all(e.result is not None and e.result.step == e.step for e in events if e.kind == "step")
    episodes = (run_dir / "episodes.jsonl").read_text().splitlines()
    assert len(episodes) == 2 * 2 and all('"step":' in e for e in episodes)
    assert any((run_dir / "tensorboard").iterdir())
    ckpt = run_dir / "checkpoints" / "step-000002"
    assert (ckpt / "state.json").is_file() and (run_dir / "checkpoints" / "latest").read_text() == "step-000002"
    trained = Policy.from_checkpoint(ckpt / "policy", device="cpu")
    fresh = Policy.from_config(cfg.model, trained.agents, seed=cfg.seed)
    # an agent whose actions all scored alike has zero advantages, hence no gradient: it must not move either
    trained_agents = {k.split("/")[1] for r in steps for k, v in r.items() if k.endswith("/advantage_abs") and v > 0}
    assert trained_agents
    for agent in trained.agents:
        moved = any(
            not torch.equal(a, b)
            for a, b in zip(trained.trainable_parameters(agent), fresh.trainable_parameters(agent), strict=True)
        )
        assert moved == (agent in trained_agents), agent


def test_gpu_check_script_runs_tiny_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_train_check.py"
    spec = importlib.util.spec_from_file_location("gpu_train_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("OUT", str(tmp_path))
    summary = module.main(["--tiny", "--steps", "2", "--batch", "2", "--tokens", "6", "--micro-batch", "2"])
    assert len(summary["steps"]) == 2 and summary["rollout_tokens_per_s"] > 0 and summary["update_tokens_per_s"] > 0
    assert json.loads((tmp_path / "gpu_train_check.json").read_text())["shape"] == "tiny"
