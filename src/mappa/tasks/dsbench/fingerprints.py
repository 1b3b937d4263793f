"""Content fingerprints of the mini-DSBench's tables, to find copies of them among the files agent code can read.

    fps = load_fingerprints(root)           # fingerprints.json beside tasks.jsonl (computed and saved when missing)
    fps["tasks"][0]["id"], fps["digest"]    # one entry per task; the digest names this set in the scan's cache

A copy of a task's table in a library's test data would let agent code label the test rows by joining on the
features. The fingerprint is made to find such a copy however it is written: every cell is normalised
(`mappa.sandbox.tables_scan.normalise`: numbers to 6 significant digits, text trimmed and case-folded, the
spellings of a missing value as one) and hashed, and nothing depends on row or column order or on column names.
Per task, from its train.csv (so it holds no test label):

- per column (the target and the MAX_COLUMNS most varied features): its number of distinct values and a sketch,
  the SKETCH smallest hashes of its distinct values, by which the scan tells which file column holds it;
- SAMPLE_ROWS training rows, each cell's hash and the row's target: a class number (a copy may spell the classes
  any way: 'survived' or 1) or, for a regression, the value's hash. A file whose rows, joined on the matching
  columns, give the sample's targets is a copy.

The build writes the file (build.py); `load_fingerprints` computes it for a benchmark built before.
"""

from __future__ import annotations

import csv
import hashlib
import heapq
import json
import random
from collections import Counter
from pathlib import Path

from mappa.errors import MappaError
from mappa.paths import atomic_write
from mappa.sandbox.tables_scan import cell_hash, name_key, normalise

FINGERPRINTS_FILE = "fingerprints.json"
VERSION = 1
SAMPLE_ROWS = 200
MAX_COLUMNS = 24  # features per task: the most varied ones tell rows apart; wider tables need no more
SKETCH = 32

# benchmark root -> {task id: the file where agent code can read its table}: tasks this process leaves out
_WITHHELD: dict[Path, dict[str, str]] = {}


def table_fingerprint(task_id: str, header: list[str], rows: list[list[str]], target: str, kind: str) -> dict:
    """One task's fingerprint from its training rows (cells as written in train.csv; the id column left out)."""
    t = header.index(target)
    memo: dict[str, str] = {}  # cells repeat: normalise each spelling once
    cells = [[memo.get(v) or memo.setdefault(v, normalise(v)) for v in col] for col in zip(*rows, strict=True)]
    distinct = [len(set(col) - {""}) for col in cells]
    features = sorted((i for i in range(len(header)) if i != t), key=lambda i: (-distinct[i], i))[:MAX_COLUMNS]
    keep = [*sorted(features), t]
    classification = kind == "classification"
    labels = sorted(set(cells[t]))
    label_of = {v: n for n, v in enumerate(labels)}
    sample = sorted(random.Random(f"fingerprint:{task_id}").sample(range(len(rows)), min(SAMPLE_ROWS, len(rows))))

    def sketch(i: int) -> list[int]:
        if i == t and classification:  # a class is found by how it splits the rows, not by its spelling
            return []
        return heapq.nsmallest(SKETCH, {cell_hash(v) for v in set(cells[i]) if v})

    def target_cell(v: str) -> int:
        return label_of[v] if classification else cell_hash(v)

    return {
        "id": task_id,
        "classification": classification,
        "classes": len(labels),
        "majority": round(Counter(cells[t]).most_common(1)[0][1] / len(rows), 4) if classification else 0.0,
        "names": [name_key(header[i]) for i in keep],
        "target": len(keep) - 1,
        "distinct": [distinct[i] for i in keep],
        "sketch": [sketch(i) for i in keep],
        "rows": [[cell_hash(cells[i][r]) for i in keep[:-1]] + [target_cell(cells[t][r])] for r in sample],
    }


def _index(root: Path) -> list[dict]:
    try:
        lines = (root / "tasks.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as e:
        raise MappaError(f"{root / 'tasks.jsonl'}: cannot read the benchmark's index ({e})") from None


def compute_fingerprints(root: Path) -> dict:
    """The fingerprints of every task of the benchmark at `root`, from tasks.jsonl and each train.csv."""
    tasks = []
    for row in _index(root):
        path = root / "tasks" / row["id"] / "train.csv"
        try:
            with path.open(encoding="utf-8", newline="") as f:
                header, *rows = list(csv.reader(f))
        except (OSError, ValueError) as e:
            raise MappaError(f"{path}: cannot read ({e})") from None
        drop = header.index(row["id_column"]) if row["id_column"] in header else None
        header = [h for i, h in enumerate(header) if i != drop]
        rows = [[v for i, v in enumerate(r) if i != drop] for r in rows if len(r) == len(header) + (drop is not None)]
        if rows and row["target"] in header:
            tasks.append(table_fingerprint(row["id"], header, rows, row["target"], row["data_type"]))
    body = json.dumps(tasks, sort_keys=True, separators=(",", ":"))
    return {"version": VERSION, "digest": hashlib.sha256(body.encode()).hexdigest()[:16], "tasks": tasks}


def write_fingerprints(root: Path) -> dict:
    """Compute the fingerprints of the benchmark at `root` and save them beside its tasks.jsonl."""
    fps = compute_fingerprints(root)
    atomic_write(root / FINGERPRINTS_FILE, json.dumps(fps, separators=(",", ":")))
    return fps


def load_fingerprints(root: Path) -> dict:
    """The saved fingerprints, or (a benchmark built before they were) computed now and saved where writable."""
    root = Path(root)
    try:
        fps = json.loads((root / FINGERPRINTS_FILE).read_text(encoding="utf-8"))
        if isinstance(fps, dict) and fps.get("version") == VERSION and isinstance(fps.get("tasks"), list):
            return fps
    except (OSError, ValueError):
        pass
    try:
        return write_fingerprints(root)
    except OSError:  # a read-only benchmark: this run computes them for itself
        return compute_fingerprints(root)


def withhold(root: Path, tasks: dict[str, str]) -> None:
    """Leave `tasks` (id -> the file where agent code reads its table) out of every load of `root` in this process."""
    _WITHHELD[Path(root).resolve()] = dict(tasks)


def withheld(root: Path) -> dict[str, str]:
    """The tasks of `root` this process leaves out (id -> where their table is readable)."""
    return dict(_WITHHELD.get(Path(root).resolve(), {}))
