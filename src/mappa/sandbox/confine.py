"""How a snippet is confined on this machine: bubblewrap when it works, else a documented fallback.

`detect_confinement()` probes once per process and says which is used; `describe_confinement()` names it
in one line (commands print it first). An automatic fallback is announced with a one-time warning (or by
that printed line), never silently.

bubblewrap (`bwrap`):
- started as root: bwrap runs privileged (no user namespace) keeping only CAP_SETUID/CAP_SETGID, and the
  runner inside drops the snippet to the workspace's own uid (one unprivileged uid per workspace, no
  capabilities). A uid that owns nothing outside its workspace cannot read root-only files such as
  /etc/shadow, and it makes the process-count limit and the final sweep exact per workspace.
- started as a user: bwrap makes a user namespace; the snippet keeps the user's uid.
- either way: read-only root filesystem, an empty read-only /tmp, /root and $HOME hidden behind an empty
  tmpfs (only the Python installation is bound back), the workspace(s) bound read-write, new PID, network,
  IPC and UTS namespaces, and the sandbox dies with its parent (the warm pool's server instead exits when
  the host's end of its socket closes, which also happens when the host is killed).

Fallback (no usable bwrap): rlimits, the resident-memory watchdog, timeouts, a process group (its own
session), `unshare -n` for the network where the OS allows it, and, as root, the same per-workspace uid
drop with a sweep of that uid's processes. It does not stop writes to world-writable places (/tmp,
/dev/shm) nor, when not root, anywhere the user can write; without `unshare` the network is open. As root
with a Python that other users cannot read (pyenv under /root), the fallback runs in a private mount
namespace (`unshare -m`) where an empty tmpfs covers the private home and only the Python installation is
bound back, so the dropped uid can import the standard library and every installed package. Where even
that is refused, snippets run as root without the uid drop: only rlimits (not the process count: root
ignores it), timeouts and the memory watchdog apply, and the warning says so.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mappa.errors import MappaError

RUNNER = Path(__file__).with_name("runner.py")
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


def _hidden_dirs() -> list[str]:
    home = os.path.realpath(os.path.expanduser("~"))
    hidden = {"/root"}
    if home not in ("/", "") and os.path.isdir(home):
        hidden.add(home)
    return sorted(h for h in hidden if os.path.isdir(h))


def _python_paths() -> list[str]:
    """Directories the interpreter and the runner need: bound back into a hidden home when they live there."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(RUNNER.parent), os.path.dirname(sys.executable)}
    paths.update(p for p in sys.path if p)
    real = {os.path.realpath(p) for p in paths}
    return sorted(p for p in real if os.path.isdir(p))


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those inside another one of them (binding a parent already brings the child)."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not _under(p, out):
            out.append(p)
    return out


def sandbox_env(workspace: Path | str) -> dict[str, str]:
    """The whole environment a snippet sees: nothing inherited, so no API keys or tokens leak in."""
    bin_dir = os.path.dirname(sys.executable)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(workspace),
        "TMPDIR": str(workspace),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
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
    # fallback as root with a Python only root can read: tmpfs over the private home, Python bound back
    hide_home: bool = False

    @property
    def network_blocked(self) -> bool:
        return self.kind == "bwrap" or "-n" in self.unshare

    def command(self, writable: list[Path], chdir: Path, argv: list[str], die_with_parent: bool = True) -> list[str]:
        """The full command line that runs `argv` confined, with `writable` directories bound read-write.

        `die_with_parent=False` for the long-lived pool server: the kernel's parent-death signal follows the
        *thread* that started it, and the server exits by itself when the host's end of its socket closes.
        """
        if self.kind == "fallback":
            if self.hide_home:
                argv = _with_mounts(argv, writable)
            return [*self.unshare, *argv]
        return [*_bwrap_mounts(writable), *_bwrap_flags(self.drop_uid, die_with_parent, chdir), "--", *argv]


def _bind_back(tmpfs: list[str], writable: list[Path]) -> list[str]:
    """What must stay reachable under directories covered by an empty tmpfs: Python, the workspaces."""
    return _outermost([p for p in [*_python_paths(), *map(str, writable)] if _under(p, tmpfs)])


def _private_ancestors() -> list[str]:
    """For each Python path, the outermost directory other users cannot pass through (/root for a pyenv there,
    a 0700 `mktemp -d` holding a fresh clone and its .venv): covered and the Python bound back, like the home."""
    out = []
    for p in _python_paths():
        for d in reversed([Path(p), *Path(p).parents]):
            if not os.stat(d).st_mode & 0o001:
                out.append(str(d))
                break
    return out


def _with_mounts(argv: list[str], writable: list[Path]) -> list[str]:
    """Runner arguments that make it hide the private dirs (in its own mount namespace) before anything else."""
    hidden = _outermost([*_hidden_dirs(), *_private_ancestors()])
    mounts = {"tmpfs": hidden, "bind": _bind_back(hidden, writable)}
    at = argv.index(str(RUNNER)) + 1
    return [*argv[:at], "--mounts", json.dumps(mounts), *argv[at:]]


@functools.cache
def _bwrap_path() -> str | None:
    """bubblewrap's path on PATH, also when it exists but cannot be executed (so that this can be said)."""
    found = [Path(d) / "bwrap" for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    return next((str(p) for p in found if p.exists()), None)


def _bwrap_mounts(writable: list[Path]) -> list[str]:
    cmd = [_bwrap_path() or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    hidden = _hidden_dirs()
    tmpfs = ["/tmp", *hidden]

    def parents(path: str) -> list[str]:
        # bwrap creates the parents of a mount point on a tmpfs as 0700: make them traversable.
        out = []
        for parent in reversed(Path(path).parents):
            if any(str(parent).startswith(t.rstrip("/") + "/") for t in tmpfs):
                out += ["--perms", "0755", "--dir", str(parent)]
        return out

    for h in hidden:
        cmd += ["--tmpfs", h]
    # The interpreter, a virtualenv or the package itself may live under /tmp or a hidden home (a clone in
    # /tmp, pyenv under /root): bind those back read-only, or the sandbox could not even start Python.
    for p in _python_paths():
        if _under(p, tmpfs):
            cmd += [*parents(p), "--ro-bind", p, p]
    for w in writable:
        cmd += [*parents(str(w)), "--bind", str(w), str(w)]
    return [*cmd, "--remount-ro", "/tmp"]


def _bwrap_flags(drop_uid: bool, die_with_parent: bool, chdir: Path) -> list[str]:
    cmd = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    cmd += ["--die-with-parent"] if die_with_parent else []
    cmd += ["--new-session", "--chdir", str(chdir)]
    if drop_uid:
        return [*cmd, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [*cmd, "--unshare-user"]


def runner_argv(*args: str) -> list[str]:
    # -E/-s: ignore PYTHON* variables and the user site; -B: no .pyc writes (the tree is read-only anyway).
    return [sys.executable, "-E", "-s", "-B", str(RUNNER), *args]


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


def python_reachable_by_others() -> bool:
    """Whether an unprivileged uid can reach the interpreter's files (false for a Python under /root)."""
    return not _private_ancestors()


@functools.cache
def bwrap_problem() -> str | None:
    """None when bubblewrap works here; else one line saying why not (missing, or present but unusable)."""
    path = _bwrap_path()
    if path is None:
        return "bubblewrap is not installed"
    why = _probe(Confinement("bwrap", drop_uid=is_root()).command([], Path("/"), ["true"]))
    return None if why is None else f"bubblewrap ({path}) is installed but cannot start here: {why}"


def _fallback() -> Confinement:
    net: tuple[str, ...] = ()
    if shutil.which("unshare"):
        for prefix in (("unshare", "-n"), ("unshare", "-r", "-n")):
            if _probe([*prefix, "true"]) is None:
                net = prefix
                break
    if not is_root() or python_reachable_by_others():
        return Confinement("fallback", drop_uid=is_root(), unshare=net)
    # Python lives where only root can read: a private mount namespace makes it reachable to the sandbox uid.
    for prefix in (("unshare", "-m", "-n"), ("unshare", "-m")) if shutil.which("unshare") else ():
        hidden = Confinement("fallback", drop_uid=True, unshare=prefix, hide_home=True)
        if _probe(hidden.command([], Path("/"), runner_argv("probe", str(PROBE_UID)))) is None:
            return hidden
    return Confinement("fallback", drop_uid=False, unshare=net)


@functools.cache
def _detect(mode: str) -> Confinement:
    problem = bwrap_problem() if mode != "fallback" else None
    if mode != "fallback" and problem is None:
        return Confinement("bwrap", drop_uid=is_root())
    if mode == "bwrap":
        raise MappaError(f"sandbox confinement 'bwrap': {problem}")
    return _fallback()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise MappaError(f"sandbox confinement {mode!r}: expected one of {', '.join(MODES)}")


def detect_confinement(mode: ConfinementMode = "auto") -> Confinement:
    """'auto': bwrap when it works here, else the fallback with a one-time warning; 'bwrap': required or
    MappaError; 'fallback': forced (warned about only when snippets would then run as root)."""
    _check_mode(mode)
    conf = _detect(mode)
    if mode not in _announced:
        _announced.add(mode)
        if (mode == "auto" and conf.kind == "fallback") or (is_root() and not conf.drop_uid):
            why = bwrap_problem() or "fallback requested"
            warnings.warn(
                f"mappa sandbox: {why}; {describe_confinement(conf)}. "
                "Install bubblewrap (apt-get install bubblewrap) for full confinement.",
                RuntimeWarning,
                stacklevel=3,
            )
    return conf


def describe_confinement(confinement: Confinement | ConfinementMode = "auto") -> str:
    """One line naming the confinement in use and what it leaves open, for the first lines of a run.

    Given a mode, it detects (once per process) and counts as the announcement: no warning follows.
    """
    if isinstance(confinement, str):
        _check_mode(confinement)
        _announced.add(confinement)
        confinement = _detect(confinement)
    c = confinement
    if c.kind == "bwrap":
        who = "one unprivileged uid per workspace" if c.drop_uid else "your uid in a user namespace"
        return (
            f"sandbox: bubblewrap (read-only root, private /tmp, no network, own PID namespace, {who}; "
            "limits: time, CPU, resident memory, processes, file size)"
        )
    net = "network blocked" if c.network_blocked else "NETWORK OPEN"
    if is_root() and not c.drop_uid:
        return (
            f"sandbox: fallback without bubblewrap, snippets RUN AS ROOT (Python under {sys.base_prefix} is "
            f"private to root and no mount namespace is allowed); {net}; NOT confined: every file and every "
            "process of the machine, the process count; only time, CPU, resident-memory and file-size limits apply"
        )
    if c.drop_uid:
        hidden = "; private homes and dirs hidden, Python bound back" if c.hide_home else ""
        return (
            f"sandbox: fallback without bubblewrap (one unprivileged uid per workspace{hidden}, {net}; limits: "
            "time, CPU, resident memory, processes, file size); NOT confined: writes to world-writable places "
            "such as /tmp and /dev/shm, reading world-readable files"
        )
    return (
        f"sandbox: fallback without bubblewrap (your uid, own session, {net}; limits: time, CPU, resident "
        "memory, processes, file size); NOT confined: any file you can read or write, processes that leave "
        "their session"
    )


def clear_detection() -> None:
    """Forget what was probed and announced (tests that change PATH or the machine's state)."""
    _bwrap_path.cache_clear()
    bwrap_problem.cache_clear()
    _detect.cache_clear()
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
