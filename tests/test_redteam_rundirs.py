"""A user's files and runs are never destroyed: only a directory mappa made as a run (run.json with its format
version, "mappa_run") is resumed, reported, probed or evaluated into; anything else is refused with one line and
left byte for byte as it was. A start that fails leaves no run directory behind, and Ctrl-C says what is saved
and how to go on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import interruptible

from mappa.errors import MappaError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.name=tiny-random", "model.lora_r=4", "generation.max_new_tokens=8", "sandbox.pool=false",
    "coach.backend=rubric", "coach.cache=false", "tasks.arithmetic_train_size=8", "tasks.arithmetic_eval_size=2",
    "train.prompts_per_step=2", "train.samples_per_prompt=1", "logging.report_to=[]",
]  # fmt: skip
# A source folder's own config: commented, and small enough that a command taking it for a run would start at once
USER_CONFIG = """\
# my experiment: keep these notes
name: mine  # the team's name
model:
  name: tiny-random
  lora_r: 4
generation:
  max_new_tokens: 8
sandbox:
  pool: false
coach:
  backend: rubric
  cache: false
tasks:
  arithmetic_train_size: 4
  arithmetic_eval_size: 2
train:
  steps: 1
  prompts_per_step: 2
  samples_per_prompt: 1
logging:
  report_to: []
"""
EPISODE = (
    '{"id": "mine-0", "workflow": "mathchat", "task": {"id": "t", "problem": "1+1?", "answer": "2"}, '
    '"actions": [], "meta": {"step": 1}}\n'
)


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes, and every directory (b"/"): a file added or changed shows."""
    return {str(p.relative_to(path)): b"/" if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def error_line(err: str) -> str:
    """The one error line of a failed command: the last line, the only error, no traceback."""
    lines = [x for x in err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("mappa: error: ")]
    assert "Traceback" not in err and len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def _source_folder(d: Path) -> None:
    (d / "config.yaml").write_text(USER_CONFIG)
    (d / "train.py").write_text("print('my own script')\n")


def _user_episodes(d: Path) -> None:
    (d / "config.yaml").write_text(USER_CONFIG)
    (d / "episodes.jsonl").write_text(EPISODE)
    (d / "metrics.jsonl").write_text('{"step": 1, "train/accuracy": 0.5}\n')


def _run_json(meta: object) -> object:
    def make(d: Path) -> None:
        _user_episodes(d)
        (d / "run.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))

    return make


FOREIGN = {  # a directory -> what the refusal must name
    "source folder with a config.yaml": (_source_folder, "no run.json"),
    "folder of the user's episodes.jsonl": (_user_episodes, "no run.json"),
    "run.json without the marker": (_run_json({"git_commit": "abc", "started": "20260101-120000"}), '"mappa_run"'),
    "run.json of another format": (_run_json({"mappa_run": 99}), "format 99"),
    "run.json not JSON": (_run_json("not json {"), "run.json"),
    "run.json a list": (_run_json([1]), "run.json"),
    "run.json says true": (_run_json({"mappa_run": True}), '"mappa_run"'),
}


def _foreign(tmp_path: Path, kind: str, checkpoint: bool = False) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    FOREIGN[kind][0](d)
    if checkpoint:  # a checkpoint-shaped folder inside it, for `mappa eval --checkpoint`
        ckpt = d / "checkpoints" / "step-000001"
        (ckpt / "policy").mkdir(parents=True)
        (ckpt / "policy" / "weights.bin").write_bytes(b"\0" * 8)
        (ckpt / "state.json").write_text('{"step": 1, "cursor": 2}')
    return d


def _commands(d: Path) -> dict[str, list[str]]:
    eval_cfg = str(ROOT / "configs" / "demo.yaml")
    return {
        "train --resume": ["train", "--resume", str(d)],
        "report": ["report", str(d)],  # default --out: RUN_DIR/report.html
        "probe": ["probe", str(d)],
        "eval --checkpoint (default --out)": [
            "eval",
            eval_cfg,
            "--checkpoint",
            str(d / "checkpoints" / "step-000001"),
        ],
        "blame": ["blame", str(d)],
        "compare": ["compare", str(d)],
        "trace": ["trace", str(d)],
        "export": ["export", str(d), "--out", str(d.parent / "exported")],
    }


COMMANDS = list(_commands(Path("x")))


@pytest.mark.parametrize("kind", FOREIGN)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_mappa_did_not_make_is_refused_and_left_as_it_was(
    command: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mappa.cli import main

    d = _foreign(tmp_path, kind, checkpoint=command.startswith("eval"))
    before = tree(d)
    assert main(_commands(d)[command]) == 2
    line = error_line(capsys.readouterr().err)
    assert str(d) in line and "not a mappa run directory" in line and FOREIGN[kind][1] in line, line
    assert tree(d) == before  # not a byte changed, no file added (config.yaml keeps its comments)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing written beside it either


def test_eval_into_a_foreign_directory_says_how_to_go_on(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mappa.cli import main

    d = _foreign(tmp_path, "source folder with a config.yaml", checkpoint=True)
    args = ["eval", str(ROOT / "configs" / "demo.yaml"), "--checkpoint", str(d / "checkpoints" / "step-000001")]
    assert main(args) == 2
    assert "--out" in error_line(capsys.readouterr().err)  # a checkpoint outside a run evaluates with --out DIR


def test_a_run_made_before_the_marker_is_refused_with_how_to_mark_it(tmp_path: Path) -> None:
    from mappa.training.tracking import require_run_dir

    d = _foreign(tmp_path, "run.json without the marker")
    with pytest.raises(MappaError) as info:
        require_run_dir(d, "--resume")
    message = str(info.value)
    assert message.startswith(f"--resume {d}: not a mappa run directory") and "\n" not in message
    assert 'add "mappa_run": 1 to its run.json' in message
    meta = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps({"mappa_run": 1, **meta}))  # what the line says to do
    assert require_run_dir(d, "--resume") == d


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "run directory not found"),
        (lambda p: p.write_text("x"), "not a directory"),
        (lambda p: (p / "run.json").mkdir(parents=True), "run.json"),
        (lambda p: (p.mkdir(), (p / "run.json").write_bytes(b"\xff\xfe")), "run.json"),
        (lambda p: (p.mkdir(), (p / "run.json").write_text('{"mappa_run": 1}' + " " * (1 << 20))), "run.json"),
    ],
    ids=["missing", "a file", "run.json a directory", "run.json not UTF-8", "run.json huge"],
)
def test_the_rule_is_one_line_for_every_shape(tmp_path: Path, make, message: str) -> None:  # noqa: ANN001
    from mappa.training.tracking import is_run_dir, require_run_dir

    d = tmp_path / "d"
    make(d)
    with pytest.raises(MappaError, match=message) as info:
        require_run_dir(d, "report")
    assert str(info.value).startswith(f"report {d}: ") and "\n" not in str(info.value)
    assert not is_run_dir(d)


def test_a_new_run_is_marked_and_keeps_its_marker(tmp_path: Path) -> None:
    from mappa.config import load_config
    from mappa.training.tracking import RUN_FORMAT, is_run_dir, new_run_dir, remember_tracker_id, require_run_dir

    run = new_run_dir(load_config(None, [f"run_dir={tmp_path / 'run'}"]))
    assert json.loads((run / "run.json").read_text())["mappa_run"] == RUN_FORMAT == 1
    remember_tracker_id(run, "wandb", "abc")  # later writers of run.json keep it
    assert is_run_dir(run) and require_run_dir(run, "report") == run


@pytest.mark.parametrize("kind", ["source folder with a config.yaml", "folder of the user's episodes.jsonl"])
def test_a_new_run_never_moves_into_a_folder_holding_files(tmp_path: Path, kind: str) -> None:
    """`run_dir=examples/mine` (a source folder): its config.yaml is not overwritten by the run's."""
    from mappa.config import load_config
    from mappa.training.tracking import new_run_dir

    d = _foreign(tmp_path, kind)
    before = tree(d)
    with pytest.raises(MappaError) as info:
        new_run_dir(load_config(None, [f"run_dir={d}"]))
    assert str(info.value) == f"run_dir {d}: holds files and is not a mappa run; give a new or empty directory"
    assert tree(d) == before
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory made beforehand is taken
    assert new_run_dir(load_config(None, [f"run_dir={empty}"])) == empty


# ---------------------------------------------------------------------------------------------- failed starts
def _mappa(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mappa.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300, env=env)


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def test_a_bad_task_file_fails_before_any_run_directory(tmp_path: Path) -> None:
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"id": "a", "problem": "1+1?", "answer": "2"}\n{"id": "b", "problem": \n')
    runs = tmp_path / "runs"
    runs.mkdir()
    proc = _mappa(
        "train", *_sets(*TINY, f"tasks.train=[jsonl:{bad}]", f"run_dir={runs}/{{name}}-{{time}}"), cwd=tmp_path
    )
    assert proc.returncode == 2
    assert f"{bad}:2" in error_line(proc.stderr) and "run: " not in proc.stderr  # no run was named
    assert list(runs.iterdir()) == []


def test_a_bad_plugin_path_fails_before_any_run_directory(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    missing = tmp_path / "coach_plugin.py"
    proc = _mappa("train", *_sets(*TINY, f"coach.backend={missing}:score", f"run_dir={runs}/x"), cwd=tmp_path)
    assert proc.returncode == 2
    assert str(missing) in error_line(proc.stderr) and not runs.exists()


def test_a_start_that_fails_after_the_model_loaded_removes_its_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, one_torch_thread: None
) -> None:
    """A coach plug-in that imports but builds nothing fails where the engine starts: the run directory made
    for it goes again, and an empty directory the user made beforehand stays, empty."""
    from mappa.cli import main

    (tmp_path / "coach_plugin.py").write_text("def make(cfg):\n    return 'not a coach'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    coach = f"coach.backend={tmp_path / 'coach_plugin.py'}:make"
    runs = tmp_path / "runs"
    assert main(["train", *_sets(*TINY, coach, f"run_dir={runs}/{{name}}-{{time}}")]) == 2
    assert "returned 'not a coach'" in error_line(capsys.readouterr().err)
    assert list(runs.iterdir()) == []
    (tmp_path / "mine").mkdir()
    assert main(["train", *_sets(*TINY, coach, f"run_dir={tmp_path / 'mine'}")]) == 2
    assert list((tmp_path / "mine").iterdir()) == []


# ----------------------------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_names_the_saved_step_and_the_resume_command(tmp_path: Path) -> None:
    from mappa.training.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mappa.cli", "train", *_sets(*TINY, "train.steps=4", f"run_dir={run_dir}")]
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, preexec_fn=interruptible
    )
    try:
        deadline = time.monotonic() + 240
        while latest_checkpoint(run_dir) is None if run_dir.exists() else True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    lines = [x for x in log.read_text().splitlines() if x.strip()]
    assert f"run: {run_dir}" in lines[:3], lines[:5]  # named as the run starts, not only at its end
    saved = latest_checkpoint(run_dir).name
    step = int(saved.removeprefix("step-"))
    assert "Traceback" not in "\n".join(lines) and lines[-1] == "mappa: interrupted", lines[-5:]
    assert lines[-2] == (
        f"interrupted: step {step} is saved ({run_dir / 'checkpoints' / saved}); "
        f"continue with: mappa train --resume {run_dir}"
    ), lines[-5:]


@pytest.mark.slow  # a `mappa train` process to the coach's self-test: over 10 s on a busy 2-core CPU
def test_ctrl_c_within_the_start_leaves_no_run_directory(tmp_path: Path) -> None:
    """Stopped while the self-test waits on a coach that never answers: nothing is saved, so nothing is left,
    and the last lines say so (no resume command to a directory that is gone)."""
    plugin = tmp_path / "silent_coach.py"
    asked = tmp_path / "asked"  # the coach's first call leaves it
    plugin.write_text(
        f"import asyncio\nfrom pathlib import Path\n\n\nasync def score(ctx):\n    Path({str(asked)!r}).touch()\n"
        "    await asyncio.sleep(600)\n"
    )
    runs = tmp_path / "runs"
    log = tmp_path / "train.log"
    cmd = ["train", *_sets(*TINY, f"coach.backend={plugin}:score", f"run_dir={runs}/{{name}}-{{time}}")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mappa.cli", *cmd], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        preexec_fn=interruptible,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not asked.exists():  # the self-test asks the coach, which never answers
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the self-test did not reach the coach in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    lines = [x for x in log.read_text().splitlines() if x.strip()]
    run_dir = next(x.removeprefix("run: ") for x in lines if x.startswith("run: "))
    assert list(runs.iterdir()) == []
    end = lines.index("mappa: interrupted")  # (after it, asyncio may note the coach's call it dropped)
    assert lines[end - 1] == f"interrupted before the run started: nothing is saved ({run_dir} removed)"


def test_the_resume_command_repeats_what_the_config_does_not_hold() -> None:
    """A resume's --set overrides are written to config.yaml only once its checkpoint loaded: the command
    repeats them (harmless after), and --ray, which no config holds; a path with spaces is quoted."""
    from mappa.cli.train import resume_command

    assert resume_command(Path("runs/a b"), [], None) == "mappa train --resume 'runs/a b'"
    command = resume_command(Path("runs/x"), ["train.steps=20"], "local", resumed=True)
    assert command == "mappa train --resume runs/x --set train.steps=20 --ray local"
    assert resume_command(Path("runs/x"), ["train.steps=20"], None) == "mappa train --resume runs/x"
