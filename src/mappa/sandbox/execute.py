"""Run one snippet in a fresh confined interpreter, read its output bounded, and build the ExecResult."""

from __future__ import annotations

import json
import math
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mappa.sandbox.confine import Confinement, kill_uid, user_process_count
from mappa.sandbox.workspace import FileDiff, diff_snapshots, prepare_workspace, snapshot
from mappa.types import ExecResult

# Evidence of an exhausted memory limit in what the snippet printed last.
_MEMORY_RE = re.compile(r"(^|\n)\w*MemoryError|Unable to allocate|Cannot allocate memory|std::bad_alloc|out of memory")


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 64
    max_file_mb: int = 64
    max_output_chars: int = 8000
    max_open_files: int = 256
    cpu_s: int | None = None  # CPU seconds per process; None: the wall-clock timeout plus one second


class BoundedStream:
    """Keeps the first 3/4 and the last 1/4 of `limit` bytes; everything between is counted and dropped.

    The tail is kept because that is where a traceback ends; the marker says how much was cut.
    """

    def __init__(self, limit: int) -> None:
        self.head_max = limit * 3 // 4
        self.tail_max = limit - self.head_max
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_max:
                del self.tail[: -self.tail_max]

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_max :]) if self.tail_max else b""
        dropped = self.total - len(self.head) - len(tail)
        head = self.head.decode("utf-8", errors="replace")
        if dropped <= 0:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace")
        return f"{head}\n[... {dropped} bytes of output cut ...]\n{tail.decode('utf-8', errors='replace')}"


def read_outputs(
    out_fd: int,
    err_fd: int,
    limit: int,
    deadline: float,
    on_deadline: Callable[[], None],
    finished: Callable[[], bool],
) -> tuple[BoundedStream, BoundedStream, bool]:
    """Read both pipes incrementally until EOF (or until the snippet finished and a short grace passed).

    Returns (stdout, stderr, deadline_hit). `on_deadline` is called once when the wall clock runs out.
    """
    streams = {out_fd: BoundedStream(limit), err_fd: BoundedStream(limit)}
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    hit = False
    finished_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if not hit and now >= deadline:
                hit = True
                on_deadline()
            if finished_at is None and finished():
                finished_at = now
            if finished_at is not None and now - finished_at > 0.5:
                break  # a leftover process still holds the pipes open: it is swept afterwards
            wait = 0.05 if hit or finished_at is not None else min(0.05, max(0.0, deadline - now))
            for key, _ in sel.select(wait):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if data:
                    streams[key.fd].feed(data)
                else:
                    sel.unregister(key.fd)
    finally:
        sel.close()
        os.close(out_fd)
        os.close(err_fd)
    return streams[out_fd], streams[err_fd], hit


def snippet_spec(workspace: Path, uid: int | None, limits: Limits, isolate: bool = False) -> dict:
    """What the runner needs to start one snippet. `isolate`: its own mount, IPC and PID namespaces."""
    nproc = limits.max_processes
    if uid is None:
        # Without a uid of its own the limit counts the user's other processes too.
        nproc += user_process_count()
    return {
        "workspace": str(workspace),
        "uid": uid,
        "memory_mb": limits.memory_mb,
        "fsize_mb": limits.max_file_mb,
        "cpu_s": limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1,
        "nproc": nproc,
        "nofile": limits.max_open_files,
        "isolate": isolate,
        "shm_mb": limits.memory_mb,  # /dev/shm is memory: it cannot hold more than the snippet may
    }


def build_result(
    wait_status: int | None,
    stdout: BoundedStream,
    stderr: BoundedStream,
    timed_out: bool,
    duration_s: float,
    files: FileDiff,
    infra_error: str | None = None,
    memory_exceeded: bool = False,
) -> ExecResult:
    """The record of one run. `memory_exceeded`: the runner's watchdog killed the snippet; an allocation that
    failed outright (MemoryError and its native cousins in the last lines of stderr) counts too.

    `infra_error` comes only from the sandbox's own channels (the runner's status pipe or the pool's reply, which
    the snippet cannot write): nothing the snippet prints or its exit status makes a fault of the sandbox."""
    exit_code: int | None = None
    killed: int | None = None
    if wait_status is not None:
        if os.WIFSIGNALED(wait_status):
            killed = os.WTERMSIG(wait_status)
        else:
            exit_code = os.waitstatus_to_exitcode(wait_status)
    elif timed_out:
        killed = signal.SIGKILL
    err_text = stderr.text()
    if killed == signal.SIGXCPU:
        timed_out = True  # the CPU-time limit: the same fault as the wall clock, reported the same way
    memory = memory_exceeded or (not timed_out and bool(_MEMORY_RE.search(err_text[-2000:])))
    flooded = files[3]  # the agent's doing: its own run fails, as a timeout does
    ok = exit_code == 0 and not timed_out and not memory and infra_error is None and not flooded
    return ExecResult(
        ok=ok,
        exit_code=exit_code,
        stdout=stdout.text(),
        stderr=err_text,
        timed_out=timed_out,
        memory_exceeded=memory,
        killed_signal=killed,
        duration_s=round(duration_s, 4),
        files_created=files[0],
        files_changed=files[1],
        files_omitted=files[2],
        workspace_flooded=flooded,
        infra_error=infra_error,
    )


def code_memfd(code: str) -> int:
    """The snippet's code as an anonymous file, passed to the runner by descriptor (no argv or disk limits)."""
    fd = os.memfd_create("snippet")
    os.write(fd, code.encode("utf-8", errors="surrogateescape"))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def failed_to_start(limits: Limits, why: str) -> ExecResult:
    empty = BoundedStream(limits.max_output_chars)
    return build_result(None, empty, empty, False, 0.0, ((), (), 0, False), infra_error=why)


class RunnerReport:
    """What a `runner.py once` writes to its status pipe: the snippet's pid, then its wait status."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data: dict = {}
        os.set_blocking(fd, False)

    def read(self) -> dict:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return self.data
            if not chunk:
                return self.data
            for line in chunk.splitlines():
                self.data.update(json.loads(line))


def _sweep_cold(proc: subprocess.Popen, confinement: Confinement, uid: int | None, report: RunnerReport) -> None:
    """Kill a cold run's processes. Under bwrap the PID namespace dies with its init and takes every
    descendant along; the fallback has no such namespace: kill the snippet's uid (root) or its session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if confinement.kind != "fallback":
        return
    if uid is not None:
        kill_uid(uid)
    elif "pid" in report.read():
        try:
            os.killpg(report.data["pid"], signal.SIGKILL)
        except OSError:
            pass


def run_cold(code: str, workspace: Path, limits: Limits, confinement: Confinement) -> ExecResult:
    """One fresh interpreter per snippet (the path without the warm pool)."""
    workspace = workspace.resolve()
    uid = prepare_workspace(workspace)
    uid = uid if confinement.drop_uid else None
    before = snapshot(workspace)
    code_fd = code_memfd(code)
    status_r, status_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    spec = snippet_spec(workspace, uid, limits, confinement.isolates_snippets)
    argv = confinement.runner_argv("once", str(status_w), str(code_fd), json.dumps(spec))
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            confinement.command([workspace], workspace, argv),
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(status_w, code_fd),
            env=confinement.environ(workspace),
            cwd=workspace,
            start_new_session=True,
        )
    except OSError as e:
        for fd in (status_r, out_r, err_r):
            os.close(fd)
        return failed_to_start(limits, f"cannot start sandbox: {e}")
    finally:
        for fd in (code_fd, status_w, out_w, err_w):
            os.close(fd)
    report = RunnerReport(status_r)
    stdout, stderr, timed_out = read_outputs(
        out_r,
        err_r,
        limits.max_output_chars,
        start + limits.timeout_s,
        lambda: _sweep_cold(proc, confinement, uid, report),
        lambda: proc.poll() is not None,
    )
    runner_status = proc.wait()
    duration = time.monotonic() - start
    report.read()  # the runner has exited: everything it wrote is in the pipe
    if confinement.kind == "fallback":
        _sweep_cold(proc, confinement, uid, report)
    os.close(status_r)
    infra = report.data.get("setup_failed")
    wait_status = report.data.get("wait_status")
    if wait_status is None and not timed_out:
        if runner_status < 0:
            # The runner itself was killed: only a snippet sharing our uid (fallback, not root) can do that.
            wait_status = (-runner_status) & 0x7F
        else:
            last = stderr.text().strip().splitlines()[-1:] or ["no output"]
            infra = f"sandbox failed to start (exit {runner_status}): {last[0]}"
    files = diff_snapshots(before, snapshot(workspace))
    memory = bool(report.data.get("memory_exceeded"))
    return build_result(wait_status, stdout, stderr, timed_out, duration, files, infra, memory)
