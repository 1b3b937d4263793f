"""`mappa sandbox run FILE`: run a Python file in the sandbox and print its ExecResult as JSON.

The first line on stderr names the confinement in use (and what it leaves open); stdout holds only the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mappa.config import SandboxConfig
from mappa.errors import MappaError
from mappa.sandbox import Sandbox, describe_confinement, new_workspace, remove_workspace
from mappa.sandbox.confine import ConfinementMode


def sandbox_run_command(
    file: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    workspace: str | None = None,
    pool: bool = False,
    confinement: ConfinementMode = "auto",
) -> int:
    """Exit 0 when the sandbox itself worked (whatever the code did), 1 on an infra error."""
    path = Path(file)
    if not path.is_file():
        raise MappaError(f"{path}: file not found")
    code = path.read_text(encoding="utf-8", errors="surrogateescape")
    fresh = workspace is None
    if not fresh:
        try:
            Path(workspace).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MappaError(f"--workspace {workspace}: cannot create it ({e.strerror or e})") from None
    sys.stderr.write(describe_confinement(confinement) + "\n")
    ws = new_workspace() if fresh else Path(workspace)
    cfg = SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb, pool=pool, concurrency=1, confinement=confinement)
    try:
        with Sandbox(cfg) as sandbox:
            result = sandbox.run(code, ws)
    finally:
        if fresh:
            remove_workspace(ws)
    sys.stdout.write(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    return 1 if result.infra_error else 0
