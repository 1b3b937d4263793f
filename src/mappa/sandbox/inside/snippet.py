"""One snippet in a forked child of the runner: enter the sandbox, run the code, and the processes above it.

The child starts a new session, sets its rlimits, drops to the workspace's uid, chdirs into the workspace
and executes the code as a fresh `__main__` module. With `spec["isolate"]` the child (the relay) makes the
snippet's own namespaces (jail.isolate), and its next child is the first process of the snippet's own PID
namespace (the init): it mounts that namespace's /proc, forks the snippet and waits for it. When the snippet
ends, the init reports its wait status and exits, and the kernel kills whatever the snippet left running in the
namespace; the relay exits as the init did, so by then nothing of the snippet is left.

Faults of the sandbox itself reach the host only through the report channel (`report_fd`): a pipe that the relay,
the init and the snippet's set-up write JSON lines to, and that the snippet's own code never holds (closed before it
runs; the processes above it are another uid, or keep capabilities it lacks, so /proc/PID/fd cannot reach theirs).
What the snippet prints or its exit status can never make a fault.
"""

from __future__ import annotations

import atexit
import builtins
import json
import linecache
import os
import resource
import sys
import threading
import traceback
import types

from .jail import isolate, libc, mount_proc, restrict
from .police import watch_namespace

# Exit status of a child that failed before the snippet ran (the report channel says why).
RUNNER_FAILED = 254
RUNNER_TAG = "mappa-runner:"
SNIPPET_NAME = "<snippet>"
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4


def report(fd: int, record: dict) -> None:
    """One JSON line on the report channel (a pipe: writes this small are atomic)."""
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass


def read_report(fd: int, limit: int = 1 << 16) -> dict:
    """Everything the report channel holds, merged (later lines win); `fd` is non-blocking and stays open."""
    data = b""
    while len(data) < limit:
        try:
            chunk = os.read(fd, limit - len(data))
        except (BlockingIOError, InterruptedError):
            break
        if not chunk:
            break
        data += chunk
    out: dict = {}
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.update(rec)
    return out


def _exit_as(status: int) -> None:
    """Exit the way a child ended (its exit code, or killed by the same signal)."""
    if os.WIFSIGNALED(status):
        import signal

        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os.kill(os.getpid(), signal.SIGKILL)  # a signal whose default is to continue: still end as killed
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def relay(init: int, spec: dict, report_fd: int) -> None:
    """Above the snippet's PID namespace, inside its other namespaces: watch what the snippet pins (police.py),
    wait for the init, then exit as it did. The init's exit waits until the kernel has killed and reaped every
    process of the namespace, so once the relay is gone nothing of the snippet runs: the server replies only then."""
    status, exceeded = watch_namespace(init, spec["memory_mb"])
    if exceeded:
        report(report_fd, {"memory_exceeded": True})
    _exit_as(status)


def init(snippet: int, report_fd: int) -> None:
    """PID 1 of the snippet's namespace: reap what is re-parented here; when the snippet ends, report its status
    and exit (the kernel then kills the rest). As PID 1 it ignores the namespace's signals (no handlers), so the
    snippet can neither stop nor kill it; the host still can, from outside."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(RUNNER_FAILED)
        if done == snippet:
            report(report_fd, {"wait_status": status})
            os._exit(0)


def enter_snippet(spec: dict) -> None:
    """In the snippet's own process (below the init when isolated): limits, uid drop, restrictions, workspace.

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
    libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the runner is not dumpable; the snippet is an ordinary process
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


def _die_with_parent() -> None:
    libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)


def enter_namespaces(spec: dict, report_fd: int) -> None:
    """New session; when isolated, the snippet's own namespaces: this process stays behind as the relay, its child
    becomes the namespace's init and the init's child continues here as the snippet."""
    os.setsid()  # own process group: the runner can kill the snippet's whole group
    if not spec.get("isolate"):
        return
    _die_with_parent()
    isolate(spec)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid != 0:
        os.close(ready_w)
        os.read(ready_r, 1)  # the init has mounted its namespace's /proc, which the relay watches (or it died: EOF)
        os.close(ready_r)
        relay(pid, spec, report_fd)
    os.close(ready_r)
    _die_with_parent()
    mount_proc()
    os.close(ready_w)
    libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the init holds the report channel: its /proc is root's
    pid = os.fork()
    if pid != 0:
        init(pid, report_fd)
    _die_with_parent()


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


def child(spec: dict, code: str, report_fd: int) -> None:
    """Never returns: a forked child must not fall back into the runner's own loop. Every descriptor but the
    standard streams and the report channel is closed first (the server's socket, other snippets' pipes)."""
    try:
        os.closerange(3, report_fd)
        os.closerange(report_fd + 1, 1 << 20)
        libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the runner is not (runner.py); its watchdog reads our /proc
        try:
            enter_namespaces(spec, report_fd)
            enter_snippet(spec)
        except BaseException as e:
            why = f"could not enter the sandbox: {type(e).__name__}: {e}"
            report(report_fd, {"setup_failed": why})
            os.write(2, f"{RUNNER_TAG} {why}\n".encode())
            os._exit(RUNNER_FAILED)
        os.close(report_fd)
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
