"""The Python entry point: `mappa.train(cfg, workflow=..., coach=..., train_tasks=..., eval_tasks=...)`.

What `mappa train` does, as a function a notebook or a script can call with its own objects (the CLI is a thin
layer over it):

    import mappa
    from mappa.config import load_config

    cfg = load_config("examples/coder_review/config.yaml", ["train.steps=2"])
    result = mappa.train(cfg, workflow=MyTeam(cfg.workflow, cfg.generation, cfg.sandbox), coach=my_score)
    print(result.gain)

Before anything is written, the sandbox is checked: for tasks whose answers live in files, agent code must not
reach them (`check_hidden_answers`), and the config's tasks are loaded (a bad task file stops here). Then the run
directory is made (`cfg.run_dir`, or `run_dir`; marked as mappa's, `mappa.tracking.require_run_dir`), the objects
handed in are recorded in its run.json by import path, and the run trains (`mappa.trainer.train`). A start that
fails before the run's first evaluation (the model, the sandbox, the coach, the self-test) removes the directory
again; a resume takes only a directory mappa made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.evaluate import eval_tasks as config_eval_tasks
from mappa.generation import check_backend
from mappa.protocols import ProgressFn, Workflow
from mappa.rollout import train_tasks as config_train_tasks
from mappa.sandbox import describe_confinement, guard_hidden_answers, guard_task_tables
from mappa.sandbox.confine import Confinement, detect_confinement
from mappa.tasks import answer_locations
from mappa.tracking import require_run_dir, run_config, run_json, started_run_dir, update_run_json
from mappa.trainer import Event, Parts, TrainResult
from mappa.trainer import train as train_run
from mappa.types import Task
from mappa.update import config_groups
from mappa.workflows import build_workflow

PYTHON_OBJECTS = "python_objects"  # run.json key: the parts handed in from Python, which a resume needs again


def check_hidden_answers(cfg: Config, run_root: str | Path | None = None, config_tasks: bool = True) -> str | None:
    """For tasks whose answers live in files (`config_tasks`: the tasks come from the config), refuse when agent
    code could reach them, or the working directory or `run_root` (MappaError, one line) unless
    `sandbox.allow_unconfined`; then the warning line every run shows. For the mini-DSBench, copies of its tables
    that agent code could read are covered, and a task whose copy stays readable is left out of this process's
    runs, with a line naming it and the file. None: nothing to hide, or hidden."""
    locations = answer_locations(cfg.tasks) if config_tasks else []
    if not locations:
        return None
    conf = detect_confinement(cfg.sandbox.confinement, cfg.sandbox.python)
    extra = [Path.cwd(), *([Path(run_root)] if run_root is not None else [])]
    warning = guard_hidden_answers(cfg.sandbox, conf, [*locations, *extra])
    lines = [warning] if warning is not None else []
    if "dsbench" in {*cfg.tasks.train, *cfg.tasks.eval}:
        lines += _hide_dsbench_tables(cfg, conf)
    return "\n".join(lines) or None


def _hide_dsbench_tables(cfg: Config, conf: Confinement) -> list[str]:
    """Cover the copies of the mini-DSBench's tables in the agent's view; withhold the tasks still readable."""
    from mappa.tasks.dsbench.fingerprints import load_fingerprints, withhold
    from mappa.tasks.tabular import dsbench_dir

    root = dsbench_dir(cfg.tasks.dsbench_dir)  # built here on first use, as loading its tasks would
    check = guard_task_tables(cfg.sandbox, conf, load_fingerprints(root))
    if check is None:
        return []
    withhold(root, check.dropped)
    return check.lines()


def _run_root(cfg: Config, run_dir: str | Path | None) -> Path:
    return Path(run_dir).parent if run_dir is not None else Path(cfg.run_dir).parent


def _record(run_dir: Path, parts: Parts) -> None:
    """The objects handed in from Python, by import path, in run.json: what a resume must hand in again."""
    names = parts.names()
    if names:
        update_run_json(run_dir, **{PYTHON_OBJECTS: names})


def python_objects(run_dir: Path) -> dict[str, str]:
    """What run.json says was handed in from Python (empty: the config names every part)."""
    return dict(run_json(run_dir).get(PYTHON_OBJECTS, {}))


def _with_tasks(cfg: Config, parts: Parts) -> Parts:
    """`parts` with the config's tasks loaded where none were handed in: a bad task file, or a task plug-in that
    fails, stops the start before the run directory exists."""
    return dataclasses.replace(
        parts,
        train_tasks=config_train_tasks(cfg) if parts.train_tasks is None else parts.train_tasks,
        eval_tasks=config_eval_tasks(cfg) if parts.eval_tasks is None else parts.eval_tasks,
    )


def _announce(emit: Callable[[Event], None] | None, cfg: Config, warning: str | None, run_dir: Path) -> None:
    """Every run's first line names the confinement (never a silent downgrade); then the run directory, so that
    a run stopped at any point can be found."""
    if emit is None:
        return
    emit(Event("note", 0, describe_confinement(cfg.sandbox.confinement, cfg.sandbox.python)))
    if warning is not None:
        emit(Event("note", 0, warning))
    emit(Event("run", 0, str(run_dir)))


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
        run_dir = require_run_dir(run_dir, "resume")
        cfg = run_config(run_dir, "resume", overrides) if cfg is None else cfg
        _check_resume(run_dir, parts)
    elif cfg is None:
        raise MappaError("mappa.train: give a Config (mappa.config.load_config) or resume=True with a run_dir")
    _check_before_writing(cfg, parts, place)
    warning = check_hidden_answers(cfg, _run_root(cfg, run_dir), config_tasks=train_tasks is None)
    loaded = _with_tasks(cfg, parts)
    if resume:
        _announce(emit, cfg, warning, Path(run_dir))
        return train_run(cfg, Path(run_dir), resume=True, emit=emit, progress=progress, place=place, parts=loaded)
    with started_run_dir(cfg if run_dir is None else cfg.model_copy(update={"run_dir": str(run_dir)})) as where:
        _record(where, parts)
        _announce(emit, cfg, warning, where)
        return train_run(cfg, where, emit=emit, progress=progress, place=place, parts=loaded)


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
