"""`run_python` (one snippet in a fresh confined interpreter) and `Sandbox` (a SandboxConfig's limits, its warm pool
and concurrency): the two ways to run agent code. What the confinement protects against, and what it does not, is
the package's docstring (`mappa.sandbox`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mappa.config import SandboxConfig
from mappa.sandbox.confine import Confinement, ConfinementMode, detect_confinement
from mappa.sandbox.execute import Limits, run_cold
from mappa.sandbox.pool import WarmPool
from mappa.sandbox.workspace import workspace_root
from mappa.types import ExecResult


def run_python(
    code: str,
    workspace: str | Path,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_processes: int = 64,
    max_file_mb: int = 64,
    max_output_chars: int = 8000,
    confinement: ConfinementMode = "auto",
) -> ExecResult:
    """Run `code` once in a fresh confined interpreter with `workspace` as its working directory.

    Never raises for anything the code does; the sandbox's own failures come back as `infra_error`.
    A missing workspace is the caller's error (MappaError).
    """
    limits = Limits(timeout_s, memory_mb, max_processes, max_file_mb, max_output_chars)
    return run_cold(code, Path(workspace), limits, detect_confinement(confinement))


class Sandbox:
    """Runs snippets with the limits of a SandboxConfig: up to `cfg.concurrency` at once, through the warm
    pool when `cfg.pool` (snippets whose workspace is outside `workspace_root()` run cold).

    The confinement is `cfg.confinement` unless `confinement` overrides it; `describe_confinement(
    sandbox.confinement)` names it in one line.
    """

    def __init__(self, cfg: SandboxConfig | None = None, *, confinement: ConfinementMode | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        self.confinement: Confinement = detect_confinement(confinement or self.cfg.confinement, self.cfg.python)
        self.limits = Limits(
            self.cfg.timeout_s,
            self.cfg.memory_mb,
            self.cfg.max_processes,
            self.cfg.max_file_mb,
            self.cfg.max_output_chars,
            self.cfg.max_open_files,
        )
        self.root = workspace_root().resolve()
        self.pool = WarmPool(self.root, self.cfg.preload, self.confinement) if self.cfg.pool else None
        self._executor = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="sandbox")
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def run(self, code: str, workspace: str | Path, *, timeout_s: float | None = None) -> ExecResult:
        """Run one snippet. Snippets of one workspace run one at a time: they share its uid, and the sweep after
        one of them (and the memory watchdog) covers every process of that uid."""
        workspace = Path(workspace).resolve()
        limits = self.limits if timeout_s is None else Limits(**{**self.limits.__dict__, "timeout_s": timeout_s})
        with self._locks_lock:
            lock = self._locks.setdefault(workspace, threading.Lock())
        with lock:
            if self.pool is not None and workspace.parent == self.root:
                return self.pool.run(code, workspace, limits)
            return run_cold(code, workspace, limits, self.confinement)

    def run_many(
        self, items: Sequence[tuple[str, Path]], progress: Callable[[int, int], None] | None = None
    ) -> list[ExecResult]:
        """Run (code, workspace) pairs, `cfg.concurrency` at a time; results in input order.

        `progress(done, total)` is called after each result, in input order.
        """
        futures = [self._executor.submit(self.run, code, ws) for code, ws in items]
        results = []
        for f in futures:
            results.append(f.result())
            if progress is not None:
                progress(len(results), len(futures))
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
