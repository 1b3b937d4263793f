"""Policing the snippet's processes: which they are, their resident memory, and killing them all.

Memory is bounded by a watchdog, not an address-space limit (which counts what numpy, pyarrow or torch
reserve rather than what they use): every WATCH_INTERVAL_S the runner sums the resident anonymous and
shared memory (RssAnon + RssShmem; file-backed pages are page cache the kernel can drop) of the snippet's
processes and kills them all when the sum passes `memory_mb`. A peak shorter than one interval can pass
unnoticed; snippets also get the highest OOM score, so the kernel's OOM killer takes them before the host.
"""

from __future__ import annotations

import os
import select

WATCH_INTERVAL_S = 0.05  # memory sampling period: ~0.1 ms of /proc reads per running snippet


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


def kill_descendants() -> None:
    """The relay's sweep: every process below this one (the snippet's leftovers re-parented here)."""
    for p in snippet_pids(os.getpid(), None, skip_root=True):
        try:
            os.kill(p, 9)
        except OSError:
            pass


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
