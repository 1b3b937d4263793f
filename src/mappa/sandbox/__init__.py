"""Sandboxed Python execution: the agents' code tool, safe under hostile code and fast under RL load.

    ws = new_workspace({"data.csv": b"a,b\\n1,2\\n"})
    result = run_python("import pandas as pd; print(pd.read_csv('data.csv').sum())", ws, timeout_s=5)
    with Sandbox(SandboxConfig()) as sb:                # warm pool + concurrency from the config
        results = sb.run_many([(code, ws) for code in snippets])
    remove_workspace(ws)

Each snippet runs in a forked child of a confined runner (see confine.py for the exact confinement):
- wall clock (`timeout_s`) and CPU time (RLIMIT_CPU): the snippet and everything it started is killed, also
  processes that started their own session (PID namespace under bwrap; per-workspace uid sweep as root);
- memory: RLIMIT_AS (`memory_mb`; in the warm pool counted on top of the preloaded modules); a MemoryError
  or allocation failure is reported as `memory_exceeded`;
- processes: RLIMIT_NPROC (`max_processes`), exact per workspace when root (a uid per workspace),
  otherwise counted on top of the user's existing processes;
- file size: RLIMIT_FSIZE (`max_file_mb`); stdout/stderr are read incrementally and only `max_output_chars`
  are kept (head and tail, with a marker saying how much was cut), so 100 MB of output costs no memory;
- no network: a network namespace (bwrap, or `unshare -n` in the fallback). Where neither works the network
  stays open, and the one-time fallback warning says so;
- environment: scrubbed to PATH/HOME/LANG and thread settings; no inherited API keys or tokens;
- files: under bwrap the root filesystem is read-only, /tmp is empty and read-only, /root and $HOME are
  hidden; only the workspace is writable (TMPDIR and HOME point into it);
- the host survives snippets that close stdout, kill their parent or leave background processes.

What it does NOT protect against:
- kernel exploits and escapes from namespaces (it is not a VM; run untrusted code at scale in a VM too);
- reading world-readable files of the host (the repository, /etc/passwd, installed packages);
- CPU and disk-bandwidth hogging within the limits (no cgroups: a snippet may use its cores until timeout);
- the many files case beyond the file-size limit: a snippet can fill the disk with many small files
  under its workspace (no quota);
- without bwrap (fallback): writes to world-writable directories, and, when not root, to anything the user
  can write; leaked processes of a non-root fallback snippet that left its session; the network when
  `unshare` is not allowed;
- in the warm pool without root: one snippet opening another episode's workspace if it can guess its
  random path (as root each workspace has its own uid and mode 0700).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from mappa.config import SandboxConfig
from mappa.errors import MappaError
from mappa.sandbox.confine import Confinement, detect_confinement
from mappa.sandbox.execute import Limits, run_cold
from mappa.sandbox.pool import WarmPool
from mappa.sandbox.workspace import new_workspace, remove_workspace, workspace_root
from mappa.types import ExecResult

__all__ = [
    "Sandbox",
    "new_workspace",
    "remove_workspace",
    "run_python",
    "sandbox_run_command",
    "workspace_root",
]

ConfinementMode = Literal["auto", "bwrap", "fallback"]


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
    pool when `cfg.pool` (snippets whose workspace is outside `workspace_root()` run cold)."""

    def __init__(self, cfg: SandboxConfig | None = None, *, confinement: ConfinementMode = "auto") -> None:
        self.cfg = cfg or SandboxConfig()
        self.confinement: Confinement = detect_confinement(confinement)
        self.limits = Limits(
            self.cfg.timeout_s,
            self.cfg.memory_mb,
            self.cfg.max_processes,
            self.cfg.max_file_mb,
            self.cfg.max_output_chars,
        )
        self.root = workspace_root().resolve()
        self.pool = WarmPool(self.root, self.cfg.preload, self.confinement) if self.cfg.pool else None
        self._executor = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="sandbox")

    def run(self, code: str, workspace: str | Path, *, timeout_s: float | None = None) -> ExecResult:
        workspace = Path(workspace).resolve()
        limits = self.limits if timeout_s is None else Limits(**{**self.limits.__dict__, "timeout_s": timeout_s})
        if self.pool is not None and workspace.parent == self.root:
            return self.pool.run(code, workspace, limits)
        return run_cold(code, workspace, limits, self.confinement)

    def run_many(self, items: Sequence[tuple[str, Path]], progress: bool = False) -> list[ExecResult]:
        """Run (code, workspace) pairs, `cfg.concurrency` at a time; results in input order."""
        futures = [self._executor.submit(self.run, code, ws) for code, ws in items]
        if not progress:
            return [f.result() for f in futures]
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task("sandbox", total=len(futures))
            results = []
            for f in futures:
                results.append(f.result())
                bar.advance(task)
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sandbox_run_command(
    file: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, workspace: str | None = None, pool: bool = False
) -> int:
    """`mappa sandbox run FILE`: print the ExecResult as JSON; exit 0 when the sandbox itself worked."""
    path = Path(file)
    if not path.is_file():
        raise MappaError(f"{path}: file not found")
    code = path.read_text(encoding="utf-8", errors="surrogateescape")
    fresh = workspace is None
    ws = new_workspace() if fresh else Path(workspace)
    if not fresh:
        ws.mkdir(parents=True, exist_ok=True)
    cfg = SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb, pool=pool, concurrency=1)
    try:
        with Sandbox(cfg) as sandbox:
            result = sandbox.run(code, ws)
    finally:
        if fresh:
            remove_workspace(ws)
    sys.stdout.write(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    return 1 if result.infra_error else 0
