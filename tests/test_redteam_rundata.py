"""Run data survives kills and is never executed: checkpoint files are read without pickle, rewrites on resume
are atomic, checkpoints are on disk before they are published, and a new run directory is never shared."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ToyPolicy  # the same one-tensor stand-in for a policy

from mappa.errors import MappaError
from mappa.training.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint
from mappa.training.tracking import drop_lines_after

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(run_dir: Path) -> Path:
    toy = ToyPolicy()
    opt = torch.optim.AdamW([toy.w], lr=0.1)
    toy.w.grad = torch.ones(3)
    opt.step()
    return save_checkpoint(run_dir, 1, policy=toy, optimizers={"a": opt}, state={"cursor": 2})


def _load(ckpt: Path) -> dict:
    toy = ToyPolicy()
    return load_checkpoint(ckpt, policy=toy, optimizers={"a": torch.optim.AdamW([toy.w], lr=0.1)})


# ------------------------------------------------------------------------------------ never executed
class _Payload:
    """Unpickling this would create a file: the proof that a checkpoint file ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name", ["rng.pt", "trainer.pt"])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_checkpoint_file_that_would_run_code_is_refused_in_one_line(tmp_path: Path, name: str, how: str) -> None:
    ckpt = _checkpoint(tmp_path / "run")
    marker = tmp_path / "ran"
    evil = {"optimizers": {"a": _Payload(marker)}, "python": _Payload(marker)}
    if how == "pickle":
        (ckpt / name).write_bytes(pickle.dumps(evil))
    else:
        torch.save(evil, ckpt / name)
    with pytest.raises(MappaError) as info:
        _load(ckpt)
    message = str(info.value)
    assert not marker.exists(), "loading the checkpoint ran code from it"
    assert message.startswith(f"{ckpt / name}: ") and "\n" not in message, message


def test_a_well_formed_file_that_is_not_an_rng_state_is_one_line(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "run")
    saved = torch.load(ckpt / "rng.pt", weights_only=True)
    saved["python"]["state"] = torch.zeros(3, dtype=torch.int64)  # a state of the wrong length
    torch.save(saved, ckpt / "rng.pt")
    before = random.getstate()
    with pytest.raises(MappaError, match=r"rng\.pt: not an RNG state") as info:
        _load(ckpt)
    assert "\n" not in str(info.value) and random.getstate() == before


def test_checkpoint_files_hold_only_what_weights_only_reads_and_rng_resumes_exactly(tmp_path: Path) -> None:
    """No allowlist, no pickle: plain `weights_only=True` reads both files, and the RNG continues exactly."""
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # cached Gaussians are part of the state too
    ckpt = _checkpoint(tmp_path / "run")
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(3), torch.rand(3))
    for name in ("rng.pt", "trainer.pt"):
        torch.load(ckpt / name, weights_only=True)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    _load(ckpt)
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(3), torch.rand(3))
    assert got[:2] == expected[:2] and np.array_equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


def test_an_rng_file_that_is_not_of_the_checkpoint_format_is_one_line(tmp_path: Path) -> None:
    """rng.pt holds tensors and plain numbers in one format (`RNG_FORMAT`); the states as python, numpy and torch
    return them (numpy's with an array) are not read: a one-line error naming the file, nothing restored."""
    ckpt = _checkpoint(tmp_path / "run")
    torch.save(rng_state(), ckpt / "rng.pt")
    with pytest.raises(MappaError, match="rng.pt") as err:
        _load(ckpt)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------ survives kills
def test_a_resume_killed_while_rewriting_a_log_loses_no_history(tmp_path: Path) -> None:
    """The rewrite on resume is killed by the kernel in mid-write (the file size limit with its default action,
    SIGXFSZ): the log is the old one, whole, and the next resume drops the lines it should."""
    if not hasattr(signal, "SIGXFSZ"):
        pytest.skip("needs SIGXFSZ")
    log = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "train/accuracy": 0.5, "pad": "x" * 80}) for s in range(1, 2001)]
    log.write_text("".join(r + "\n" for r in rows) + '{"step": 2001, "tor', encoding="utf-8")
    original = log.read_bytes()
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from mappa.training.tracking import drop_lines_after\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"  # Python ignores it; the kernel's default kills
        "resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))\n"
        "drop_lines_after(Path(sys.argv[1]), 1500)\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(log)], cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr.decode()[-2000:]
    assert log.read_bytes() == original
    drop_lines_after(log, 1500)
    assert log.read_text(encoding="utf-8") == "".join(r + "\n" for r in rows[:1500])
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # the killed rewrite's temp file is gone


def test_a_line_separator_inside_a_model_text_does_not_cost_the_episode(tmp_path: Path) -> None:
    log = tmp_path / "episodes.jsonl"
    kept = json.dumps({"meta": {"step": 1}, "text": "a\u2028b"}, ensure_ascii=False)
    log.write_text(kept + "\n" + json.dumps({"meta": {"step": 2}}) + "\n", encoding="utf-8")
    drop_lines_after(log, 1)
    assert log.read_text(encoding="utf-8") == kept + "\n"


def test_every_checkpoint_file_is_on_disk_before_the_rename_that_publishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_rename(src: str | Path, dst: str | Path) -> None:
        events.append(("rename", str(src)))
        rename(src, dst)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc")
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    final = _checkpoint(tmp_path / "run").resolve()  # as /proc names the files
    published = next(i for i, (kind, path) in enumerate(events) if kind == "rename" and "/.tmp-step-" in path)
    tmp = events[published][1]
    synced = {path for kind, path in events[:published] if kind == "fsync"}
    inside = {str(p).replace(str(final), tmp) for p in [final, *final.rglob("*")]}
    assert inside <= synced, sorted(inside - synced)
    after = {path for kind, path in events[published:] if kind == "fsync"}
    assert str(final.parent.resolve()) in after  # the rename itself made durable
    assert latest_checkpoint(tmp_path / "run").resolve() == final


# ------------------------------------------------------------------------------------ never shared
def test_runs_started_in_the_same_second_get_their_own_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import datetime

    import mappa.training.tracking as tracking
    from mappa.config import load_config

    class _SameSecond(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206
            return datetime(2030, 1, 2, 3, 4, 5)

    monkeypatch.setattr(tracking, "datetime", _SameSecond)
    monkeypatch.setattr(tracking, "_git_commit", lambda: "abc")
    cfg = load_config(None, [f"run_dir={tmp_path}/{{name}}-{{time}}", "name=twin"])
    start, made, errors = threading.Barrier(6), [], []

    def one() -> None:
        start.wait()
        try:
            made.append(tracking.new_run_dir(cfg))
        except Exception as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    names = sorted(p.name for p in made)
    assert names == sorted(["twin-20300102-030405", *[f"twin-20300102-030405-{n}" for n in range(2, 7)]])
    for p in made:
        assert json.loads((p / "run.json").read_text())["started"] == "20300102-030405"
        assert (p / "config.yaml").is_file()
