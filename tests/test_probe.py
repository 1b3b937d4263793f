"""`mappa probe` on a tiny random run: real evaluation episodes, real checkpoints, one agent's adapter perturbed."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mappa.analysis.probe import BASE, PROBE_FILE, probe_run, read_probes
from mappa.errors import MappaError

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.name=tiny-random",
    "model.lora_r=4",
    "model.lora_alpha=8",
    "generation.max_new_tokens=8",
    "sandbox.pool=false",
    "sandbox.timeout_s=5",
    "tasks.arithmetic_eval_size=3",
    "logging.report_to=[]",
]
MOVED = "code_executor"  # the agent whose adapter the fixture perturbs before the second checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as `mappa train` leaves it: config.yaml, the start evaluation (played by the workflow in
    the real sandbox), checkpoint 1 at the initial weights, checkpoint 2 with one agent's LoRA B perturbed, and
    a half-written checkpoint a kill left behind."""
    from mappa.config import dump_config, load_config
    from mappa.generation import LocalGenerator
    from mappa.policy.policy import Policy
    from mappa.sandbox import Sandbox
    from mappa.training.checkpoint import save_checkpoint
    from mappa.training.evaluate import eval_tasks, evaluate, write_eval
    from mappa.workflows import build_workflow

    run_dir = tmp_path_factory.mktemp("probe") / "run"
    run_dir.mkdir()
    cfg = load_config(None, [*TINY, f"run_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(dump_config(cfg), encoding="utf-8")
    (run_dir / "run.json").write_text('{"mappa_run": 1}')  # marked, as `mappa train` marks it
    workflow = build_workflow(cfg)
    policy = Policy.from_config(cfg.model, workflow.agents, seed=cfg.seed)
    generator = LocalGenerator(policy)
    with Sandbox(cfg.sandbox) as sandbox:
        metrics, episodes = evaluate(cfg, workflow, generator, sandbox, eval_tasks(cfg))
    generator.close()
    write_eval(run_dir / "eval", "start", {"step": 0, **metrics}, episodes)
    save_checkpoint(run_dir, 1, policy=policy, optimizers={}, state={"cursor": 0})
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.trainable_parameters(MOVED):
            p.add_(0.5 * torch.randn(p.shape, generator=generator))
    save_checkpoint(run_dir, 2, policy=policy, optimizers={}, state={"cursor": 0})
    (run_dir / "checkpoints" / ".tmp-step-000003-99").mkdir()
    probe_run(run_dir)
    return run_dir


def value(rows, checkpoint: str, agent: str, probe: str, role: str | None) -> float:
    (found,) = [r for r in rows if (r.checkpoint, r.agent, r.probe, r.role) == (checkpoint, agent, probe, role)]
    return found.value


def test_rows_for_every_checkpoint_finite_and_counted(tiny_run: Path) -> None:
    rows = read_probes(tiny_run)
    agents = ("problem_solver", "code_executor", "verifier")
    assert {r.checkpoint for r in rows} == {BASE, "step-000001", "step-000002"}
    assert {r.step for r in rows if r.checkpoint == "step-000002"} == {2}
    assert all(math.isfinite(r.value) and r.n > 0 for r in rows)
    for checkpoint in ("step-000001", "step-000002"):
        mine = [r for r in rows if r.checkpoint == checkpoint]
        assert {r.agent for r in mine} == set(agents)
        for agent in agents:  # its own role's KL, the general text, every role's NLL
            assert {(r.probe, r.role) for r in mine if r.agent == agent} == {
                ("kl_base", agent),
                ("general_nll", None),
                *(("role_nll", role) for role in agents),
            }
    base = [r for r in rows if r.agent == BASE]
    assert {r.role for r in base if r.probe == "kl_base"} == set(agents)
    assert all(r.value == pytest.approx(0.0, abs=1e-9) for r in base if r.probe == "kl_base")
    line = json.loads((tiny_run / PROBE_FILE).read_text().splitlines()[-1])
    assert set(line) == {"step", "checkpoint", "agent", "probe", "role", "value", "n"}


def test_only_the_perturbed_agent_moved_from_the_base(tiny_run: Path) -> None:
    rows = read_probes(tiny_run)
    base_general = value(rows, BASE, BASE, "general_nll", None)
    for agent in ("problem_solver", "code_executor", "verifier"):
        # checkpoint 1 holds the initial adapters (B = 0): every agent is the base
        assert value(rows, "step-000001", agent, "kl_base", agent) == pytest.approx(0.0, abs=1e-6)
        assert value(rows, "step-000001", agent, "general_nll", None) == pytest.approx(base_general, rel=1e-5)
        moved = agent == MOVED
        kl = value(rows, "step-000002", agent, "kl_base", agent)
        general = value(rows, "step-000002", agent, "general_nll", None)
        assert (kl > 1e-3) == moved, (agent, kl)
        assert (abs(general - base_general) > 1e-3) == moved, (agent, general, base_general)
        for role in ("problem_solver", "verifier"):  # and on other roles' prompts too
            shift = value(rows, "step-000002", agent, "role_nll", role) - value(rows, BASE, BASE, "role_nll", role)
            assert (abs(shift) > 1e-3) == moved, (agent, role, shift)


def test_probe_is_idempotent_resumes_and_forces(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = read_probes(run)
    again = probe_run(run)
    assert again.probed == [] and set(again.skipped) == {BASE, "step-000001", "step-000002"}
    assert read_probes(run) == before
    # a probe killed before checkpoint 2: only that one is measured next time
    kept = [line for line in (run / PROBE_FILE).read_text().splitlines() if '"step-000002"' not in line]
    (run / PROBE_FILE).write_text("\n".join(kept) + "\n")
    ticks: list[tuple[int, int]] = []
    resumed = probe_run(run, progress=lambda done, total: ticks.append((done, total)))
    assert resumed.probed == ["step-000002"] and ticks[-1][0] == ticks[-1][1] == 3 * 5
    assert read_probes(run) == before  # same seeds, same set: the same values
    with pytest.raises(MappaError, match="was measured with --prompts 16 --gsm8k 0"):
        probe_run(run, prompts_per_role=1)  # another probe set would not be comparable
    forced = probe_run(run, force=True)
    assert forced.probed == [BASE, "step-000001", "step-000002"] and len(forced.rows) == len(before)


def test_gsm8k_questions_answered_alone(tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "math"
    data.mkdir()
    questions = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in (2, 3)]
    (data / "gsm8k_test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    monkeypatch.setenv("MAPPA_DATA_DIR", str(data))
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    rows = probe_run(run, force=True, gsm8k=2, gsm8k_tokens=4).rows
    accuracy = [r for r in rows if r.probe == "gsm8k_accuracy"]
    assert len(accuracy) == 1 + 2 * 3  # the base, then three agents at each of two checkpoints
    assert all(r.n == 2 and 0.0 <= r.value <= 1.0 and r.role is None for r in accuracy)


def test_missing_foreign_and_empty_run_directories(tmp_path: Path) -> None:
    with pytest.raises(MappaError, match="run directory not found"):
        probe_run(tmp_path / "nope")
    (tmp_path / "foreign").mkdir()
    with pytest.raises(MappaError, match="not a mappa run directory"):
        probe_run(tmp_path / "foreign")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text("name: x\n")
    (empty / "run.json").write_text('{"mappa_run": 1}')
    with pytest.raises(MappaError, match="no checkpoints to probe"):
        probe_run(empty)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mappa.cli", "probe", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_cli_probes_a_run_and_errors_in_one_line(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / PROBE_FILE).unlink()
    proc = _cli(str(run))
    assert proc.returncode == 0, proc.stderr
    assert "probed base, step-000001, step-000002" in proc.stderr and "probes at step 2" in proc.stderr
    assert len(read_probes(run)) == len(read_probes(tiny_run))
    proc = _cli(str(run))
    assert proc.returncode == 0 and "already probed: base, step-000001, step-000002" in proc.stderr
    for target, message in ((tmp_path / "nope", "run directory not found"), (tmp_path, "not a mappa run directory")):
        proc = _cli(str(target))
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and message in proc.stderr


@pytest.mark.slow  # three training subprocesses and the HTML report: minutes
def test_process_vs_outcome_bench_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark end to end on the tiny model: every arm trains from one seed on the same tasks, the arms'
    start evaluations agree (the same base weights and eval seed), and the gap is paired over tasks x seeds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_pvo", ROOT / "bench" / "bench_process_vs_outcome.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = [*TINY, "train.prompts_per_step=2", "train.samples_per_prompt=1", "train.drop_truncated=false"]
    args = ["--seeds", "1", "--steps", "1", "--eval-size", "3", "--out", str(tmp_path)]
    summary = bench.main([*args, *(x for o in tiny for x in ("--set", o))])
    assert summary["same_start"] and summary["tasks_per_seed"] == 3
    assert set(summary["arms"]) == {"process", "outcome", "shared"}
    assert set(summary["gaps"]) == {"process-outcome", "process-shared"}
    assert all(g["paired"] and -1 <= g["ci"][0] <= g["ci"][1] <= 1 for g in summary["gaps"].values())
    out = capsys.readouterr().out
    assert "process - outcome:" in out and "process - shared:" in out
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "outcome-seed42" / "eval" / "final.jsonl").is_file()
    again = bench.main([*args, *(x for o in tiny for x in ("--set", o))])  # finished runs are reused
    assert again == summary and capsys.readouterr().out.count("reused") == 3


def test_batched_kl_equals_each_reply_scored_alone() -> None:
    """Replies of different lengths scored together (padding, one forward per weights) give the KL each
    reply gives alone, summed over tokens."""
    from mappa.analysis.probe import kl_to_base, vocab_logprobs
    from mappa.config import ModelConfig
    from mappa.policy.policy import Policy
    from mappa.types import Message

    policy = Policy.from_config(ModelConfig(name="tiny-random", lora_r=4, lora_alpha=8), ["a"], seed=0)
    with torch.no_grad():
        for p in policy.trainable_parameters("a"):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    prompts = [[Message(role="user", content="hi " * k)] for k in (1, 5, 9, 2, 7)]
    kl, n = kl_to_base(policy, "a", prompts, max_new_tokens=6, seed=3, batch=3)
    gens = policy.generate("a", prompts, temperature=1.0, top_p=1.0, max_new_tokens=6, max_context_tokens=None, seed=3)
    total, count = 0.0, 0
    with torch.no_grad():
        for g in (g for g in gens if g.response_ids):
            with policy.active("a") as module:
                own, _ = vocab_logprobs(module, [g.prompt_ids], [g.response_ids], policy.pad_id)
            with policy.active(None) as module:
                base, _ = vocab_logprobs(module, [g.prompt_ids], [g.response_ids], policy.pad_id)
            total += float((own.exp() * (own - base)).sum())
            count += len(g.response_ids)
    assert n == count and len({len(g.prompt_ids) for g in gens}) > 1
    assert kl > 1e-3 and kl == pytest.approx(total / count, rel=1e-4)
