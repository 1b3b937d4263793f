"""One snippet in a forked child of the runner: enter the sandbox, run the code, and the relay above it.

The child starts a new session, sets its rlimits, drops to the workspace's uid, chdirs into the workspace
and executes the code as a fresh `__main__` module. Its parent is the runner, so a snippet that kills its
parent (`os.kill(os.getppid(), 9)`) hits a process of another uid (when root) or at worst the runner, never
the trainer. With `spec["isolate"]` it gets its own namespaces (jail.isolate) and runs below a relay, a child
subreaper that kills whatever the snippet left running (daemons that left its session too) when it ends.
"""

from __future__ import annotations

import atexit
import builtins
import linecache
import os
import resource
import sys
import threading
import traceback
import types

from .jail import isolate, libc, restrict
from .police import kill_descendants

# Exit status of a child that failed before the snippet ran (the host reports it as an infra error).
RUNNER_FAILED = 254
RUNNER_TAG = "mappa-runner:"
SNIPPET_NAME = "<snippet>"


def relay(pid: int) -> None:
    """The process above the snippet, a child subreaper: whatever the snippet leaves running (daemons that
    left its session included) is re-parented here and killed when the snippet ends; then exit as it did."""
    status = None
    while True:
        try:
            done, st = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        if done == pid:
            status = st
        if status is not None:
            kill_descendants()
    if status is None:
        os._exit(RUNNER_FAILED)
    if os.WIFSIGNALED(status):
        import signal

        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os.kill(os.getpid(), signal.SIGKILL)  # a signal whose default is to continue: still end as killed
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def enter_snippet(spec: dict) -> None:
    """In the forked child (the snippet's init when isolated): limits, uid drop, restrictions, workspace.

    Raises OSError on failure."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # should memory run out before the watchdog acts, the kernel kills snippets first
    except OSError:
        pass
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_mb"] << 20, spec["fsize_mb"] << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], spec["nofile"]))
    # RLIMIT_NPROC counts the processes of the real uid; with a uid of its own per workspace it is exact.
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    restrict(keep_uid=spec["uid"] is None)
    workspace = spec["workspace"]
    os.chdir(workspace)
    os.environ.update(HOME=workspace, TMPDIR=workspace, PWD=workspace)
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile.tempdir = None  # forget a temp dir the server may have computed
    sys.path[0] = workspace  # helper modules the agents saved are importable, the runner's folder is not
    # Nor its package, already imported: a module of the same name in the workspace imports as itself.
    for name in [m for m in sys.modules if m == __package__ or m.startswith(f"{__package__}.")]:
        del sys.modules[name]
    sys.argv = [SNIPPET_NAME]


def enter_namespaces(spec: dict) -> None:
    """New session; when isolated, the snippet's own namespaces, continuing in their init process (this
    process stays behind as the relay that reports how the snippet ended)."""
    os.setsid()  # own process group: the runner can kill the snippet's whole group
    if not spec.get("isolate"):
        return
    isolate(spec)
    libc().prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the snippet come back to the relay
    pid = os.fork()
    if pid != 0:
        relay(pid)
    libc().prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL when the relay goes


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def run_code(code: str) -> None:
    """Run `code` as a fresh `__main__`, print its traceback like `python file.py` would, and _exit."""
    linecache.cache[SNIPPET_NAME] = (len(code), None, code.splitlines(True), SNIPPET_NAME)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    try:
        sys.stdout.reconfigure(line_buffering=True)  # output printed before a timeout is not lost
    except Exception:
        pass
    status = 0
    try:
        exec(compile(code, SNIPPET_NAME, "exec"), main.__dict__)
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as e:
        status = 1
        try:
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # hide this frame
            traceback.print_exception(type(e), e, tb)
        except BaseException:
            # Too little memory left even to format the traceback (or no stderr left): still try to say why.
            try:
                os.write(2, f"{type(e).__name__}\n".encode())
            except OSError:
                pass
    try:
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass  # the snippet closed or broke its stdout: what it printed is gone, the status is not
    os._exit(status)


def child(spec: dict, code: str) -> None:
    """Never returns: a forked child must not fall back into the runner's own loop."""
    try:
        try:
            enter_namespaces(spec)
            enter_snippet(spec)
        except BaseException as e:
            os.write(2, f"{RUNNER_TAG} could not enter the sandbox: {type(e).__name__}: {e}\n".encode())
            os._exit(RUNNER_FAILED)
        run_code(code)
    finally:
        os._exit(1)


def read_fd(fd: int) -> str:
    """Everything written to `fd` (the snippet's code), decoded; `fd` is closed."""
    chunks = []
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")
