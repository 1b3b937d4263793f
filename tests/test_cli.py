"""The command line as a user meets it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def mappa(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mappa.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr  # no traceback
    assert lines[0].startswith("mappa: error: ")
    return lines[0]


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
    assert "--resume" in line and "config.yaml" in line


def test_trace_of_a_missing_run(tmp_path: Path) -> None:
    line = one_line_error(mappa("trace", str(tmp_path / "no-run")))
    assert "no-run" in line


def test_eval_with_missing_checkpoint(tmp_path: Path) -> None:
    line = one_line_error(mappa("eval", "configs/demo.yaml", "--checkpoint", str(tmp_path / "ckpt")))
    assert "ckpt" in line
