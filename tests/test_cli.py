"""The command line as a user meets it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, mappa, one_line_error

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("command", [[], ["train"], ["eval"], ["trace"]])
def test_help(command: list[str]) -> None:
    proc = mappa(*command, "--help")
    assert proc.returncode == 0
    assert "usage: mappa" in proc.stdout


def test_train_help_lists_resume() -> None:
    assert "--resume" in mappa("train", "--help").stdout


def test_missing_config_file(tmp_path: Path) -> None:
    line = one_line_error(mappa("train", str(tmp_path / "nope.yaml")))
    assert "nope.yaml" in line and "not found" in line


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    line = one_line_error(mappa("train", str(bad)))
    assert "bad.yaml" in line and "train.stepz" in line


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 3\n bad: [\n")
    line = one_line_error(mappa("eval", str(bad)))
    assert "bad.yaml:" in line and "invalid YAML" in line


def test_bad_override_type() -> None:
    line = one_line_error(mappa("train", "configs/demo.yaml", "--set", "train.steps=many"))
    assert "train.steps" in line


def test_resume_of_a_non_run(tmp_path: Path) -> None:
    line = one_line_error(mappa("train", "--resume", str(tmp_path)))
    assert (
        line
        == f"mappa: error: --resume {tmp_path}: not a mappa run directory (no run.json: mappa writes one into every run it makes)"
    )


def test_trace_of_a_missing_run(tmp_path: Path) -> None:
    line = one_line_error(mappa("trace", str(tmp_path / "no-run")))
    assert "no-run" in line


def test_eval_with_missing_checkpoint(tmp_path: Path) -> None:
    line = one_line_error(mappa("eval", "configs/demo.yaml", "--checkpoint", str(tmp_path / "ckpt")))
    assert "ckpt" in line


# ------------------------------------------------------------------------------------------------ guards
def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpointed", "killed-before-a-checkpoint"])
def test_train_refuses_to_overwrite_a_run(tmp_path: Path, checkpointed: bool) -> None:
    from mappa.config import load_config
    from mappa.training.tracking import new_run_dir

    run_dir = new_run_dir(load_config(None, [f"run_dir={tmp_path / 'run'}"]))
    if checkpointed:
        (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
        (run_dir / "checkpoints" / "step-000001" / "state.json").write_text('{"step": 1, "cursor": 2}')
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/accuracy": 0.5}\n')
    before = tree(run_dir)
    line = one_line_error(mappa("train", "configs/demo.yaml", "--set", f"run_dir={run_dir}"))
    assert f"run_dir {run_dir} already holds a run" in line and f"--resume {run_dir}" in line
    assert tree(run_dir) == before


def test_train_refuses_a_run_dir_holding_the_users_files(tmp_path: Path) -> None:
    """`--set run_dir=` a source folder: its own config.yaml (comments and all) is not replaced by the run's."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("# my notes\nseed: 7\n")
    line = one_line_error(mappa("train", "configs/demo.yaml", "--set", f"run_dir={folder}"))
    assert line == f"mappa: error: run_dir {folder}: holds files and is not a mappa run; give a new or empty directory"
    assert tree(folder) == {"config.yaml": b"# my notes\nseed: 7\n"}


def test_train_unknown_agent_lr_fails_before_the_run_dir_exists(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = mappa("train", "configs/demo.yaml", "--set", f"run_dir={run_dir}", "--set", "train.agent_lr={nobody: 1e-5}")
    line = one_line_error(proc)
    assert "train.agent_lr: unknown agent(s) ['nobody']" in line and "problem_solver" in line
    assert not run_dir.exists()  # nothing to clean up, and the same run_dir works once the config is fixed


def test_train_needs_a_config_or_a_run_to_resume(tmp_path: Path) -> None:
    line = one_line_error(mappa("train", cwd=tmp_path))
    assert line == "mappa: error: mappa train: give a CONFIG file or --resume RUN_DIR"
    assert list(tmp_path.iterdir()) == []  # no runs/ directory appeared


def test_train_refuses_a_config_and_a_resume_together(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 7\n")
    line = one_line_error(mappa("train", "configs/demo.yaml", "--resume", str(run_dir)))
    assert "give CONFIG or --resume RUN_DIR, not both" in line and "--set" in line
    assert (run_dir / "config.yaml").read_text() == "seed: 7\n"  # the run's config is not replaced by the preset


def _recorded(tmp_path: Path, agent: str = "verifier") -> Path:
    from mappa.types import Action, Episode, Message, Task, write_jsonl

    task = Task(id="t", problem="What is 2 + 3?", answer="5", source="arithmetic")
    action = Action(agent=agent, turn=0, messages=(Message(role="system", content="role"),), text="\\boxed{5}")
    path = tmp_path / f"{agent}.jsonl"
    write_jsonl(path, [Episode(id="e0", workflow="mathchat", task=task, actions=(action,), correct=True)])
    return path


def test_coach_score_guards(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    (out_dir / "keep.txt").parent.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    line = one_line_error(
        mappa("coach", "score", str(_recorded(tmp_path)), "--coach", "rubric", "--out", str(out_dir))
    )
    assert line == f"mappa: error: --out {out_dir}: is a directory; give a FILE.jsonl"
    assert tree(out_dir) == {"keep.txt": b"mine"}

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "scored.jsonl"
    out.write_text("earlier results\n")
    line = one_line_error(mappa("coach", "score", str(empty), "--coach", "rubric", "--out", str(out)))
    assert line == f"mappa: error: {empty}: no episodes"
    assert out.read_text() == "earlier results\n"  # an earlier output is not clobbered by a failed run

    stranger = _recorded(tmp_path, agent="analyst")
    line = one_line_error(mappa("coach", "score", str(stranger), "--coach", "rubric", "--out", str(out)))
    assert line.startswith("mappa: error: episode e0: agent 'analyst' is not part of workflow 'mathchat'")
    assert out.read_text() == "earlier results\n"

    proc = mappa("coach", "score", str(_recorded(tmp_path)), "--coach", "rubric", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert '"score":10.0' in out.read_text()  # the same command on good input does write


def test_sandbox_run_exit_codes(tmp_path: Path) -> None:
    """0 whatever the code did, 1 when the sandbox itself failed (its pool server killed under a running
    snippet), 2 for a bad argument; the JSON result on stdout either way, no traceback."""
    import json
    import time

    import psutil

    failing = tmp_path / "fails.py"
    failing.write_text("raise SystemExit(3)\n")
    proc = mappa("sandbox", "run", str(failing))
    assert proc.returncode == 0 and json.loads(proc.stdout)["exit_code"] == 3, proc.stderr

    sleeper = tmp_path / "sleeps.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    cmd = [sys.executable, "-m", "mappa.cli", "sandbox", "run", str(sleeper), "--pool", "--timeout", "90"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def is_server(p: psutil.Process) -> bool:
        try:
            return p.name() not in ("bwrap", "unshare") and "serve" in p.cmdline() and bool(p.children())
        except psutil.Error:  # a short-lived process of the start-up (a probe, a relay) gone meanwhile
            return False

    def pool_server() -> psutil.Process | None:
        """The warm pool's server once it has forked the snippet (its child: the snippet is a fork of it)."""
        running = [p for p in psutil.Process(child.pid).children(recursive=True) if is_server(p)]
        return running[0] if running else None

    try:
        deadline = time.monotonic() + 120
        while (server := pool_server()) is None:
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        server.kill()  # the sandbox's own process dies under the snippet
        stdout, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 1, stderr
    result = json.loads(stdout)
    assert "pool server" in result["infra_error"] and not result["ok"]
    assert "Traceback" not in stderr and stderr.startswith("sandbox: ")

    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(mappa("sandbox", "run", str(failing), "--workspace", str(blocker / "ws")))
    assert line.startswith(f"mappa: error: --workspace {blocker / 'ws'}: cannot create it")


def test_train_with_a_coach_that_is_down_stops_at_the_self_test(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # closed on leaving: connections are refused
    run_dir = tmp_path / "run"
    settings = [
        "model.name=tiny-random", "model.lora_r=4", "generation.max_new_tokens=8", "sandbox.pool=false",
        "tasks.arithmetic_eval_size=2", "coach.backend=openai", "coach.model=judge", f"coach.base_url={url}",
        "coach.max_retries=0", f"run_dir={run_dir}",
    ]  # fmt: skip
    proc = mappa("train", *[a for o in settings for a in ("--set", o)], timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "Traceback" not in proc.stderr and [x for x in lines if x.startswith("mappa: error:")] == lines[-1:]
    assert lines[-1].startswith(
        f"mappa: error: self-test: the coach did not answer (request failed: cannot connect to {url}"
    )
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()  # no step, no eval


def test_the_step_table_says_its_agent_columns_are_mean_coach_scores() -> None:
    """`mappa train`'s step table: a header line over the agent columns says what their numbers are, the header is
    printed once, each step's row reads the step's typed results, and a group that trained on nothing gets its
    line after the row."""
    from io import StringIO

    from rich.console import Console

    from mappa.cli.train import Printer
    from mappa.config import Config
    from mappa.training.tracking import StepResult
    from mappa.training.trainer import Event
    from mappa.training.update import GroupResult, UpdateStats

    out = StringIO()
    printer = Printer(Console(file=out, width=200), Config())
    agents = printer.agents
    update = UpdateStats(0.25, 1.0, 0.5, 1.0, 0.0, 1.0, 0.125, 1.0, 12.0, 2)
    dropped = {"empty": 0, "infra_error": 0, "truncated": 3, "unscored": 0}
    groups = {a: GroupResult(2, dropped, 7.0, 1.0, 1e-5, update) for a in agents}
    groups[agents[-1]] = GroupResult(0, dropped, None, None, 1e-5, None)
    episodes = {"train/accuracy": 0.5, **{f"train/{a}/score_mean": 7.25 + i for i, a in enumerate(agents)}}
    for step in (1, 2):
        printer(Event("step", step, result=StepResult(step, agents, episodes, groups, {}, {}, 3.0, 4.0, 10)))
    over, header, row, untrained, row2, _ = out.getvalue().splitlines()
    label = over.strip().strip("-").strip()
    assert label == "mean coach score (0-10)"
    start, end = header.index(agents[0][:12]), header.index(agents[-1][:12]) + len(agents[-1][:12])
    assert start <= over.index(label) and over.index(label) + len(label) <= end  # over the agent columns
    assert header.split()[:2] == ["step", "acc"] and header.split()[-4:] == ["loss/kl", "opt", "clip", "s"]
    assert row.split() == ["1", "50%", "7.25", "8.25", "9.25", "+0.250/0.125", "4", "50.0%", "7"]
    assert untrained == f"step 1: {agents[-1]} trained on no action: 3 of 3 cut off at generation.max_new_tokens=" + (
        f"{Config().generation.max_new_tokens} (train.drop_truncated)"
    )
    assert row2.split()[0] == "2"
