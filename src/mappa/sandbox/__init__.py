"""Sandboxed Python execution: the agents' code tool, safe under hostile code and fast under RL load.

    ws = new_workspace({"data.csv": b"a,b\\n1,2\\n"})
    result = run_python("import pandas as pd; print(pd.read_csv('data.csv').sum())", ws, timeout_s=5)
    with Sandbox(SandboxConfig()) as sb:                # warm pool + concurrency from the config
        results = sb.run_many([(code, ws) for code in snippets])
    remove_workspace(ws)
    print(describe_confinement(sb.confinement))        # one line: the confinement in use, what it leaves open

Each snippet runs in a forked child of a confined runner (see confine.py for the exact confinement):
- wall clock (`timeout_s`) and CPU time (RLIMIT_CPU): the snippet and everything it started is killed, also
  processes that started their own session (the snippet's own PID namespace dies with its init);
- memory: a watchdog sums what the snippet pins every 50 ms, the resident memory (anonymous + shared, not
  file-backed) of its processes and the kernel's buffers for it (its sockets, pipes and /dev/shm), and kills them
  all above `memory_mb`, reported as `memory_exceeded` (so is an allocation that fails outright). Not an
  address-space limit: that counts what numpy, pyarrow and torch reserve, not what they use. In the warm pool the
  preloaded modules count as in a cold run that imports them;
- processes: RLIMIT_NPROC (`max_processes`), exact per workspace when root (a uid per workspace),
  otherwise counted on top of the user's existing processes;
- file size: RLIMIT_FSIZE (`max_file_mb`); stdout/stderr are read incrementally and only `max_output_chars`
  are kept (head and tail, with a marker saying how much was cut), so 100 MB of output costs no memory;
- no network: a network namespace (bwrap, or `unshare -n` in the fallback). Where neither works the network
  stays open, and the confinement's one-line description says so;
- environment: scrubbed to PATH/HOME/LANG and thread settings; no inherited API keys or tokens; string hashing
  fixed (PYTHONHASHSEED=0), so an agent's program prints a set in the same order in every run;
- files: agent code sees an allowlist of the host (the system's /usr, a minimal /etc, the agent environment,
  its workspace, an empty /tmp, its own /dev/shm of at most `memory_mb`), nothing of the trainer's checkout,
  data, run directories or other workspaces, nor the files in that view found to hold a copy of a task's table
  (`guard_task_tables`); see confine.py and docs/sandbox.md for the threat model;
- memory outside processes: memfd_create, System V shared memory and message queues are refused (seccomp);
- episodes share nothing: each snippet has its own mount, IPC, network and PID namespaces (no abstract socket,
  port, process or /proc entry of another episode in sight); keyrings, file locks and inotify are refused; open
  files are limited (`max_open_files`);
- faults: `infra_error` comes only from the sandbox's own report channel, never from what the snippet prints or
  its exit status; every host walk of a workspace is iterative and bounded (`workspace_flooded`);
- the host survives snippets that close stdout, kill their parent or leave background processes.

What it does NOT protect against:
- kernel exploits and escapes from namespaces (it is not a VM; run untrusted code at scale in a VM too);
- CPU and disk-bandwidth hogging within the limits (no cgroups: a snippet may use its cores until timeout);
- memory peaks shorter than the watchdog's 50 ms period; pages that forked workers still share with their
  parent are counted once per process (fork-based multiprocessing is charged more than it uses);
- filling the disk with many small files under its workspace (no quota);
- where no mount namespace is allowed (the fallback as a plain user without user namespaces): reading what
  the snippet's uid may read, which is why runs on tasks with hidden answers are then refused
  (`guard_hidden_answers`) unless `sandbox.allow_unconfined`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mappa.config import SandboxConfig
from mappa.errors import MappaError
from mappa.sandbox.confine import (
    FORBIDDEN_MODULES,
    Confinement,
    ConfinementMode,
    describe_confinement,
    detect_confinement,
)
from mappa.sandbox.execute import Limits, run_cold
from mappa.sandbox.pool import WarmPool
from mappa.sandbox.tables_probe import TablesCheck, check_tables
from mappa.sandbox.workspace import new_workspace, remove_workspace, workspace_root
from mappa.types import ExecResult

__all__ = [
    "Confinement",
    "ConfinementMode",
    "Sandbox",
    "answers_reachable",
    "describe_confinement",
    "guard_hidden_answers",
    "guard_task_tables",
    "detect_confinement",
    "new_workspace",
    "remove_workspace",
    "run_python",
    "workspace_root",
]


def run_python(
    code: str,
    workspace: str | Path,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_processes: int = 64,
    max_file_mb: int = 64,
    max_output_chars: int = 8000,
    confinement: ConfinementMode = "auto",
) -> ExecResult:
    """Run `code` once in a fresh confined interpreter with `workspace` as its working directory.

    Never raises for anything the code does; the sandbox's own failures come back as `infra_error`.
    A missing workspace is the caller's error (MappaError).
    """
    limits = Limits(timeout_s, memory_mb, max_processes, max_file_mb, max_output_chars)
    return run_cold(code, Path(workspace), limits, detect_confinement(confinement))


class Sandbox:
    """Runs snippets with the limits of a SandboxConfig: up to `cfg.concurrency` at once, through the warm
    pool when `cfg.pool` (snippets whose workspace is outside `workspace_root()` run cold).

    The confinement is `cfg.confinement` unless `confinement` overrides it; `describe_confinement(
    sandbox.confinement)` names it in one line.
    """

    def __init__(self, cfg: SandboxConfig | None = None, *, confinement: ConfinementMode | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        self.confinement: Confinement = detect_confinement(confinement or self.cfg.confinement, self.cfg.python)
        self.limits = Limits(
            self.cfg.timeout_s,
            self.cfg.memory_mb,
            self.cfg.max_processes,
            self.cfg.max_file_mb,
            self.cfg.max_output_chars,
            self.cfg.max_open_files,
        )
        self.root = workspace_root().resolve()
        self.pool = WarmPool(self.root, self.cfg.preload, self.confinement) if self.cfg.pool else None
        self._executor = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="sandbox")
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def run(self, code: str, workspace: str | Path, *, timeout_s: float | None = None) -> ExecResult:
        """Run one snippet. Snippets of one workspace run one at a time: they share its uid, and the sweep after
        one of them (and the memory watchdog) covers every process of that uid."""
        workspace = Path(workspace).resolve()
        limits = self.limits if timeout_s is None else Limits(**{**self.limits.__dict__, "timeout_s": timeout_s})
        with self._locks_lock:
            lock = self._locks.setdefault(workspace, threading.Lock())
        with lock:
            if self.pool is not None and workspace.parent == self.root:
                return self.pool.run(code, workspace, limits)
            return run_cold(code, workspace, limits, self.confinement)

    def run_many(
        self, items: Sequence[tuple[str, Path]], progress: Callable[[int, int], None] | None = None
    ) -> list[ExecResult]:
        """Run (code, workspace) pairs, `cfg.concurrency` at a time; results in input order.

        `progress(done, total)` is called after each result, in input order.
        """
        futures = [self._executor.submit(self.run, code, ws) for code, ws in items]
        results = []
        for f in futures:
            results.append(f.result())
            if progress is not None:
                progress(len(results), len(futures))
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
