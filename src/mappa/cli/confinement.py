"""The first lines of every command that runs agent code: the confinement in use and, for tasks whose
answers live in files, whether agent code could reach them (refused unless `sandbox.allow_unconfined`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from mappa.api import check_hidden_answers
from mappa.config import Config
from mappa.sandbox import describe_confinement


def print_confinement(console: Console, cfg: Config, run_root: str | Path | None = None, guard: bool = True) -> None:
    """The first lines of a run: the confinement in use, and (`guard`), for tasks whose answers live in files,
    the check that agent code cannot reach them (MappaError unless `sandbox.allow_unconfined`)."""
    line = describe_confinement(cfg.sandbox.confinement, cfg.sandbox.python)  # never a silent downgrade
    console.print(line, highlight=False, soft_wrap=True)
    warning = check_hidden_answers(cfg, run_root) if guard else None
    if warning is not None:
        console.print(warning, style="bold red", highlight=False, soft_wrap=True)
