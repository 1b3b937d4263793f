"""The warm pool's fork server (runner.py `serve`): pre-import once, then fork a fresh child per snippet.

Requests arrive on the socket with the code, stdout and stderr as descriptors; each reply carries the
snippet's wait status and whether it was killed at its deadline or over its memory limit.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import socket
import time

from .police import WATCH_INTERVAL_S, over_memory, stop, sweep
from .snippet import child, read_fd


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
        child(req["spec"], read_fd(code_fd))
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
