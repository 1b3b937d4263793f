"""A heterogeneous team: agents on two base models (`model.agent_models`), each sampling from and training its own
base's weights on its own base's tokens, checkpointed per base and resumed exactly.

The two bases are `tiny-random` (a Llama, hidden 64, a 512-token vocabulary) and `tiny-random-2` (a Qwen2, hidden 48,
a 384-token vocabulary), so a token id or a tensor that crossed from one base to the other would show."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY

from mappa.config import load_config
from mappa.errors import MappaError
from mappa.types import Episode, Message, read_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AGENTS = ("problem_solver", "code_executor", "verifier")
TEAM = [*TINY, "model.agent_models.verifier=tiny-random-2"]
MSGS = [Message(role="user", content="What is 17 * 23? Run Python if it helps.")]


def _cfg(*overrides: str):  # noqa: ANN202
    return load_config(None, [*TEAM, *overrides])


def _chat_ids(tokenizer, messages) -> list[int]:  # noqa: ANN001
    """`messages` templated and tokenized by `tokenizer` alone, as the agent's prompt should be."""
    chat = [{"role": m.role, "content": m.content} for m in messages]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------------------ config and build
def test_agents_are_grouped_by_base_and_what_a_team_cannot_hold_is_one_line() -> None:
    from mappa.policy.team import team_bases

    cfg = _cfg()
    assert team_bases(cfg.model, AGENTS) == {"tiny-random": ["problem_solver", "code_executor"],
                                             "tiny-random-2": ["verifier"]}  # fmt: skip
    # the base `model.name` names comes first (its files are base-0/) even when its first agent comes later
    first = _cfg("model.agent_models.problem_solver=tiny-random-2")
    assert list(team_bases(first.model, AGENTS)) == ["tiny-random", "tiny-random-2"]
    # every agent moved to one other model: one base, which a shared adapter may use
    moved = _cfg(*(f"model.agent_models.{a}=tiny-random-2" for a in AGENTS), "model.agent_weights=shared")
    assert team_bases(moved.model, AGENTS) == {"tiny-random-2": list(AGENTS)}
    with pytest.raises(MappaError, match=r"^model\.agent_models: unknown agent\(s\) \['critic'\] \(agents: "):
        team_bases(_cfg("model.agent_models.critic=tiny-random-2").model, AGENTS)
    with pytest.raises(MappaError, match=r"^model\.agent_weights: shared .* one base model.*2 "):
        team_bases(_cfg("model.agent_weights=shared").model, AGENTS)
    with pytest.raises(MappaError, match=r"model\.agent_models: verifier: an empty model name"):
        _cfg("model.agent_models.verifier=")


def test_a_generation_server_serves_one_base_and_says_so() -> None:
    from mappa.rollout import build_kit

    cfg = _cfg("generation.backend=server")
    with pytest.raises(MappaError, match=r"^generation\.backend: server .* one base model"):
        build_kit(cfg, AGENTS, coach=False, sandbox=False, generator=True)


def test_each_agent_samples_from_its_own_base_through_the_one_generator() -> None:
    import asyncio

    from mappa.policy.models import load_base_model
    from mappa.protocols import SamplingSettings
    from mappa.rollout import build_kit

    _, tok1 = load_base_model("tiny-random")
    _, tok2 = load_base_model("tiny-random-2")
    assert len(tok2) < len(tok1)
    with build_kit(_cfg(), AGENTS, coach=False, sandbox=False) as kit:
        policies = kit.policies
        assert policies["problem_solver"] is policies["code_executor"] is not policies["verifier"]
        assert policies["verifier"].model.config.vocab_size == len(tok2)
        with pytest.raises(MappaError, match=r"2 base models"):
            kit.policy  # noqa: B018 - the one-base accessor refuses a team
        ids = {a: kit.generator.chat_ids(a, MSGS) for a in AGENTS}
        assert ids["verifier"] == _chat_ids(tok2, MSGS) and ids["problem_solver"] == _chat_ids(tok1, MSGS)
        assert ids["problem_solver"] == ids["code_executor"] != ids["verifier"]
        sampling = SamplingSettings(1.0, 1.0, 8, 1024)

        async def both() -> list:
            calls = [kit.generator.generate(a, MSGS, ids[a], sampling, seed=3) for a in AGENTS]
            return await asyncio.gather(*calls)

        gens = dict(zip(AGENTS, asyncio.run(both()), strict=True))
        for agent, gen in gens.items():
            policy = policies[agent]
            assert max(gen.response_ids) < policy.model.config.vocab_size
            own, mask = policy.forward_logprobs(agent, [gen.prompt_ids], [gen.response_ids])
            assert torch.allclose(own[mask], torch.tensor(gen.logprobs), atol=1e-4), agent


# ------------------------------------------------------------------------------------------------ a run end to end
def spread(ctx) -> float:  # noqa: ANN001
    """A coach whose scores differ between actions (the rubric's are often all alike on a random model's text, which
    leaves nothing to learn): every agent trains."""
    return float(len(ctx.output) % 11)


@pytest.fixture(scope="module")
def team_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of MathChat with the verifier on the second base, a checkpoint after each."""
    from mappa.api import train

    run_dir = tmp_path_factory.mktemp("team") / "run"
    events = []
    cfg = _cfg("train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=0", f"run_dir={run_dir}")
    train(cfg, coach=spread, run_dir=run_dir, emit=events.append)
    checked = " ".join(e.text for e in events if "self-test ok" in e.text)  # every agent, each on its own base
    assert all(f"self-test ok: agent {a}: own trainable weights" in checked for a in AGENTS), checked
    return run_dir


def _weights(policy_dir: Path) -> dict[str, list[torch.Tensor]]:
    from mappa.policy.team import Policies

    policies = Policies.from_checkpoint(policy_dir, device="cpu")
    return {a: [p.detach().clone() for p in policies[a].trainable_parameters(a)] for a in policies.agents}


def test_a_two_base_team_trains_on_its_own_tokens_and_evaluates(team_run: Path) -> None:
    from mappa.policy.models import load_base_model
    from mappa.training.tracking import read_metrics

    tokenizers = {
        "tiny-random": load_base_model("tiny-random")[1],
        "tiny-random-2": load_base_model("tiny-random-2")[1],
    }
    base = {"problem_solver": "tiny-random", "code_executor": "tiny-random", "verifier": "tiny-random-2"}
    episodes = read_jsonl(team_run / "episodes.jsonl", Episode)
    seen = set()
    for action in (a for e in episodes for a in e.actions):
        tok = tokenizers[base[action.agent]]
        assert list(action.prompt_ids) == _chat_ids(tok, action.messages), action.agent
        assert max(action.response_ids) < len(tok)
        seen.add(action.agent)
    assert seen == set(AGENTS)
    rows = read_metrics(team_run)
    steps = [r for r in rows if "time/rollout_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r[f"agent/{a}/advantage_abs"] > 0 for r in steps for a in ("problem_solver", "verifier"))
    assert len([r for r in rows if "eval/accuracy" in r]) == 2  # before and after training, through the generator
    # one subdirectory per base, each a whole policy checkpoint, and a manifest that lists the agents per base
    policy = team_run / "checkpoints" / "step-000002" / "policy"
    manifest = json.loads((policy / "mappa_policy.json").read_text())
    assert manifest["format_version"] == 2 and manifest["agents"] == list(AGENTS)
    assert manifest["bases"] == [{"model": "tiny-random", "agents": ["problem_solver", "code_executor"]},
                                 {"model": "tiny-random-2", "agents": ["verifier"]}]  # fmt: skip
    assert json.loads((policy / "base-1" / "mappa_policy.json").read_text())["agents"] == ["verifier"]
    # trained: the checkpoint's verifier is no longer its initial adapter, and `mappa eval` loads the team back
    initial = _weights(team_run / "checkpoints" / "step-000001" / "policy")
    trained = _weights(policy)
    assert any(not torch.equal(p, q) for p, q in zip(initial["verifier"], trained["verifier"], strict=True))
    from mappa.rollout import build_kit
    from mappa.training.evaluate import eval_tasks, evaluate
    from mappa.workflows import build_workflow

    cfg = load_config(None, [*TINY, "tasks.arithmetic_eval_size=1"])  # the checkpoint names its bases itself
    workflow = build_workflow(cfg)
    with build_kit(cfg, AGENTS, weights=policy, coach=False) as kit:
        assert kit.policies["verifier"].base_name == "tiny-random-2"
        metrics, done = evaluate(cfg, workflow, kit.generator, kit.sandbox, eval_tasks(cfg))
    assert len(done) == 1 and "eval/accuracy" in metrics


def test_a_two_base_team_resumes_exactly(team_run: Path, tmp_path: Path) -> None:
    from mappa.api import train

    resumed = tmp_path / "resumed"
    shutil.copytree(team_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000002")  # as if killed before step 2's checkpoint
    (resumed / "checkpoints" / "latest").write_text("step-000001")
    cfg = _cfg("train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=0", f"run_dir={resumed}")
    train(cfg, coach=spread, run_dir=resumed, resume=True, quiet=True)
    a = _weights(team_run / "checkpoints" / "step-000002" / "policy")
    b = _weights(resumed / "checkpoints" / "step-000002" / "policy")
    for agent in AGENTS:
        for p, q in zip(a[agent], b[agent], strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    # a team checkpoint does not load into a one-base team, nor the other way round
    with pytest.raises(MappaError, match=r"mappa_policy\.json: .*2 base models.*this team has 1"):
        train(load_config(None, [*TINY, "train.steps=2"]), coach=spread, run_dir=resumed, resume=True, quiet=True)


def test_export_probe_and_serve_refuse_a_team_checkpoint_in_one_line(team_run: Path, tmp_path: Path) -> None:
    from mappa.analysis.probe import probe_run
    from mappa.export import export_run
    from mappa.policy.policy import Policy

    one_line = r"^[^\n]*2 base models \(tiny-random: problem_solver, code_executor; tiny-random-2: verifier\)[^\n]*$"
    with pytest.raises(MappaError, match=one_line):
        export_run(team_run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(MappaError, match=one_line):
        probe_run(team_run)
    with pytest.raises(MappaError, match=one_line):  # what `mappa serve --adapters` loads
        Policy.from_checkpoint(team_run / "checkpoints" / "step-000002" / "policy")
    # each base's subdirectory is an ordinary policy checkpoint
    assert Policy.from_checkpoint(team_run / "checkpoints" / "step-000002" / "policy" / "base-1").agents == (
        "verifier",
    )


# ------------------------------------------------------------------------------------------------ the file format
def test_one_base_keeps_its_layout_and_the_format_version_is_checked(tmp_path: Path) -> None:
    from mappa.policy.team import Policies

    cfg = load_config(None, TINY)
    policies = Policies.from_config(cfg.model, AGENTS, seed=cfg.seed)
    policies.save(tmp_path / "one")
    manifest = json.loads((tmp_path / "one" / "mappa_policy.json").read_text())
    assert (
        manifest["agents"] == list(AGENTS) and "bases" not in manifest and not (tmp_path / "one" / "base-0").exists()
    )
    # a checkpoint of format 1 (before teams) loads as it did
    (tmp_path / "one" / "mappa_policy.json").write_text(json.dumps({**manifest, "format_version": 1}))
    Policies.from_checkpoint(tmp_path / "one", device="cpu").load_weights(tmp_path / "one")
    (tmp_path / "one" / "mappa_policy.json").write_text(json.dumps({**manifest, "format_version": 9}))
    with pytest.raises(MappaError, match=r"mappa_policy\.json: format version 9 .*newer mappa"):
        policies.load_weights(tmp_path / "one")
    team = Policies.from_config(_cfg().model, AGENTS, seed=cfg.seed)
    (tmp_path / "one" / "mappa_policy.json").write_text(json.dumps(manifest))
    with pytest.raises(MappaError, match=r"mappa_policy\.json: .*one base model.*this team has 2"):
        team.load_weights(tmp_path / "one")


# ------------------------------------------------------------------------------------------------ on a Ray cluster
@pytest.mark.slow  # a Ray cluster, 5 actors and two runs: about 2 min on 2 cores
def test_a_two_base_team_on_ray_trains_on_each_base_and_resumes_exactly(tmp_path: Path) -> None:
    """`mappa train --ray`: a trainer actor per agent builds its agent's base alone, the rollout workers hold both;
    the checkpoint has a local team run's layout (each base's files written by its lead trainer), and a run resumed
    from its step-1 checkpoint ends where the uninterrupted one does."""
    ray = pytest.importorskip("ray")
    from mappa.distributed import placement
    from mappa.policy.team import Policies
    from mappa.training.trainer import train

    (tmp_path / "rewards.py").write_text("def score(ctx):\n    return float(len(ctx.output) % 11)\n")  # as `spread`
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    sets = [*TEAM, "train.steps=2", "train.keep_checkpoints=0", "ray.rollout_workers=2", "ray.worker_cpus=0.25",
            "ray.trainer_cpus=0.25", f"coach.backend={tmp_path / 'rewards.py'}:score"]  # fmt: skip
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        train(load_config(None, [*sets, f"run_dir={straight}"]), straight, place=placement("local"))
        shutil.copytree(straight, resumed)
        shutil.rmtree(resumed / "checkpoints" / "step-000002")
        (resumed / "checkpoints" / "latest").write_text("step-000001")
        train(load_config(None, [*sets, f"run_dir={resumed}"]), resumed, resume=True, place=placement("local"))
    finally:
        ray.shutdown()
    policy = straight / "checkpoints" / "step-000002" / "policy"
    assert json.loads((policy / "mappa_policy.json").read_text())["bases"][1] == {
        "model": "tiny-random-2", "agents": ["verifier"]
    }  # fmt: skip
    a, b = _weights(policy), _weights(resumed / "checkpoints" / "step-000002" / "policy")
    start = Policies.from_config(_cfg().model, AGENTS, seed=_cfg().seed)
    for agent in AGENTS:
        for p, q in zip(a[agent], b[agent], strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    moved = [not torch.equal(p, q) for p, q in zip(a["verifier"], start.trainable_parameters("verifier"), strict=True)]
    assert any(moved)  # the verifier's trainer trained it on its own base
