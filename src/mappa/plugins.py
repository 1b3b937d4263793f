"""Plug-ins named by import path: a workflow, a coach or a task source from outside the package.

Two spellings, both `WHERE:NAME` (NAME may be dotted, `Outer.Inner`):

    "my_pkg.team:MyTeam"          a module importable from sys.path
    "examples/team/team.py:MyTeam" a Python file; a relative path in a config file resolves against that
                                   file's directory (`anchor`), so a run directory records it absolute

A file is imported once under a stable module name (registered in `sys.modules`, so pickling and dataclasses
work), with its directory on `sys.path` so that it can import its siblings. Every failure is one `MappaError`
line naming the config key. This module imports nothing of mappa but its errors: the config validates names
with it when it loads.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mappa.errors import MappaError

# Task entries with these prefixes are data files, not import paths (`mappa.tasks.sources`).
DATA_PREFIXES = ("jsonl:", "hf:")

CoachKind = Literal["class", "factory", "function"]


def is_import_path(spec: str) -> bool:
    """Whether `spec` names a plug-in (`where:name`) rather than a built-in name or a data file."""
    if spec.startswith(DATA_PREFIXES) or spec.count(":") != 1:
        return False
    where, name = spec.split(":")
    return bool(where.strip()) and bool(name.strip())


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def anchor(spec: str, base: Path) -> str:
    """`spec` with a relative plug-in file path made absolute against `base` (a config file's directory);
    module paths, built-in names and absolute paths come back unchanged."""
    if not is_import_path(spec):
        return spec
    where, name = spec.split(":")
    if not _is_file(where) or Path(where).expanduser().is_absolute():
        return spec
    return f"{(base / where).resolve()}:{name}"


def _import_file(path: Path, key: str) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise MappaError(f"{key}: plug-in file {path} not found")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"mappa_plugin_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if str(path.parent) not in sys.path:  # its sibling modules import as they would next to a script
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise MappaError(f"{key}: cannot import {path} (not a Python file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise MappaError(f"{key}: importing {path} failed: {type(e).__name__}: {_one_line(e)}") from None
    return module


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def load_object(spec: str, key: str) -> Any:
    """The object `spec` names (`module:attr` or `file.py:attr`); a bad path is one line naming `key`."""
    if not is_import_path(spec):
        raise MappaError(f"{key}: {spec!r} is not an import path (expected 'module:name' or 'file.py:name')")
    where, name = (part.strip() for part in spec.split(":"))
    if _is_file(where):
        module = _import_file(Path(where), key)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # ModuleNotFoundError, or the plug-in's own import-time error
            raise MappaError(f"{key}: cannot import module {where!r}: {type(e).__name__}: {_one_line(e)}") from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise MappaError(f"{key}: {where} has no attribute {name!r}")
        obj = getattr(obj, part)
    return obj


def qualified_name(obj: Any) -> str:
    """`module:qualname` of a class or function (an instance: of its class), as a run directory records it."""
    target = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    return f"{target.__module__}:{target.__qualname__}"


def check_workflow(obj: Any, key: str) -> None:
    """A workflow plug-in is a class (or factory) called like the built-ins: `(WorkflowConfig, GenerationConfig,
    SandboxConfig)`; a class must have the protocol's methods (`mappa.protocols.Workflow`)."""
    if not callable(obj):
        raise MappaError(f"{key}: {qualified_name(obj)} is not a class or factory")
    if inspect.isclass(obj):
        missing = [m for m in ("run", "context") if not callable(getattr(obj, m, None))]
        if missing:
            raise MappaError(
                f"{key}: {qualified_name(obj)} is not a workflow: no {' or '.join(missing)} method "
                "(see mappa.protocols.Workflow)"
            )
    _check_arity(obj, 3, key, "(workflow_cfg, generation_cfg, sandbox_cfg)")


def check_instance(workflow: Any, key: str) -> None:
    """A built workflow satisfies the protocol: `name`, `agents` (a non-empty tuple of names), `run`, `context`."""
    for attr in ("run", "context"):
        if not callable(getattr(workflow, attr, None)):
            raise MappaError(f"{key}: {qualified_name(workflow)} has no {attr} method (see mappa.protocols.Workflow)")
    agents = getattr(workflow, "agents", None)
    if not isinstance(agents, tuple | list) or not agents or not all(isinstance(a, str) and a for a in agents):
        raise MappaError(f"{key}: {qualified_name(workflow)}.agents must be a non-empty tuple of agent names")
    if not isinstance(getattr(workflow, "name", None), str):
        raise MappaError(f"{key}: {qualified_name(workflow)}.name must be a string")


def coach_kind(obj: Any) -> CoachKind:
    """How a coach plug-in is used, told apart by what it is:

    - a class: a coach class (`mappa.protocols.Coach`), built as `cls(coach_cfg)`;
    - a function whose one parameter is named `cfg` or `config`, or annotated `CoachConfig`: a factory
      `f(coach_cfg) -> Coach`;
    - any other callable of one argument: a reward function `f(ctx: CoachContext) -> float | None`, 0-10,
      None for unscored, wrapped into a coach (`mappa.coach.function.FunctionCoach`).
    """
    if inspect.isclass(obj):
        return "class"
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return "function"
    if params:
        first = params[0]
        annotation = (
            first.annotation if isinstance(first.annotation, str) else getattr(first.annotation, "__name__", "")
        )
        if first.name in ("cfg", "config") or annotation.endswith("CoachConfig"):
            return "factory"
    return "function"


def check_coach(obj: Any, key: str) -> CoachKind:
    if not callable(obj):
        raise MappaError(f"{key}: {qualified_name(obj)} is not a coach class, factory or reward function")
    kind = coach_kind(obj)
    if kind == "class":
        missing = [m for m in ("score", "aclose") if not callable(getattr(obj, m, None))]
        if missing:
            raise MappaError(
                f"{key}: {qualified_name(obj)} is not a coach: no {' or '.join(missing)} method "
                "(see mappa.protocols.Coach; a plain function ctx -> score is accepted too)"
            )
    _check_arity(obj, 1, key, "one argument")
    return kind


def check_task_loader(obj: Any, key: str) -> None:
    """A task-source plug-in is a function `(split: 'train' | 'eval', seed: int) -> iterable of Task or dict`."""
    if not callable(obj) or inspect.isclass(obj):
        raise MappaError(f"{key}: {qualified_name(obj)} is not a function (split, seed) -> tasks")
    _check_arity(obj, 2, key, "(split, seed)")


def _check_arity(obj: Callable[..., Any], n: int, key: str, what: str) -> None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check before calling it
    try:
        sig.bind(*range(n))
    except TypeError:
        raise MappaError(f"{key}: {qualified_name(obj)} must accept {what}, its signature is {sig}") from None
