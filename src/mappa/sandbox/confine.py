"""How a snippet is confined on this machine: bubblewrap when it works, else a documented fallback.

`detect_confinement()` probes once per process and says which of the two is used; the fallback is
announced with a one-time warning, never silently.

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

Fallback (no usable bwrap): rlimits, a process group, `unshare -n` for the network where the OS allows it,
and, as root, the same per-workspace uid drop. It does not stop writes to world-writable places (/tmp,
/dev/shm) nor, when not root, anywhere the user can write; without root or `unshare`, the network is open.
As root it needs a Python installation that other users can read: one under /root (as on some build
machines) leaves snippets only the modules the runner imported before dropping the uid; the warning says so.
"""

from __future__ import annotations

import functools
import itertools
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
_uid_counter = itertools.count()


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
    net_prefix: tuple[str, ...] = ()  # fallback: `unshare -n` (or -rn) where it works

    def command(self, writable: list[Path], chdir: Path, argv: list[str], die_with_parent: bool = True) -> list[str]:
        """The full command line that runs `argv` confined, with `writable` directories bound read-write.

        `die_with_parent=False` for the long-lived pool server: the kernel's parent-death signal follows the
        *thread* that started it, and the server exits by itself when the host's end of its socket closes.
        """
        if self.kind == "fallback":
            return [*self.net_prefix, *argv]
        cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
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
            if any(p == h or p.startswith(h.rstrip("/") + "/") for h in tmpfs):
                cmd += [*parents(p), "--ro-bind", p, p]
        for w in writable:
            cmd += [*parents(str(w)), "--bind", str(w), str(w)]
        cmd += ["--remount-ro", "/tmp"]
        cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        cmd += ["--die-with-parent"] if die_with_parent else []
        cmd += ["--new-session", "--chdir", str(chdir)]
        if self.drop_uid:
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            cmd += ["--unshare-user"]
        return [*cmd, "--", *argv]


def runner_argv(*args: str) -> list[str]:
    # -E/-s: ignore PYTHON* variables and the user site; -B: no .pyc writes (the tree is read-only anyway).
    return [sys.executable, "-E", "-s", "-B", str(RUNNER), *args]


def _probe(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30, env=sandbox_env("/")).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def python_reachable_by_others() -> bool:
    """Whether an unprivileged uid can reach the interpreter's files (false for a Python under /root)."""
    for p in {sys.base_prefix, sys.prefix}:
        path = Path(os.path.realpath(p))
        for d in [path, *path.parents]:
            if not os.stat(d).st_mode & 0o001:
                return False
    return True


@functools.cache
def _detect(mode: str) -> Confinement:
    root = is_root()
    if mode in ("auto", "bwrap") and shutil.which("bwrap"):
        bw = Confinement("bwrap", drop_uid=root)
        if _probe(bw.command([], Path("/"), ["true"])):
            return bw
    if mode == "bwrap":
        raise MappaError("sandbox confinement 'bwrap': bubblewrap is missing or cannot start here")
    net: tuple[str, ...] = ()
    if shutil.which("unshare"):
        for prefix in (("unshare", "-n"), ("unshare", "-r", "-n")):
            if _probe([*prefix, "true"]):
                net = prefix
                break
    if mode == "auto":
        what = "network blocked" if net else "NETWORK OPEN"
        who = "per-workspace uid" if root else "same uid as you, files outside the workspace NOT protected"
        if root and not python_reachable_by_others():
            who += f"; Python under {sys.base_prefix} is private to root, so snippets can only use modules already imported"
        warnings.warn(
            f"mappa sandbox: bubblewrap unavailable; using the fallback confinement (rlimits, {what}, {who}). "
            "Install bubblewrap (apt-get install bubblewrap) for full confinement.",
            RuntimeWarning,
            stacklevel=3,
        )
    return Confinement("fallback", drop_uid=root, net_prefix=net)


def detect_confinement(mode: Literal["auto", "bwrap", "fallback"] = "auto") -> Confinement:
    """'auto': bwrap when it works here, else the fallback with a one-time warning; 'bwrap': required."""
    if mode not in ("auto", "bwrap", "fallback"):
        raise MappaError(f"sandbox confinement {mode!r}: expected auto, bwrap or fallback")
    return _detect(mode)


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
