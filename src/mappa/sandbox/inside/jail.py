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
