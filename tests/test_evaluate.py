"""Evaluation: a real eval run (tiny model, real sandbox) via `mappa eval`'s command, and the gain of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mappa.cli.evaluate import eval_command
from mappa.config import dump_config, load_config
from mappa.errors import MappaError
from mappa.training.evaluate import eval_gain
from mappa.types import Episode, Task, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_eval_command_on_a_saved_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mappa.policy.policy import Policy
    from mappa.workflows import build_workflow

    cfg = load_config(
        None,
        [
            "model.name=tiny-random",
            "model.lora_r=4",
            "generation.max_new_tokens=8",
            "sandbox.pool=false",
            "tasks.arithmetic_eval_size=3",
            "eval.samples=2",
        ],
    )
    agents = build_workflow(cfg).agents
    policy = Policy.from_config(cfg.model, agents, seed=0)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    policy.save(ckpt / "policy")
    (tmp_path / "run" / "run.json").write_text('{"mappa_run": 1}')  # a run mappa made: eval/ goes in it
    assert eval_command(cfg, str(ckpt), None) == 0
    out = tmp_path / "run" / "eval"
    episodes = (out / "step-000003.jsonl").read_text().splitlines()
    assert len(episodes) == 3 * 2
    summary = json.loads((out / "summary.jsonl").read_text())
    assert summary["tag"] == "step-000003" and summary["eval/episodes"] == 6
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
    assert summary["eval/arithmetic/accuracy"] == summary["eval/accuracy"] and summary["eval/tasks"] == 3
    console = capsys.readouterr().err
    assert "arithmetic" in console and "accuracy [95% CI]" in console  # per source, with its interval
    assert all(a["coach"] is None for e in episodes for a in json.loads(e)["actions"])  # no coach in eval


def test_eval_command_rejects_a_non_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(MappaError, match="not a checkpoint"):
        eval_command(load_config(None, ["model.name=tiny-random"]), str(tmp_path / "empty"), None)


def test_eval_gain_pairs_the_start_and_final_episodes(tmp_path: Path) -> None:
    tasks = [Task(id=f"t{i}", problem="p", answer="1", source="arithmetic") for i in range(20)]

    def run(correct: list[bool]) -> list[Episode]:
        return [
            Episode(id=f"e{i}", workflow="w", task=t, correct=c)
            for i, (t, c) in enumerate(zip(tasks, correct, strict=True))
        ]

    write_jsonl(tmp_path / "start.jsonl", run([False] * 20))
    write_jsonl(tmp_path / "final.jsonl", run([True] * 6 + [False] * 14))
    gain = eval_gain(tmp_path)
    assert gain is not None and gain.paired and gain.gain == pytest.approx(0.3) and gain.improved == 6
    assert gain.significant  # six improved, none worse: more than noise even on 20 tasks
    assert eval_gain(tmp_path, after="step-000004") is None


# ------------------------------------------------------------------------------------- what eval really runs
GREEDY = [
    "model.name=tiny-random",
    "model.lora_r=4",
    "generation.max_new_tokens=8",
    "sandbox.pool=false",
    "tasks.arithmetic_eval_size=3",
    "eval.samples=1",
    "eval.temperature=0",
]


def test_eval_command_plays_the_checkpoints_weights(tmp_path: Path) -> None:
    """A checkpoint whose problem_solver adapter differs from the base: greedy evaluation must play that adapter
    (each solver text is what the perturbed policy writes for the same messages, not what the base writes)."""
    from mappa.policy.policy import Policy
    from mappa.types import read_jsonl
    from mappa.workflows import build_workflow

    cfg = load_config(None, GREEDY)
    agents = build_workflow(cfg).agents
    base = Policy.from_config(cfg.model, agents, seed=0)
    trained = Policy.from_config(cfg.model, agents, seed=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trained.trainable_parameters("problem_solver"):
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    trained.save(ckpt / "policy")
    (tmp_path / "run" / "run.json").write_text('{"mappa_run": 1}')  # a run mappa made: eval/ goes in it
    assert eval_command(cfg, str(ckpt), None) == 0

    episodes = read_jsonl(tmp_path / "run" / "eval" / "step-000003.jsonl", Episode)
    differs = 0
    for ep in episodes:
        solver = ep.actions[0]
        assert solver.agent == "problem_solver"
        (mine,) = trained.generate("problem_solver", [list(solver.messages)], temperature=0, max_new_tokens=8)
        (theirs,) = base.generate("problem_solver", [list(solver.messages)], temperature=0, max_new_tokens=8)
        assert solver.response_ids == mine.response_ids and solver.text == mine.text
        differs += theirs.response_ids != mine.response_ids
    assert differs == len(episodes) == 3  # the base would have answered otherwise every time
    summary = json.loads((tmp_path / "run" / "eval" / "summary.jsonl").read_text())
    assert summary["eval/accuracy"] == sum(e.correct for e in episodes) / len(episodes)


def test_eval_accuracy_is_the_mean_of_the_written_correct_flags(tmp_path: Path) -> None:
    """A scripted team whose verifier is right on even tasks and wrong on odd ones: the written episodes carry
    exactly those verdicts, and `eval/accuracy` is their mean."""
    import re

    from helpers import ScriptedPolicy

    from mappa.config import SandboxConfig
    from mappa.generation import PolicyGenerator
    from mappa.sandbox import Sandbox
    from mappa.training.evaluate import evaluate, write_eval
    from mappa.types import read_jsonl
    from mappa.workflows import build_workflow

    def reply(agent: str | None, conv) -> str:  # noqa: ANN001
        if agent != "verifier":
            return "No code needed."
        i = int(re.search(r"What is (\d+) \+ 1\?", " ".join(m.content for m in conv)).group(1))
        return f"\\boxed{{{i + 1 if i % 2 == 0 else i + 7}}}"

    tasks = [Task(id=f"t{i}", problem=f"What is {i} + 1?", answer=str(i + 1), source="arithmetic") for i in range(6)]
    cfg = load_config(None, GREEDY)
    with Sandbox(SandboxConfig(pool=False)) as sandbox:
        workflow = build_workflow(cfg)
        metrics, episodes = evaluate(cfg, workflow, PolicyGenerator(ScriptedPolicy(reply)), sandbox, tasks)
    write_eval(tmp_path, "scripted", metrics, episodes)
    written = read_jsonl(tmp_path / "scripted.jsonl", Episode)
    assert [e.correct for e in written] == [i % 2 == 0 for i in range(6)]
    summary = json.loads((tmp_path / "summary.jsonl").read_text())
    assert summary["eval/accuracy"] == 0.5 == sum(e.correct for e in written) / len(written)


def _damaged_adapter(policy: Path) -> None:
    path = policy / "adapters" / "agent_problem_solver" / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def _no_manifest(policy: Path) -> None:
    (policy / "mappa_policy.json").unlink()


def _other_agents(policy: Path) -> None:
    import shutil

    from mappa.policy.policy import Policy

    shutil.rmtree(policy)
    Policy.from_config(load_config(None, GREEDY).model, ["analyst", "critic"], seed=0).save(policy)


@pytest.mark.parametrize(
    "harm, message",
    [
        (_damaged_adapter, "agent_problem_solver/adapter_model.safetensors: unreadable weights"),
        (_no_manifest, "policy: not a mappa policy checkpoint (mappa_policy.json not found)"),
        (_other_agents, "policy/mappa_policy.json: the checkpoint has agents ['analyst', 'critic']"),
    ],
    ids=["truncated adapter", "no manifest", "other agents"],
)
def test_eval_of_a_damaged_checkpoint_is_one_line_and_writes_nothing(
    harm, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # fmt: skip
    from mappa.cli import main
    from mappa.policy.policy import Policy
    from mappa.workflows import build_workflow

    cfg = load_config(None, GREEDY)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    Policy.from_config(cfg.model, build_workflow(cfg).agents, seed=0).save(ckpt / "policy")
    harm(ckpt / "policy")
    (tmp_path / "run" / "run.json").write_text('{"mappa_run": 1}')  # a run mappa made: eval/ goes in it
    config = tmp_path / "tiny.yaml"
    config.write_text(dump_config(cfg))
    before = sorted(p for p in (tmp_path / "run").rglob("*"))
    assert main(["eval", str(config), "--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and lines[-1].startswith("mappa: error: ") and sum("error" in x for x in lines) == 1
    assert message in lines[-1] and str(ckpt) in lines[-1], lines[-1]
    assert sorted(p for p in (tmp_path / "run").rglob("*")) == before  # no eval/ directory, nothing written


def test_eval_console_shows_tabular_submissions_per_data_type() -> None:
    from rich.console import Console

    from mappa.cli.evaluate import print_eval
    from mappa.metrics import episode_metrics

    def episode(i: int, data_type: str, valid: bool, gap: float) -> Episode:
        task = Task(id=f"t{i}", problem="p", answer="", source="dsbench", meta={"data_type": data_type})
        sub = {"valid": valid, "gap": gap, "reference_fraction": 2 * gap}
        return Episode(id=f"e{i}", workflow="ds_pipeline", task=task, correct=valid, meta={"submission": sub})

    episodes = [episode(0, "classification", True, 0.4), episode(1, "classification", False, 0.9),
                episode(2, "regression", True, 0.5)]  # fmt: skip
    metrics = {**episode_metrics(episodes, ["analyst"], "eval"), "eval/seconds": 1.0}
    console = Console(record=True, width=120)
    print_eval(console, "eval", metrics, ["analyst"])
    lines = console.export_text().splitlines()
    table = lines[next(i for i, x in enumerate(lines) if "data type" in x) :]  # the last table: submissions
    rows = {cells[1]: cells[2:6] for x in table if len(cells := [c.strip() for c in x.split("│")]) > 5}
    # an invalid submission counts 0 towards the gap: classification (0.4 + 0) / 2
    assert rows["classification"] == ["2", "50.0% [9.5, 90.5]", "0.200", "0.40"]
    assert rows["regression"] == ["1", "100.0% [20.7, 100.0]", "0.500", "1.00"]
    assert rows["all"] == ["3", "66.7% [20.8, 93.9]", "0.300", "0.60"]
