"""Receipts for the pickles the data-science agents pass on: does each required file hold what it claims?

    want = expectations(n_train=170, n_test=70)               # name -> what it must hold
    code = receipt_code({n: want[n] for n in present})          # run it in the workspace, through the sandbox
    receipts = parse_receipts(result.stdout, list(want))        # name -> {"ok", "kind", "rows", "columns", "why"}

A required file counts only when it is non-empty and loads as what it claims: X_train.pkl a table of features
(2-D) with 1 to n_train rows, y_train.pkl one target column with as many rows as X_train.pkl, X_test.pkl a table
with exactly n_test rows (test.csv's) and as many columns as X_train.pkl, model.pkl a fitted scikit-learn
estimator with a predict method. The files are loaded inside the sandbox, by `receipt_check`'s source (a
restricted unpickler: no code of the agent's runs there either), and never on the host.

Its one line of output is hostile text all the same: the host reads at most MAX_REPORT_CHARS of it, takes only
the files it asked about, only fields of the expected types, numbers within bounds and reasons cut to one short
line. A file the report does not vouch for (a failed or timed-out check, a malformed report) is not ok.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mappa.tasks.files import shown

RECEIPT_FILES = ("X_train.pkl", "y_train.pkl", "X_test.pkl", "model.pkl")
MARKER = "mappa-receipts:"  # receipt_check.MARKER: the line the check prints
MAX_REPORT_CHARS = 8192
MAX_WHY_CHARS = 160
MAX_KIND_CHARS = 40
MAX_COUNT = 10**9
_CHECKER = Path(__file__).with_name("receipt_check.py")
# Before any import of the check: the workspace is first on sys.path in the sandbox, and a module the agent saved
# there (numpy.py, json.py) must not stand in for the real one.
_PRELUDE = (
    "import os, sys\n"
    "_ws = os.path.realpath(os.getcwd())\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.') and os.path.realpath(p) != _ws]\n"
)


def expectations(n_train: int, n_test: int) -> dict[str, dict[str, Any]]:
    """What each required pickle must hold, for a task with `n_train` training and `n_test` test rows."""
    return {
        "X_train.pkl": {"holds": "features", "rows": [1, n_train]},
        "y_train.pkl": {"holds": "target", "rows": [1, n_train], "same_rows_as": "X_train.pkl"},
        "X_test.pkl": {"holds": "features", "rows": [n_test, n_test], "same_columns_as": "X_train.pkl"},
        "model.pkl": {"holds": "estimator"},
    }


def receipt_code(expect: Mapping[str, Mapping[str, Any]]) -> str:
    """The snippet that checks the files of `expect` (a subset of `expectations`) in the workspace it runs in."""
    source = _CHECKER.read_text(encoding="utf-8")
    return f"{_PRELUDE}{source}\ncheck(json.loads({json.dumps(dict(expect))!r}))\n"


def failed(names: Sequence[str], why: str) -> dict[str, dict[str, Any]]:
    """Receipts of `names` when the check gave no usable report: none of them counts."""
    return {
        name: {"ok": False, "kind": "", "rows": None, "columns": None, "why": shown(why, MAX_WHY_CHARS)}
        for name in names
    }


def _count(value: object) -> int | None:
    return value if type(value) is int and 0 <= value <= MAX_COUNT else None


def _entry(raw: object) -> dict[str, Any] | None:
    if not isinstance(raw, dict) or type(raw.get("ok")) is not bool:
        return None
    kind, why = raw.get("kind"), raw.get("why")
    ok = raw["ok"] and isinstance(why, str) and not why
    return {
        "ok": ok,
        "kind": shown(kind, MAX_KIND_CHARS) if isinstance(kind, str) else "",
        "rows": _count(raw.get("rows")),
        "columns": _count(raw.get("columns")),
        "why": "" if ok else shown(why if isinstance(why, str) and why else "no reason given", MAX_WHY_CHARS),
    }


def parse_receipts(stdout: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The receipts of `names` from the check's output (its last MARKER line); a file the report does not
    vouch for in the expected form gets a receipt that is not ok, with the reason."""
    line = next((x for x in reversed(stdout.splitlines()) if x.startswith(MARKER)), None)
    if line is None:
        return failed(names, "the check printed no report")
    if len(line) > MAX_REPORT_CHARS:
        return failed(names, "the check's report is too long")
    try:
        report = json.loads(line[len(MARKER) :])
    except (json.JSONDecodeError, RecursionError):
        return failed(names, "the check's report is not JSON")
    if not isinstance(report, dict):
        return failed(names, "the check's report is not a mapping")
    out = {}
    for name in names:
        entry = _entry(report.get(name))
        out[name] = entry if entry is not None else failed([name], "not in the check's report")[name]
    return out


def usable(receipts: Mapping[str, Mapping[str, Any]] | None, name: str) -> bool:
    """Whether file `name` counts: no receipt was taken of it (not a checked kind, or evidence recorded before
    receipts existed), or its receipt is ok."""
    if receipts is None or name not in receipts:
        return True
    return receipts[name].get("ok") is True
