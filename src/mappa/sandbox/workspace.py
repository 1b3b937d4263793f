"""Per-episode workspaces: one directory that all tool calls of all agents of an episode share.

Workspaces live under one root (`workspace_root()`, mode 0711: others may pass through it but not list
it). As root, each workspace belongs to its own sandbox uid with mode 0700, so a snippet cannot open
another episode's workspace even inside the warm pool, where all of them are mounted.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from mappa.errors import MappaError
from mappa.sandbox.confine import UID_BASE, allocate_uid, is_root

KEEP_PREFIX = "ws-keep-"
MAX_SNAPSHOT_FILES = 5_000  # a snippet that creates a million files must not stall the host
MAX_LISTED = 200  # names of created or changed files an ExecResult carries; the rest are counted


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
    return root


def _chown_tree(path: Path, uid: int) -> None:
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
    """Delete a workspace, unless it was made with `keep=True` (then only with `force=True`)."""
    path = Path(path)
    if path.name.startswith(KEEP_PREFIX) and not force:
        return

    def _make_writable(func, p, _exc):  # a snippet may have chmod-ed its files read-only
        parent = os.path.dirname(p)
        os.chmod(parent, 0o700)
        if os.path.lexists(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
        func(p)

    if path.exists():
        shutil.rmtree(path, onerror=_make_writable)


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """relative name -> (size, mtime_ns) of every file in the workspace, bounded in count."""
    out: dict[str, tuple[int, int]] = {}
    stack = [path]
    while stack and len(out) < MAX_SNAPSHOT_FILES:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                else:
                    st = e.stat(follow_symlinks=False)
                    out[os.path.relpath(e.path, path)] = (st.st_size, st.st_mtime_ns)
            except OSError:
                continue
    return out


def diff_snapshots(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """(created, changed, omitted): at most MAX_LISTED names each, sorted, and how many more there were."""
    created = sorted(k for k in after if k not in before)
    changed = sorted(k for k in after if k in before and after[k] != before[k])
    omitted = max(0, len(created) - MAX_LISTED) + max(0, len(changed) - MAX_LISTED)
    return tuple(created[:MAX_LISTED]), tuple(changed[:MAX_LISTED]), omitted
