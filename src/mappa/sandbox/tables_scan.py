"""Finds copies of the tasks' tables among the files agent code can read; its source runs inside the sandbox.

The host hands it, in the probe's workspace, each task's fingerprint (`mappa.tasks.dsbench.fingerprints`): per
column a sketch of its distinct values, and for a sample of training rows each cell's hash with the row's target (a
class number, or the value's hash for a regression). The scan walks what agent code sees (bounded in time and bytes,
skipping binaries), reads every table-like file it can parse cheaply (delimited text, ARFF, JSON, NumPy, MATLAB,
Parquet/Feather/ORC, SQLite, Stata/SAS, pickles), also inside .gz/.bz2/.xz files and .zip/.tar archives, and
reports the files that label the sample: joined on the columns whose values match the task's, their rows give the
sample's targets (any encoding of the classes), as a model would from a copy of the table.

Standard library only at import (numpy, pyarrow, pandas, scipy are imported for their formats when present), so
the host imports `normalise` and `cell_hash` from here to fingerprint tasks the same way.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import json
import lzma
import math
import os
import pickle
import re
import signal
import sqlite3
import sys
import tarfile
import time
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain

MISSING = {"", "na", "nan", "n/a", "null", "none", "?", "."}
MAX_BYTES = 16 << 20  # of one file, decompressed: a task table's copy is far smaller
MAX_ROWS = 200_000
MAX_CELLS = 3_000_000
MAX_MEMBERS = 5_000  # of one archive
MAX_MATCHES = 200  # the result stays a few hundred kB
FILE_S = 30  # seconds for one file (an archive with its members)
ALIGN = 0.8  # share of a task column's sketched values a file column must hold to stand for it
MIN_ROWS = 10  # sample rows a file must label before it counts as a copy
MIN_KEY_SPACE = 200  # a join key must tell at least this many rows apart (product of distinct counts)
TEXT = {"csv", "tsv", "tab", "psv", "ssv", "txt", "dat", "data", "asc", "prn", "test", "train", "tra", "tes", "all"}
FORMATS = TEXT | {"arff", "json", "jsonl", "ndjson", "npy", "npz", "mat", "parquet", "pq", "feather", "arrow", "ipc"}
FORMATS |= {"orc", "sqlite", "sqlite3", "db", "pkl", "pickle", "dta", "sas7bdat", "xpt"}
COMPRESSED = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open, "lzma": lzma.open}
ARCHIVES = ("zip", "tar", "tgz", "tbz2", "txz", "whl", "egg")
SKIP_DIRS = {"/proc", "/sys", "/dev", "/run/mappa"}
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def normalise(value: object) -> str:
    """One spelling per value: numbers to 6 significant digits, text trimmed and case-folded, missing as ''."""
    kind = type(value)
    if kind is str or kind is float or kind is int:  # the usual cells first: a table has millions
        try:
            return _number(float(value))  # type: ignore[arg-type]
        except ValueError:
            pass
    elif value is None:
        return ""
    elif isinstance(value, bool):
        return "1" if value else "0"
    elif isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    elif type(value).__module__ == "numpy":
        try:
            return _number(float(value))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
    text = " ".join(str(value).strip().strip("'\"").casefold().split())
    if text in MISSING:
        return ""
    if text in ("true", "false"):
        return "1" if text == "true" else "0"
    if _NUMBER.fullmatch(text):  # a quoted number
        return _number(float(text))
    return text


def _number(x: float) -> str:
    if math.isnan(x):
        return ""
    return "0" if x == 0 else format(x, ".6g")


def cell_hash(text: str) -> int:
    """A 48-bit hash of a normalised cell (the same on the host and inside the sandbox)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=6).digest(), "big")


MISSING_HASH = cell_hash("")


def name_key(name: object) -> str:
    return re.sub(r"[^0-9a-z]", "", str(name).casefold())


# --- reading tables ---------------------------------------------------------------------------------------


@dataclass
class Table:
    names: list[str]
    columns: list[list]  # one list of cells per column, all of one length


def _kind(name: str) -> str:
    """The format of a file by its name ('' when not table-like); compression and archives by suffix."""
    low = name.lower()
    parts = low.rsplit("/", 1)[-1].split(".")
    ext = parts[-1] if len(parts) > 1 else ""
    if ext in COMPRESSED:
        inner = parts[-2] if len(parts) > 2 else "sniff"  # data.gz: read when it looks like text
        return "tar" if inner == "tar" else (f"{ext}:{inner}" if inner in FORMATS or inner == "sniff" else "")
    if ext in ARCHIVES:
        return "tar" if ext.startswith("t") else "zip"
    if ext in FORMATS:
        return ext
    return "sniff" if len(parts) == 1 else ""  # no extension: read when it looks like text


def _rows_of(rows: list[list], names: list[str] | None = None) -> Table | None:
    """Rows of one common length (the most frequent) as columns; the first row doubles as the names."""
    if not rows:
        return None
    width = Counter(len(r) for r in rows[:200]).most_common(1)[0][0]
    rows = [r for r in rows if len(r) == width][:MAX_ROWS]
    if width < 2 or len(rows) < MIN_ROWS:
        return None
    rows = rows[: max(MIN_ROWS, MAX_CELLS // width)]
    names = names if names is not None and len(names) == width else [str(c) for c in rows[0]]
    return Table(names, [list(col) for col in zip(*rows, strict=True)])


def _delimiter(lines: list[str]) -> str | None:
    """The delimiter that splits the first lines into one common number (>1) of fields, quotes respected; None:
    none does (whitespace, or not a table)."""
    best, best_fields = None, 1
    for d in (",", "\t", ";", "|"):
        if not any(d in line for line in lines):
            continue
        fields, n = Counter(len(r) for r in csv.reader(lines, delimiter=d)).most_common(1)[0]
        if fields > best_fields and n >= 0.8 * len(lines):
            best, best_fields = d, fields
    return best


def read_text(data: bytes) -> Table | None:
    """Delimited or whitespace-separated text; prose (no common number of fields) is left after its first lines."""
    head = [ln.strip() for ln in data[:65536].decode("utf-8", "replace").splitlines()]
    head = [ln for ln in head if ln and ln[0] not in "#%"][:50]
    if len(head) < MIN_ROWS:
        return None
    d = _delimiter(head)
    if d is None:
        width, n = Counter(len(ln.split()) for ln in head).most_common(1)[0]
        if width < 2 or n < 0.8 * len(head):
            return None
    text = data.decode("utf-8", "replace")
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and ln[0] not in "#%"]
    if len(data) >= MAX_BYTES:
        lines.pop()  # a cut last line
    if d is not None:
        return _rows_of(list(csv.reader(lines, delimiter=d)))
    if '"' in text[:4096]:
        return _rows_of(list(csv.reader(lines, delimiter=" ", skipinitialspace=True)))
    return _rows_of([ln.split() for ln in lines])


def read_arff(data: bytes) -> Table | None:
    text = data.decode("utf-8", "replace")
    names, body, at = [], [], False
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] == "%":
            continue
        low = s.lower()
        if at:
            if not s.startswith("{"):  # sparse rows are not read
                body.append(s)
        elif low.startswith("@attribute"):
            rest = s[len("@attribute") :].strip()
            quoted = rest[:1] in ("'", '"')
            names.append(next(csv.reader([rest], delimiter=" ", quotechar=rest[0]))[0] if quoted else rest.split()[0])
        elif low.startswith("@data"):
            at = True
    quote = '"' if '"' in "".join(body[:50]) else "'"
    return _rows_of(list(csv.reader(body, quotechar=quote, skipinitialspace=True)), names)


def _json_tables(obj: object, depth: int = 0) -> Iterator[Table]:
    """Records (a list of objects), rows (a list of lists) and columns (an object of equal-length lists)."""
    if depth > 6:
        return
    if isinstance(obj, list) and len(obj) >= MIN_ROWS:
        if all(isinstance(r, dict) for r in obj[:50]):
            keys = list(dict.fromkeys(k for r in obj[:50] for k in r))
            rows = [[r.get(k) for k in keys] for r in obj[:MAX_ROWS] if isinstance(r, dict)]
            table = _rows_of(rows, keys)
        else:
            table = _rows_of([r for r in obj[:MAX_ROWS] if isinstance(r, list)])
        if table is not None:
            yield table
    if isinstance(obj, dict):
        lists = {str(k): v for k, v in obj.items() if isinstance(v, list) and len(v) >= MIN_ROWS}
        by_len: dict[int, list[str]] = {}
        for k, v in lists.items():
            by_len.setdefault(len(v), []).append(k)
        for keys in by_len.values():
            if len(keys) >= 2 and all(not isinstance(lists[k][0], (list, dict)) for k in keys):
                yield Table(keys, [lists[k][:MAX_ROWS] for k in keys])
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    for child in list(children)[:200]:
        if isinstance(child, (list, dict)):
            yield from _json_tables(child, depth + 1)


def read_json(data: bytes, lines: bool) -> list[Table]:
    text = data.decode("utf-8", "replace")
    try:
        obj = [json.loads(ln) for ln in text.splitlines() if ln.strip()] if lines else json.loads(text)
    except ValueError:
        return []
    return list(_json_tables(obj))


def _array_tables(arrays: dict[str, object]) -> list[Table]:
    """NumPy arrays of one length as the columns of a table (2-D arrays give one column each)."""
    import numpy as np

    groups: dict[int, Table] = {}
    for key, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.names:  # a structured array: one column per field
            fields = {f"{key}.{f}": a[f] for f in a.dtype.names}
            groups.update({-len(groups) - 1: t for t in _array_tables(fields)})
            continue
        if a.ndim == 0 or a.ndim > 2 or a.dtype.kind not in "biufUSO" or a.shape[0] < MIN_ROWS:
            continue
        a = a[:MAX_ROWS]
        table = groups.setdefault(a.shape[0], Table([], []))
        for j in range(a.shape[1] if a.ndim == 2 else 1):
            if len(table.columns) < 256:
                table.names.append(f"{key}{j}" if a.ndim == 2 else key)
                table.columns.append((a[:, j] if a.ndim == 2 else a).tolist())
    return [t for t in groups.values() if len(t.columns) >= 2]


def read_numpy(data: bytes, kind: str) -> list[Table]:
    import numpy as np

    if kind == "mat":
        from scipy.io import loadmat

        return _array_tables({k: v for k, v in loadmat(io.BytesIO(data)).items() if not k.startswith("__")})
    loaded = np.load(io.BytesIO(data), allow_pickle=False)
    return _array_tables(dict(loaded.items()) if kind == "npz" else {"x": loaded})


def _frame_table(frame: object) -> Table | None:
    """A pandas DataFrame (or anything with `columns` and item access) as a table."""
    names = [str(c) for c in frame.columns][:256]  # type: ignore[attr-defined]
    cols = [frame[c].tolist()[:MAX_ROWS] for c in list(frame.columns)[:256]]  # type: ignore[attr-defined, index]
    return Table(names, cols) if cols and len(cols[0]) >= MIN_ROWS else None


def read_arrow(data: bytes, kind: str) -> list[Table]:
    import pyarrow as pa

    if kind in ("parquet", "pq"):
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(pa.BufferReader(data)).iter_batches(batch_size=MAX_ROWS), None)
        table = pa.Table.from_batches([batch]) if batch is not None else None
    elif kind == "orc":
        import pyarrow.orc as orc

        table = orc.ORCFile(pa.BufferReader(data)).read()
    else:
        import pyarrow.feather as feather

        table = feather.read_table(pa.BufferReader(data))
    if table is None or table.num_rows < MIN_ROWS:
        return []
    table = table.slice(0, MAX_ROWS)
    return [Table(table.column_names, [table.column(i).to_pylist() for i in range(min(256, table.num_columns))])]


def read_sqlite(path: str) -> list[Table]:
    out = []
    with sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True) as db:
        names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")][:50]
        for name in names:
            cur = db.execute(f'SELECT * FROM "{name}" LIMIT {MAX_ROWS}')
            cols = [d[0] for d in cur.description]
            table = _rows_of([list(r) for r in cur.fetchall()], cols)
            if table is not None:
                out.append(table)
    return out


def read_other(data: bytes, kind: str) -> list[Table]:
    """Pickles (the sandbox's own view: nothing here is the trainer's) and Stata/SAS files, through pandas."""
    if kind in ("pkl", "pickle"):
        obj = pickle.loads(data)
    else:
        import pandas as pd

        reader = pd.read_stata if kind == "dta" else pd.read_sas
        obj = reader(io.BytesIO(data), **({} if kind == "dta" else {"format": kind}))
    if hasattr(obj, "columns"):
        table = _frame_table(obj)
        return [table] if table is not None else []
    if isinstance(obj, dict):
        return _array_tables(obj) if "numpy" in sys.modules else []
    return _array_tables({"x": obj}) if type(obj).__module__ == "numpy" else list(_json_tables(obj))


def read_tables(data: bytes, kind: str, path: str) -> list[Table]:
    """The tables of one file's bytes (`kind` from `_kind`, without compression); [] when none can be read."""
    if kind == "sniff":
        head = data[:4096]
        return [t for t in [read_text(data)] if t is not None] if head and b"\0" not in head else []
    if kind in TEXT:
        return [t for t in [read_text(data)] if t is not None]
    if kind == "arff":
        return [t for t in [read_arff(data)] if t is not None]
    if kind in ("json", "jsonl", "ndjson"):
        return read_json(data, kind != "json")
    if kind in ("npy", "npz", "mat"):
        return read_numpy(data, kind)
    if kind in ("parquet", "pq", "feather", "arrow", "ipc", "orc"):
        return read_arrow(data, kind)
    if kind in ("sqlite", "sqlite3", "db"):
        return read_sqlite(path) if os.path.isfile(path) else []
    return read_other(data, kind)


# --- matching ---------------------------------------------------------------------------------------------


def _aligned(tasks: list[dict], sets: list[set[int]]) -> dict[int, dict[int, list[tuple[float, int]]]]:
    """task -> task column -> [(share of its sketch found, file column)] for every file column holding >= ALIGN."""
    index: dict[int, list[tuple[int, int]]] = {}
    for t, task in enumerate(tasks):
        for i, sketch in enumerate(task["sketch"]):
            for h in sketch:
                index.setdefault(h, []).append((t, i))
    out: dict[int, dict[int, list[tuple[float, int]]]] = {}
    keys = set(index)
    for j, values in enumerate(sets):
        # Counted in C: most of a file's values are in no sketch, and small numbers are in hundreds
        counts = Counter(chain.from_iterable(map(index.__getitem__, values & keys)))
        for (t, i), n in counts.items():
            share = n / len(tasks[t]["sketch"][i])
            if share >= ALIGN:
                out.setdefault(t, {}).setdefault(i, []).append((share, j))
    return out


def _assign(task: dict, cands: dict[int, list[tuple[float, int]]], names: list[str], sizes: list[int]) -> dict:
    """Task feature column -> one file column each: same name first, then the larger share, then the closer size."""
    used: set[int] = set()
    align: dict[int, int] = {}
    for i in sorted(cands, key=lambda i: -task["distinct"][i]):
        if i == task["target"]:
            continue
        size = task["distinct"][i] + 1
        options = [
            (bool(names[j]) and names[j] == task["names"][i], share, -abs(math.log((sizes[j] + 1) / size)), -j)
            for share, j in cands[i]
            if j not in used
        ]
        if options:
            j = -max(options)[-1]
            align[i] = j
            used.add(j)
    return align


def _keys(task: dict, align: dict[int, int], names: list[str]) -> list[list[int]]:
    """Join keys to try: every aligned column, those whose names match too, the three most varied."""
    feats = sorted(align, key=lambda i: -task["distinct"][i])
    named = [i for i in feats if names[align[i]] == task["names"][i]]
    out: list[list[int]] = []
    for key in (feats, named, feats[:3]):
        if key and key not in out and math.prod(min(task["distinct"][i], 10**6) for i in key) >= MIN_KEY_SPACE:
            out.append(key)
    return out


def _targets(task: dict, cands: dict, taken: set[int], names: list[str], sizes: list[int]) -> list[int]:
    """File columns that may hold the target: any few-valued column for a class (any encoding), else the columns
    that hold the target's values."""
    if task["classification"]:
        js = [j for j in range(len(sizes)) if j not in taken and 2 <= sizes[j] <= task["classes"] + 3]
    else:
        js = [j for _, j in cands.get(task["target"], []) if j not in taken]
    tname = task["names"][task["target"]]
    return sorted(js, key=lambda j: (names[j] != tname, sizes[j]))[:16]


def _labelled(task: dict, key: list[int], cols: list[list[int]], targets: list[int], hashes: list) -> tuple:
    """(rows labelled right, rows labelled, file column) of the best target column when rows are joined on `key`."""
    t = task["target"]
    samples: dict[tuple, list] = {}
    for row in task["rows"]:
        samples.setdefault(tuple(row[i] for i in key), []).append(row[t])
    found: dict[tuple, list[int]] = {}
    for r, k in enumerate(zip(*cols, strict=True)):
        if k in samples:
            found.setdefault(k, []).append(r)
    best = (0, 0, -1)
    for j in targets:
        pairs = Counter()
        for k, rows in found.items():
            values = {hashes[j][r] for r in rows}
            if len(values) == 1 and MISSING_HASH not in values:
                v = values.pop()
                pairs.update((v, y) for y in samples[k])
        if task["classification"]:  # the best reading of each file value as a class: any encoding labels
            per_value: dict[int, int] = {}
            for (v, _), n in pairs.items():
                per_value[v] = max(per_value.get(v, 0), n)
            right = sum(per_value.values())
        else:
            right = sum(n for (v, y), n in pairs.items() if v == y)
        if right > best[0]:
            best = (right, sum(pairs.values()), j)
    return best


def match_table(table: Table, tasks: list[dict]) -> list[dict]:
    """The tasks whose sample this table labels: one entry each (task, rows labelled, precision, columns)."""
    memo: dict = {}  # cell -> hash: each spelling is normalised once
    hashes = []
    for col in table.columns:
        try:
            distinct = set(col)
        except TypeError:  # unhashable cells (lists in JSON): their text
            col = [c if isinstance(c, (str, int, float)) or c is None else str(c) for c in col]
            distinct = set(col)
        for cell in distinct:
            if cell not in memo:
                memo[cell] = cell_hash(normalise(cell))
        hashes.append([memo[c] for c in col])
    sets = [set(h) for h in hashes]
    sizes = [len(s - {MISSING_HASH}) for s in sets]
    names = [name_key(n) for n in table.names]
    hits = []
    for t, cands in _aligned(tasks, sets).items():
        task = tasks[t]
        align = _assign(task, cands, names, sizes)
        for key in _keys(task, align, names):
            taken = {align[i] for i in key}
            targets = _targets(task, cands, taken, names, sizes)
            right, labelled, j = _labelled(task, key, [hashes[align[i]] for i in key], targets, hashes)
            need = max(0.95, task["majority"] + 0.8 * (1 - task["majority"]))
            if right >= max(MIN_ROWS, 0.1 * len(task["rows"])) and right >= need * labelled:
                key_names = [table.names[align[i]] for i in key]
                hits.append((right, labelled, task["id"], key_names, table.names[j]))
                break
    return [
        {"task": tid, "rows": r, "precision": round(r / n, 3), "key": k[:8], "target": str(tc)[:80]}
        for r, n, tid, k, tc in hits
    ]


# --- walking the view -------------------------------------------------------------------------------------


def walk(roots: list[str], skip: set[str]) -> Iterator[str]:
    """Every regular file under `roots` (a root may be a file), not following links, skipping `skip`."""
    stack = list(reversed(roots))
    while stack:
        top = stack.pop()
        if os.path.isfile(top) and not os.path.islink(top):
            yield top
            continue
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.path not in skip and e.name != "__pycache__":
                        stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    yield e.path
            except OSError:
                continue


def _read(stream: io.BufferedIOBase) -> bytes:
    return stream.read(MAX_BYTES)


def _members(archive: object, kind: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the table-like members of an open zip or tar archive."""
    if kind == "zip":
        infos = [i for i in archive.infolist() if not i.is_dir()][:MAX_MEMBERS]  # type: ignore[attr-defined]
        for info in infos:
            if _kind(info.filename) not in ("", "sniff"):
                with archive.open(info) as f:  # type: ignore[attr-defined]
                    yield info.filename, _read(f)
        return
    for n, info in enumerate(archive):  # type: ignore[attr-defined]
        if n >= MAX_MEMBERS:
            return
        if info.isfile() and _kind(info.name) not in ("", "sniff"):
            f = archive.extractfile(info)  # type: ignore[attr-defined]
            if f is not None:
                yield info.name, _read(f)


def file_tables(path: str, name: str, data: bytes | None = None, depth: int = 0) -> Iterator[tuple[str, Table]]:
    """(where, table) for the tables in a file on disk (`data` None) or in bytes from an archive or a stream."""
    kind = _kind(name)
    if kind in ("zip", "tar"):
        if depth > 1:
            return
        with io.BytesIO(data) if data is not None else open(path, "rb") as source:  # noqa: SIM115
            opened = zipfile.ZipFile(source) if kind == "zip" else tarfile.open(fileobj=source, mode="r|*")
            with opened as archive:
                for member, raw in _members(archive, kind):
                    yield from file_tables(f"{path}!{member}", member, raw, depth + 1)
        return
    if ":" in kind:
        comp, kind = kind.split(":")
        with COMPRESSED[comp](io.BytesIO(data) if data is not None else path) as f:
            data = _read(f)
    elif data is None:
        with open(path, "rb") as f:
            if kind == "sniff" and b"\0" in f.read(4096):
                return
            f.seek(0)
            data = f.read(MAX_BYTES)
    for table in read_tables(data, kind, path):
        yield path, table


class _TooSlow(Exception):
    pass


def _too_slow(signum: int, frame: object) -> None:
    raise _TooSlow


def scan(tasks: list[dict], roots: list[str], skip: set[str], budget_s: float) -> dict:
    """Walk `roots` and match every table read against `tasks`; bounded JSON-ready counts and matches. A file
    that takes longer than FILE_S is left (counted unreadable), so no single file can stall the scan."""
    start = time.monotonic()
    stats = Counter()
    matches: list[dict] = []
    errors: list[str] = []
    unfinished = False
    signal.signal(signal.SIGALRM, _too_slow)
    for path in walk(roots, skip):
        stats["files"] += 1
        if not _kind(path):
            continue
        if time.monotonic() - start > budget_s or len(matches) >= MAX_MATCHES:
            unfinished = True
            break
        stats["read"] += 1
        signal.alarm(FILE_S)
        try:
            for where, table in file_tables(path, path):
                stats["tables"] += 1
                stats["cells"] += len(table.columns) * len(table.columns[0])
                matches += [{"path": where[:500], **m} for m in match_table(table, tasks)][:20]
        except Exception as e:  # noqa: BLE001 - a file no reader understands is not a table
            stats["unreadable"] += 1
            if len(errors) < 5:
                errors.append(f"{path[:200]}: {type(e).__name__}")
        finally:
            signal.alarm(0)
    seconds = round(time.monotonic() - start, 2)
    return {"matches": matches[:MAX_MATCHES], **stats, "seconds": seconds, "unfinished": unfinished, "errors": errors}


def main(spec_file: str = "scan.json") -> None:
    """Inside the sandbox: read the scan's spec (tasks, roots, time budget) and print the result as one JSON line."""
    with open(spec_file, encoding="utf-8") as f:
        spec = json.load(f)
    skip = SKIP_DIRS | {os.path.realpath(os.getcwd())}
    print(json.dumps(scan(spec["tasks"], spec["roots"], skip, spec["budget_s"])))
