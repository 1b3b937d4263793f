"""Per-episode workspaces: one directory that all tool calls of all agents of an episode share.

Workspaces live under one root (`workspace_root()`, mode 0711: others may pass through it but not list
it). As root, each workspace belongs to its own sandbox uid with mode 0700, so a snippet cannot open
another episode's workspace even inside the warm pool, where all of them are mounted.

Everything in a workspace is the agents' making, so every walk of one from the host is iterative (any depth) and
bounded in entries, directories included: a snapshot stops at MAX_WALK_ENTRIES and says so (`Snapshot.cut`), and
removal flattens the tree by renames (never deeper than one level, never following links) for at most
REMOVE_BUDGET_S before it leaves the rest to a background thread.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from mappa.errors import MappaError
from mappa.sandbox.confine import UID_BASE, allocate_uid, is_root

KEEP_PREFIX = "ws-keep-"
TRASH_PREFIX = ".trash-"  # a workspace being removed: renamed first, so it is gone from its path at once
MAX_WALK_ENTRIES = 10_000  # files and directories a snapshot looks at: a flood of names must not stall the host
MAX_LISTED = 200  # names of created or changed files an ExecResult carries; the rest are counted
REMOVE_BUDGET_S = 2.0  # how long removing one workspace may hold up its caller; the rest goes on in the background


def workspace_root() -> Path:
    """`$TMPDIR/mappa-sandbox-<uid>`: created 0711 and owned by us (refused when someone else owns it)."""
    root = Path(tempfile.gettempdir()) / f"mappa-sandbox-{os.getuid()}"
    try:
        root.mkdir(mode=0o711, exist_ok=True)
    except OSError as e:
        raise MappaError(f"sandbox workspace root {root}: cannot create ({e.strerror})") from None
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise MappaError(f"sandbox workspace root {root}: not a directory owned by uid {os.getuid()}")
    os.chmod(root, 0o711)
    global _trash_collected
    if not _trash_collected:
        _trash_collected = True
        collect_trash(root)
    return root


_trash_collected = False


def _chown_tree(path: Path, uid: int) -> None:
    """Hand a workspace we made (the task's files, before any snippet ran) to the sandbox uid."""
    os.chown(path, uid, uid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


def prepare_workspace(path: Path) -> int | None:
    """Make `path` usable by the sandbox; return the uid snippets run as there (None: keep ours).

    As root, a workspace not yet owned by a sandbox uid is handed to a fresh one (chown -R, mode 0700).
    """
    if not path.is_dir():
        raise MappaError(f"sandbox workspace {path}: not a directory")
    if not is_root():
        return None
    st = path.stat()
    if st.st_uid >= UID_BASE:
        return st.st_uid
    uid = allocate_uid()
    _chown_tree(path, uid)
    os.chmod(path, 0o700)
    return uid


def new_workspace(files: Mapping[str, bytes | Path] | None = None, keep: bool = False) -> Path:
    """Create a fresh workspace holding `files` (relative name -> bytes, or a file/directory to copy).

    `keep=True` marks it for inspection: `remove_workspace` then leaves it in place.
    """
    files = dict(files or {})
    for name, content in files.items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise MappaError(f"workspace file {name!r}: must be a relative path inside the workspace")
        if not isinstance(content, bytes) and not Path(content).exists():
            raise MappaError(f"workspace file {name!r}: source {content} not found")
    path = Path(tempfile.mkdtemp(prefix=KEEP_PREFIX if keep else "ws-", dir=workspace_root()))
    for name, content in files.items():
        dest = path / PurePosixPath(name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            dest.write_bytes(content)
        elif Path(content).is_dir():
            shutil.copytree(content, dest)
        else:
            shutil.copyfile(content, dest)
    prepare_workspace(path)
    return path


def remove_workspace(path: str | Path, force: bool = False) -> None:
    """Delete a workspace, unless it was made with `keep=True` (then only with `force=True`).

    The workspace is renamed out of the way first and removed for at most REMOVE_BUDGET_S; what a flood of files or
    directories leaves after that is removed by a background thread (and by the next process, if this one ends)."""
    path = Path(path)
    if path.name.startswith(KEEP_PREFIX) and not force:
        return
    if not path.is_dir() or path.is_symlink():
        if path.is_symlink() or path.exists():
            path.unlink()
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    if not remove_tree(trash, time.monotonic() + REMOVE_BUDGET_S):
        _background_removal().put(trash)


def remove_tree(top: Path, deadline: float | None = None) -> bool:
    """Remove the directory `top` and everything in it; True when done, False when `deadline` came first.

    Iterative and flat: the entries of each subdirectory are unlinked and its own subdirectories renamed up into
    `top`, so no walk is ever deeper than one level or longer than a path (a 1,500-deep chain is 1,500 renames, not a
    recursion). Links are removed, never followed; directories a snippet made unreadable are made readable first."""
    try:
        os.chmod(top, 0o700, follow_symlinks=False)  # a snippet may have made its own workspace unreadable
        top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        while True:
            names = _names(top_fd, 4096)
            if not names:
                break
            for name in names:
                if deadline is not None and time.monotonic() > deadline:
                    return False
                _remove_entry(top_fd, name)
    finally:
        os.close(top_fd)
    os.rmdir(top)
    return True


def _names(dir_fd: int, limit: int) -> list[str]:
    with os.scandir(dir_fd) as it:
        out = []
        for e in it:
            out.append(e.name)
            if len(out) >= limit:
                break
        return out


def _remove_entry(top_fd: int, name: str) -> None:
    """One entry of `top`: unlinked, or (a directory) emptied one level down and removed. An entry that is gone
    already (another removal of the same tree got there first) is done."""
    try:
        _remove_one(top_fd, name)
    except FileNotFoundError:
        pass


def _remove_one(top_fd: int, name: str) -> None:
    st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=top_fd)
        return
    if st.st_mode & 0o700 != 0o700:
        os.chmod(name, 0o700, dir_fd=top_fd)  # a directory, checked just above; nothing runs in a workspace now
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top_fd)
    try:
        for sub in _names(fd, 1 << 30):
            try:
                os.unlink(sub, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno not in (errno.EISDIR, errno.EPERM):  # POSIX allows EPERM for unlink on a directory
                    raise
                os.rename(sub, f"{TRASH_PREFIX}{uuid.uuid4().hex}", src_dir_fd=fd, dst_dir_fd=top_fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=top_fd)


_remover: queue.Queue[Path] | None = None
_remover_lock = threading.Lock()


def _background_removal() -> queue.Queue[Path]:
    """The queue of a daemon thread that removes what a removal's budget left (one thread per process)."""
    global _remover
    with _remover_lock:
        if _remover is None:
            _remover = queue.Queue()
            threading.Thread(target=_remove_forever, args=(_remover,), daemon=True, name="workspace-removal").start()
        return _remover


def _remove_forever(q: queue.Queue[Path]) -> None:
    while True:
        path = q.get()
        try:
            remove_tree(path)
        except OSError:
            pass  # what is left is in the trash under the workspace root; `collect_trash` tries again later


def collect_trash(root: Path) -> None:
    """Hand workspaces left half-removed under `root` (by an earlier process) to the background removal."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        names = [n for n in _names(fd, 1 << 16) if n.startswith(TRASH_PREFIX)]
    finally:
        os.close(fd)
    for name in names:
        _background_removal().put(root / name)


@dataclass(frozen=True)
class Snapshot:
    """A workspace's files: relative name -> (size, mtime_ns). `cut`: the workspace held more than MAX_WALK_ENTRIES
    files and directories, and the walk stopped there (the agents' doing: a run that leaves it so has failed)."""

    files: dict[str, tuple[int, int]] = field(default_factory=dict)
    cut: bool = False


def snapshot(path: Path, limit: int | None = None) -> Snapshot:
    """Every file in the workspace (any depth, iteratively, links not followed), looking at most `limit` entries
    (default MAX_WALK_ENTRIES)."""
    limit = MAX_WALK_ENTRIES if limit is None else limit
    out: dict[str, tuple[int, int]] = {}
    stack, seen = [str(path)], 0
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                seen += 1
                if seen > limit:
                    return Snapshot(out, cut=True)
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        st = e.stat(follow_symlinks=False)
                        out[os.path.relpath(e.path, path)] = (st.st_size, st.st_mtime_ns)
                except OSError:
                    continue
    return Snapshot(out)


FileDiff = tuple[tuple[str, ...], tuple[str, ...], int, bool]  # (created, changed, omitted, flooded)


def diff_snapshots(before: Snapshot, after: Snapshot) -> FileDiff:
    """(created, changed, omitted, flooded): at most MAX_LISTED names each, sorted, how many more there were, and
    whether the workspace was left with more entries than a snapshot walks."""
    created = sorted(k for k in after.files if k not in before.files)
    changed = sorted(k for k in after.files if k in before.files and after.files[k] != before.files[k])
    omitted = max(0, len(created) - MAX_LISTED) + max(0, len(changed) - MAX_LISTED)
    return _text(created[:MAX_LISTED]), _text(changed[:MAX_LISTED]), omitted, after.cut


def _text(names: list[str]) -> tuple[str, ...]:
    """Names as text that any writer takes: bytes that are not UTF-8 (lone surrogates in a str) become `\\xNN`."""
    return tuple(os.fsencode(n).decode("utf-8", "backslashreplace") for n in names)
