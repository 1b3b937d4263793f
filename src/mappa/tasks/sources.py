"""Task sources from outside the package: JSONL files, `datasets` datasets and loader functions.

    tasks.train: ["jsonl:data/train.jsonl"]     one JSON object a line: {"id", "problem", "answer", ...}
    tasks.eval:  ["hf:data/my_eval"]             a directory written by `Dataset.save_to_disk`
    tasks.eval:  ["hf:openai/gsm8k:test"]        a hub dataset already in the local cache (nothing is downloaded)
    tasks.train: ["my_tasks.py:load"]            a function load(split, seed) -> iterable of Task or dict

Every row, whatever its origin, has the fields of `mappa.types.Task`: `id` (text; whole numbers are turned to
text), `problem` (text), `answer` (text; numbers are turned to text, 27.0 -> "27"), optional `source` (default: the
file's stem, the dataset's name or the loader's module) and `meta` (an object), and an optional `split`
("train" or "eval": the row is used only for that split; rows without one are used for both). Unknown fields are
errors (extra data goes under `meta`); a `datasets` dataset's other columns are ignored. A bad row stops the load
with one `MappaError` line naming the file and line (a dataset: its row index; a loader: the loader and the row
index) and never quoting more than `QUOTED_CHARS` of the row.

Bounds: a JSONL file of at most `MAX_FILE_BYTES` and lines of at most `MAX_LINE_BYTES`; a dataset's used
columns at most `MAX_FILE_BYTES` in Arrow memory. Hub datasets load offline unless `$MAPPA_ALLOW_DOWNLOADS=1`.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from mappa.errors import MappaError
from mappa.plugins import DATA_PREFIXES, check_task_loader, is_import_path, load_object
from mappa.tasks.files import shown
from mappa.types import Task

Split = Literal["train", "eval"]

MAX_FILE_BYTES = 512 << 20  # a task set, not a corpus: GSM8K's train split is 4 MB, MATH's 12 MB
MAX_LINE_BYTES = 1 << 20  # one problem with its data; far above any prompt an agent can take
QUOTED_CHARS = 80  # the most of a bad row an error line shows
DOWNLOADS_ENV = "MAPPA_ALLOW_DOWNLOADS"
FIELDS = ("id", "problem", "answer", "source", "meta", "split")
INSTALL_DATASETS = "pip install 'mappa-rl[datasets]'"


class RowError(ValueError):
    """What is wrong with one row; the caller adds where the row is."""


def is_external(name: str) -> bool:
    """Whether a `tasks.train`/`tasks.eval` entry is a data file, a dataset or a loader (not a built-in name)."""
    return name.startswith(DATA_PREFIXES) or is_import_path(name)


def load_external(name: str, split: Split, seed: int) -> list[Task]:
    """All tasks of one external source for `split`, in its order (see the module docstring)."""
    if name.startswith("jsonl:"):
        return load_jsonl(name.removeprefix("jsonl:"), split)
    if name.startswith("hf:"):
        return load_hf(name.removeprefix("hf:"), split)
    return load_plugin(name, split, seed)


def external_locations(name: str) -> list[Path]:
    """Where an external source keeps its answers on disk (a loader's data: unknown, none). Paths only."""
    if name.startswith("jsonl:"):
        return [Path(name.removeprefix("jsonl:")).expanduser().absolute().parent]
    if not name.startswith("hf:"):
        return []
    dataset, _, _ = name.removeprefix("hf:").partition(":")
    local = Path(dataset).expanduser()
    if local.exists():
        return [local.absolute()]
    # A hub dataset: its Arrow files in the datasets cache, and the raw files in the hub cache (the hub client
    # comes with transformers; its constants resolve HF_HOME and XDG_CACHE_HOME as `datasets` does).
    from huggingface_hub import constants

    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")
    return [Path(datasets_cache).expanduser().absolute(), Path(constants.HF_HUB_CACHE).absolute()]


# ---------------------------------------------------------------------------------------------------- rows
def _text(row: dict[str, Any], field: str, numbers: bool) -> str:
    value = row[field]
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"{field!r} is empty")
        return value
    if numbers and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if numbers and field == "answer" and isinstance(value, float):
        if not math.isfinite(value):
            raise RowError(f"'answer' is {value}, not a number an answer can be")
        return str(int(value)) if value.is_integer() else repr(value)
    kind = "a string or a number" if numbers and field == "answer" else "a string"
    raise RowError(f"{field!r} must be {kind}, got {type(value).__name__}")


def row_task(row: Any, default_source: str) -> tuple[Task, str | None]:
    """The task one row describes, and the split it is limited to (None: both); RowError says what is wrong."""
    if not isinstance(row, dict):
        raise RowError(f"expected an object with id, problem and answer, got {type(row).__name__}")
    unknown = [k for k in row if k not in FIELDS]
    if unknown:
        raise RowError(
            f"unknown field {shown(str(unknown[0]), 40)!r} (fields: {', '.join(FIELDS)}; extra data goes under meta)"
        )
    row = {k: v for k, v in row.items() if v is not None}  # a null is an absent field (datasets fill gaps so)
    for field in ("id", "problem", "answer"):
        if field not in row:
            raise RowError(f"missing {field!r}")
    meta = row.get("meta", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise RowError(f"'meta' must be an object with text keys, got {type(meta).__name__}")
    try:  # episodes carry their task into JSONL files
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise RowError(f"'meta' is not JSON data ({shown(str(e), QUOTED_CHARS)})") from None
    split = row.get("split")
    if split not in (None, "train", "eval"):
        raise RowError(f"'split' must be 'train' or 'eval', got {shown(repr(split), QUOTED_CHARS)}")
    source = _text(row, "source", numbers=False) if "source" in row else default_source
    task = Task(
        id=_text(row, "id", numbers=True),
        problem=_text(row, "problem", numbers=False),
        answer=_text(row, "answer", numbers=True),
        source=source,
        meta=meta,
    )
    return task, split


class _Collector:
    """Tasks of one source in order: ids unique over all rows, rows of the other split left out."""

    def __init__(self, split: Split) -> None:
        self.split, self.rows = split, 0
        self.tasks: list[Task] = []
        self.first: dict[str, str] = {}  # id -> where it first appeared

    def add(self, task: Task, split: str | None, where: str) -> None:
        if task.id in self.first:
            raise RowError(f"duplicate id {shown(task.id, QUOTED_CHARS)!r} (first at {self.first[task.id]})")
        self.first[task.id] = where
        self.rows += 1
        if split is None or split == self.split:
            self.tasks.append(task)

    def result(self, label: str) -> list[Task]:
        if not self.tasks:
            why = f"all {self.rows} rows have split: {'eval' if self.split == 'train' else 'train'}"
            raise MappaError(f"{label}: no tasks for tasks.{self.split} ({why if self.rows else 'no rows'})")
        return self.tasks


# --------------------------------------------------------------------------------------------------- jsonl
def _parse_line(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise RowError(f"not UTF-8 text (byte {e.start + 1})") from None
    text = text.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError(f"invalid JSON ({e.msg}, column {e.colno}): {shown(text, QUOTED_CHARS)}") from None
    except RecursionError:
        raise RowError("invalid JSON (nested too deeply)") from None


def load_jsonl(path_text: str, split: Split) -> list[Task]:
    """The tasks of a JSONL file (one object a line, blank lines skipped) for `split`."""
    path = Path(path_text).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise MappaError(f"{path}: task file not found (jsonl:{path_text})") from None
    except OSError as e:
        raise MappaError(f"{path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise MappaError(f"{path}: not a regular file (jsonl:{path_text})")
    if st.st_size > MAX_FILE_BYTES:
        raise MappaError(f"{path}: {st.st_size:,} bytes, more than the {MAX_FILE_BYTES:,} a task file may have")
    collector = _Collector(split)
    try:
        f = path.open("rb")
    except OSError as e:
        raise MappaError(f"{path}: cannot be read ({e.strerror})") from None
    with f:
        lineno = 0
        # Each line is read with a bound, so a huge line or a file that grows costs no more than the limits.
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            try:
                if len(raw) > MAX_LINE_BYTES:
                    raise RowError(f"line longer than the {MAX_LINE_BYTES:,} bytes allowed")
                if f.tell() > MAX_FILE_BYTES:
                    raise RowError(f"the file grew past the {MAX_FILE_BYTES:,} bytes a task file may have")
                row = _parse_line(raw)
                if row is not None:
                    collector.add(*row_task(row, path.stem), where=f"line {lineno}")
            except RowError as e:
                raise MappaError(f"{path}:{lineno}: {e}") from None
    return collector.result(str(path))


# ------------------------------------------------------------------------------------------------ datasets
@contextmanager
def _offline() -> Iterator[None]:
    """`datasets` and the hub client reading only their caches, unless the user allowed downloads. Their
    switches are read from the environment at import, so the module settings are set for the call."""
    if os.environ.get(DOWNLOADS_ENV, "").strip().lower() in ("1", "true", "yes"):
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = before


def _one_line(e: BaseException) -> str:
    return shown(" ".join(str(e).split()), 200)


def _open_dataset(spec: str, name: str, hf_split: str | None) -> tuple[Any, str | None]:
    """The dataset `name` names (a save_to_disk directory, else a cached hub id) and the split used."""
    try:
        import datasets
    except ImportError:
        raise MappaError(f"{spec}: the datasets package is not installed: {INSTALL_DATASETS}") from None
    local = Path(name).expanduser()
    if local.exists():
        try:
            loaded = datasets.load_from_disk(str(local))
        except Exception as e:  # FileNotFoundError for a directory without dataset files, or a broken one
            raise MappaError(f"{spec}: {local} is not a dataset saved with save_to_disk ({_one_line(e)})") from None
        if hf_split is not None and isinstance(loaded, datasets.Dataset):
            raise MappaError(f"{spec}: {local} holds one dataset without splits; write hf:{name}")
    else:
        try:
            with _offline():
                loaded = datasets.load_dataset(name, split=hf_split)
        except Exception as e:  # not cached (offline), no such dataset, no such split: all one line
            raise MappaError(
                f"{spec}: no directory {local} and no cached hub dataset {name!r} (nothing is downloaded unless "
                f"{DOWNLOADS_ENV}=1): {_one_line(e)}"
            ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if hf_split is None and len(splits) != 1:
            raise MappaError(f"{spec}: holds the splits {', '.join(splits)}; name one: hf:{name}:{splits[0]}")
        hf_split = splits[0] if hf_split is None else hf_split
        if hf_split not in loaded:
            raise MappaError(f"{spec}: no split {hf_split!r} (splits: {', '.join(splits)})")
        loaded = loaded[hf_split]
    return loaded, hf_split


def load_hf(body: str, split: Split) -> list[Task]:
    """The tasks of `hf:NAME[:SPLIT]` for `split`: columns id, problem, answer (+ source, meta, split)."""
    spec = f"hf:{body}"
    name, sep, hf_split = body.partition(":")
    if not name:
        raise MappaError(f"{spec}: name a dataset: hf:NAME[:SPLIT] (a save_to_disk directory or a hub id)")
    ds, hf_split = _open_dataset(spec, name, hf_split if sep else None)
    columns = [c for c in FIELDS if c in ds.column_names]
    for needed in ("problem", "answer"):
        if needed not in columns:
            listed = ", ".join(shown(c, 40) for c in ds.column_names[:20])
            raise MappaError(f"{spec}: no column {needed!r} (columns: {listed})")
    ds = ds.select_columns(columns)
    if ds.data.nbytes > MAX_FILE_BYTES:
        raise MappaError(f"{spec}: {ds.data.nbytes:,} bytes of tasks, more than the {MAX_FILE_BYTES:,} allowed")
    label = Path(name).name if Path(name).expanduser().exists() else name
    prefix = f"{label}:{hf_split}" if hf_split else label  # ids of a dataset without an id column
    collector = _Collector(split)
    for i, row in enumerate(ds):
        try:
            if "id" not in columns:
                row["id"] = f"{prefix}:{i}"
            collector.add(*row_task(row, label.rsplit("/", 1)[-1]), where=f"row {i}")
        except RowError as e:
            raise MappaError(f"{spec} row {i}: {e}") from None
    return collector.result(spec)


# ------------------------------------------------------------------------------------------------- loaders
def load_plugin(spec: str, split: Split, seed: int) -> list[Task]:
    """The tasks a loader function `module:name` / `file.py:name` returns for `split` (called as `f(split, seed)`)."""
    key = f"tasks.{split}"
    loader = load_object(spec, key)
    check_task_loader(loader, key)
    where = spec.split(":")[0].strip()
    default_source = Path(where).stem if where.endswith(".py") or "/" in where else where.rsplit(".", 1)[-1]
    collector = _Collector(split)
    i = -1
    try:
        rows = loader(split, seed)
        if isinstance(rows, str | bytes | dict) or not isinstance(rows, Iterable):
            raise MappaError(f"{key}: loader {spec} returned {type(rows).__name__}, not an iterable of tasks")
        for i, row in enumerate(rows):
            if isinstance(row, Task):
                collector.add(row, None, where=f"row {i}")
            else:
                collector.add(*row_task(row, default_source), where=f"row {i}")
    except RowError as e:
        raise MappaError(f"{key}: loader {spec} row {i}: {e}") from None
    except MappaError:
        raise
    except Exception as e:  # the loader's own bug: one line, as for a plug-in that fails to import
        raise MappaError(f"{key}: loader {spec} failed: {type(e).__name__}: {_one_line(e)}") from None
    return collector.result(f"{key}: loader {spec}")
