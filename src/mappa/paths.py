"""Where mappa keeps things on disk: the model/coach cache and the math data directory."""

from __future__ import annotations

import os
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
