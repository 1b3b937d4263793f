"""The Python entry point: `mappa.train(cfg, workflow=..., coach=..., train_tasks=..., eval_tasks=...)`.

What `mappa train` does, as a function a notebook or a script can call with its own objects (the CLI is a thin
layer over it):

    import mappa
    from mappa.config import load_config

    cfg = load_config("examples/coder_review/config.yaml", ["train.steps=2"])
    result = mappa.train(cfg, workflow=MyTeam(cfg.workflow, cfg.sandbox), coach=my_score)
    print(result.run_dir, result.final["eval/accuracy"], result.gain)

It prints as it goes, as `mappa train` does in a log (`ConsoleLines`: what is under way with a few progress lines,
one line per evaluation and per step, the held-out gain at the end); `quiet=True` prints nothing, and `emit` /
`progress` take the events instead.

Before anything is written, the sandbox is checked: for tasks whose answers live in files, agent code must not
reach them (`check_hidden_answers`), and the config's tasks are loaded (a bad task file stops here). Then the run
directory is made (`cfg.run_dir`, or `run_dir`; marked as mappa's, `mappa.training.tracking.require_run_dir`), the
objects handed in are recorded in its run.json by import path, and the run trains (`mappa.training.trainer.train`).
A start that fails before the run's first evaluation (the model, the sandbox, the coach, the self-test) removes the
directory again; a resume takes only a directory mappa made.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.generation import check_backend
from mappa.metrics import wilson_interval
from mappa.progress import ProgressLines
from mappa.protocols import ProgressFn, Workflow
from mappa.sandbox import describe_confinement, guard_hidden_answers, guard_task_tables
from mappa.sandbox.confine import Confinement, detect_confinement
from mappa.tasks import answer_locations
from mappa.tasks.sampler import train_tasks as config_train_tasks
from mappa.training.evaluate import eval_tasks as config_eval_tasks
from mappa.training.tracking import StepResult, require_run_dir, run_config, run_json, started_run_dir, update_run_json
from mappa.training.trainer import Event, Parts, TrainResult
from mappa.training.trainer import train as train_run
from mappa.training.update import config_groups
from mappa.types import Task
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


class ConsoleLines:
    """What `mappa.train` prints when no `emit` is given: the run's notes, what is under way with a few progress
    lines per phase (`mappa.progress`), one line per evaluation and per step, and the held-out gain at the end.
    Plain lines on stderr, so that a notebook, a log and a terminal all show them; `mappa train` prints its own
    tables (`mappa.cli.train`)."""

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        self.write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self.progress = ProgressLines(self.write, unit="actions")

    def __call__(self, event: Event) -> None:
        if event.kind == "status":
            self.write(event.text)
            self.progress.start(event.text)
        elif event.kind == "note":
            self.write(event.text)
        elif event.kind == "run":
            self.write(f"run: {event.text}")
        elif event.kind == "eval":
            self.write(f"eval {event.text} (step {event.step}): {_accuracy(event.metrics, 'eval')}")
        elif event.kind == "step" and event.result is not None:
            self.write(_step_line(event.result))

    def done(self, result: TrainResult) -> None:
        gain = result.gain
        if gain is not None:
            lo, hi = gain.gain_ci
            self.write(
                f"held-out accuracy {gain.before:.1%} -> {gain.after:.1%} at step {result.step}: gain "
                f"{gain.gain * 100:+.1f} pp, 95% CI [{lo * 100:+.1f}, {hi * 100:+.1f}] pp"
            )
        if result.trained_nothing:
            self.write(f"WARNING: {result.why_nothing_trained} in {result.step} step(s) (the step lines say why)")
        self.write(f"run: {result.run_dir}")


def _accuracy(m: dict[str, float], prefix: str) -> str:
    n = int(m.get(f"{prefix}/episodes", 0))
    acc = m.get(f"{prefix}/accuracy", math.nan)
    if not n or not math.isfinite(acc):
        return "no episodes"
    lo, hi = wilson_interval(round(acc * n), n)
    return f"accuracy {acc:.1%} [{lo:.1%}, {hi:.1%}] of {n} episodes"


def _step_line(r: StepResult) -> str:
    """`step 3: train accuracy 50%; coach score coder 7.50, reviewer 5.00; loss +0.012, kl 0.003; 41 s` (each
    agent's mean coach score; loss and KL: means over the update groups that trained)."""
    scores = [f"{a} {r.episodes[k]:.2f}" for a in r.agents if (k := f"train/{a}/score_mean") in r.episodes]
    updates = [g.update for g in r.groups.values() if g.update is not None]
    loss, kl = _finite_mean([u.loss for u in updates]), _finite_mean([u.kl for u in updates])
    accuracy = r.episodes.get("train/accuracy", math.nan)
    return (
        f"step {r.step}: train accuracy {accuracy:.0%}; coach score {', '.join(scores) or '-'}; "
        f"loss {loss:+.3f}, kl {kl:.3f}; {r.rollout_s + r.update_s:.0f} s"
    )


def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


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
    quiet: bool = False,
) -> TrainResult:
    """Train a team; returns a `TrainResult`: `run_dir` (where everything is saved), `final` (the final evaluation's
    metrics, e.g. `final["eval/accuracy"]`), `gain` (held-out accuracy after minus before, with its interval), and
    how many actions and optimizer steps each agent (update group) trained on: `result.trained_nothing` is True when
    no agent's weights moved (every action left out: cut off at the token cap, unscored, ...; or each step's kept
    actions all scored alike; the steps' metrics say why). The run is then returned as any other, not raised;
    `mappa train` exits 3 on it.

    `workflow`: a built workflow (`mappa.protocols.Workflow`); `coach`: a coach instance, class, factory or a
    reward function ctx -> 0-10 | None (`mappa.coach.plugin`); `train_tasks` / `eval_tasks`: lists of Task. Each
    replaces what the config names. `resume=True` continues `run_dir` from its last checkpoint (`cfg` None: the
    run's own config.yaml, with `overrides`). `emit` receives the run's events (`mappa.training.trainer.Event`) and
    `progress` the actions played `(done, total)`; without `emit` they are printed (`ConsoleLines`), unless `quiet`.
    `place`: a Ray cluster (`mappa.distributed.placement`)."""
    console = ConsoleLines() if emit is None and not quiet else None
    if console is not None:
        emit, progress = console, progress or console.progress
    result = _train(
        cfg, Parts(workflow, coach, train_tasks, eval_tasks), run_dir, resume, overrides, emit, progress, place
    )
    if console is not None:
        console.done(result)
    return result


def _train(
    cfg: Config | None, parts: Parts, run_dir: str | Path | None, resume: bool, overrides: Sequence[str],
    emit: Callable[[Event], None] | None, progress: ProgressFn | None, place: Callable[..., Any] | None,
) -> TrainResult:  # fmt: skip
    """`train` once its console is settled: check, make (or take) the run directory, train."""
    if resume:
        if run_dir is None:
            raise MappaError("mappa.train(resume=True): give the run_dir to resume")
        run_dir = require_run_dir(run_dir, "resume")
        cfg = run_config(run_dir, "resume", overrides) if cfg is None else cfg
        _check_resume(run_dir, parts)
    elif cfg is None:
        raise MappaError("mappa.train: give a Config (mappa.config.load_config) or resume=True with a run_dir")
    _check_before_writing(cfg, parts, place)
    warning = check_hidden_answers(cfg, _run_root(cfg, run_dir), config_tasks=parts.train_tasks is None)
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
