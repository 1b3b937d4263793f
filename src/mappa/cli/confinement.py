"""The first lines of every command that runs agent code: the confinement in use and, for tasks whose
answers live in files, whether agent code could reach them (refused unless `sandbox.allow_unconfined`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from mappa.config import Config
from mappa.sandbox import describe_confinement, guard_hidden_answers
from mappa.sandbox.confine import detect_confinement
from mappa.tasks import answer_locations


def print_confinement(console: Console, cfg: Config, run_root: str | Path | None = None) -> None:
    """The first lines of a run: the confinement in use, and, for tasks whose answers live in files, the
    check that agent code cannot reach them (MappaError unless `sandbox.allow_unconfined`)."""
    line = describe_confinement(cfg.sandbox.confinement, cfg.sandbox.python)  # never a silent downgrade
    console.print(line, highlight=False, soft_wrap=True)
    locations = answer_locations(cfg.tasks)
    if locations:
        conf = detect_confinement(cfg.sandbox.confinement, cfg.sandbox.python)
        extra = [Path.cwd(), *([run_root] if run_root is not None else [])]
        warning = guard_hidden_answers(cfg.sandbox, conf, [*locations, *extra])
        if warning is not None:
            console.print(warning, style="bold red", highlight=False, soft_wrap=True)
