"""The training loop depends only on the `Engine` protocol: a scripted engine (episodes and updates written in this
file, one real weight tensor, a real optimizer, checkpoints through `mappa.training.checkpoint`) drives
`mappa.training.trainer.train` from start to final evaluation, and a run stopped after step 2 and resumed ends exactly
where an uninterrupted one does. The engines of the package (`LocalEngine`, the Ray `Cluster`) have the protocol's
methods and arguments."""

from __future__ import annotations

import inspect
import json
import random
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from mappa.config import Config, load_config
from mappa.distributed.cluster import Cluster
from mappa.metrics import episode_metrics
from mappa.protocols import Engine, ProgressFn, StatusFn
from mappa.training.checkpoint import latest_checkpoint, restore_run, save_checkpoint
from mappa.training.engine import LocalEngine
from mappa.training.tracking import read_metrics
from mappa.training.trainer import Event, Parts, Run, train
from mappa.training.update import GroupResult, UpdateJob, UpdateStats
from mappa.types import Action, CoachScore, Episode, Message, Task

TASKS = [Task(id=f"t{i}", problem=f"{i} + 1?", answer=str(i + 1), source="scripted") for i in range(6)]
HELD_OUT = [Task(id=f"e{i}", problem=f"{i} + 2?", answer=str(i + 2), source="scripted") for i in range(3)]


class Weights:
    """A one-tensor "policy": what `mappa.training.checkpoint` needs of one (`save`, `load_weights`)."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.zeros(1))

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "w.json").write_text(json.dumps(self.w.tolist()))

    def load_weights(self, directory: Path) -> None:
        with torch.no_grad():
            self.w.copy_(torch.tensor(json.loads((Path(directory) / "w.json").read_text())))


class ScriptedEngine:
    """Plays episodes whose coach scores follow from (seed, task, agent) and whose correctness follows the weight;
    an update moves the weight by the mean score plus noise from the global torch RNG (as LoRA dropout would draw
    it), so a resume that lost the RNG, the cursor, the optimizer state or a step shows in the final weight."""

    def __init__(
        self, agents: Sequence[str], groups: dict[str, list[str]], log: list[str], samples_exactly: bool = True
    ) -> None:
        self.agents, self.log, self.samples_exactly = tuple(agents), log, samples_exactly
        self.weights = Weights()
        self.optimizers = {g: torch.optim.Adam([self.weights.w], lr=0.1) for g in groups}
        self.judgments = 0

    def play(self, tasks: Sequence[Task], seed: int, progress: ProgressFn | None = None) -> list[Episode]:
        self.log.append(f"play {seed} {','.join(t.id for t in tasks)}")
        self.judgments += len(tasks) * len(self.agents)
        return [self._episode(t, seed, i) for i, t in enumerate(tasks)]

    def _episode(self, task: Task, seed: int, i: int) -> Episode:
        rng = random.Random(f"{seed}/{task.id}/{i}")
        actions = tuple(
            Action(agent=a, turn=0, messages=(Message(role="user", content=task.problem),), text="x",
                   prompt_ids=(1, 2), response_ids=(3, 4, 5), logprobs=(-1.0, -1.0, -1.0),
                   coach=CoachScore(score=float(rng.randint(0, 10))))
            for a in self.agents
        )  # fmt: skip
        return Episode(id=f"{task.id}-{seed}-{i}", workflow="scripted", task=task, actions=actions, correct=True)

    def update(self, jobs: dict[str, UpdateJob], status: StatusFn | None = None) -> dict[str, GroupResult]:
        if status is not None:
            status(f"scripted update of {len(jobs)} groups")
        out = {}
        for g, job in jobs.items():
            self.log.append(f"update {g} step {job.step} seed {job.seed} scores {job.scores}")
            self.log.append(f"exact {job.settings.samples_exactly}")
            opt = self.optimizers[g]
            opt.zero_grad()
            target = sum(job.scores) / max(len(job.scores), 1) + float(torch.rand(1))
            loss = (self.weights.w - target).pow(2).sum()
            loss.backward()
            opt.step()
            tokens = float(sum(len(a.response_ids) for a in job.actions))
            stats = UpdateStats(float(loss.detach()), 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, tokens, 1)
            out[g] = GroupResult.of(job, stats, opt.param_groups[0]["lr"])
        return out

    def step_sync(self, version: int) -> dict[str, float]:
        self.log.append(f"sync {version}")
        return {}

    def evaluate(
        self, tasks: Sequence[Task], progress: ProgressFn | None = None
    ) -> tuple[dict[str, float], list[Episode]]:
        right = float(self.weights.w.detach()) > 0.5  # a trained weight answers correctly
        episodes = [self._episode(t, 0, 0).model_copy(update={"correct": right}) for t in tasks]
        return episode_metrics(episodes, self.agents, "eval"), episodes

    def self_test(self) -> list[str]:
        torch.rand(5)  # a self-test that draws from the RNG must not shift the steps after it
        return ["scripted engine answers"]

    def stats(self) -> dict[str, float]:
        return {"judgments": float(self.judgments)}

    def save_checkpoint(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
        self.log.append(f"save {step}")
        return save_checkpoint(run_dir, step, policy=self.weights, optimizers=self.optimizers, state=state, keep=keep)

    def restore_checkpoint(self, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        self.log.append("restore")
        return restore_run(run_dir, policy=self.weights, optimizers=self.optimizers)

    def close(self) -> None:
        self.log.append("close")


def scripted(log: list[str], engines: list[ScriptedEngine], samples_exactly: bool = True) -> Any:
    """A `place` that builds the scripted engine: the trainer gets it exactly where it would get a Ray cluster."""

    def place(cfg: Config, run_dir: Path, agents: Sequence[str], groups: dict[str, list[str]]) -> Engine:
        engines.append(ScriptedEngine(agents, groups, log, samples_exactly))
        return engines[-1]

    return place


def cfg(run_dir: Path, steps: int) -> Config:
    return load_config(
        None,
        [f"run_dir={run_dir}", f"train.steps={steps}", "train.prompts_per_step=2", "train.samples_per_prompt=2",
         "train.eval_every=0", "coach.backend=rubric", "logging.report_to=[]"],
    )  # fmt: skip


def run(
    run_dir: Path, steps: int, log: list[str], *, resume: bool = False, samples_exactly: bool = True
) -> tuple[ScriptedEngine, list[Event]]:
    engines: list[ScriptedEngine] = []
    events: list[Event] = []
    parts = Parts(train_tasks=TASKS, eval_tasks=HELD_OUT)
    place = scripted(log, engines, samples_exactly)
    train(cfg(run_dir, steps), run_dir, resume=resume, emit=events.append, place=place, parts=parts)
    return engines[0], events


def test_the_loop_drives_any_engine_and_checkpoints_through_it(tmp_path: Path) -> None:
    log: list[str] = []
    engine, events = run(tmp_path / "run", 3, log)
    assert [e.kind for e in events].count("step") == 3
    assert any(e.text == "self-test ok: scripted engine answers" for e in events)
    assert any(e.text == "step 1: scripted update of 3 groups" for e in events if e.kind == "status")
    plays = [x for x in log if x.startswith("play")]
    assert [p.split()[1] for p in plays] == ["43", "44", "45"]  # seed + step + 1
    # a sync at start (the weights the run starts from), then one after each step's updates, then close
    assert [x for x in log if x.startswith(("sync", "save", "close"))] == [
        "sync 0", "sync 1", "save 1", "sync 2", "save 2", "sync 3", "save 3", "close",
    ]  # fmt: skip
    rows = [r for r in read_metrics(tmp_path / "run") if "time/rollout_s" in r]
    assert [r["coach/judgments"] for r in rows] == [12.0, 24.0, 36.0]  # 4 episodes x 3 agents per step
    assert all(r["agent/problem_solver/tokens"] == 12.0 for r in rows)
    assert {x for x in log if x.startswith("exact")} == {"exact True"}
    assert latest_checkpoint(tmp_path / "run").name == "step-000003"
    assert {p.name for p in (tmp_path / "run" / "eval").iterdir()} == {"start.jsonl", "final.jsonl", "summary.jsonl"}
    assert float(engine.weights.w.detach()) > 0.5
    assert read_metrics(tmp_path / "run")[-1]["eval/gain"] == 1.0  # start eval wrong, final right: through the files


def test_a_resume_through_the_protocol_is_exact(tmp_path: Path) -> None:
    straight_log: list[str] = []
    straight, _ = run(tmp_path / "straight", 3, straight_log)

    log: list[str] = []
    run(tmp_path / "stopped", 2, log)
    resumed, events = run(tmp_path / "stopped", 3, log, resume=True)
    assert any(e.text.startswith("resumed from") and e.text.endswith("at step 2") for e in events)
    assert torch.equal(resumed.weights.w.detach(), straight.weights.w.detach())
    # the same tasks, seeds, scores and steps: the updates the resumed run made are the uninterrupted run's
    assert [x for x in log if x.startswith(("play", "update"))] == [
        x for x in straight_log if x.startswith(("play", "update"))
    ]
    assert [r["step"] for r in read_metrics(tmp_path / "stopped") if "time/rollout_s" in r] == [1, 2, 3]
    assert "restore" in log and log.index("restore") > log.index("close")  # the second engine restored


def test_the_update_is_told_what_the_engine_says_of_its_generation(tmp_path: Path) -> None:
    """Whether the actions' log-probs are the training forward pass's is asked of the engine (its generators), and
    every group's job carries the answer: the one rule in `mappa.training.update` decides the recompute from it."""
    log: list[str] = []
    run(tmp_path / "run", 1, log, samples_exactly=False)
    assert {x for x in log if x.startswith("exact")} == {"exact False"}


def _methods(cls: type) -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


@pytest.mark.parametrize("engine", [LocalEngine, Cluster, ScriptedEngine])
def test_engines_have_the_protocols_methods(engine: type) -> None:
    wanted = _methods(Engine)
    assert set(wanted) == {"play", "update", "step_sync", "evaluate", "self_test", "stats", "save_checkpoint",
                           "restore_checkpoint", "close"}  # fmt: skip
    have = _methods(engine)
    assert {name: have.get(name) for name in wanted} == wanted
    assert typing.get_type_hints(Engine)["samples_exactly"] is bool  # asked of it before every update
    if engine is not ScriptedEngine:  # the scripted one sets it in __init__
        assert isinstance(inspect.getattr_static(engine, "samples_exactly"), property)


def test_the_run_holds_one_engine_and_nothing_untyped() -> None:
    hints = typing.get_type_hints(Run)
    assert hints["engine"] is Engine
    assert not [name for name, hint in hints.items() if hint is Any]
