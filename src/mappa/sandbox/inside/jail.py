"""The kernel calls that confine a snippet: mounts, namespaces, no privileges, and the seccomp filter.

`build_root` is the fallback's allowlisted root (runner.py `--root`); `isolate` gives a snippet its own mount
and IPC namespaces (a fresh size-limited /dev/shm, the other workspaces covered); `restrict`, after the uid
drop, leaves it no new privileges, no capabilities and a seccomp filter refusing the calls that hold memory
outside any process's resident set (memfd_create, System V shared memory, message queues).
"""

from __future__ import annotations

import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_PRIVATE = 1 << 18
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x08000000, 0x40000000, 0x20000000
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
    """The snippet's own namespaces (in the forked child, before the uid drop): mounts, IPC, network and PIDs.

    Its /dev/shm is a fresh tmpfs of `shm_mb`, and the directory holding the workspaces is covered with only
    this snippet's workspace bound back, so a pooled snippet sees no other episode's files. Its own network
    namespace (no interface up, not even loopback) leaves no abstract unix socket or port that another episode could
    reach; its own PID namespace (entered by the caller's next child, `mount_proc`) leaves no other process to
    signal, trace or read through /proc. All of them end with the snippet's last process, and what it held with it."""
    _check(libc().unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    _tmpfs("/dev/shm", spec["shm_mb"], "1777")
    workspace = spec.get("workspace")
    if workspace and os.path.dirname(workspace) not in ("/", ""):
        keep = os.open(workspace, os.O_PATH | os.O_DIRECTORY)
        _tmpfs(os.path.dirname(workspace), 1, "0755")
        os.makedirs(workspace, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{keep}", workspace, None, MS_BIND | MS_REC)
        os.close(keep)


def mount_proc() -> None:
    """In the first process of the snippet's PID namespace: a /proc of that namespace alone, over the server's."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


# What a snippet may not call, per architecture (AUDIT_ARCH value). Each rule is one kind of channel or memory the
# watchdog could not see: memfd and System V/POSIX IPC hold memory in no process's resident set; keyrings, file locks
# and inotify are kernel objects that two snippets reach through the same key or the same read-only file, so data
# could pass between concurrent episodes; F_SETPIPE_SZ would let a pipe pin 1 MiB instead of 64 KiB; sockets of other
# families than unix and IP (netlink, packet, ...) hold buffers the watchdog does not count; kill(-1) signals every
# process the snippet may signal (without namespaces: the user's whole session). Data-science code needs none of
# them (multiprocessing uses /dev/shm, pipes and unix sockets).
EPERM, EAFNOSUPPORT = 1, 97
F_LOCKS = (5, 6, 7, 36, 37, 38, 1024)  # F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK/SETLK/SETLKW, F_SETLEASE
F_SETPIPE_SZ = 1031
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
ARG0, ARG1 = 16, 24  # offsets of the low words of the first two arguments in seccomp_data

# Per ABI: (calls refused outright, [argument rules]). An argument rule is (calls, argument offset, values, whether
# the values are the refused ones (else the only allowed ones), errno). Tuples, not dataclasses: the runner imports
# this module at every cold start.
Rules = tuple[tuple[int, ...], list[tuple[tuple[int, ...], int, tuple[int, ...], bool, int]]]


def _abi(
    deny: tuple[int, ...], fcntl: tuple[int, ...], lock_cmds: tuple[int, ...], sockets: tuple[int, ...], kill: int
) -> Rules:
    return deny, [
        (fcntl, ARG1, (*lock_cmds, F_SETPIPE_SZ), True, EPERM),
        (sockets, ARG0, SOCKET_FAMILIES, False, EAFNOSUPPORT),
        ((kill,), ARG0, (0xFFFFFFFF,), True, EPERM),
    ]


def _x86_64(x: int) -> Rules:  # x: 0, or the x32 ABI's bit
    deny = (319, 447, 29, 64, 68, 240, 248, 249, 250, 73, 253, 294, 300)  # memfd*, sysv, mq, keys, flock, notify
    return _abi(tuple(x | n for n in deny), (x | 72,), F_LOCKS, (x | 41, x | 53), x | 62)


_X32 = 0x40000000
SECCOMP_RULES = {
    0xC000003E: (_x86_64(0), _x86_64(_X32)),  # x86_64 and x32 share the audit arch
    # i386: 117 is the ipc() multiplexer and 102 socketcall(), whose arguments a filter cannot read; 12-14 are the
    # 64-bit lock commands
    0x40000003: (
        _abi(
            (356, 447, 117, 395, 393, 399, 277, 286, 287, 288, 143, 291, 332, 338, 102),
            (55, 221),
            (*F_LOCKS, 12, 13, 14),
            (359, 360),
            37,
        ),
    ),
    0xC00000B7: (  # aarch64
        _abi((279, 447, 194, 190, 186, 180, 217, 218, 219, 32, 26, 262), (25,), F_LOCKS, (198, 199), 129),
    ),
}


def _assemble(prog: list[tuple]) -> bytes:
    """Classic BPF from ("ld", offset) / ("jeq", k, label_true, label_false) / ("ret", k) / ("label", name);
    a jump label of None is the next instruction."""
    import struct

    where, n = {}, 0
    for ins in prog:
        if ins[0] == "label":
            where[ins[1]] = n
        else:
            n += 1
    out, i = [], 0
    for ins in prog:
        if ins[0] == "label":
            continue
        if ins[0] == "ld":
            out.append(struct.pack("HBBI", 0x20, 0, 0, ins[1]))
        elif ins[0] == "ret":
            out.append(struct.pack("HBBI", 0x06, 0, 0, ins[1]))
        else:
            jt, jf = (0 if lab is None else where[lab] - i - 1 for lab in ins[2:4])
            out.append(struct.pack("HBBI", 0x15, jt, jf, ins[1]))
        i += 1
    return b"".join(out)


def seccomp_program() -> bytes:
    """A classic-BPF seccomp filter carrying out SECCOMP_RULES; every other call is allowed."""
    allow = 0x7FFF0000
    prog: list[tuple] = [("ld", 4)]  # seccomp_data.arch
    for a, (arch, abis) in enumerate(SECCOMP_RULES.items()):
        prog += [("jeq", arch, None, f"arch{a + 1}"), ("ld", 0)]  # seccomp_data.nr
        for b, (deny, arg_rules) in enumerate(abis):
            prog += [("jeq", nr, "eperm", None) for nr in deny]
            for r, (calls, *_) in enumerate(arg_rules):
                prog += [("jeq", nr, f"args{a}.{b}.{r}", None) for nr in calls]
        prog.append(("ret", allow))
        for b, (_, arg_rules) in enumerate(abis):
            for r, (_, offset, values, refused, errno) in enumerate(arg_rules):
                hit, miss = ("eperm", None) if refused else ("allow", None)
                prog += [("label", f"args{a}.{b}.{r}"), ("ld", offset)]
                prog += [("jeq", v, hit, miss) for v in values]
                prog.append(("ret", allow if refused else 0x00050000 | errno))
        prog.append(("label", f"arch{a + 1}"))
    prog += [("label", "allow"), ("ret", allow), ("label", "eperm"), ("ret", 0x00050000 | EPERM)]
    return _assemble(prog)


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
