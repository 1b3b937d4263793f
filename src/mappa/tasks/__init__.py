"""Task sets for the workflows: the generated arithmetic default, the math data files, and answer checking.

    load_tasks(["aime"], cfg.tasks, "train", seed=42)   # AIME 1983-2024 minus every eval problem
    check_answer("... so \\boxed{080}", "80")             # True

Sources: "arithmetic" (generated, no files), and the math files under `tasks.data_dir` / $MAPPA_DATA_DIR:
"aime" (1983-2024), "aime2025", "aime_eval32", "amc", "amc_eval32", "math500", "gsm8k" (train split),
"gsm8k_test"; and "dsbench", the offline mini-DSBench's tabular tasks of one split (`mappa.tasks.tabular`).
From outside the package (`mappa.tasks.sources`): "jsonl:PATH", "hf:NAME[:SPLIT]", and loader functions named
"module:name" or "file.py:name".
"""

from __future__ import annotations

from mappa.tasks.answers import check_answer, extract_answer
from mappa.tasks.loading import SOURCES, answer_locations, load_source, load_tasks
from mappa.tasks.math import normalise_problem

__all__ = [
    "SOURCES",
    "answer_locations",
    "check_answer",
    "extract_answer",
    "load_source",
    "load_tasks",
    "normalise_problem",
]
