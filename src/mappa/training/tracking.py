"""The run directory and its files: one `log(metrics, step)` to metrics.jsonl, and to the experiment trackers.

Metric names are namespaced (`agent/code_executor/clip_frac`, `train/accuracy`, `eval/aime2025/accuracy`,
`coach/unscored_rate`). A training step's results come here typed (`StepResult`, with a `GroupResult` per update
group) and get their names in one place, `step_metrics`: inside the run nothing reads a name back, and the names
are the file format that `mappa report` and a resume read. The JSONL files are the source of truth: reports are
rebuilt from them without rerunning anything. The trackers of `logging.report_to` (TensorBoard, W&B, MLflow,
trackio) get the same rows through accelerate's tracker classes, used without an Accelerator; run.json keeps each
tracker's run id, so a resumed run logs on to the same tracked run. `new_run_dir` records what is needed to
reproduce a run (resolved config, git commit, package versions, command line).

What a run directory is, is decided here alone: one whose run.json holds `"mappa_run": RUN_FORMAT`, written when
`new_run_dir` makes it. Every command that takes a RUN_DIR asks `require_run_dir` first, so a user's folder that
happens to hold a config.yaml or an episodes.jsonl is refused with one line, never resumed or written into.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from mappa.config import Config, dump_config, load_config
from mappa.errors import MappaError
from mappa.paths import atomic_write
from mappa.training.update import GroupResult, mean_logprob_gap
from mappa.types import Episode

VERSIONED = ("mappa-rl", "torch", "transformers", "peft", "pydantic", "openai", "math-verify", "numpy")
RUN_LOGS = ("episodes.jsonl", "metrics.jsonl", "eval/summary.jsonl")  # logs with one row per step (or eval)
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # `logging.report_to`'s values, each its package's name
MARKER = "mappa_run"  # run.json's key: the run directory's format version, written when mappa makes the run
RUN_FORMAT = 1  # the layout of a run directory this version reads and writes
MAX_RUN_JSON = 1 << 20  # bytes: run.json holds a few ids and names; anything larger is not mappa's
# What a run holds before its first evaluation: a start that fails with no more than these is undone
START_FILES = frozenset({"config.yaml", "run.json", "adapters", "wandb"})


@dataclass(frozen=True)
class StepResult:
    """What one training step did (`mappa.training.trainer.train_step`); `step_metrics` names it for metrics.jsonl."""

    step: int  # the step just done (1 for the first)
    agents: tuple[str, ...]  # the workflow's agents, in order of play
    episodes: dict[str, float]  # `train/...`: `mappa.metrics.episode_metrics` of the step's episodes
    groups: dict[str, GroupResult]  # per update group: what it trained on and what its update did
    generation: dict[str, float]  # `generation/...` counters of the rollout and of the weights' sync
    coach: dict[str, float]  # the coach's accounting over the step (`CoachRunner.stats`)
    rollout_s: float  # playing and scoring the episodes
    update_s: float  # rewards, the groups' updates and the sync
    rollout_tokens: int  # response tokens generated

    @property
    def update_tokens(self) -> float:
        return sum(g.update.tokens for g in self.groups.values() if g.update is not None)


def group_metrics(group: str, result: GroupResult) -> dict[str, float]:
    """One update group's result as `agent/<group>/<name>`: what it trained on and left out, its rewards (when it
    trained on any action), the update's numbers (when it ran) and the learning rate."""
    out: dict[str, float] = {f"dropped_{why}": float(n) for why, n in result.dropped.items()}
    out.update(actions_trained=float(result.actions_trained), optimizer_steps=float(result.optimizer_steps))
    if result.reward_mean is not None and result.reward_std is not None:
        out.update(reward_mean=result.reward_mean, reward_std=result.reward_std)
        out["reward_zero_std"] = float(bool(result.reward_zero_std))
    if result.update is not None:
        out.update({k: float(v) for k, v in asdict(result.update).items() if v is not None})
    out["lr"] = result.lr
    return {f"agent/{group}/{k}": v for k, v in out.items()}


def step_metrics(result: StepResult) -> dict[str, float]:
    """A step's results under their metrics.jsonl names: `train/...`, `agent/<group>/...`, `generation/...`
    (with `generation/logprob_gap`, the groups' token-weighted mean, when they report one), `time/...`,
    `coach/...`."""
    out = dict(result.episodes)
    for group, r in result.groups.items():
        out.update(group_metrics(group, r))
    out.update(result.generation)
    if (gap := mean_logprob_gap(result.groups)) is not None:
        out["generation/logprob_gap"] = gap
    out.update(
        {"time/rollout_s": result.rollout_s, "time/update_s": result.update_s,
         "time/rollout_tokens_per_s": result.rollout_tokens / max(result.rollout_s, 1e-9),
         "time/update_tokens_per_s": result.update_tokens / max(result.update_s, 1e-9)}
    )  # fmt: skip
    out.update({f"coach/{k}": float(v) for k, v in result.coach.items()})
    return out


class Tracker:
    """Writes one JSON line per `log` call to `run_dir/metrics.jsonl`, then the same metrics to each tracker.

    A tracker whose package is not installed, or that fails to start (no W&B login, an MLflow server down), is
    skipped with a line in `warnings` (the caller shows it): metrics.jsonl has everything, so the run goes on.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        report_to: Sequence[str] = ("tensorboard",),
        project: str = "mappa",
        run_name: str = "run",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.warnings: list[str] = []
        self._sinks: list[Any] = []  # accelerate GeneralTrackers, started
        self._tensorboard = False  # asked for and installed: its writer starts at the first `log`
        for name in report_to:
            if name not in TRACKERS:
                raise ValueError(f"unknown tracker {name!r} (one of {', '.join(TRACKERS)})")
            try:
                importlib.import_module(name)
            except ImportError:
                self.warnings.append(f"logging.report_to: {name} is not installed (pip install {name}); skipped")
                continue
            if name == "tensorboard":
                self._tensorboard = True
                continue
            try:
                self._sinks.append(self._start(name, project, run_name, config or {}))
            except Exception as e:  # any failure of a third-party client: metrics.jsonl still has every row
                why = " ".join(str(e).split())[:200] or type(e).__name__
                self.warnings.append(f"logging.report_to: {name} did not start ({why}); skipped")

    def _start(self, name: str, project: str, run_name: str, config: dict[str, Any]) -> Any:
        """Start one tracker on the run id kept in run.json (a new one the first time)."""
        from accelerate.tracking import MLflowTracker, TrackioTracker, WandBTracker

        _accelerate_state()
        ids = tracker_ids(self.run_dir)
        if name == "wandb":  # our own id, kept before the run starts: a kill during init still resumes it
            run_id = ids.get("wandb") or uuid.uuid4().hex[:16]
            remember_tracker_id(self.run_dir, "wandb", run_id)
            sink = WandBTracker(
                project, id=run_id, resume="allow", name=run_name, config=config, dir=str(self.run_dir)
            )
        elif name == "trackio":  # trackio resumes a run by its name within the project
            run_id = ids.get("trackio") or run_name
            remember_tracker_id(self.run_dir, "trackio", run_id)
            sink = TrackioTracker(project, name=run_id, resume="allow", config=config)
        else:  # mlflow: the run id is MLflow's own, known once the run has started
            sink = MLflowTracker(experiment_name=project, run_id=ids.get("mlflow"), run_name=run_name)
        sink.start()
        if name == "mlflow" and "mlflow" not in ids:  # params are write-once in MLflow: set them on a new run only
            remember_tracker_id(self.run_dir, "mlflow", sink.tracker.info.run_id)
            sink.store_init_configuration(_flat(config))
        return sink

    def log_step(self, result: StepResult) -> None:
        """A training step's results, named by `step_metrics`."""
        self.log(step_metrics(result), result.step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        purge_step = 0
        if self._tensorboard:  # the step after the last one metrics.jsonl holds, read before this row lands
            purge_step = max((r["step"] for r in read_metrics(self.run_dir)), default=-1) + 1
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tensorboard:
            self._start_tensorboard(purge_step)
        for sink in self._sinks:
            sink.log(clean, step=step)

    def _start_tensorboard(self, purge_step: int) -> None:
        """The event writer, in run_dir/tensorboard, started at the first `log`: by then a resume has cut
        metrics.jsonl back to its checkpoint's step, and `purge_step` (the step after that) makes TensorBoard
        hide the events the killed run wrote after it, as metrics.jsonl forgot them (`drop_lines_after`)."""
        from accelerate.tracking import TensorBoardTracker

        _accelerate_state()
        sink = TensorBoardTracker("tensorboard", self.run_dir, purge_step=purge_step)
        sink.start()
        self._sinks.append(sink)
        self._tensorboard = False

    def close(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.finish()


def _accelerate_state() -> None:
    """accelerate's trackers log through its logger, which needs its process state: in this one process (the
    driver, also with --ray; never a launcher's rank) that is a single process on the default device, no
    process group and no device switch."""
    from accelerate import PartialState

    PartialState()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-5}} -> {"train.lr": 1e-5}: MLflow params are flat key-value pairs."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def tracker_ids(run_dir: str | Path) -> dict[str, str]:
    """The run ids of the trackers this run logged to, from run.json (`{"wandb": ..., "mlflow": ...}`)."""
    return dict(run_json(run_dir).get("trackers", {}))


def remember_tracker_id(run_dir: str | Path, name: str, run_id: str) -> None:
    """Keep `name`'s run id in run.json's "trackers", beside what `new_run_dir` wrote there."""
    trackers = run_json(run_dir).get("trackers", {})
    if trackers.get(name) != run_id:
        update_run_json(run_dir, trackers={**trackers, name: run_id})


def run_json(run_dir: str | Path) -> dict[str, Any]:
    """run.json as a dict; {} when it is missing, empty (claimed, not yet written) or not a JSON object."""
    found, _ = _read_run_json(Path(run_dir) / "run.json")
    return found if isinstance(found, dict) else {}


def update_run_json(run_dir: str | Path, **fields: Any) -> None:
    """Set `fields` in run.json, keeping what is there (the marker `new_run_dir` wrote, the trackers' ids)."""
    atomic_write(Path(run_dir) / "run.json", json.dumps({**run_json(run_dir), **fields}, indent=1))


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """All rows of `run_dir/metrics.jsonl` (a torn last line from a killed process is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


# ---------------------------------------------------------------------------------------------------- run dir
def _git_commit() -> str:
    src = Path(__file__).resolve().parent  # the checkout mappa runs from, wherever the run directory is
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False, cwd=src
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5, check=False, cwd=src
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    commit = out.stdout.strip() or "unknown"
    return commit + ("-dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_dir_problem(path: Path) -> str | None:
    """Why `path` is not a run directory this mappa made (one phrase), or None when it is one."""
    if not path.exists():
        return "run directory not found"
    if not path.is_dir():
        return "not a directory (give a run directory, e.g. runs/demo-YYYYMMDD-HHMMSS)"
    meta = path / "run.json"
    if not meta.exists():
        return "not a mappa run directory (no run.json: mappa writes one into every run it makes)"
    found, why = _read_run_json(meta)
    if why:
        return f"not a mappa run directory (run.json is not mappa's: {why})"
    if not isinstance(found, dict) or MARKER not in found:
        return (
            f'not a mappa run directory (run.json has no "{MARKER}" format version; if mappa made this run before '
            f'run directories were marked, add "{MARKER}": {RUN_FORMAT} to its run.json)'
        )
    version = found[MARKER]
    if type(version) is not int:  # not bool: true == 1 in Python, but is no format version
        return (
            f'not a mappa run directory (run.json\'s "{MARKER}" is {json.dumps(version)[:40]}, not a format version)'
        )
    if version != RUN_FORMAT:
        return (
            f"not a mappa run directory this version reads (run.json: format {version}; this mappa reads {RUN_FORMAT})"
        )
    return None


def _read_run_json(path: Path) -> tuple[Any, str]:
    """run.json's contents, or why it cannot be mappa's: a regular file only (a FIFO would block the read), read
    up to MAX_RUN_JSON bytes (the folder may be anyone's)."""
    if not path.is_file():
        return None, "not a file"
    try:
        with path.open("rb") as f:
            data = f.read(MAX_RUN_JSON + 1)
    except OSError as e:
        return None, e.strerror or type(e).__name__
    if len(data) > MAX_RUN_JSON:
        return None, f"over {MAX_RUN_JSON >> 20} MiB"
    try:
        return json.loads(data.decode("utf-8")), ""
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError:
        return None, "not JSON"


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a run directory this mappa made (`require_run_dir` says why not)."""
    return run_dir_problem(Path(path)) is None


def require_run_dir(path: str | Path, what: str = "") -> Path:
    """`path` when it is a run directory mappa made: run.json holding `"mappa_run": RUN_FORMAT`, written when
    `new_run_dir` made it. Otherwise one MappaError line, `"{what} {path}: ..."`, naming what is missing (`what`:
    the command or argument, "--resume", "report", ...). Only run.json is read, so a refused directory (a source
    folder with its own config.yaml, a user's episodes.jsonl) is left exactly as it was."""
    path = Path(path)
    problem = run_dir_problem(path)
    if problem is not None:
        raise MappaError(f"{what} {path}: {problem}" if what else f"{path}: {problem}")
    return path


def run_config(run_dir: str | Path, what: str = "", overrides: Sequence[str] = ()) -> Config:
    """The config.yaml of the run directory `run_dir` (`require_run_dir`), with `a.b=c` overrides."""
    return load_config(require_run_dir(run_dir, what) / "config.yaml", list(overrides))


def _claim(run_dir: Path) -> Literal["made", "empty", "taken"]:
    """Take `run_dir` for a new run: "made" it, took it "empty" (a directory made beforehand, holding nothing),
    or "taken" (a run, or anyone's files: never written into). Race-free: a directory is created, or an empty
    one's run.json, exclusively, so of two runs reaching for one name only one gets it."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    how: Literal["made", "empty"] = "made"
    try:
        os.mkdir(run_dir)
    except FileExistsError:
        if not run_dir.is_dir() or any(run_dir.iterdir()):
            return "taken"
        how = "empty"
    try:
        os.close(os.open(run_dir / "run.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return "taken"
    return how


def _make_run_dir(cfg: Config) -> tuple[Path, bool]:
    """`new_run_dir`, and whether it made the directory (False: it took an empty one made beforehand)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    first = Path(cfg.run_dir.format(name=cfg.name, time=stamp))
    for n in itertools.count(1):
        run_dir = first if n == 1 else first.with_name(f"{first.name}-{n}")
        how = _claim(run_dir)
        if how != "taken":
            break
        if "{time}" in cfg.run_dir:
            continue  # another run of the same second, or anyone's folder: the next suffix
        if is_run_dir(run_dir):
            raise MappaError(f"run_dir {run_dir} already holds a run; use --resume {run_dir} or another run_dir")
        if not run_dir.is_dir():
            raise MappaError(f"run_dir {run_dir}: not a directory")
        raise MappaError(f"run_dir {run_dir}: holds files and is not a mappa run; give a new or empty directory")
    atomic_write(run_dir / "config.yaml", dump_config(cfg))
    meta = {
        MARKER: RUN_FORMAT,
        "git_commit": _git_commit(),
        "versions": _versions(),
        "argv": sys.argv,
        "started": stamp,
    }
    atomic_write(run_dir / "run.json", json.dumps(meta, indent=1))
    return run_dir, how == "made"


def new_run_dir(cfg: Config) -> Path:
    """A fresh run directory with config.yaml and run.json (marked: `require_run_dir`). When the name has a
    {time} in it, a directory that is taken (another run started within the same second, or anyone's files)
    gets a suffix: -2, -3, ...; a name without {time} names one directory: new, or empty, or an error."""
    return _make_run_dir(cfg)[0]


@contextmanager
def started_run_dir(cfg: Config) -> Iterator[Path]:
    """A new run directory (`new_run_dir`) for the block. When the block fails (or Ctrl-C stops it) while the
    run holds no more than its start (START_FILES: no evaluation, no step), the start is undone: the directory
    is removed, or emptied again when it was an empty one made beforehand. A run that got further stays, to be
    resumed."""
    run_dir, made = _make_run_dir(cfg)
    try:
        yield run_dir
    except BaseException:
        _undo_start(run_dir, made)
        raise


def _undo_start(run_dir: Path, made: bool) -> None:
    try:
        names = {p.name for p in run_dir.iterdir()}
        if not names <= START_FILES:
            return
        for name in names:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        if made:
            run_dir.rmdir()
    except OSError:  # what could not be undone stays; the start's own error is the one to report
        pass


def drop_lines_after(path: Path, step: int) -> None:
    """Forget log lines of steps after `step` (the step a kill interrupted runs again after resume), and a torn
    last line (a later append would be glued to it). The file is replaced whole (`atomic_write`): a kill during
    the rewrite leaves the old file, so a resume interrupted here loses no history."""
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")  # not splitlines(): that would also cut a line at a U+2028 in a model's text
    if lines[-1] == "":
        lines.pop()
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if isinstance(row, dict) and row.get("step", row.get("meta", {}).get("step", 0)) <= step:
            keep.append(line)
    if len(keep) == len(lines) and (not text or text.endswith("\n")):
        return  # nothing to forget: a large episodes.jsonl is not copied for nothing
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a resume killed mid-rewrite
        stale.unlink(missing_ok=True)
    atomic_write(path, (k + "\n" for k in keep))


def append_episodes(path: Path, episodes: Sequence[Episode], step: int) -> None:
    """Append episodes as JSON lines, each with `meta["step"]`."""
    with path.open("a", encoding="utf-8") as f:
        for ep in episodes:
            f.write(ep.model_copy(update={"meta": {**ep.meta, "step": step}}).model_dump_json() + "\n")
