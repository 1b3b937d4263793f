"""Files opened beneath a directory descriptor without following a link, then read from what was opened.

Hostile files reach the host in two places: the files agents made in their workspaces (read through
`mappa.tasks.files`), and the adapters `mappa serve` loads from directories that clients name, under roots an
adversary may write to. A name may be a symbolic link out of the directory, a hard link to a file elsewhere, a
FIFO that blocks whoever opens it, a file of terabytes, or a directory swapped for a link between a check and the
read. So a directory is opened once, as a descriptor, and everything in it is opened relative to that descriptor:

    fd = open_beneath(root_fd, "solver/v000003", os.O_RDONLY | os.O_DIRECTORY)   # no link on the way
    data = read_beneath(fd, "adapter_config.json", max_bytes=1 << 20)             # the bytes, from that fd

The kernel does the resolving where it can: `openat2` with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS (Linux 5.6+;
x86_64 and aarch64 name it 437), through ctypes since Python's os module has no openat2. Elsewhere (an older
kernel answers ENOSYS, a seccomp filter EPERM, another architecture has another number) each component is
opened in turn with O_NOFOLLOW | O_DIRECTORY relative to the one before. A file read is then a regular file
with one name and at most `max_bytes` bytes: it is checked before it is opened (a FIFO or a device is never
opened), and the descriptor is checked again (fstat: the same file, still regular, single-linked, small
enough), so a swap between the two is caught; the read stops one byte past the size checked, so a file that
grows meanwhile is refused.

Not covered: a mount point below the directory is crossed (RESOLVE_NO_XDEV would refuse bind mounts, which
some clusters use for shared storage), and the directory the caller opened first is trusted as it stands.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
from typing import Any

# openat2's number where it is known; None: walk the components. Tests set an unassigned number to get ENOSYS.
OPENAT2_NR: int | None = {"x86_64": 437, "amd64": 437, "aarch64": 437, "arm64": 437}.get(platform.machine().lower())
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x02, 0x04, 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_UNAVAILABLE = (errno.ENOSYS, errno.EPERM)  # no openat2 here: an old kernel, or a seccomp filter that hides it
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY  # O_NONBLOCK: a FIFO swapped in late cannot block
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
    (stat.S_ISSOCK, "a socket"),
)


class FileRefused(Exception):
    """A path beneath a directory that is not opened or read; the message is a one-line reason naming the path
    (relative to the directory), `kind` its class: "missing", "link", "not_regular", "too_large", "name" or
    "unreadable"."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _libc_syscall() -> Any:
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):  # no C library to call through: the walk does it all
        return None
    syscall.restype = ctypes.c_long
    return syscall


_syscall = _libc_syscall()


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """The raw `openat2(dir_fd, path, {flags | O_CLOEXEC, 0, resolve})`: a descriptor, or the OSError the kernel
    gave (ENOSYS where this machine has no openat2 or its number is unknown)."""
    if OPENAT2_NR is None or _syscall is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), path)
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _syscall(
        ctypes.c_long(OPENAT2_NR), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
    )  # fmt: skip
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _parts(rel: str) -> list[str]:
    """`rel`'s components ("." and empty ones dropped); FileRefused for an absolute path, "..", or a NUL."""
    if rel.startswith("/") or "\0" in rel:
        raise FileRefused("name", f"{rel!r} is not a relative path")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileRefused("name", f"{rel}: '..' is not allowed")
    return parts


def open_beneath(dir_fd: int, rel: str, flags: int) -> int:
    """A descriptor of `rel` beneath `dir_fd`, opened with `flags` without following any link, on the way or at
    the end; FileRefused says why not. "" or "." is `dir_fd`'s directory itself, opened again."""
    parts = _parts(rel)
    try:
        try:
            return openat2(dir_fd, "/".join(parts) or ".", flags | os.O_NOFOLLOW, RESOLVE)
        except OSError as e:
            if e.errno not in _UNAVAILABLE:
                raise
        return _walk(dir_fd, parts, flags)
    except OSError as e:
        raise _refusal(dir_fd, parts, e) from None


def _walk(dir_fd: int, parts: list[str], flags: int) -> int:
    """openat2's resolution by hand: each directory opened with O_NOFOLLOW relative to the one before."""
    here = dir_fd
    try:
        for part in parts[:-1]:
            there = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            if here != dir_fd:
                os.close(here)
            here = there
        return os.open(parts[-1] if parts else ".", flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
    finally:
        if here != dir_fd:
            os.close(here)


def _refusal(dir_fd: int, parts: list[str], e: OSError) -> FileRefused:
    """Why opening `parts` failed, naming the first link on the way when there is one (openat2 says only ELOOP)."""
    rel = "/".join(parts) or "."
    for i in range(1, len(parts) + 1):  # the components before the first link are not links: nothing is followed
        prefix = "/".join(parts[:i])
        try:
            if stat.S_ISLNK(os.stat(prefix, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return FileRefused("link", f"{prefix} is a symbolic link (links are not followed)")
        except OSError:
            break
    if e.errno == errno.ENOENT:
        return FileRefused("missing", f"no {rel}")
    if e.errno == errno.ENOTDIR:
        return FileRefused("not_regular", f"{rel} is not a directory, or lies under something that is not")
    if e.errno in (errno.ELOOP, errno.EXDEV):  # EXDEV: a resolution that would leave the directory
        return FileRefused("link", f"{rel} leads through a link (links are not followed)")
    return FileRefused("unreadable", f"{rel} could not be opened ({e.strerror})")


def _check(rel: str, st: os.stat_result, max_bytes: int) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise FileRefused("link", f"{rel} is a symbolic link (links are not followed)")
    if not stat.S_ISREG(st.st_mode):
        what = next((w for test, w in _KINDS if test(st.st_mode)), "not a regular file")
        raise FileRefused("not_regular", f"{rel} is {what}, not a regular file")
    if st.st_nlink != 1:  # a hard link shares its content with a name elsewhere, perhaps outside the root
        raise FileRefused("link", f"{rel} is a hard link ({st.st_nlink} names for one file)")
    if st.st_size > max_bytes:
        raise FileRefused("too_large", f"{rel} is {st.st_size:,} bytes, more than the {max_bytes:,} allowed")


def open_file(parent: int, name: str, rel: str, max_bytes: int) -> tuple[int, int]:
    """(a descriptor of the regular file `name` in the directory `parent`, its size), checked before and after
    opening."""
    try:
        before = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        raise FileRefused("missing", f"no {rel}") from None
    except OSError as e:
        raise FileRefused("unreadable", f"{rel} could not be read ({e.strerror})") from None
    _check(rel, before, max_bytes)  # before opening: opening a device may act, a FIFO may block
    fd = open_beneath(parent, name, _FILE_FLAGS)
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise FileRefused("link", f"{rel} was replaced while being opened")
        _check(rel, after, max_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, after.st_size


def read_beneath(dir_fd: int, rel: str, max_bytes: int) -> bytes:
    """All of the regular file `rel` beneath `dir_fd`, read from the descriptor its checks were made on (see the
    module docstring); FileRefused says why not."""
    parts = _parts(rel)
    if not parts:
        raise FileRefused("name", f"{rel!r} names no file")
    head, name = "/".join(parts[:-1]), parts[-1]
    parent = open_beneath(dir_fd, head, _DIR_FLAGS) if head else dir_fd
    try:
        fd, size = open_file(parent, name, "/".join(parts), max_bytes)
    finally:
        if parent != dir_fd:
            os.close(parent)
    try:  # one byte past the size checked: a read of `max_bytes + 1` would allocate that much up front
        with open(fd, "rb", closefd=False) as f:
            data = f.read(size + 1)
    except OSError as e:
        raise FileRefused("unreadable", f"{rel} could not be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > size:
        raise FileRefused("too_large", f"{rel} grew while being read (past the {size:,} bytes checked)")
    return data
