"""The run directory and its files: one `log(metrics, step)` to metrics.jsonl (plus TensorBoard and W&B).

Metric names are namespaced (`agent/code_executor/clip_frac`, `train/accuracy`, `eval/aime2025/accuracy`,
`coach/unscored_rate`). The JSONL files are the source of truth: reports are rebuilt from them without
rerunning anything. `new_run_dir` records what is needed to reproduce a run (resolved config, git commit,
package versions, command line).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
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


class Tracker:
    """Writes one JSON line per `log` call to `run_dir/metrics.jsonl`, plus the optional sinks.

    A sink that is asked for but not installed is skipped with a line in `warnings` (the caller shows it).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        run_name: str = "run",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.warnings: list[str] = []
        self._tb = None
        self._wandb = None
        if tensorboard:
            # torch's writer needs only the `tensorboard` package; absent, JSONL still has everything.
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.warnings.append("tensorboard not installed: metrics go to metrics.jsonl only")
            else:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                self.warnings.append(f"logging.wandb_project={wandb_project!r} set but wandb is not installed")
            else:
                self._wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(self.run_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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
