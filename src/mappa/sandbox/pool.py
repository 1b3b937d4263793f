"""Warm pool: one confined fork server that pre-imports numpy/pandas/sklearn once and forks a child per snippet.

The server (runner.py `serve`) runs inside the same confinement as a cold snippet, with the whole workspace
root bound read-write instead of one workspace. For each request the host sends, over a Unix socket, the
snippet's code (a memfd) and the write ends of its stdout/stderr pipes; the server forks a child that
applies the limits, drops to the workspace's uid and runs the code; while it runs the server enforces its
timeout and watches its resident memory; when the child exits the server kills everything that uid left
behind and replies with the wait status. A fresh fork per snippet means a fresh
copy of the preloaded interpreter: nothing a snippet sets (globals, monkeypatches, `sys.modules`) reaches
the next one.

If the server dies, the snippets in flight get `infra_error` and the next request starts a new server.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import psutil

from mappa.sandbox.confine import Confinement
from mappa.sandbox.execute import Limits, build_result, code_memfd, failed_to_start, read_outputs, snippet_spec
from mappa.sandbox.workspace import diff_snapshots, prepare_workspace, snapshot
from mappa.types import ExecResult

# scikit-learn imports its estimators lazily: preloading `sklearn` alone would leave them to every snippet.
SKLEARN_SUBMODULES = [
    "sklearn.linear_model",
    "sklearn.ensemble",
    "sklearn.tree",
    "sklearn.model_selection",
    "sklearn.metrics",
    "sklearn.preprocessing",
    "sklearn.pipeline",
    "sklearn.impute",
]
START_TIMEOUT_S = 180.0  # importing pandas + sklearn on a busy 2-core machine can take a while
REPLY_GRACE_S = 10.0  # how long past its timeout a snippet may take before the server counts as hung


def expand_preload(modules: list[str]) -> list[str]:
    out = list(modules)
    if "sklearn" in modules:
        out += SKLEARN_SUBMODULES
    return out


class PoolError(Exception):
    """The pool server failed (not the snippet): reported as ExecResult.infra_error."""


class WarmPool:
    def __init__(self, root: Path, preload: list[str], confinement: Confinement) -> None:
        self.root = root
        self.preload = expand_preload(preload)
        self.confinement = confinement
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        """Host pid of the server's outermost process (bwrap or the runner)."""
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        host_sock, server_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        argv = self.confinement.runner_argv("serve", str(server_sock.fileno()), json.dumps(self.preload))
        cmd = self.confinement.command([self.root], self.root, argv, die_with_parent=False)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=self._log,
                pass_fds=(server_sock.fileno(),),
                env=self.confinement.environ(self.root),
                cwd=self.root,
                start_new_session=True,
            )
        except OSError as e:
            host_sock.close()
            raise PoolError(f"cannot start the pool server: {e}") from None
        finally:
            server_sock.close()
        host_sock.settimeout(START_TIMEOUT_S)
        try:
            ready = json.loads(host_sock.recv(1 << 16) or b"null")
        except (TimeoutError, OSError, json.JSONDecodeError):
            ready = None
        if not ready:
            self._kill(proc)
            host_sock.close()
            raise PoolError(f"the pool server did not start: {self._log_tail()}")
        if ready["failed"]:
            warnings.warn(
                f"mappa sandbox pool: could not preload {'; '.join(ready['failed'])}", RuntimeWarning, stacklevel=4
            )
        host_sock.settimeout(None)
        self._proc, self._sock = proc, host_sock
        threading.Thread(target=self._read_replies, args=(proc, host_sock), daemon=True).start()

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        lines = self._log.read().decode("utf-8", errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """Kill the server's whole process tree (bwrap, its init, the server, its children)."""
        try:
            tree = [*psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()

    def _read_replies(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        while True:
            try:
                msg = sock.recv(1 << 16)
            except OSError:
                msg = b""
            if not msg:
                break
            reply = json.loads(msg)
            with self._lock:
                fut = self._pending.pop(reply["id"], None)
            if fut is not None:
                fut.set_result(reply)
        # The server is gone: fail what is in flight and let the next request start a new one.
        proc.poll()
        with self._lock:
            if self._proc is proc:
                self._proc, self._sock = None, None
            pending, self._pending = self._pending, {}
        reason = f"the pool server exited (status {proc.returncode})"
        for fut in pending.values():
            fut.set_exception(PoolError(reason))
        sock.close()

    def _submit(self, spec: dict, code_fd: int, out_w: int, err_w: int, timeout_s: float) -> Future:
        with self._lock:
            if self._sock is None:
                self._start()
            req_id = next(self._ids)
            fut: Future = Future()
            self._pending[req_id] = fut
            msg = json.dumps({"id": req_id, "spec": spec, "timeout_s": timeout_s}).encode()
            try:
                socket.send_fds(self._sock, [msg], [code_fd, out_w, err_w])
            except OSError as e:
                self._pending.pop(req_id, None)
                raise PoolError(f"cannot reach the pool server: {e}") from None
        return fut

    def run(self, code: str, workspace: Path, limits: Limits) -> ExecResult:
        workspace = workspace.resolve()
        uid = prepare_workspace(workspace)
        before = snapshot(workspace)
        uid = uid if self.confinement.drop_uid else None
        spec = snippet_spec(workspace, uid, limits, self.confinement.isolates_snippets)
        code_fd = code_memfd(code)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        start = time.monotonic()
        try:
            fut = self._submit(spec, code_fd, out_w, err_w, limits.timeout_s)
        except PoolError as e:
            for fd in (out_r, err_r):
                os.close(fd)
            return failed_to_start(limits, str(e))
        finally:
            for fd in (code_fd, out_w, err_w):
                os.close(fd)
        # The server enforces the timeout; the host only notices a server that stopped answering.
        backstop = start + limits.timeout_s + REPLY_GRACE_S
        stdout, stderr, _ = read_outputs(out_r, err_r, limits.max_output_chars, backstop, lambda: None, fut.done)
        infra = None
        reply: dict = {"wait_status": None, "timed_out": False, "memory_exceeded": False}
        try:
            reply = fut.result(timeout=max(0.0, backstop - time.monotonic()))
        except FutureTimeout:
            infra = "the pool server stopped answering; restarted"
            self.close()
        except PoolError as e:
            infra = str(e)
        duration = time.monotonic() - start
        files = diff_snapshots(before, snapshot(workspace))
        status, timed_out, memory = reply["wait_status"], reply["timed_out"], reply["memory_exceeded"]
        infra = infra or reply.get("setup_failed")
        return build_result(status, stdout, stderr, timed_out, duration, files, infra, memory)

    def close(self) -> None:
        with self._lock:
            proc, sock = self._proc, self._sock
            self._proc, self._sock = None, None
        if proc is not None:
            self._kill(proc)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
