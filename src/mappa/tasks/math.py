"""Loaders for the math data files: every file maps to one schema, `Task(id, problem, answer, source, meta)`.

The files (see SOURCES.md beside them) and their traps, handled here:
- AIME 2022-II-8's answer is "080 or 081 (both were accepted)": stored as "080 or 081", which
  `check_answer` reads as two accepted alternatives;
- amc answers are floats with integral values (27.0): stored as "27";
- gsm8k answers end a worked solution with "#### 1,080": stored as "1080";
- evaluation problems also appear in training pools (at least 18 of aime_eval_32 are in AIME 1983-2024):
  `mappa.tasks.load_tasks` removes them by normalised text (`normalise_problem`), not by id.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mappa.errors import MappaError
from mappa.types import Task


def normalise_problem(text: str) -> str:
    """Text key for matching the same problem across files: letters and digits only, lower case.

    Drops what differs between copies of one problem: Asymptote diagrams, LaTeX spacing and size commands
    (`\\tfrac` vs `\\frac`), `$` signs around numbers, punctuation and whitespace.
    """
    text = re.sub(r"\[asy\].*?\[/asy\]", "", text, flags=re.S)
    text = re.sub(r"\\[td]frac", r"\\frac", text).replace("\\left", "").replace("\\right", "")
    return re.sub(r"[^a-z0-9]", "", text.lower())


def near_duplicate(a: str, b: str) -> bool:
    """Two normalised problems that are one problem with a copy-editing difference (same opening, >= 90% equal).

    Catches e.g. AIME 2024-II-8, whose copy in aime_eval_32 says "outside ... externally" where the original
    says "inside ... internally".
    """
    return a[:48] == b[:48] and difflib.SequenceMatcher(None, a, b, autojunk=False).ratio() >= 0.9


def _read_json(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise MappaError(f"{path}: data file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise MappaError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise MappaError(f"{path}: expected a JSON list of records")
    return data


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise MappaError(f"{path}: data file not found")
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise MappaError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
            if not isinstance(rec, dict):
                raise MappaError(f"{path}:{lineno}: expected a JSON object")
            out.append(rec)
    return out


def _field(rec: dict[str, Any], key: str, path: Path, index: int) -> Any:
    if key not in rec or rec[key] is None:
        raise MappaError(f"{path}: record {index + 1} has no {key!r} field")
    return rec[key]


def _number_text(value: Any) -> str:
    """27.0 -> "27"; 2.5 -> "2.5"; strings pass through."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _aime_answer(raw: str) -> str:
    # "080 or 081 (both were accepted)" -> "080 or 081"
    return re.sub(r"\s*\(.*\)\s*$", "", raw.strip())


def load_aime(data_dir: Path) -> list[Task]:
    path = data_dir / "AIME_1983_2024.json"
    tasks = []
    for i, rec in enumerate(_read_json(path)):
        rid = str(_field(rec, "id", path, i))
        meta = {k: rec[k] for k in ("year", "problem_number", "part") if rec.get(k) is not None}
        answer = _aime_answer(str(_field(rec, "answer", path, i)))
        tasks.append(
            Task(id=f"aime-{rid}", problem=_field(rec, "prompt", path, i), answer=answer, source="aime", meta=meta)
        )
    return tasks


def load_aime2025(data_dir: Path) -> list[Task]:
    path = data_dir / "aime_2025.json"
    return [
        Task(
            id=f"aime2025-{i + 1}",
            problem=_field(rec, "prompt", path, i),
            answer=_number_text(_field(rec, "answer", path, i)),
            source="aime2025",
        )
        for i, rec in enumerate(_read_json(path))
    ]


def load_aime_eval32(data_dir: Path) -> list[Task]:
    path = data_dir / "aime_eval_32.json"
    tasks = []
    for i, rec in enumerate(_read_json(path)):
        meta = {"url": rec["url"]} if rec.get("url") else {}
        tasks.append(
            Task(
                id=f"aime_eval32-{i}",
                problem=_field(rec, "prompt", path, i),
                answer=_aime_answer(str(_field(rec, "answer", path, i))),
                source="aime_eval32",
                meta=meta,
            )
        )
    return tasks


def _load_amc(path: Path, source: str) -> list[Task]:
    return [
        Task(
            id=f"amc-{rec.get('id', i)}",  # amc_eval_32 ids are amc.json ids: same problem, same id
            problem=_field(rec, "prompt", path, i),
            answer=_number_text(_field(rec, "answer", path, i)),
            source=source,
        )
        for i, rec in enumerate(_read_json(path))
    ]


def load_amc(data_dir: Path) -> list[Task]:
    return _load_amc(data_dir / "amc.json", "amc")


def load_amc_eval32(data_dir: Path) -> list[Task]:
    return _load_amc(data_dir / "amc_eval_32.json", "amc_eval32")


def load_math500(data_dir: Path) -> list[Task]:
    path = data_dir / "math500.jsonl"
    tasks = []
    for i, rec in enumerate(_read_jsonl(path)):
        meta = {k: rec[k] for k in ("subject", "level") if rec.get(k) is not None}
        tasks.append(
            Task(
                id=f"math500-{rec.get('unique_id', i)}",
                problem=_field(rec, "problem", path, i),
                answer=str(_field(rec, "answer", path, i)).strip(),
                source="math500",
                meta=meta,
            )
        )
    return tasks


def gsm8k_answer(solution: str) -> str:
    """The number after '####' in a gsm8k worked solution, thousands separators removed."""
    if "####" not in solution:
        raise ValueError("no '####' line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _load_gsm8k(path: Path, source: str) -> list[Task]:
    tasks = []
    for i, rec in enumerate(_read_jsonl(path)):
        try:
            answer = gsm8k_answer(str(_field(rec, "answer", path, i)))
        except ValueError:
            raise MappaError(f"{path}:{i + 1}: answer has no '#### N' line") from None
        tasks.append(Task(id=f"{source}-{i}", problem=_field(rec, "question", path, i), answer=answer, source=source))
    return tasks


def load_gsm8k(data_dir: Path) -> list[Task]:
    return _load_gsm8k(data_dir / "gsm8k_train.jsonl", "gsm8k")


def load_gsm8k_test(data_dir: Path) -> list[Task]:
    return _load_gsm8k(data_dir / "gsm8k_test.jsonl", "gsm8k_test")


def published_draw(n: int, size: int, seed: int) -> list[int]:
    """The rows the paper's training code draws from a file of `n` rows: numpy's legacy global generator seeded with
    `seed`, `choice(n, size, replace=False)`, sorted (marti/controllers/base_controller.py, lines 429-434 of the
    published code). The legacy generator's streams are fixed across numpy versions, so the draw is too."""
    import numpy as np  # a training dependency already; imported here to keep task loading light

    return sorted(int(i) for i in np.random.RandomState(seed).choice(n, size=size, replace=False))


# Source name -> loader. Every file in the math data directory has one.
MATH_SOURCES: dict[str, Callable[[Path], list[Task]]] = {
    "aime": load_aime,
    "aime2025": load_aime2025,
    "aime_eval32": load_aime_eval32,
    "amc": load_amc,
    "amc_eval32": load_amc_eval32,
    "math500": load_math500,
    "gsm8k": load_gsm8k,
    "gsm8k_test": load_gsm8k_test,
}

# Held out whatever the config says: the paper's evaluation sets never leak into a training pool. The one exception
# is `tasks.train_draw: paper`, which keeps the published draw whole (it holds 10 of aime_eval32's problems) and
# refuses only the configured evaluation sets.
HELD_OUT_SOURCES = ("aime2025", "aime_eval32", "amc_eval32")
