"""The Python entry point: `mappa.train(cfg, workflow=..., coach=..., train_tasks=..., eval_tasks=...)`.

What `mappa train` does, as a function a notebook or a script can call with its own objects (the CLI is a thin
layer over it):

    import mappa
    from mappa.config import load_config

    cfg = load_config("examples/coder_review/config.yaml", ["train.steps=2"])
    result = mappa.train(cfg, workflow=MyTeam(cfg.workflow, cfg.generation, cfg.sandbox), coach=my_score)
    print(result.gain)

Before anything is written, the sandbox is checked: for tasks whose answers live in files, agent code must not
reach them (`check_hidden_answers`). Then the run directory is made (`cfg.run_dir`, or `run_dir`), the objects
handed in are recorded in its run.json by import path, and the run trains (`mappa.trainer.train`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mappa.config import Config, load_config
from mappa.errors import MappaError
from mappa.generation import check_backend
from mappa.paths import atomic_write
from mappa.protocols import ProgressFn, Workflow
from mappa.sandbox import describe_confinement, guard_hidden_answers
from mappa.sandbox.confine import detect_confinement
from mappa.tasks import answer_locations
from mappa.tracking import new_run_dir
from mappa.trainer import Event, Parts, TrainResult
from mappa.trainer import train as train_run
from mappa.types import Task
from mappa.update import config_groups
from mappa.workflows import build_workflow

PYTHON_OBJECTS = "python_objects"  # run.json key: the parts handed in from Python, which a resume needs again


def check_hidden_answers(cfg: Config, run_root: str | Path | None = None, config_tasks: bool = True) -> str | None:
    """For tasks whose answers live in files (`config_tasks`: the tasks come from the config), refuse when agent
    code could reach them, or the working directory or `run_root` (MappaError, one line) unless
    `sandbox.allow_unconfined`; then the warning line every run shows. None: nothing to hide, or hidden."""
    locations = answer_locations(cfg.tasks) if config_tasks else []
    if not locations:
        return None
    conf = detect_confinement(cfg.sandbox.confinement, cfg.sandbox.python)
    extra = [Path.cwd(), *([Path(run_root)] if run_root is not None else [])]
    return guard_hidden_answers(cfg.sandbox, conf, [*locations, *extra])


def _run_root(cfg: Config, run_dir: str | Path | None) -> Path:
    return Path(run_dir).parent if run_dir is not None else Path(cfg.run_dir).parent


def _record(run_dir: Path, parts: Parts) -> None:
    """The objects handed in from Python, by import path, in run.json: what a resume must hand in again."""
    names = parts.names()
    if not names:
        return
    path = run_dir / "run.json"
    meta = json.loads(path.read_text(encoding="utf-8") or "{}") if path.is_file() else {}
    meta[PYTHON_OBJECTS] = names
    atomic_write(path, json.dumps(meta, indent=1))


def python_objects(run_dir: Path) -> dict[str, str]:
    """What run.json says was handed in from Python (empty: the config names every part)."""
    try:
        meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return dict(meta.get(PYTHON_OBJECTS, {})) if isinstance(meta, dict) else {}


def _check_resume(run_dir: Path, parts: Parts) -> None:
    missing = {role: name for role, name in python_objects(run_dir).items() if role not in parts.names()}
    if missing:
        what = ", ".join(f"{role}={name}" for role, name in missing.items())
        raise MappaError(
            f"resume {run_dir}: this run was given {what} from Python; resume it with mappa.train(..., resume=True) "
            "and the same objects, or name them by import path in the config"
        )


def train(
    cfg: Config | None = None,
    *,
    workflow: Workflow | None = None,
    coach: Any = None,
    train_tasks: Sequence[Task] | None = None,
    eval_tasks: Sequence[Task] | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    overrides: Sequence[str] = (),
    emit: Callable[[Event], None] | None = None,
    progress: ProgressFn | None = None,
    place: Callable[..., Any] | None = None,
) -> TrainResult:
    """Train a team; returns the final evaluation and the held-out gain with its interval, and how many actions
    each agent (update group) trained on: `result.trained_nothing` is True when no agent trained on any action
    (every one left out: cut off at the token cap, unscored, ...; the steps' metrics say why). The run is then
    returned as any other, not raised; `mappa train` exits 3 on it.

    `workflow`: a built workflow (`mappa.protocols.Workflow`); `coach`: a coach instance, class, factory or a
    reward function ctx -> 0-10 | None (`mappa.coach.plugin`); `train_tasks` / `eval_tasks`: lists of Task. Each
    replaces what the config names. `resume=True` continues `run_dir` from its last checkpoint (`cfg` None: the
    run's own config.yaml, with `overrides`). `emit` receives the run's events (`mappa.trainer.Event`), `place`
    a Ray cluster (`mappa.distributed.placement`)."""
    parts = Parts(workflow, coach, train_tasks, eval_tasks)
    if resume:
        if run_dir is None:
            raise MappaError("mappa.train(resume=True): give the run_dir to resume")
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise MappaError(f"resume {run_dir}: not a run directory (config.yaml missing)")
        if cfg is None:
            cfg = load_config(run_dir / "config.yaml", list(overrides))
        _check_resume(run_dir, parts)
    elif cfg is None:
        raise MappaError("mappa.train: give a Config (mappa.config.load_config) or resume=True with a run_dir")
    _check_before_writing(cfg, parts, place)
    warning = check_hidden_answers(cfg, _run_root(cfg, run_dir), config_tasks=train_tasks is None)
    if resume:
        where = Path(str(run_dir))
    else:
        where = new_run_dir(cfg if run_dir is None else cfg.model_copy(update={"run_dir": str(run_dir)}))
        _record(where, parts)
    if emit is not None:  # every run's first line names the confinement: never a silent downgrade
        emit(Event("note", 0, describe_confinement(cfg.sandbox.confinement, cfg.sandbox.python)))
        if warning is not None:
            emit(Event("note", 0, warning))
    return train_run(cfg, where, resume=resume, emit=emit, progress=progress, place=place, parts=parts)


def _check_before_writing(cfg: Config, parts: Parts, place: object) -> None:
    """What can fail from the arguments alone fails before the run directory exists."""
    for role, tasks in (("train_tasks", parts.train_tasks), ("eval_tasks", parts.eval_tasks)):
        if tasks is not None and not list(tasks):
            raise MappaError(f"{role}: no {'training' if role == 'train_tasks' else 'evaluation'} tasks given")
    if place is None and cfg.train.ranks > 1:
        raise MappaError(
            f"train.fsdp_ranks: sharding each agent over {cfg.train.ranks} processes needs --ray (docs/scale.md)"
        )
    workflow = parts.workflow if parts.workflow is not None else build_workflow(cfg)
    config_groups(cfg, workflow.agents)  # a bad train.agent_lr
    check_backend(cfg)  # what a generation server cannot serve fails before any model loads
