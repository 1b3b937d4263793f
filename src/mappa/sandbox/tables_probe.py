"""Whether agent code can read a copy of a task's table: scanned inside the sandbox, cached, covered, re-checked.

    check = check_tables(confinement, fingerprints)     # fingerprints: mappa.tasks.dsbench.fingerprints
    check.found, check.dropped, check.lines()           # copies read; tasks whose copy stays readable

The scan (tables_scan.py) runs as a snippet under `confinement`, so it reads what agent code would: the agent
environment, the base installation, /usr, bounded by SCAN_BUDGET_S and per-file limits. Every file it matches is
recorded as covered for the agent environment (allowlist.record_covers: from then on every allowlisted root hides
it), and the scan runs again on those files alone: a task whose copy is still readable is dropped by the caller.
The outcome is cached by the agent environment's identity (its paths, the entries of the folders that installing
a package changes, and the scanner's own source) and the fingerprints' digest, so only the first
run after a change pays for the scan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from mappa.errors import MappaError
from mappa.paths import atomic_write, cache_dir
from mappa.sandbox.allowlist import AgentEnv, record_covers
from mappa.sandbox.confine import Confinement
from mappa.sandbox.execute import Limits, run_cold
from mappa.sandbox.workspace import new_workspace, remove_workspace

SCANNER = Path(__file__).with_name("tables_scan.py")
SCAN_BUDGET_S = 240.0  # the scan stops reading new files after this long and says so
SCAN_FILE = "tables-scan.json"  # under <MAPPA_CACHE>/sandbox: outcomes by environment and fingerprints
KEEP_SCANS = 16
_ENV_FOLDERS = ("/usr", "/usr/share", "/usr/lib", "/usr/local", "/usr/local/lib", "/usr/lib/python3")


@dataclasses.dataclass(frozen=True)
class TablesCheck:
    found: tuple[tuple[str, str], ...]  # (task id, file as agent code sees it) for each copy the scan read
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)  # task id -> file still readable once covered
    seconds: float = 0.0  # the scans' own time in the sandbox (the cached one's, when cached)
    files: int = 0  # files seen, and read as possible tables
    read: int = 0
    unfinished: bool = False  # the time budget ran out before every file was read
    cached: bool = False
    failed: str = ""  # why no scan could run (only where sandbox.allow_unconfined lets the run go on)

    def lines(self) -> list[str]:
        """What a run prints: one line per dropped task, one for the copies hidden, one if the scan was cut."""
        if self.failed:
            return [f"sandbox: WARNING: copies of task tables were not looked for: {self.failed}"]
        out = [
            f"sandbox: task {task} dropped: agent code can read a copy of its table at {path}"
            for task, path in sorted(self.dropped.items())
        ]
        hidden = sorted({(t, p) for t, p in self.found if t not in self.dropped})
        if hidden:
            what = "; ".join(f"{t}: {p}" for t, p in hidden[:5]) + (
                f"; {len(hidden) - 5} more" if len(hidden) > 5 else ""
            )
            copies = "1 copy" if len(hidden) == 1 else f"{len(hidden)} copies"
            out.append(f"sandbox: covered {copies} of task tables in the agent's view ({what})")
        if self.unfinished:
            out.append(
                f"sandbox: WARNING: the scan for copies of task tables stopped after {self.seconds:.0f} s with files "
                "left unread; those files were not checked"
            )
        return out


def _names(folder: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(folder) if e.name != "__pycache__")
    except OSError:
        return []


def _folder_names(top: str, hidden: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """The entries of `top` and of each of its folders: installing or removing a package changes them (a
    dist-info folder names the version). Byte-code caches, which any host process that imports may write, do not
    count, nor folders hidden from agent code."""
    out = [(top, _names(top))]
    for name in out[0][1]:
        path = os.path.join(top, name)
        if path not in hidden and os.path.isdir(path) and not os.path.islink(path):
            out.append((name, _names(path)))
    return out


def env_identity(env: AgentEnv) -> str:
    """A digest that changes when a package is installed or removed in what agent code sees, or the scanner does."""
    tops = list(_ENV_FOLDERS)
    for prefix in filter(None, (env.venv, env.base)):
        real = Path(os.path.realpath(prefix))
        tops += [str(real), *(str(p) for p in [*real.glob("lib/python3*"), *real.glob("lib/python3*/site-packages")])]
    h = hashlib.sha256(json.dumps([env.python, env.base, env.venv, list(env.hidden)]).encode())
    for top in dict.fromkeys(t for t in tops if t not in env.hidden):
        h.update(json.dumps(_folder_names(top, env.hidden)).encode())
    h.update(SCANNER.read_bytes())
    return h.hexdigest()[:24]


def scan_tables(
    confinement: Confinement, tasks: list[dict], roots: list[str], budget_s: float = SCAN_BUDGET_S
) -> dict:
    """Run the scanner under `confinement` over `roots` (as agent code sees them); its JSON result.

    MappaError when the scan itself fails (it could not check anything)."""
    spec = json.dumps({"tasks": tasks, "roots": roots, "budget_s": budget_s})
    ws = new_workspace({"scan.json": spec.encode()})
    limits = Limits(timeout_s=budget_s + 120, memory_mb=3072, max_output_chars=400_000, max_file_mb=1)
    try:
        r = run_cold(SCANNER.read_text(encoding="utf-8") + "\nmain()\n", ws, limits, confinement)
    finally:
        remove_workspace(ws)
    lines = r.stdout.strip().splitlines()
    if not r.ok or not lines:
        why = r.infra_error or ("timed out" if r.timed_out else "") or r.stderr.strip()[-300:]
        raise MappaError(f"sandbox: the scan for copies of task tables failed ({why})")
    try:
        result = json.loads(lines[-1])
    except ValueError:
        raise MappaError("sandbox: the scan for copies of task tables printed no result") from None
    if not isinstance(result, dict) or not isinstance(result.get("matches"), list):
        raise MappaError("sandbox: the scan for copies of task tables printed an unexpected result")
    return result


def _outer_file(path: str) -> str:
    """The file on disk of a match: an archive's member is covered with its archive."""
    return path.partition("!")[0]


def _cache() -> dict:
    try:
        data = json.loads((cache_dir() / "sandbox" / SCAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(key: str, outcome: dict) -> None:
    data = _cache()
    data.pop(key, None)
    data[key] = outcome
    path = cache_dir() / "sandbox" / SCAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(dict(list(data.items())[-KEEP_SCANS:]), indent=1))


def check_tables(
    confinement: Confinement, fingerprints: dict, roots: Sequence[str] = ("/",), budget_s: float = SCAN_BUDGET_S
) -> TablesCheck:
    """Scan `roots` (or recall the scan), cover what it found for the agent environment, re-check those files.

    A scan cut by its time budget is not remembered: the next run scans again rather than trust a partial look."""
    env = confinement.env
    key = f"{env_identity(env)}:{fingerprints['digest']}:{':'.join(roots)}"
    known = _cache().get(key)
    if isinstance(known, dict):
        try:
            check = TablesCheck(**{**known, "found": tuple((str(t), str(p)) for t, p in known["found"])})
        except (KeyError, TypeError, ValueError):  # written by another version: scan again
            check = None
        if check is not None:
            record_covers(env, [env.on_host(_outer_file(p)) for _, p in check.found])  # as when it was scanned
            return dataclasses.replace(check, cached=True)
    tasks = fingerprints["tasks"]
    first = scan_tables(confinement, tasks, list(roots), budget_s)
    found = tuple(sorted({(str(m["task"]), str(m["path"])) for m in first["matches"]}))
    files = sorted({_outer_file(p) for _, p in found})
    record_covers(env, [env.on_host(f) for f in files])
    seconds = float(first.get("seconds", 0.0))
    dropped: dict[str, str] = {}
    if files:  # covered now: the same files, read again as agent code would read them
        again = scan_tables(confinement, tasks, files, budget_s)
        dropped = {str(m["task"]): str(m["path"]) for m in again["matches"]}
        seconds += float(again.get("seconds", 0.0))
    files_seen, read, unfinished = int(first.get("files", 0)), int(first.get("read", 0)), bool(first.get("unfinished"))
    check = TablesCheck(found, dropped, round(seconds, 2), files_seen, read, unfinished)
    if not unfinished:
        _remember(key, dataclasses.asdict(check))
    return check
