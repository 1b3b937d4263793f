"""SQLite cache of coach judgments: never pay twice for the same judgment.

Keyed by (backend, model, template version, sha256 of the canonical context JSON). WAL mode plus a
busy timeout makes it safe for several processes (parallel replays, a trainer and a replay) to
read and write the same file: SQLite serialises the writers, readers never block.
Only judgments the endpoint actually returned are stored; transport failures are not, so a later
run retries them.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path

from mappa.errors import MappaError
from mappa.paths import cache_dir
from mappa.types import CoachContext, CoachScore


def context_hash(ctx: CoachContext) -> str:
    """sha256 of the context as canonical JSON (sorted keys, no whitespace)."""
    canonical = json.dumps(ctx.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def cache_key(backend: str, model: str, template_version: str, ctx_hash: str) -> str:
    return hashlib.sha256("\x1f".join((backend, model, template_version, ctx_hash)).encode("utf-8")).hexdigest()


def default_cache_path() -> Path:
    return cache_dir() / "coach_cache.sqlite"


class JudgmentCache:
    """A process- and thread-safe key -> CoachScore store."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else default_cache_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One connection shared by the threads of this process, guarded by a lock.
            self._conn = sqlite3.connect(self.path, timeout=60.0, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA busy_timeout=60000")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS judgments (key TEXT PRIMARY KEY, backend TEXT, model TEXT, "
                "template_version TEXT, context_hash TEXT, score TEXT NOT NULL, created REAL)"
            )
        except (OSError, sqlite3.Error) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise MappaError(f"coach.cache_path: cannot open the coach cache {self.path} ({why})") from None
        self._lock = threading.Lock()

    def get(self, key: str) -> CoachScore | None:
        with self._lock:
            row = self._conn.execute("SELECT score FROM judgments WHERE key = ?", (key,)).fetchone()
        return CoachScore.model_validate_json(row[0]) if row else None

    def put(self, key: str, score: CoachScore, *, backend: str, model: str, template_version: str, ctx_hash: str):
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO judgments VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key, backend, model, template_version, ctx_hash, score.model_dump_json(), time.time()),
            )

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM judgments").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
