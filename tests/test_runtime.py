"""The per-episode runtime on a real (tiny, random) policy: episodes of several agents decoded together by the
continuously batched local generator, reproducible whatever runs beside them, and recorded with the log-probs
the update starts from."""

from __future__ import annotations

import pytest
import torch

from mappa.config import GenerationConfig, SandboxConfig, WorkflowConfig, load_config
from mappa.generation import LocalGenerator
from mappa.policy.policy import Policy
from mappa.protocols import Runtime
from mappa.sandbox import Sandbox
from mappa.types import Message, Task
from mappa.workflows import MathChat, play

GEN = GenerationConfig(temperature=1.0, max_new_tokens=12, max_context_tokens=512, batch_size=8)
TINY = ["model.name=tiny-random", "model.lora_r=4", "model.lora_alpha=8"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, TINY)
    workflow = MathChat(WorkflowConfig(coder_max_turns=2), SandboxConfig())
    policy = Policy.from_config(cfg.model, workflow.agents, seed=0)
    with torch.no_grad():  # each agent its own weights (an untrained adapter is the base model)
        gen = torch.Generator().manual_seed(1)
        for agent in workflow.agents:
            for p in policy.trainable_parameters(agent):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    generator = LocalGenerator(policy, max_batch=8)
    with Sandbox(SandboxConfig(pool=False, timeout_s=10)) as sandbox:
        yield workflow, policy, generator, sandbox
    generator.close()


def tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", problem=f"What is {i} + 2?", answer=str(i + 2), source="arithmetic") for i in range(n)]


def test_episodes_of_many_agents_decode_together_and_record_exact_log_probs(setup, one_torch_thread) -> None:
    workflow, policy, generator, sandbox = setup
    generator.stats()
    episodes = play(workflow, tasks(6), Runtime(generator, sandbox), sampling=GEN.sampling(), seed=3)
    stats = generator.stats()
    assert stats["generation/decode_rows"] / stats["generation/decode_steps"] > 1.5  # rows shared decode steps
    actions = [a for e in episodes for a in e.actions]
    assert {a.agent for a in actions} == set(workflow.agents)
    for a in actions:  # what the update's ratio starts from: the policy's own forward pass at the temperature
        logp, mask = policy.forward_logprobs(a.agent, [a.prompt_ids], [a.response_ids], temperature=1.0)
        torch.testing.assert_close(logp[0][mask[0]], torch.tensor(a.logprobs), atol=2e-4, rtol=0)


def test_an_episode_draws_the_same_tokens_whatever_runs_beside_it(setup, one_torch_thread) -> None:
    workflow, _, generator, sandbox = setup
    rt = Runtime(generator, sandbox)
    alone = play(workflow, tasks(1), rt, sampling=GEN.sampling(), seed=5)[0]
    crowded = play(workflow, tasks(5), rt, sampling=GEN.sampling(), seed=5)[0]
    again = play(workflow, tasks(5), rt, sampling=GEN.sampling(), seed=5)
    assert [a.response_ids for a in crowded.actions] == [a.response_ids for a in alone.actions]
    assert [a.response_ids for a in again[0].actions] == [a.response_ids for a in alone.actions]
    other = play(workflow, tasks(1), rt, sampling=GEN.sampling(), seed=6)[0]
    assert [a.response_ids for a in other.actions] != [a.response_ids for a in alone.actions]


class Echo:
    """A one-agent team unlike the shipped ones, handed in from Python under a name the config does not use."""

    name = "echo_team"
    agents = ("writer",)
    max_actions = 1

    def __init__(self) -> None:
        self.played: list[str] = []

    def check_task(self, task: Task) -> None:
        pass

    async def play(self, task, team, tools):  # type: ignore[no-untyped-def]
        self.played.append(task.id)
        action = await team.act("writer", [Message(role="user", content=task.problem)])
        return team.episode(final_answer=action.text, correct=task.answer in action.text)

    def context(self, task: Task, action):  # type: ignore[no-untyped-def]
        from mappa.types import CoachContext

        return CoachContext(task=task.problem, workflow=self.name, agent=action.agent, role="", is_final=True,
                            messages=action.messages, output=action.text)  # fmt: skip


def test_training_evaluates_the_workflow_it_was_handed(tmp_path, one_torch_thread) -> None:
    import mappa

    tiny = [*TINY, "generation.max_new_tokens=8", "sandbox.pool=false", "train.steps=1", "train.prompts_per_step=2",
            "train.samples_per_prompt=1", "train.drop_truncated=false", "eval.max_tasks=2", "train.self_test=false",
            f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    cfg = load_config(None, tiny)  # the config names mathchat, whose agents the team does not have
    team = Echo()
    result = mappa.train(
        cfg, workflow=team, coach=lambda ctx: 5.0, train_tasks=tasks(2), eval_tasks=tasks(2), quiet=True
    )
    episodes = [line for line in (result.run_dir / "eval" / "final.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 and all('"workflow":"echo_team"' in e for e in episodes)
    assert len(team.played) == 2 + 2 + 2  # the start evaluation, one step, the final evaluation: all its own


def test_a_task_the_team_cannot_play_fails_before_anything_plays(tmp_path, one_torch_thread) -> None:
    import mappa
    from mappa.errors import MappaError

    class Picky(Echo):
        def check_task(self, task: Task) -> None:
            if task.id == "t1":
                raise MappaError(f"task {task.id!r}: not a task this team plays")

    cfg = load_config(None, [*TINY, "train.self_test=false", f"run_dir={tmp_path / 'run'}"])
    team = Picky()
    with pytest.raises(MappaError, match="task 't1': not a task this team plays"):
        mappa.train(cfg, workflow=team, coach=lambda ctx: 5.0, train_tasks=tasks(1), eval_tasks=tasks(2), quiet=True)
    assert team.played == []  # before the start evaluation
