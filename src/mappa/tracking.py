"""One `log(metrics, step)`: metrics.jsonl always, TensorBoard and W&B when enabled.

Metric names are namespaced (`agent/code_executor/score_mean`, `coach/unscored_rate`, `eval/accuracy`).
The JSONL file is the source of truth: reports are rebuilt from it without rerunning anything.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console


class Tracker:
    """Writes one JSON line per `log` call to `run_dir/metrics.jsonl`, plus the optional sinks."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        run_name: str = "run",
        config: dict[str, Any] | None = None,
        console: Console | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.console = console or Console(stderr=True)
        self._tb = None
        self._wandb = None
        if tensorboard:
            # torch's writer needs only the `tensorboard` package; absent, JSONL still has everything.
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.console.print("[yellow]tensorboard not installed: metrics go to metrics.jsonl only[/]")
            else:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                self.console.print(
                    f"[yellow]logging.wandb_project={wandb_project!r} set but wandb is not installed[/]"
                )
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
