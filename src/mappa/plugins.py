"""Plug-ins named by import path: a workflow, a coach or a task source from outside the package.

Two spellings, both `WHERE:NAME` (NAME may be dotted, `Outer.Inner`):

    "my_pkg.team:MyTeam"          a module importable from sys.path
    "examples/team/team.py:MyTeam" a Python file; a relative path in a config file resolves against that
                                   file's directory (`anchor`), so a run directory records it absolute

A file is imported once, under its own name (`rewards.py` is the module `rewards`, registered in `sys.modules`
so that pickling and dataclasses work and a sibling's `import rewards` is the same module), with its directory
on `sys.path` so that it can import its siblings. A name that is already another module's (the standard
library's `json`, an installed package, a file of that name in another directory) is never replaced: the file
then gets a name of its own. Messages and run directories name a plug-in by its file, `rewards.py:score`
(`qualified_name`). Every failure is one `MappaError` line naming the config key.

An exception raised in a plug-in's code is located at its innermost frame in the user's files
(`user_code_error`): `error in your reward function rewards.py:12 (score): ZeroDivisionError: ...`. This module
imports nothing of mappa but its errors: the config validates names with it when it loads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mappa.errors import MappaError

# Task entries with these prefixes are data files, not import paths (`mappa.tasks.sources`).
DATA_PREFIXES = ("jsonl:", "hf:")

CoachKind = Literal["class", "instance", "factory", "function"]

_FILES: dict[str, Path] = {}  # module name -> the plug-in file imported under it (messages name the file)
# A user's file (resolved) -> what it is to mappa, so that an error raised in it says "your workflow", ...
_ROLES: dict[str, str] = {}
_KEY_ROLES = {"workflow": "workflow", "coach": "coach", "tasks": "task loader"}  # by the config key that names it


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


def _same_file(module: Any, path: Path) -> bool:
    file = getattr(module, "__file__", None)  # a built-in or namespace module has none
    return file is not None and Path(file).resolve() == path


def _module_name(path: Path) -> str:
    """The file's own name (`rewards`), unless that is another module's: one imported already, the standard
    library's, or one importable from another directory of `sys.path`. Then a name of the file's own, so that
    loading a plug-in never replaces a module that mappa, a library or another plug-in uses."""
    stem = path.stem
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != path.parent]
    free = (
        stem.isidentifier() and stem not in sys.modules and stem not in sys.stdlib_module_names
        and importlib.machinery.PathFinder.find_spec(stem, elsewhere) is None
    )  # fmt: skip
    return stem if free else f"{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"


def _import_file(path: Path, key: str) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise MappaError(f"{key}: plug-in file {path} not found")
    # Imported already: by a sibling's plain `import rewards`, or it is the script that is running (importing that
    # again would run the script a second time).
    for loaded in (sys.modules.get(path.stem), sys.modules.get("__main__")):
        if loaded is not None and _same_file(loaded, path):
            _FILES.setdefault(loaded.__name__, path)
            return loaded
    module_name = _module_name(path)
    if module_name in sys.modules:  # its own name, given when the file was loaded before
        return sys.modules[module_name]
    # Its sibling modules import as they would next to a script; appended, so that a sibling named like a module of
    # the standard library or an installed package (a `json.py`) never shadows it, here or in a spawned process.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise MappaError(f"{key}: cannot import {path} (not a Python file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise MappaError(f"{key}: importing {path} failed: {_described(e)}{_at(e)}") from None
    _FILES[module_name] = path
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
            raise MappaError(f"{key}: cannot import module {where!r}: {_described(e)}{_at(e)}") from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise MappaError(f"{key}: {where} has no attribute {name!r}")
        obj = getattr(obj, part)
    if (role := _KEY_ROLES.get(key.split(".")[0])) is not None:
        note_user_code(obj, role)
    return obj


def qualified_name(obj: Any) -> str:
    """How messages and run directories name a class or function (an instance: its class): `rewards.py:score`
    when it comes from a plug-in file (or the script that is running), else `module:qualname`."""
    target = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    module = target.__module__
    path = _FILES.get(module) or (getattr(sys.modules.get(module), "__file__", None) if module == "__main__" else None)
    return f"{Path(path).name if path else module}:{target.__qualname__}"


WORKFLOW_METHODS = ("play", "context", "check_task")  # what `mappa.protocols.Workflow` asks of a team


def check_workflow(obj: Any, key: str) -> None:
    """A workflow plug-in is a class (or factory) called like the built-ins: `(WorkflowConfig, SandboxConfig)`; a
    class must have the protocol's methods (`mappa.protocols.Workflow`), `play` a coroutine function."""
    if not callable(obj):
        raise MappaError(f"{key}: {qualified_name(obj)} is not a class or factory")
    if inspect.isclass(obj):
        missing = [m for m in WORKFLOW_METHODS if not callable(getattr(obj, m, None))]
        if missing:
            raise MappaError(
                f"{key}: {qualified_name(obj)} is not a workflow: no {' or '.join(missing)} method "
                "(see mappa.protocols.Workflow and docs/your-team.md)"
            )
        _check_play(obj, key)
    _check_arity(obj, 2, key, "(workflow_cfg, sandbox_cfg)")


def _check_play(obj: Any, key: str) -> None:
    if not inspect.iscoroutinefunction(obj.play):
        raise MappaError(
            f"{key}: {qualified_name(obj)}.play must be `async def play(self, task, team, tools)`: one episode, "
            "played as a program (see docs/your-team.md)"
        )


def check_instance(workflow: Any, key: str) -> None:
    """A built workflow satisfies the protocol: `name`, `agents` (a non-empty tuple of names), `max_actions` (a
    positive int), `play` (async), `context`, `check_task`."""
    for attr in WORKFLOW_METHODS:
        if not callable(getattr(workflow, attr, None)):
            raise MappaError(f"{key}: {qualified_name(workflow)} has no {attr} method (see mappa.protocols.Workflow)")
    _check_play(type(workflow), key)
    agents = getattr(workflow, "agents", None)
    if not isinstance(agents, tuple | list) or not agents or not all(isinstance(a, str) and a for a in agents):
        raise MappaError(f"{key}: {qualified_name(workflow)}.agents must be a non-empty tuple of agent names")
    if not isinstance(getattr(workflow, "name", None), str):
        raise MappaError(f"{key}: {qualified_name(workflow)}.name must be a string")
    most = getattr(workflow, "max_actions", None)
    if not isinstance(most, int) or isinstance(most, bool) or most < 1:
        raise MappaError(f"{key}: {qualified_name(workflow)}.max_actions must be a positive int (the most actions "
                         "one episode takes)")  # fmt: skip


def coach_kind(obj: Any) -> CoachKind:
    """How a coach plug-in is used, by what it is and what it declares, never by a parameter's name:

    - a class: a coach class (`mappa.protocols.Coach`), built as `cls(coach_cfg)`;
    - an object with a `score` method: a coach instance, used as it is;
    - a function whose one parameter is annotated `CoachConfig`: a factory `f(coach_cfg) -> Coach`;
    - any other callable of one argument: a reward function `f(ctx: CoachContext) -> score`, called with one
      `CoachContext` per action (`mappa.coach.plugin.FunctionCoach`).
    """
    if inspect.isclass(obj):
        return "class"
    if callable(getattr(obj, "score", None)):
        return "instance"
    return "factory" if _declared(obj)[1] == "CoachConfig" else "function"


def _declared(obj: Any) -> tuple[str, str, str]:
    """The first parameter's name, its annotation's name ("" without one) and that type's module ("" unknown). A
    postponed (string) annotation is resolved in the function's module when it can be, else read by its name."""
    try:
        params = list(inspect.signature(obj, eval_str=True).parameters.values())
    except Exception:  # noqa: BLE001 - a name only imported for type checkers: read the annotation as text
        try:
            params = list(inspect.signature(obj).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable
            return "", "", ""
    if not params:
        return "", "", ""
    first = params[0]
    annotation = first.annotation
    if annotation is inspect.Parameter.empty:
        return first.name, "", ""
    if isinstance(annotation, str):
        return first.name, annotation.rsplit(".", 1)[-1], ""
    return first.name, getattr(annotation, "__name__", ""), getattr(annotation, "__module__", "")


def check_coach(obj: Any, key: str) -> CoachKind:
    """`obj`'s kind (`coach_kind`), checked: a class has the protocol's methods, a function takes one argument of a
    type it can be called with. Every mismatch is one line naming `obj` and what was expected."""
    kind = coach_kind(obj)
    if kind != "instance" and not callable(obj):
        raise MappaError(f"{key}: {qualified_name(obj)} is not a coach class, instance, factory or reward function")
    if kind == "class":
        missing = [m for m in ("score", "aclose") if not callable(getattr(obj, m, None))]
        if missing:
            raise MappaError(
                f"{key}: {qualified_name(obj)} is not a coach: no {' or '.join(missing)} method "
                "(see mappa.protocols.Coach; a plain function ctx -> score is accepted too)"
            )
    param, declared, module = _declared(obj)
    if kind == "function" and declared and module.startswith("mappa") and declared != "CoachContext":
        expected = (
            "a factory takes the coach's section: annotate it CoachConfig"
            if declared == "Config"
            else "a reward function takes one CoachContext: f(ctx: CoachContext) -> 0-10 | None"
        )
        raise MappaError(f"{key}: {qualified_name(obj)} takes `{param}: {declared}`; {expected}")
    if kind != "instance":
        what = "one argument: a reward function f(ctx: CoachContext), a factory f(cfg: CoachConfig) or a coach class"
        _check_arity(obj, 1, key, what)
    note_user_code(obj, "reward function" if kind == "function" else "coach")
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


# ---------------------------------------------------------------------------------------------------- user code
class UserCodeError(MappaError):
    """An exception raised in the user's own code, named by its file, line and function (`user_code_error`);
    `original` keeps the exception and its traceback (`mappa --debug` prints them)."""

    def __init__(
        self, role: str, where: str, error: str, original: BaseException, *, during: str = "", note: str = ""
    ) -> None:
        self.role, self.where, self.error, self.original = role, where, error, original
        super().__init__(f"error in your {role} {where}{during}: {error}{note}")

    def during(self, what: str, note: str = "") -> UserCodeError:
        """The same error, said to have happened during `what` (e.g. " on the self-test's context"), with `note`."""
        return UserCodeError(self.role, self.where, self.error, self.original, during=what, note=note)

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to another process (a Ray actor's error), it arrives as the one line it says: the traceback of
        # code that ran over there does not travel.
        return MappaError, (str(self),)


def note_user_code(obj: Any, role: str) -> None:
    """Remember that the file `obj` comes from is the user's `role` ("workflow", "reward function", ...), so that an
    error raised in it says so; mappa's own objects and libraries' are left out."""
    target = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    file = getattr(sys.modules.get(getattr(target, "__module__", "") or ""), "__file__", None)
    if file is None or (path := os.path.realpath(file)).startswith(_library_dirs()[:3]):  # mappa's, the stdlib's
        return
    _ROLES[path] = role if _ROLES.get(path, role) == role else "code"  # one file, two parts: say "your code"


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: mappa itself and the standard library (the first three), then
    installed packages (a plug-in installed as a package is the user's all the same: `note_user_code`)."""
    paths = sysconfig.get_paths()
    dirs = [str(Path(__file__).parent), *(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))]
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # frozen importlib, code compiled from a string
        return False
    path = os.path.realpath(filename)
    return path in _ROLES or not path.startswith(_library_dirs())


def user_code_error(e: BaseException, role: str | None = None) -> UserCodeError | None:
    """`e` located at the innermost frame of its traceback that is in the user's files, as one line: `error in your
    reward function rewards.py:12 (score): ZeroDivisionError: division by zero`. `role` defaults to what the
    nearest plug-in file on the way there is to mappa (`note_user_code`), else "code". None: no frame is the
    user's (a fault of mappa or of a library it called keeps its traceback)."""
    frames = _user_frames(e)
    if not frames:
        return None
    roles = (_ROLES.get(os.path.realpath(f.filename)) for f in reversed(frames))
    where = f"{_file_line(frames[-1])} ({frames[-1].name})"
    return UserCodeError(role or next((r for r in roles if r), "code"), where, _described(e), e)


def _user_frames(e: BaseException) -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_tb(e.__traceback__) if _is_users(f.filename)]


def _file_line(frame: traceback.FrameSummary) -> str:
    return f"{Path(frame.filename).name}:{frame.lineno}"


def _described(e: BaseException) -> str:
    text = _one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _at(e: BaseException) -> str:
    """Where in the user's file an import failed: " (at rewards.py:3)", or "" when no frame is the user's."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f" (at {Path(e.filename).name}:{e.lineno})"
    frames = _user_frames(e)
    return f" (at {_file_line(frames[-1])})" if frames else ""
