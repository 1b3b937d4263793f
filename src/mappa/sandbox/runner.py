"""The process that runs inside the confinement: applies the limits, drops to the sandbox uid, runs snippets.

Standard library only, and started as a script (never imported by mappa), so that it starts in tens of
milliseconds and owns no state of the host. Two modes:

    runner.py once STATUS_FD CODE_FD SPEC_JSON   run one snippet; write its wait status to STATUS_FD
    runner.py serve SOCK_FD PRELOAD_JSON         fork server: pre-import modules once, fork one child per snippet

In both modes the snippet runs in a forked child, so its parent is this runner: a snippet that kills its
parent (`os.kill(os.getppid(), 9)`) hits a process of another uid (when root) or at worst this runner, never
the trainer. The child starts a new session, sets its rlimits, drops to the workspace's uid, chdirs into the
workspace and executes the code as a fresh `__main__` module.
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import json
import linecache
import os
import resource
import selectors
import socket
import sys
import threading
import time
import traceback
import types

# Exit status of a child that failed before the snippet ran (the host reports it as an infra error).
RUNNER_FAILED = 254
RUNNER_TAG = "mappa-runner:"
SNIPPET_NAME = "<snippet>"


def _vsz_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def enter_snippet(spec: dict) -> None:
    """In the forked child: new session, limits, uid drop, workspace. Raises OSError on failure."""
    os.setsid()  # own process group: the runner can kill the snippet's whole group
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    memory = spec["memory_mb"] << 20
    if spec.get("memory_on_top"):
        # A pool child starts with the server's preloaded modules mapped (shared, copy-on-write): the
        # snippet's budget is counted on top of them so that it matches a cold run's headroom.
        memory += _vsz_bytes()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_mb"] << 20, spec["fsize_mb"] << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    # RLIMIT_NPROC counts the processes of the real uid; with a uid of its own per workspace it is exact.
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    workspace = spec["workspace"]
    os.chdir(workspace)
    os.environ.update(HOME=workspace, TMPDIR=workspace, PWD=workspace)
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile.tempdir = None  # forget a temp dir the server may have computed
    sys.path[0] = workspace  # helper modules the agents saved are importable, the runner's folder is not
    sys.argv = [SNIPPET_NAME]


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
            enter_snippet(spec)
        except BaseException as e:
            os.write(2, f"{RUNNER_TAG} could not enter the sandbox: {e!r}\n".encode())
            os._exit(RUNNER_FAILED)
        run_code(code)
    finally:
        os._exit(1)


def _read_fd(fd: int) -> str:
    chunks = []
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def main_once(status_fd: int, code_fd: int, spec: dict) -> None:
    code = _read_fd(code_fd)
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        child(spec, code)
    os.write(status_fd, (json.dumps({"pid": pid}) + "\n").encode())
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    os.write(status_fd, (json.dumps({"wait_status": status}) + "\n").encode())
    os._exit(0)


def _has_processes(uid: int) -> bool:
    """Whether a live (non-zombie) process of `uid` other than this one is visible in /proc."""
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    return True
        except (OSError, IndexError):
            continue  # it exited while we looked
    return False


def sweep(uid: int | None, pid: int) -> None:
    """Kill every process the snippet left behind, even those that started their own session.

    With a uid per workspace, a helper that becomes that uid and calls kill(-1, SIGKILL) reaches exactly
    the snippet's processes in this PID namespace (repeated: a fork bomb races the first round). Without
    one, the snippet's process group is all we know.
    """
    if uid is None:
        try:
            os.killpg(pid, 9)
        except OSError:
            pass
        return
    helper = os.fork()
    if helper == 0:
        try:
            os.setuid(uid)
            for _ in range(1000):
                try:
                    os.kill(-1, 9)
                except ProcessLookupError:
                    pass
                if not _has_processes(uid):
                    break
        finally:
            os._exit(0)
    os.waitpid(helper, 0)


def main_serve(sock_fd: int, preload: list[str]) -> None:
    sock = socket.socket(fileno=sock_fd)
    failed = []
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:
            failed.append(f"{name}: {e!r}")
    import gc

    gc.collect()
    gc.freeze()  # keep the preloaded objects out of the children's collections: pages stay shared
    sock.send(json.dumps({"ready": True, "failed": failed}).encode())
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    running: dict[int, dict] = {}  # pidfd -> request state
    while True:
        now = time.monotonic()
        deadlines = [r["deadline"] for r in running.values() if not r["timed_out"]]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for key, _ in sel.select(timeout):
            if key.fileobj is sock:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
                if not msg:
                    os._exit(0)  # the host went away
                req = json.loads(msg)
                code_fd, out_fd, err_fd = fds
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    sock.close()
                    for pidfd in running:
                        os.close(pidfd)
                    os.dup2(out_fd, 1)
                    os.dup2(err_fd, 2)
                    os.close(out_fd)
                    os.close(err_fd)
                    child(req["spec"], _read_fd(code_fd))
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                running[pidfd] = {
                    "id": req["id"],
                    "pid": pid,
                    "uid": req["spec"]["uid"],
                    "deadline": time.monotonic() + req["timeout_s"],
                    "timed_out": False,
                }
                sel.register(pidfd, selectors.EVENT_READ)
            else:
                pidfd = key.fileobj
                r = running.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(r["pid"], 0)
                sweep(r["uid"], r["pid"])
                reply = {"id": r["id"], "wait_status": status, "timed_out": r["timed_out"]}
                sock.send(json.dumps(reply).encode())
        now = time.monotonic()
        for r in running.values():
            if not r["timed_out"] and now >= r["deadline"]:
                r["timed_out"] = True
                sweep(r["uid"], r["pid"])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "once":
        main_once(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
    elif mode == "serve":
        main_serve(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        raise SystemExit(f"{RUNNER_TAG} unknown mode {mode!r}")
