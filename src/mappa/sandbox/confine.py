"""How a snippet is confined on this machine: bubblewrap when it works, else a documented fallback.

`detect_confinement()` probes once per process and says which is used; `describe_confinement()` names it
in one line (commands print it first). An automatic fallback is announced with a one-time warning (or by
that printed line), never silently.

Agent code sees an allowlist of the host, nothing else: the system's `/usr` (and the `/lib*`, `/bin` links
into it), a minimal `/etc`, `/dev/null|zero|full|random|urandom`, `/proc`, an empty read-only `/tmp`, the
interpreter and packages of the **agent environment** (`AgentEnv`: `.venv-agents` by default, never the
trainer's own environment), and its workspace. The trainer's repository, data directories, run directories,
coach cache and `sys.path` are not there. Other Python installations' site-packages under `/usr` and the
tables that packages bundle (scikit-learn's `datasets/data`) are covered by empty directories.

bubblewrap (`bwrap`) builds that root from bind mounts:
- started as root: bwrap runs privileged (no user namespace) keeping only CAP_SETUID/CAP_SETGID (and
  CAP_SYS_ADMIN for the runner's per-snippet namespaces), and the runner inside drops the snippet to the
  workspace's own uid (one unprivileged uid per workspace, no capabilities).
- started as a user: bwrap makes a user namespace; the snippet keeps the user's uid, its capabilities dropped.
- either way: new PID, network, IPC and UTS namespaces, and the sandbox dies with its parent (the warm pool's
  server instead exits when the host's end of its socket closes).

Fallback (no usable bwrap): rlimits, the resident-memory watchdog, timeouts, a process group, `unshare -n`
for the network where the OS allows it, and, as root, the same per-workspace uid drop with a sweep of that
uid's processes. Where a private mount namespace is allowed (`unshare -m` as root, `unshare -r -m` as a
user) the runner builds the same allowlisted root itself and chroots into it before anything runs. Where it
is not, the host stays readable (`hides_host` is False): the printed line says so, and tasks with hidden
answers are refused unless `sandbox.allow_unconfined` (see `answers_reachable`).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mappa.errors import MappaError
from mappa.sandbox.allowlist import (
    AGENT_ROOT,
    FORBIDDEN_MODULES,
    RUNNER,
    RUNNER_INSIDE,
    AgentEnv,
    agent_env,
    bwrap_args,
    root_plan,
)

__all__ = ["AGENT_ROOT", "FORBIDDEN_MODULES", "RUNNER", "AgentEnv", "Confinement", "agent_env", "detect_confinement"]

# Sandbox uids: far above any real account, one per workspace (see allocate_uid).
UID_BASE = 1_800_000_000
PROBE_UID = UID_BASE - 1  # the uid the fallback's start-up probe imports the standard library as
ConfinementMode = Literal["auto", "bwrap", "fallback"]
MODES = ("auto", "bwrap", "fallback")
_uid_counter = itertools.count()
_announced: set[str] = set()  # modes whose confinement was already warned about or printed


def is_root() -> bool:
    return os.geteuid() == 0


def allocate_uid() -> int:
    """A fresh sandbox uid: distinct per workspace in this process, and across processes by pid."""
    return UID_BASE + (os.getpid() % 4096) * 65536 + next(_uid_counter) % 65536


def sandbox_env(workspace: Path | str, bin_dir: str | None = None) -> dict[str, str]:
    """The whole environment a snippet sees: nothing inherited, so no API keys or tokens leak in."""
    bin_dir = bin_dir or os.path.dirname(sys.executable)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(workspace),
        "TMPDIR": str(workspace),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        # The same string hashes in every run: an agent that prints a set prints it in the same order, so a seeded
        # run reproduces (agent output feeds the next prompts). Hash flooding needs an attacker outside the process.
        "PYTHONHASHSEED": "0",
        # One thread each: the pool forks safely and concurrent snippets do not fight over the cores.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


@dataclass(frozen=True)
class Confinement:
    kind: Literal["bwrap", "fallback"]
    drop_uid: bool  # root: run each workspace under its own unprivileged uid
    # fallback: the `unshare` prefix that worked here ("-n": network namespace; "-m": mount namespace)
    unshare: tuple[str, ...] = ()
    # fallback: the runner builds the allowlisted root itself (a mount namespace was allowed)
    allowlist: bool = False
    env: AgentEnv = field(default_factory=lambda: agent_env(None))
    shm_mb: int = 1024  # size of the snippet's own /dev/shm

    @property
    def network_blocked(self) -> bool:
        return self.kind == "bwrap" or "-n" in self.unshare

    @property
    def hides_host(self) -> bool:
        """Whether agent code sees only the allowlist (else every file the snippet's uid may read)."""
        return self.kind == "bwrap" or self.allowlist

    @property
    def isolates_snippets(self) -> bool:
        """Whether each snippet gets its own mount and IPC namespaces and a relay (needs the runner's privilege)."""
        return self.hides_host

    @property
    def python(self) -> str:
        """The agent interpreter as snippets see it (the venv at `AGENT_ROOT` inside an allowlisted root)."""
        return self.env.python_at(AGENT_ROOT if self.hides_host else None)

    def runner_argv(self, *args: str) -> list[str]:
        # -s: no user site; -B: no .pyc writes (the tree is read-only anyway). Not -E: the environment is all
        # `sandbox_env`'s (nothing inherited), and its PYTHONHASHSEED must apply. The fallback starts the runner
        # on the host; with `--root` it re-executes itself inside the new root.
        if self.kind == "fallback":
            return [self.env.python, "-s", "-B", str(RUNNER), *args]
        return [self.python, "-s", "-B", RUNNER_INSIDE, *args]

    def environ(self, workspace: Path | str) -> dict[str, str]:
        return sandbox_env(workspace, os.path.dirname(self.python))

    def command(self, writable: list[Path], chdir: Path, argv: list[str], die_with_parent: bool = True) -> list[str]:
        """The full command line that runs `argv` confined, with `writable` directories bound read-write.

        `die_with_parent=False` for the long-lived pool server: the kernel's parent-death signal follows the
        *thread* that started it, and the server exits by itself when the host's end of its socket closes.
        """
        ops = root_plan(self.env, writable, self.shm_mb)
        if self.kind == "fallback":
            if self.allowlist:
                at = argv.index(str(RUNNER)) + 1
                root = {"ops": ops, "python": self.python, "runner": RUNNER_INSIDE}
                argv = [*argv[:at], "--root", json.dumps(root), *argv[at:]]
            return [*self.unshare, *argv]
        bwrap = [_bwrap_path() or "bwrap", *bwrap_args(ops)]
        return [*bwrap, *_bwrap_flags(self.drop_uid, die_with_parent, chdir), "--", *argv]


@functools.cache
def _bwrap_path() -> str | None:
    """bubblewrap's path on PATH, also when it exists but cannot be executed (so that this can be said)."""
    for d in os.environ.get("PATH", "").split(os.pathsep):
        try:
            if d and (Path(d) / "bwrap").exists():
                return str(Path(d) / "bwrap")
        except OSError:  # a directory on PATH that this user may not enter
            continue
    return None


def _bwrap_flags(drop_uid: bool, die_with_parent: bool, chdir: Path) -> list[str]:
    cmd = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    cmd += ["--die-with-parent"] if die_with_parent else []
    # CAP_SYS_ADMIN stays with the runner for each snippet's own namespaces; the snippet never has it.
    cmd += ["--new-session", "--chdir", str(chdir), "--cap-add", "CAP_SYS_ADMIN"]
    if drop_uid:
        return [*cmd, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [*cmd, "--unshare-user"]


def _probe(cmd: list[str]) -> str | None:
    """None when `cmd` exits 0; else one line saying why not."""
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=60, env=sandbox_env("/"), cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if done.returncode == 0:
        return None
    lines = done.stderr.decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def _probe_argv(conf: Confinement) -> list[str]:
    """The runner's self-check: a snippet's namespaces (where the confinement gives them), then the standard
    library imported as the sandbox uid (as root) or the user."""
    spec = {
        "uid": PROBE_UID if conf.drop_uid else None,
        "isolate": conf.isolates_snippets,
        "shm_mb": 16,
        "memory_mb": 64,
    }
    return conf.command([], Path("/"), conf.runner_argv("probe", json.dumps(spec)))


@functools.cache
def _bwrap_problem(python: str | None) -> str | None:
    path = _bwrap_path()
    if path is None:
        return "bubblewrap is not installed"
    why = _probe(_probe_argv(Confinement("bwrap", drop_uid=is_root(), env=agent_env(python))))
    return None if why is None else f"bubblewrap ({path}) is installed but cannot start here: {why}"


def bwrap_problem(python: str | None = None) -> str | None:
    """None when bubblewrap works here; else one line saying why not (missing, or present but unusable)."""
    return _bwrap_problem(python)


def _fallback(env: AgentEnv) -> Confinement:
    net: tuple[str, ...] = ()
    unshare = shutil.which("unshare") is not None
    for prefix in (("unshare", "-n"), ("unshare", "-r", "-n")) if unshare else ():
        if _probe([*prefix, "true"]) is None:
            net = prefix
            break
    # A private mount namespace lets the runner build the allowlisted root itself; a PID namespace too gives it
    # a /proc of the sandbox's own processes (the host's would show every command line, and, to a snippet that
    # kept the user's uid, the trainer's environment).
    user = () if is_root() else ("-r",)
    pid = ("-p", "--kill-child")  # --kill-child forks, and the sandbox dies with the unshare that started it
    flags = (("-m", "-n", *pid), ("-m", *pid), ("-m", "-n"), ("-m",))
    private = [("unshare", *user, *f) for f in flags]
    for prefix in private if unshare else ():
        conf = Confinement("fallback", drop_uid=is_root(), unshare=prefix, allowlist=True, env=env)
        if _probe(_probe_argv(conf)) is None:
            return conf
    # No mount namespace: as root, the uid drop works only where others can read the interpreter.
    drop = is_root() and _probe(_probe_argv(Confinement("fallback", True, net, env=env))) is None
    return Confinement("fallback", drop_uid=drop, unshare=net, env=env)


@functools.cache
def _detect(mode: str, python: str | None) -> Confinement:
    env = agent_env(python)
    problem = bwrap_problem(python) if mode != "fallback" else None
    if mode != "fallback" and problem is None:
        return Confinement("bwrap", drop_uid=is_root(), env=env)
    if mode == "bwrap":
        raise MappaError(f"sandbox confinement 'bwrap': {problem}")
    return _fallback(env)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise MappaError(f"sandbox confinement {mode!r}: expected one of {', '.join(MODES)}")


def detect_confinement(mode: ConfinementMode = "auto", python: str | None = None) -> Confinement:
    """'auto': bwrap when it works here, else the fallback with a one-time warning; 'bwrap': required or
    MappaError; 'fallback': forced (warned about when the host stays readable or snippets run as root).
    `python`: the agent environment's interpreter (`sandbox.python`; default: see `agent_env`)."""
    _check_mode(mode)
    conf = _detect(mode, python)
    if mode not in _announced:
        _announced.add(mode)
        if (mode == "auto" and conf.kind == "fallback") or not conf.hides_host or (is_root() and not conf.drop_uid):
            why = bwrap_problem(python) or "fallback requested"
            warnings.warn(
                f"mappa sandbox: {why}; {describe_confinement(conf)}. "
                "Install bubblewrap (apt-get install bubblewrap) for full confinement.",
                RuntimeWarning,
                stacklevel=3,
            )
    return conf


def describe_confinement(confinement: Confinement | ConfinementMode = "auto", python: str | None = None) -> str:
    """One line naming the confinement in use and what it leaves open, for the first lines of a run.

    Given a mode, it detects (once per process) and counts as the announcement: no warning follows.
    """
    if isinstance(confinement, str):
        _check_mode(confinement)
        _announced.add(confinement)
        confinement = _detect(confinement, python)
    c = confinement
    env = "the trainer's own Python" if c.env.shared_with_trainer else f"agent environment {c.env.python}"
    limits = (
        "limits: time, CPU, memory (resident, socket and pipe buffers, /dev/shm), processes, open files, file size"
    )
    own = "own mount, IPC, network and PID namespaces per snippet"
    if c.kind == "bwrap":
        who = "one unprivileged uid per workspace" if c.drop_uid else "your uid in a user namespace"
        return f"sandbox: bubblewrap (allowlisted root: system, {env}, workspace; no network, {own}, {who}; {limits})"
    net = "network blocked" if c.network_blocked else "NETWORK OPEN"
    if c.allowlist:
        who = "one unprivileged uid per workspace" if c.drop_uid else "your uid in a user namespace"
        return (
            f"sandbox: fallback without bubblewrap (allowlisted root built in a mount namespace: system, {env}, "
            f"workspace; {net}, {own}, {who}; {limits})"
        )
    if is_root() and not c.drop_uid:
        return (
            f"sandbox: fallback without bubblewrap, snippets RUN AS ROOT (Python under {sys.base_prefix} is "
            f"private to root and no mount namespace is allowed); {net}; NOT confined: every file and every "
            "process of the machine (hidden answers are reachable), the process count; only time, CPU, "
            "resident-memory and file-size limits apply"
        )
    who = "one unprivileged uid per workspace" if c.drop_uid else "your uid, own session"
    return (
        f"sandbox: fallback without bubblewrap ({who}, {net}, {env}; limits: time, CPU, resident memory, processes, "
        "open files, file size); NOT confined: reading any file the snippet's uid may read (hidden answers are "
        "reachable), writes to world-writable places, IPC and signals between snippets, kernel buffers"
    )


def clear_detection() -> None:
    """Forget what was probed and announced (tests that change PATH or the machine's state)."""
    _bwrap_path.cache_clear()
    _bwrap_problem.cache_clear()
    _detect.cache_clear()
    agent_env.cache_clear()
    _announced.clear()


def kill_uid(uid: int) -> None:
    """Fallback sweep from the host (root): SIGKILL every process of `uid`, until none is left."""
    import psutil

    for _ in range(100):
        found = False
        for p in psutil.process_iter(["uids", "status"]):
            if p.info["uids"] and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found = True
                try:
                    p.kill()
                except psutil.Error:
                    pass
        if not found:
            return


def user_process_count() -> int:
    """Processes of this uid: RLIMIT_NPROC counts them too when snippets keep the user's uid."""
    import psutil

    uid = os.getuid()
    return sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid)
