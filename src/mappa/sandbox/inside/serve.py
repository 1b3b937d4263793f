"""The warm pool's fork server (runner.py `serve`): pre-import once, then fork a fresh child per snippet.

Requests arrive on the socket with the code, stdout and stderr as descriptors; each reply carries the
snippet's wait status, whether it was killed at its deadline or over its memory limit, and a set-up failure
only when the sandbox's own report channel (never the snippet's output) said so.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import socket
import time

from .police import WATCH_INTERVAL_S, Meter, stop, sweep
from .snippet import child, read_fd, read_report


def _start_request(sock: socket.socket, running: dict[int, dict], sel: selectors.BaseSelector) -> None:
    """Receive one request and fork its snippet; the child never returns from here."""
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    if not msg:
        os._exit(0)  # the host went away
    req = json.loads(msg)
    code_fd, out_fd, err_fd = fds
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        code = read_fd(code_fd)
        child(req["spec"], code, report_w)  # closes every other descriptor: the socket, other snippets' pipes
    for fd in (*fds, report_w):
        os.close(fd)
    os.set_blocking(report_r, False)
    pidfd = os.pidfd_open(pid)
    spec = req["spec"]
    running[pidfd] = {
        "id": req["id"],
        "meter": Meter(pid, spec["uid"], bool(spec.get("isolate"))),
        "memory_mb": spec["memory_mb"],
        "report": report_r,
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
        m = r["meter"]
        if now >= r["deadline"]:
            r["timed_out"] = True
            sweep(m.uid, m.pid, m.isolate)
        elif watch:
            pids = m.over(r["memory_mb"])
            if pids is not None:
                r["memory_exceeded"] = True
                stop(m, pids)


def _finish(r: dict) -> dict:
    """The reply for a snippet whose process (the relay, or the snippet) has ended."""
    m = r["meter"]
    _, status = os.waitpid(m.pid, 0)
    if not m.isolate:
        sweep(m.uid, m.pid, False)  # what it left running (an isolated snippet's namespace is already gone)
    said = read_report(r["report"])
    os.close(r["report"])
    reply = {k: r[k] for k in ("id", "timed_out", "memory_exceeded")}
    reply["memory_exceeded"] = r["memory_exceeded"] or bool(said.get("memory_exceeded"))
    # The init reports the snippet's own status; a relay killed at the deadline or over memory has none to give.
    reply["wait_status"] = said.get("wait_status", status)
    reply["setup_failed"] = said.get("setup_failed")
    return reply


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
            sock.send(json.dumps(_finish(r)).encode())
        watch = time.monotonic() >= next_watch
        if watch:
            next_watch = time.monotonic() + WATCH_INTERVAL_S
        _police(running, watch)
