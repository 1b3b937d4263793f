"""Training smoke tests on a tiny random Llama: real generation, real gradients, real optimizer steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mappa.config import Config, load_config
from mappa.errors import MappaError
from mappa.train import lr_lambda, select_actions, task_batch, update_group, update_groups
from mappa.types import Action, CoachScore, Episode, ExecResult, Message, Task

AGENTS = ("solver", "coder", "verifier")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_policy(agent_weights: str = "lora"):
    from mappa.models import tiny_model_and_tokenizer
    from mappa.policy import Policy

    model, tok = tiny_model_and_tokenizer(seed=0)
    return Policy.from_model(model, tok, AGENTS, agent_weights=agent_weights, lora_r=4, lora_alpha=8, seed=0)


def sampled_actions(policy, agent: str, n: int, seed: int) -> list[Action]:
    convs = [[Message(role="user", content=f"What is {i} + {i}?")] for i in range(n)]
    gens = policy.generate(agent, convs, max_new_tokens=6, temperature=1.0, seed=seed)
    return [
        Action(
            agent=agent,
            turn=0,
            messages=tuple(c),
            text=g.text,
            prompt_ids=g.prompt_ids,
            response_ids=g.response_ids,
            logprobs=g.logprobs,
            truncated=g.truncated,
        )
        for c, g in zip(convs, gens, strict=True)
    ]


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def changed(before, params) -> bool:
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))


@pytest.mark.parametrize("agent_weights", ["lora", "full"])
def test_two_updates_touch_only_the_trained_agent(agent_weights: str) -> None:
    policy = make_policy(agent_weights)
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
        stats = update_group(policy, opt, actions, [0.0, 10.0, 3.0, 7.0, 5.0], cfg)
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
        assert stats["tokens"] == sum(len(a.response_ids) for a in actions)
    assert changed(own_before, own)
    for a in others:
        assert not changed(others_before[a], others[a]), a
    assert not changed(base_before, base)


def test_update_raises_the_probability_of_the_high_scored_action() -> None:
    policy = make_policy()
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
        update_group(policy, opt, fresh, [10.0, 0.0], cfg)
    after = seq_logp()
    assert after[0] - before[0] > 0 and after[1] - before[1] < 0


def _action(agent: str, score: float | None, **kw) -> Action:
    coach = CoachScore(score=score) if score is not None or kw.pop("coach", True) else None
    return Action(
        agent=agent, turn=0, messages=(), text="x", response_ids=(1, 2), logprobs=(-1.0, -1.0), coach=coach, **kw
    )


def test_select_actions_drops_what_must_not_train() -> None:
    task = Task(id="t", problem="1+1", answer="2", source="arithmetic")
    infra = ExecResult(ok=False, infra_error="pool died")
    ep = Episode(
        id="e",
        workflow="mathchat",
        task=task,
        actions=(
            _action("coder", 7.0),
            _action("coder", None),  # unscored
            _action("coder", 9.0, truncated=True),
            _action("coder", 8.0, exec_result=infra),
            _action("solver", 2.0),  # another agent's action
            Action(agent="coder", turn=1, messages=(), text="", coach=CoachScore(score=4.0)),  # empty
        ),
    )
    kept, scores, dropped = select_actions([ep], ["coder"], "skip", drop_truncated=True)
    assert scores == [7.0] and all(a.agent == "coder" for a in kept)
    assert dropped == {"unscored": 1, "truncated": 1, "infra_error": 1, "empty": 1}
    _, scores, _ = select_actions([ep], ["coder"], "neutral", drop_truncated=False)
    assert scores == [7.0, 5.0, 9.0]


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    values = [lr_lambda(s, 100, 0.03, 0.1) for s in range(100)]
    assert values[0] < values[1] < values[2] < values[3] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(0.1 - 1e-9 <= v <= 1.0 + 1e-9 for v in values)
    assert all(a >= b for a, b in zip(values[3:], values[4:], strict=False))


def test_task_batches_cover_each_pass_once_and_are_reproducible() -> None:
    tasks = [Task(id=str(i), problem=str(i), answer=str(i), source="x") for i in range(10)]
    first_pass = [t.id for c in range(0, 10, 5) for t in task_batch(tasks, c, 5, seed=1)]
    assert sorted(first_pass) == sorted(t.id for t in tasks)
    assert [t.id for t in task_batch(tasks, 5, 5, seed=1)] == first_pass[5:]
    assert [t.id for t in task_batch(tasks, 10, 5, seed=1)] != first_pass[:5]  # next pass reshuffled


def test_update_groups() -> None:
    assert update_groups(AGENTS, "lora") == {a: [a] for a in AGENTS}
    assert update_groups(AGENTS, "shared") == {"shared": list(AGENTS)}


# ---------------------------------------------------------------------------------------------------- end to end
def tiny_cfg(tmp_path: Path, *overrides: str) -> Config:
    return load_config(
        None,
        [
            "model.name=tiny-random",
            "model.lora_r=4",
            "model.lora_alpha=8",
            "generation.max_new_tokens=12",
            "generation.max_context_tokens=1024",
            "sandbox.pool=false",
            "sandbox.timeout_s=5",
            "coach.backend=rubric",
            "coach.cache=false",
            "tasks.arithmetic_train_size=16",
            "tasks.arithmetic_eval_size=2",
            "train.steps=2",
            "train.prompts_per_step=2",
            "train.samples_per_prompt=1",
            "train.drop_truncated=false",
            "train.lr=1e-2",
            "logging.tensorboard=true",
            f"run_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def test_train_two_steps_end_to_end(tmp_path: Path) -> None:
    from mappa.policy import Policy
    from mappa.train import train

    cfg = tiny_cfg(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    train(cfg, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/rollout_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    losses = [v for r in steps for k, v in r.items() if k.endswith("/loss")]
    assert losses and all(math.isfinite(x) for x in losses)
    assert sum("eval/accuracy" in r for r in rows) == 2  # start and end
    episodes = (run_dir / "episodes.jsonl").read_text().splitlines()
    assert len(episodes) == 2 * 2 and all('"step":' in e for e in episodes)
    assert any((run_dir / "tensorboard").iterdir())
    ckpt = run_dir / "checkpoints" / "step-000002"
    assert (ckpt / "state.json").is_file() and (run_dir / "checkpoints" / "latest").read_text() == "step-000002"
    trained = Policy.from_checkpoint(ckpt / "policy", device="cpu")
    fresh = Policy.from_config(cfg.model, trained.agents, seed=cfg.seed)
    trained_agents = {k.split("/")[1] for r in steps for k in r if k.endswith("/loss")}
    for agent in trained.agents:
        moved = any(
            not torch.equal(a, b)
            for a, b in zip(trained.trainable_parameters(agent), fresh.trainable_parameters(agent), strict=True)
        )
        assert moved == (agent in trained_agents), agent


def test_self_test_catches_an_agent_without_its_own_weights(tmp_path: Path) -> None:
    from mappa.selftest import check_agents

    policy = make_policy()
    assert len(check_agents(policy, AGENTS)) == 3
    # Simulate the classic bug: generation and logprobs run on the base model for every agent.
    policy.trainable_parameters = lambda agent: [torch.nn.Parameter(torch.zeros(3))]  # type: ignore[method-assign]
    with pytest.raises(MappaError, match="did not change its outputs"):
        check_agents(policy, AGENTS)


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
