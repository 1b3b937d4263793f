"""The process that runs inside the confinement: applies the limits, drops to the sandbox uid, runs snippets.

Standard library only, and started as a script (never imported by mappa), so that it starts in tens of
milliseconds and owns no state of the host. Three modes:

    runner.py [--root JSON] once STATUS_FD CODE_FD SPEC   one snippet; its wait status goes to STATUS_FD
    runner.py [--root JSON] serve SOCK_FD PRELOAD_JSON    fork server: pre-import once, fork per snippet
    runner.py [--root JSON] probe SPEC                    exit 0 when a snippet's set-up works here

`--root` (the fallback inside `unshare -m`): build the allowlisted root (confine.root_plan) on a tmpfs from
bind mounts, chroot into it and execute the runner again from there, as bubblewrap does from its options.

With `spec["isolate"]` each snippet gets its own mount and IPC namespaces (a fresh size-limited /dev/shm, the
other workspaces covered, no IPC shared with any other snippet) and runs below a relay, a child subreaper
that kills whatever the snippet left running (daemons that left its session too) when it ends. A seccomp filter refuses the calls that hold
memory outside any process's resident set (memfd_create, System V shared memory, message queues).

In every mode the snippet runs in a forked child, so its parent is this runner: a snippet that kills its
parent (`os.kill(os.getppid(), 9)`) hits a process of another uid (when root) or at worst this runner, never
the trainer. The child starts a new session, sets its rlimits, drops to the workspace's uid, chdirs into the
workspace and executes the code as a fresh `__main__` module.

Memory is bounded by a watchdog, not an address-space limit (which counts what numpy, pyarrow or torch
reserve rather than what they use): every WATCH_INTERVAL_S the runner sums the resident anonymous and
shared memory (RssAnon + RssShmem; file-backed pages are page cache the kernel can drop) of the snippet's
processes and kills them all when the sum passes `memory_mb`. A peak shorter than one interval can pass
unnoticed; snippets also get the highest OOM score, so the kernel's OOM killer takes them before the host.
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import json
import linecache
import os
import resource
import select
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
WATCH_INTERVAL_S = 0.05  # memory sampling period: ~0.1 ms of /proc reads per running snippet
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_PRIVATE = 1 << 18
CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
NEW_ROOT = "/mnt"  # where the fallback assembles the allowlisted root before chrooting into it
_libc = None


def libc():  # noqa: ANN201 - ctypes is imported only where namespaces are used
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    import ctypes

    enc = [x.encode() if x is not None else None for x in (source, target, fstype, data)]
    _check(libc().mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {source} on {target}")


def _mount_point(path: str, like: str) -> None:
    """A directory or an empty file at `path`, whichever `like` is (bind mounts need the same kind)."""
    if os.path.isdir(like):
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def _bind(source: str, target: str, read_only: bool) -> None:
    _mount_point(target, source)
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _tmpfs(target: str, size_mb: int | None, mode: str) -> None:
    os.makedirs(target, mode=0o755, exist_ok=True)
    size = f",size={size_mb}m" if size_mb is not None else ""
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}{size}")


def build_root(ops: list) -> None:
    """In a fresh mount namespace: assemble the allowlisted root under NEW_ROOT, then chroot into it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    _tmpfs(NEW_ROOT, None, "0755")
    for op in ops:
        kind, at = op[0], NEW_ROOT + op[-1] if op[0] in ("ro", "rw", "link") else NEW_ROOT + op[1]
        if kind == "dir":
            os.makedirs(at, mode=0o755, exist_ok=True)
            os.chmod(at, 0o755)
        elif kind in ("ro", "rw"):
            _bind(op[1], at, kind == "ro")
        elif kind == "link":
            os.symlink(op[1], at)
        elif kind == "tmpfs":
            _tmpfs(at, op[2], op[3])
        elif kind == "dev":
            _tmpfs(at, 1, "0755")
            for name in ("null", "zero", "full", "random", "urandom"):
                _bind(f"/dev/{name}", f"{at}/{name}", False)
        elif kind == "proc":
            if os.getpid() == 1:  # our own PID namespace: a procfs of its processes alone (no host environ, argv)
                os.makedirs(at, mode=0o755, exist_ok=True)
                mount("proc", at, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            else:
                _bind("/proc", at, False)
        elif kind == "remount_ro":
            mount(None, at, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(NEW_ROOT)
    os.chdir("/")


def isolate(spec: dict) -> None:
    """The snippet's own namespaces (in the forked child, before the uid drop): mounts and IPC.

    Its /dev/shm is a fresh tmpfs of `shm_mb`, and the directory holding the workspaces is covered with only
    this snippet's workspace bound back, so a pooled snippet sees no other episode's files. Both namespaces
    end with the snippet's last process, and what it held in them with it."""
    _check(libc().unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    _tmpfs("/dev/shm", spec["shm_mb"], "1777")
    workspace = spec.get("workspace")
    if workspace and os.path.dirname(workspace) not in ("/", ""):
        keep = os.open(workspace, os.O_PATH | os.O_DIRECTORY)
        _tmpfs(os.path.dirname(workspace), 1, "0755")
        os.makedirs(workspace, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{keep}", workspace, None, MS_BIND | MS_REC)
        os.close(keep)


def _kill_descendants() -> None:
    for p in snippet_pids(os.getpid(), None, skip_root=True):
        try:
            os.kill(p, 9)
        except OSError:
            pass


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
            _kill_descendants()
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


# Calls refused to snippets, per architecture (AUDIT_ARCH value, syscall numbers): memfd_create and
# memfd_secret, System V shm/sem/msg and POSIX message queues. Their memory is in no process's resident set,
# so the watchdog could not see it; data-science code does not need them (multiprocessing uses /dev/shm).
_X32 = 0x40000000
SECCOMP_DENY = {
    0xC000003E: (319, 447, 29, 64, 68, 240, *(_X32 | n for n in (319, 447, 29, 64, 68, 240))),  # x86_64, x32
    0x40000003: (356, 447, 117, 395, 393, 399, 277),  # i386 (117: the ipc() multiplexer)
    0xC00000B7: (279, 447, 194, 190, 186, 180),  # aarch64
}


def seccomp_program() -> bytes:
    """A classic-BPF seccomp filter: EPERM for the calls in SECCOMP_DENY, everything else allowed."""
    import struct

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    prog = [ins(ld_w_abs, 4)]  # seccomp_data.arch
    for arch, nrs in SECCOMP_DENY.items():
        block = [ins(ld_w_abs, 0)]  # seccomp_data.nr
        for i, nr in enumerate(nrs):
            block.append(ins(jeq_k, nr, jt=len(nrs) - i, jf=0))
        block += [ins(ret_k, allow), ins(ret_k, eperm)]
        prog.append(ins(jeq_k, arch, jt=0, jf=len(block)))
        prog += block
    prog.append(ins(ret_k, allow))
    return b"".join(prog)


def restrict(keep_uid: bool) -> None:
    """After the uid drop: no new privileges, no capabilities left (a snippet that kept the user's uid had
    the user namespace's), and the seccomp filter."""
    import ctypes

    lib = libc()
    _check(lib.prctl(38, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if keep_uid:
        lib.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
        for cap in range(64):
            lib.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails quietly past the last capability)
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
        data = (ctypes.c_uint32 * 6)()
        _check(lib.syscall(126 if os.uname().machine == "x86_64" else 91, header, data), "capset")
    program = seccomp_program()
    buf = ctypes.create_string_buffer(program)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(lib.prctl(22, 2, ctypes.byref(fprog), 0, 0), "prctl(SECCOMP)")


def resident_bytes(pid: int) -> int:
    """Resident anonymous + shared memory of one process (0 when it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return 0
    kb = 0
    for line in text.split(b"\n"):
        if line.startswith((b"RssAnon:", b"RssShmem:")):
            kb += int(line.split()[1])
    return kb << 10


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def snippet_pids(pid: int, uid: int | None, skip_root: bool = False) -> list[int]:
    """The snippet's processes: all of its uid (exact, also those that left the tree), else its descendants.

    `skip_root`: `pid` is the relay above the snippet, a copy of this runner, not the
    snippet (charging it would count the preloaded modules twice)."""
    if uid is not None:
        return pids_of_uid(uid)
    tree, i = [pid], 0
    while i < len(tree) and len(tree) < 4096:  # breadth-first; the cap bounds the cost of a fork bomb
        tree += _children(tree[i])
        i += 1
    return tree[1:] if skip_root else tree


def over_memory(pid: int, uid: int | None, limit_mb: int, skip_root: bool = False) -> list[int] | None:
    """The snippet's processes when their resident memory is above the limit, else None."""
    pids = snippet_pids(pid, uid, skip_root)
    return pids if sum(resident_bytes(p) for p in pids) > limit_mb << 20 else None


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


def _read_fd(fd: int) -> str:
    chunks = []
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def wait_watching(pid: int, spec: dict) -> tuple[int, bool]:
    """Wait for the snippet `pid`, killing all its processes if their memory passes the limit.

    Returns (wait status, memory_exceeded).
    """
    pidfd = os.pidfd_open(pid)
    exceeded = False
    try:
        while not select.select([pidfd], [], [], WATCH_INTERVAL_S)[0]:
            if not exceeded:
                pids = over_memory(pid, spec["uid"], spec["memory_mb"], bool(spec.get("isolate")))
                if pids is not None:
                    exceeded = True
                    stop(spec["uid"], pid, pids)
    finally:
        os.close(pidfd)
    while True:
        try:
            return os.waitpid(pid, 0)[1], exceeded
        except InterruptedError:
            continue


def main_once(status_fd: int, code_fd: int, spec: dict) -> None:
    code = _read_fd(code_fd)
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        child(spec, code)
    os.write(status_fd, (json.dumps({"pid": pid}) + "\n").encode())
    status, exceeded = wait_watching(pid, spec)
    os.write(status_fd, (json.dumps({"wait_status": status, "memory_exceeded": exceeded}) + "\n").encode())
    os._exit(0)


def main_probe(spec: dict) -> None:
    """Exit 0 when a snippet's set-up works here: its namespaces (if asked), the uid drop, the restrictions,
    and importing standard-library modules the runner has not imported yet."""
    pid = os.fork()
    if pid == 0:
        try:
            enter_namespaces(spec)
            if spec["uid"] is not None:
                os.setgroups([])
                os.setgid(spec["uid"])
                os.setuid(spec["uid"])
            restrict(keep_uid=spec["uid"] is None)
            import csv  # noqa: F401
            import pickle  # noqa: F401
        except BaseException as e:
            os.write(2, f"{RUNNER_TAG} the sandbox's set-up failed: {e!r}\n".encode())
            os._exit(1)
        os._exit(0)
    os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))


def pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes of `uid` other than this one, as visible in /proc."""
    me = str(os.getpid())
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    out.append(int(name))
        except (OSError, IndexError):
            continue  # it exited while we looked
    return out


def sweep(uid: int | None, pid: int) -> None:
    """Kill every process the snippet left behind, even those that started their own session.

    With a uid per workspace, a helper that becomes that uid and calls kill(-1, SIGKILL) reaches exactly
    the snippet's processes in this PID namespace (repeated: a fork bomb races the first round). Without
    one, the snippet's process group is all we know.
    """
    if uid is None:
        for p in snippet_pids(pid, None):  # the tree first: a snippet may have left the group
            try:
                os.kill(p, 9)
            except OSError:
                pass
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
                if not pids_of_uid(uid):
                    break
        finally:
            os._exit(0)
    os.waitpid(helper, 0)


def stop(uid: int | None, pid: int, pids: list[int]) -> None:
    """Kill the snippet over its memory limit: the processes just measured, then the usual sweep."""
    for p in pids:
        try:
            os.kill(p, 9)
        except OSError:
            pass
    sweep(uid, pid)


def _start_request(sock: socket.socket, running: dict[int, dict], sel: selectors.BaseSelector) -> None:
    """Receive one request and fork its snippet; the child never returns from here."""
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
        "memory_mb": req["spec"]["memory_mb"],
        "isolate": bool(req["spec"].get("isolate")),
        "deadline": time.monotonic() + req["timeout_s"],
        "timed_out": False,
        "memory_exceeded": False,
    }
    sel.register(pidfd, selectors.EVENT_READ)


def _police(running: dict[int, dict], watch: bool) -> None:
    """Kill snippets past their deadline and, when `watch`, those over their memory limit."""
    now = time.monotonic()
    for r in running.values():
        if r["timed_out"] or r["memory_exceeded"]:
            continue
        if now >= r["deadline"]:
            r["timed_out"] = True
            sweep(r["uid"], r["pid"])
        elif watch:
            pids = over_memory(r["pid"], r["uid"], r["memory_mb"], r["isolate"])
            if pids is not None:
                r["memory_exceeded"] = True
                stop(r["uid"], r["pid"], pids)


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
    next_watch = time.monotonic()
    while True:
        live = [r for r in running.values() if not (r["timed_out"] or r["memory_exceeded"])]
        wake = [r["deadline"] for r in live] + ([next_watch] if live else [])
        timeout = max(0.0, min(wake) - time.monotonic()) if wake else None
        for key, _ in sel.select(timeout):
            if key.fileobj is sock:
                _start_request(sock, running, sel)
                continue
            pidfd = key.fileobj
            r = running.pop(pidfd)
            sel.unregister(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(r["pid"], 0)
            sweep(r["uid"], r["pid"])
            reply = {k: r[k] for k in ("id", "timed_out", "memory_exceeded")}
            sock.send(json.dumps({**reply, "wait_status": status}).encode())
        watch = time.monotonic() >= next_watch
        if watch:
            next_watch = time.monotonic() + WATCH_INTERVAL_S
        _police(running, watch)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--root"]:
        root = json.loads(argv[1])
        build_root(root["ops"])
        # Start again from inside: the agent environment's paths are those of the new root from now on.
        os.execv(root["python"], [root["python"], "-E", "-s", "-B", root["runner"], *argv[2:]])
    mode = argv[0]
    if mode == "once":
        main_once(int(argv[1]), int(argv[2]), json.loads(argv[3]))
    elif mode == "serve":
        main_serve(int(argv[1]), json.loads(argv[2]))
    elif mode == "probe":
        main_probe(json.loads(argv[1]))
    else:
        raise SystemExit(f"{RUNNER_TAG} unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
