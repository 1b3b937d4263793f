"""Where mappa keeps things on disk (the model/coach cache, the math data directory) and how files that must
survive a kill are written (`atomic_write`, `fsync_path`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from mappa.errors import MappaError


def cache_dir() -> Path:
    """`$MAPPA_CACHE` or `~/.cache/mappa`; created on first use, with a clear error when unwritable."""
    root = Path(os.environ.get("MAPPA_CACHE") or Path.home() / ".cache" / "mappa").expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MappaError(f"cache directory {root} is not writable ({e.strerror}); set MAPPA_CACHE") from None
    if not os.access(root, os.W_OK):
        raise MappaError(f"cache directory {root} is not writable; set MAPPA_CACHE to a writable directory")
    return root


def data_dir(configured: str | None = None) -> Path:
    """The math data directory: the config value, else `$MAPPA_DATA_DIR`, else ../shared/data/math next to cwd."""
    raw = configured or os.environ.get("MAPPA_DATA_DIR")
    path = Path(raw).expanduser() if raw else Path.cwd().parent / "shared" / "data" / "math"
    if not path.is_dir():
        hint = "" if raw else " (set tasks.data_dir or MAPPA_DATA_DIR)"
        raise MappaError(f"math data directory {path} not found{hint}")
    return path


# ------------------------------------------------------------------------------------------ durable writes
def fsync_path(path: str | Path) -> None:
    """Flush a file's bytes, or a directory's names, to disk (a new name or a rename is durable only once its
    directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | Iterable[str]) -> None:
    """Replace `path` with `data` (UTF-8 text, or chunks of it) all at once: written to a temporary file beside
    it, fsynced, renamed over it, and the directory fsynced. A kill or a power loss at any moment leaves the old
    file or the new one whole, never a mix or an empty file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    # O_EXCL: never write through a name someone else placed there; 0o666 lets the umask decide, as open() would
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            for chunk in [data] if isinstance(data, str) else data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
