"""Policing the snippet's processes: which they are, the memory they pin, and killing them all.

Memory is bounded by a watchdog, not an address-space limit (which counts what numpy, pyarrow or torch
reserve rather than what they use): every WATCH_INTERVAL_S the snippet is charged
- the resident anonymous and shared memory (RssAnon + RssShmem; file-backed pages are page cache the kernel can
  drop) of its processes,
- and, where it has its own namespaces, what the kernel holds for it outside any process: the buffers of every
  socket of its network namespace (sock_diag: queued data, in flight or unread), its /dev/shm (a tmpfs of its
  own), and PIPE_BYTES for every pipe its processes hold open (the most a pipe can buffer: growing one is refused),
and all of it is killed when the sum passes `memory_mb`. An isolated snippet is watched from inside its namespaces
by the relay above it (`watch_namespace`), which alone sees them all; otherwise the runner watches its processes
(`Meter`). A peak shorter than one interval can pass unnoticed; snippets also get the highest OOM score, so the
kernel's OOM killer takes them before the host.
"""

from __future__ import annotations

import os
import select
import socket
import struct

WATCH_INTERVAL_S = 0.05  # memory sampling period: ~0.1 ms of /proc reads per running snippet
PIPE_BYTES = 65536 + 4096  # a pipe's 16 pages of buffer and its bookkeeping (F_SETPIPE_SZ is refused: jail.py)
MAX_PROCESSES_SEEN = 4096  # the cost of a fork bomb's walk stays bounded
MAX_FDS_SEEN = 1 << 16  # descriptors looked at per charge


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


def children(pid: int) -> list[int]:
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


def tree(pid: int) -> list[int]:
    """`pid` and its descendants, breadth first, at most MAX_PROCESSES_SEEN."""
    out, i = [pid], 0
    while i < len(out) and len(out) < MAX_PROCESSES_SEEN:
        out += children(out[i])
        i += 1
    return out


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


def pipes_held(pids: list[int]) -> int:
    """Distinct pipes open in `pids` (each can buffer at most PIPE_BYTES)."""
    seen: set[str] = set()
    budget = MAX_FDS_SEEN
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names[:budget]:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if target.startswith("pipe:"):
                seen.add(target)
        budget -= len(names)
        if budget <= 0:
            break
    return len(seen)


# sock_diag (netlink): the memory of every unix socket of a network namespace, asked from a socket opened inside it.
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, NLM_F_DUMP = 4, 20, 1, 0x300
NLMSG_ERROR, NLMSG_DONE, UDIAG_SHOW_MEMINFO, UNIX_DIAG_MEMINFO = 2, 3, 0x20, 5


def diag_socket() -> socket.socket | None:
    """A sock_diag socket in this process's network namespace (None where netlink is not allowed)."""
    try:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError:
        return None


def unix_socket_bytes(diag: socket.socket) -> int:
    """The kernel memory of all unix sockets of the namespace: queued for reading, written and not yet read, and
    option memory (SK_MEMINFO: rmem_alloc, wmem_alloc, wmem_queued, optmem)."""
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_MEMINFO, 0, 0)
    diag.send(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
    total = 0
    while True:
        data = diag.recv(1 << 16)
        at = 0
        while at + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, at)
            if kind in (NLMSG_DONE, NLMSG_ERROR) or length < 16:
                return total
            total += _meminfo(data[at + 16 + 16 : at + length])  # past nlmsghdr and unix_diag_msg
            at += (length + 3) & ~3
        if not data:
            return total


def _meminfo(attrs: bytes) -> int:
    at = 0
    while at + 4 <= len(attrs):
        length, kind = struct.unpack_from("=HH", attrs, at)
        if length < 4:
            break
        if kind == UNIX_DIAG_MEMINFO and length >= 4 + 9 * 4:
            rmem, _, wmem, _, _, queued, optmem = struct.unpack_from("=7I", attrs, at + 4)
            return rmem + wmem + queued + optmem
        at += (length + 3) & ~3
    return 0


class Meter:
    """The runner's watch on one snippet without namespaces of its own: its processes' resident memory (the host's
    sockets, pipes and /dev/shm are not the snippet's alone, so they are not counted there). `pid` is the runner's
    child: the snippet itself, or the relay above an isolated snippet (which watches itself: `watch_namespace`)."""

    def __init__(self, pid: int, uid: int | None, isolate: bool) -> None:
        self.pid, self.uid, self.isolate = pid, uid, isolate

    def over(self, limit_mb: int) -> list[int] | None:
        """The snippet's processes when their resident memory is above the limit, else None (and always None for an
        isolated snippet)."""
        if self.isolate:
            return None
        # All of its uid (exact, also those that left the tree), else its descendants.
        pids = pids_of_uid(self.uid) if self.uid is not None else tree(self.pid)
        return pids if sum(resident_bytes(p) for p in pids) > limit_mb << 20 else None


def namespace_charge(diag: socket.socket | None) -> int:
    """What the snippet pins, seen from inside its namespaces: every process of its PID namespace but the init
    (this /proc is that namespace's), the pipes they hold, its network namespace's sockets and its /dev/shm."""
    pids = [int(n) for n in os.listdir("/proc") if n.isdigit() and n != "1"][:MAX_PROCESSES_SEEN]
    total = sum(resident_bytes(p) for p in pids) + pipes_held(pids) * PIPE_BYTES
    if diag is not None:
        try:
            total += unix_socket_bytes(diag)
        except OSError:
            pass
    try:
        shm = os.statvfs("/dev/shm")
        total += (shm.f_blocks - shm.f_bfree) * shm.f_frsize
    except OSError:
        pass
    return total


def watch_namespace(init: int, limit_mb: int) -> tuple[int, bool]:
    """The relay's watch: wait for the namespace's init, killing it (and so the whole namespace) when what the
    snippet pins passes the limit. Returns (the init's wait status, memory_exceeded)."""
    diag = diag_socket()
    pidfd = os.pidfd_open(init)
    exceeded = False
    try:
        while not select.select([pidfd], [], [], WATCH_INTERVAL_S)[0]:
            if not exceeded and namespace_charge(diag) > limit_mb << 20:
                exceeded = True
                kill(init)
    finally:
        os.close(pidfd)
        if diag is not None:
            diag.close()
    while True:
        try:
            return os.waitpid(init, 0)[1], exceeded
        except InterruptedError:
            continue
        except ChildProcessError:
            return 9, exceeded  # cannot happen for our own child; read as killed by SIGKILL


def kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except OSError:
        pass


def sweep(uid: int | None, pid: int, isolate: bool) -> None:
    """Kill every process of the snippet, even those that started their own session.

    Isolated: its PID namespace's init (found below the relay `pid`), whose death takes every process of the
    namespace along; the relay exits once they are all gone. Otherwise, with a uid per workspace, a helper that
    becomes that uid and calls kill(-1, SIGKILL) reaches exactly the snippet's processes (repeated: a fork bomb
    races the first round); without one, the snippet's tree and process group are all we know.
    """
    if isolate:
        inits = children(pid)
        for p in inits:
            kill(p)
        if not inits:  # not forked yet: the init dies with the relay (parent-death signal) before any code ran
            kill(pid)
        return
    if uid is None:
        for p in tree(pid):  # the tree first: a snippet may have left the group
            kill(p)
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


def stop(meter: Meter, pids: list[int]) -> None:
    """Kill the snippet over its memory limit: the processes just measured, then the usual sweep."""
    for p in pids:
        kill(p)
    sweep(meter.uid, meter.pid, meter.isolate)


def wait_watching(pid: int, spec: dict) -> tuple[int, bool]:
    """Wait for the runner's child `pid`, killing all the snippet's processes if what they pin passes the limit.

    Returns (wait status, memory_exceeded).
    """
    meter = Meter(pid, spec["uid"], bool(spec.get("isolate")))
    pidfd = os.pidfd_open(pid)
    exceeded = False
    try:
        while not select.select([pidfd], [], [], WATCH_INTERVAL_S)[0]:
            if not exceeded:
                pids = meter.over(spec["memory_mb"])
                if pids is not None:
                    exceeded = True
                    stop(meter, pids)
    finally:
        os.close(pidfd)
    while True:
        try:
            return os.waitpid(pid, 0)[1], exceeded
        except InterruptedError:
            continue
