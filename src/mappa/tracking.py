"""The run directory and its files: one `log(metrics, step)` to metrics.jsonl, and to the experiment trackers.

Metric names are namespaced (`agent/code_executor/clip_frac`, `train/accuracy`, `eval/aime2025/accuracy`,
`coach/unscored_rate`). The JSONL files are the source of truth: reports are rebuilt from them without
rerunning anything. The trackers of `logging.report_to` (TensorBoard, W&B, MLflow, trackio) get the same rows
through accelerate's tracker classes, used without an Accelerator; run.json keeps each tracker's run id, so a
resumed run logs on to the same tracked run. `new_run_dir` records what is needed to reproduce a run (resolved
config, git commit, package versions, command line).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from mappa.config import Config, dump_config
from mappa.errors import MappaError
from mappa.paths import atomic_write
from mappa.types import Episode

VERSIONED = ("mappa-rl", "torch", "transformers", "peft", "pydantic", "openai", "math-verify", "numpy")
RUN_LOGS = ("episodes.jsonl", "metrics.jsonl", "eval/summary.jsonl")  # logs with one row per step (or eval)
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # `logging.report_to`'s values, each its package's name


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

    def log(self, metrics: dict[str, float], step: int) -> None:
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
    return dict(_run_json(Path(run_dir)).get("trackers", {}))


def remember_tracker_id(run_dir: str | Path, name: str, run_id: str) -> None:
    """Keep `name`'s run id in run.json's "trackers", beside what `new_run_dir` wrote there."""
    meta = _run_json(Path(run_dir))
    if meta.get("trackers", {}).get(name) == run_id:
        return
    meta["trackers"] = {**meta.get("trackers", {}), name: run_id}
    atomic_write(Path(run_dir) / "run.json", json.dumps(meta, indent=1))


def _run_json(run_dir: Path) -> dict[str, Any]:
    """run.json as a dict; {} when it is missing, empty (claimed, not yet written) or not a JSON object."""
    try:
        meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


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


RUN_FILES = ("checkpoints", "run.json", "metrics.jsonl", "episodes.jsonl")  # any of them: the directory holds a run


def _claim(run_dir: Path) -> bool:
    """Take `run_dir` for a new run, or False when it is taken. Race-free: a directory is created (or, when it is
    there and empty of run files, its run.json) exclusively, so of two runs reaching for one name only one
    gets it. A run killed before its first checkpoint has logs but no checkpoints: never taken either."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(run_dir)
    except FileExistsError:
        if not run_dir.is_dir() or any((run_dir / name).exists() for name in RUN_FILES):
            return False
    try:
        os.close(os.open(run_dir / "run.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return False
    return True


def new_run_dir(cfg: Config) -> Path:
    """A fresh run directory with config.yaml and run.json. When the name has a {time} in it, a directory that
    another run already took (two started within the same second) gets a suffix: -2, -3, ...; a name without
    {time} names one directory, and a run already there is an error."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run_dir.format(name=cfg.name, time=stamp))
    n = 1
    while not _claim(run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")):
        if "{time}" not in cfg.run_dir:
            raise MappaError(f"run_dir {run_dir} already holds a run; use --resume {run_dir} or another run_dir")
        n += 1
    run_dir = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
    atomic_write(run_dir / "config.yaml", dump_config(cfg))
    meta = {"git_commit": _git_commit(), "versions": _versions(), "argv": sys.argv, "started": stamp}
    atomic_write(run_dir / "run.json", json.dumps(meta, indent=1))
    return run_dir


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
