"""Before a run on tasks with hidden answers: can agent code reach them? Checked from inside the sandbox.

`answers_reachable` looks at imports and host paths, `guard_hidden_answers` refuses (or warns) on its answer,
and `guard_task_tables` looks for copies of the tasks' tables among the files agent code can read
(`mappa.sandbox.tables_probe`); the fingerprints it matches are handed in as data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from mappa.config import SandboxConfig
from mappa.errors import MappaError
from mappa.sandbox.confine import FORBIDDEN_MODULES, Confinement
from mappa.sandbox.execute import Limits, run_cold
from mappa.sandbox.tables_probe import TablesCheck, check_tables
from mappa.sandbox.workspace import new_workspace, remove_workspace

# Run inside the sandbox: which of the forbidden packages agent code could import, which host paths it sees.
_REACH_PROBE = """
import importlib.util, json, os, sys
names, paths = json.loads(ARGS)
found = []
for n in names:
    try:
        if importlib.util.find_spec(n) is not None:
            found.append(n)
    except Exception:
        pass
try:
    from sklearn.datasets import load_iris
    load_iris()
    found.append("sklearn.datasets (bundled tables)")
except Exception:
    pass
mine = (os.path.realpath(sys.prefix), os.path.realpath(os.getcwd()))  # the allowlist's own mount points


def reachable(p):  # a file, or a directory holding more than the way down to the allowlist's own paths
    if not os.path.isdir(p):
        return os.path.exists(p)
    try:
        names = os.listdir(p)
    except OSError:
        return False
    on_way = [os.path.join(p, n) for n in names if any(m == os.path.join(p, n) or m.startswith(os.path.join(p, n) + "/") for m in mine)]
    return len(on_way) < len(names)


print(json.dumps([found, [p for p in paths if reachable(p)]]))
"""


def answers_reachable(confinement: Confinement, host_paths: Sequence[str | os.PathLike] = ()) -> str | None:
    """None when agent code cannot reach a task's ground truth under `confinement`; else one line saying how.

    Checked from inside: no package that holds the benchmark's tables (or mappa, with its catalogue) is
    importable, scikit-learn's bundled tables do not load, and none of `host_paths` (data directories, the
    run directory, the working directory) exists there."""
    if not confinement.hides_host:
        return "the sandbox cannot hide the host's files here (no bubblewrap and no mount namespace)"
    paths = [os.path.abspath(p) for p in host_paths]
    ws = new_workspace()
    try:
        code = f"ARGS = {json.dumps([list(FORBIDDEN_MODULES), paths])!r}\n" + _REACH_PROBE
        r = run_cold(code, ws, Limits(timeout_s=60), confinement)
    finally:
        remove_workspace(ws)
    if not r.ok:
        return f"the sandbox's reach could not be checked ({r.infra_error or r.stderr.strip()[-200:]})"
    modules, seen = json.loads(r.stdout)
    if modules:
        return (
            f"agent code can import {', '.join(modules)} (agent environment {confinement.env.python}; "
            "make the agent environment: `make venv`, or set sandbox.python)"
        )
    if seen:
        return f"agent code can see {', '.join(seen)}"
    return None


def guard_hidden_answers(
    cfg: SandboxConfig, confinement: Confinement, host_paths: Sequence[str | os.PathLike]
) -> str | None:
    """Before training or evaluating on tasks whose answers live in files: refuse (MappaError, one line) when
    agent code could reach them, unless `sandbox.allow_unconfined`; then return the line every run prints."""
    why = answers_reachable(confinement, host_paths)
    if why is None:
        return None
    if not cfg.allow_unconfined:
        raise MappaError(
            f"sandbox: the tasks' hidden answers would be reachable by agent code: {why}. Install bubblewrap "
            "(apt-get install bubblewrap), or set sandbox.allow_unconfined=true to run anyway"
        )
    return f"sandbox: WARNING: hidden answers are reachable by agent code ({why}); sandbox.allow_unconfined=true"


def guard_task_tables(cfg: SandboxConfig, confinement: Confinement, fingerprints: dict) -> TablesCheck | None:
    """Before a run on tasks whose answers are columns of tables: the probe's look at data files, as
    `answers_reachable` looks at imports. Every copy of a task's table that agent code could read (a library's test
    data, say) is covered from then on; the tasks whose copy stays readable come back in `dropped`, for the caller to
    leave out. None where the sandbox cannot hide the host (then `guard_hidden_answers` has refused or warned). A scan
    that fails refuses the run (MappaError, one line) unless `sandbox.allow_unconfined`; then the check says so."""
    if not confinement.hides_host:
        return None
    try:
        return check_tables(confinement, fingerprints)
    except MappaError as e:
        if not cfg.allow_unconfined:
            raise MappaError(f"{e}; set sandbox.allow_unconfined=true to run anyway") from None
        return TablesCheck((), failed=str(e))
