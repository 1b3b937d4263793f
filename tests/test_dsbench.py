"""The mini-DSBench build: byte-identical rebuilds, Kaggle-shaped files without answers in them, the catalogue,
and the scripted reference team solving tasks through the real sandbox (warm pool, default limits)."""

from __future__ import annotations

import importlib.resources
import json
import re
import tomllib
from collections import Counter
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path

import pandas as pd
import pytest
import yaml

from mappa.cli import main
from mappa.config import SandboxConfig, TasksConfig
from mappa.errors import MappaError
from mappa.sandbox import Sandbox
from mappa.tasks import load_source, load_tasks
from mappa.tasks.dsbench.build import BuildResult, assign_splits, build_dsbench
from mappa.tasks.dsbench.catalogue import CATALOGUE_FILE, SOURCES, SPECS, load_catalogue
from mappa.tasks.dsbench.metrics import METRICS, higher_is_better
from mappa.tasks.dsbench.reference import TASK_FILES, run_reference
from mappa.tasks.dsbench.tables import AtLeast, Complement, Indicator, Ordinal, Rename
from mappa.tasks.tabular import load_dsbench, score_submission

# One small classification and one small regression task: a build of both takes seconds.
SMALL = ("breast_cancer_diagnosis", "diabetes_progression")
INDEX_KEYS = {
    "id",
    "split",
    "data_type",
    "metric",
    "target",
    "id_column",
    "source",
    "baseline_score",
    "reference_score",
    "n_train",
    "n_test",
    "n_features",
}
ARTIFACTS = {"X_train.pkl", "y_train.pkl", "X_test.pkl", "model.pkl", "submission.csv"}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    """One warm pool at the default limits for the module: its start-up is paid once."""
    with Sandbox(SandboxConfig()) as sb:
        yield sb


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, sandbox: Sandbox) -> BuildResult:
    return build_dsbench(tmp_path_factory.mktemp("dsbench") / "bench", only=SMALL, sandbox=sandbox)


def test_two_builds_with_one_seed_are_identical_byte_for_byte(
    small: BuildResult, tmp_path: Path, sandbox: Sandbox
) -> None:
    again = build_dsbench(tmp_path / "again", only=SMALL, sandbox=sandbox)
    first, second = _files(small.root), _files(again.root)
    assert "tasks.jsonl" in first and f"tasks/{SMALL[0]}/train.csv" in first
    assert first == second
    other = build_dsbench(tmp_path / "other", seed=7, only=SMALL[:1], sandbox=sandbox)
    name = f"tasks/{SMALL[0]}/train.csv"
    assert _files(other.root)[name] != first[name]  # the seed draws the split


def test_task_files_have_dsbench_shape_and_test_files_never_hold_the_target(small: BuildResult) -> None:
    root = small.root
    rows = [json.loads(line) for line in (root / "tasks.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in rows] == sorted(SMALL) and small.refused == []
    for row in rows:
        assert INDEX_KEYS <= set(row)
        task_dir, target, id_column = root / "tasks" / row["id"], row["target"], row["id_column"]
        assert sorted(p.name for p in task_dir.iterdir()) == sorted(TASK_FILES)  # no answer among them
        train, test = pd.read_csv(task_dir / "train.csv"), pd.read_csv(task_dir / "test.csv")
        answers = pd.read_csv(root / "answers" / row["id"] / "test_answer.csv")
        assert target not in test.columns and list(answers.columns) == [id_column, target]
        assert list(test.columns) == [c for c in train.columns if c != target]
        assert (len(train), len(test), test.shape[1] - 1) == (row["n_train"], row["n_test"], row["n_features"])
        assert list(answers[id_column]) == list(test[id_column])
        assert not set(train[id_column]) & set(test[id_column])
        text = (task_dir / "description.txt").read_text(encoding="utf-8")
        assert f"`{target}`" in text and f"{row['n_test']:,} rows" in text and "## Submission format" in text
        tasks = {t.id: t for t in load_dsbench(root, row["split"])}
        baseline = score_submission(tasks[row["id"]], task_dir / "sample_submission.csv")
        assert baseline.valid and baseline.score == pytest.approx(row["baseline_score"], abs=1e-6)
        assert baseline.gap == pytest.approx(0.0, abs=1e-6) and baseline.reference_fraction == pytest.approx(0.0)
        better = row["reference_score"] > row["baseline_score"]
        assert better if higher_is_better(row["metric"]) else not better
    info = json.loads((root / "build.json").read_text(encoding="utf-8"))
    assert info["seed"] == 42 and info["tasks"] == 2 and info["refused"] == [] and "scikit-learn" in info["packages"]


def test_reference_team_solves_built_tasks_through_the_sandbox_seeing_no_answers(
    small: BuildResult, sandbox: Sandbox
) -> None:
    tasks = load_dsbench(small.root, "train") + load_dsbench(small.root, "eval")
    runs = [run_reference(sandbox, task) for task in tasks]  # warm pool, default limits
    for task, run in zip(tasks, runs, strict=True):
        assert run.failure == "" and run.score is not None and run.score.valid, (task.id, run)
        assert run.score.score == pytest.approx(task.meta["reference_score"], abs=1e-6)
        assert run.score.reference_fraction == pytest.approx(1.0, abs=1e-4) and run.score.gap > 0
        assert set(run.files) == set(TASK_FILES) | ARTIFACTS  # every file the workspace ever held


def test_source_dsbench_loads_through_the_task_loader_without_math_data(small: BuildResult) -> None:
    cfg = TasksConfig(dsbench_dir=str(small.root), train=["dsbench"], eval=["dsbench"], data_dir="/nonexistent")
    train = load_tasks(["dsbench"], cfg, "train", seed=0)
    evals = load_source("dsbench", cfg, "eval", seed=0)
    assert {t.id for t in train} | {t.id for t in evals} == set(SMALL) and len(evals) == 1
    assert all(t.source == "dsbench" and Path(t.meta["task_dir"]).is_dir() for t in train + evals)


def test_build_refuses_tasks_the_reference_team_cannot_solve(tmp_path: Path) -> None:
    # 64 MB: pandas alone needs more, so a snippet is stopped by the memory watchdog. Which one depends on when
    # the 50 ms watchdog samples a worker forked with pandas already imported: the first or the second.
    with Sandbox(SandboxConfig(memory_mb=64)) as tight:
        result = build_dsbench(tmp_path / "b", only=SMALL[:1], sandbox=tight)
    assert result.tasks == [] and [task for task, _ in result.refused] == [SMALL[0]]
    why = result.refused[0][1]
    assert why in ("data_engineer: memory limit exceeded", "modeler: memory limit exceeded")
    assert not (tmp_path / "b" / "tasks" / SMALL[0]).exists()
    assert not (tmp_path / "b" / "answers" / SMALL[0]).exists()
    info = json.loads((tmp_path / "b" / "build.json").read_text(encoding="utf-8"))
    assert info["refused"] == [{"id": SMALL[0], "reason": why}] and info["tasks"] == 0


def test_build_never_overwrites_a_directory_that_is_not_a_benchmark(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(MappaError, match="is not a mini-DSBench directory"):
        build_dsbench(tmp_path / "mine", only=SMALL[:1])
    assert (tmp_path / "mine" / "notes.txt").read_text(encoding="utf-8") == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no staging folder left behind


def test_cli_unknown_task_is_one_line_and_list_shows_the_catalogue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["dsbench", "build", "--out", str(tmp_path / "b"), "--only", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "mappa: error: unknown mini-DSBench task(s) nope (see: mappa dsbench list)"
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["dsbench", "list"]) == 0
    out = capsys.readouterr().out
    assert f"catalogue: {len(SPECS)} tasks" in out and all(spec.id in out for spec in SPECS)


def test_catalogue_is_balanced_varied_and_free_of_duplicate_tables() -> None:
    assert len(SPECS) >= 72
    assert len({s.id for s in SPECS}) == len(SPECS)
    assert len({(s.source, s.table) for s in SPECS}) == len(SPECS)
    kinds = Counter(s.data_type for s in SPECS)
    assert 0.4 <= kinds["classification"] / len(SPECS) <= 0.6
    assert set(Counter(s.metric for s in SPECS)) == set(METRICS)  # every metric DSBench mixes is used
    assert {s.source for s in SPECS} <= set(SOURCES)
    assert all(s.title and s.about.endswith(".") for s in SPECS)


def test_the_catalogue_is_data_shipped_with_the_package() -> None:
    shipped = importlib.resources.files("mappa.tasks.dsbench").joinpath(CATALOGUE_FILE)
    assert shipped.is_file() and load_catalogue(str(shipped)) == SPECS
    # `pip install .` copies it only if package-data names it
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["mappa"]
    assert any(fnmatchcase(f"tasks/dsbench/{CATALOGUE_FILE}", p) for p in patterns)
    recipes = {s.id: s.prepare for s in SPECS if s.prepare is not None}
    assert recipes["loan_grade"] == Ordinal(recipe="ordinal", column="grade", order=tuple("ABCDEFG"))


GOOD = {"id": "toy", "source": "sklearn", "table": "diabetes", "target": "progression", "metric": "mae"}
GOOD |= {"title": "Toy", "about": "A row.", "prepare": {"recipe": "rename", "columns": {"target": "progression"}}}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"metric": "acc"}, "task 'toy': metric: unknown metric 'acc' (one of roc_auc,"),
        ({"source": "kaggle"}, "task 'toy': source: unknown source 'kaggle'"),
        ({"colour": "red"}, "task 'toy': unknown field 'colour'"),
        ({"target": None}, "task 'toy': field 'target' is missing"),
        ({"max_rows": 0}, "task 'toy': max_rows: Input should be greater than 0"),
        ({"prepare": {"recipe": "shuffle"}}, "task 'toy': prepare: Input tag 'shuffle'"),
        ({"prepare": {"recipe": "ordinal", "column": "x"}}, "task 'toy': field 'prepare.ordinal.order' is missing"),
        ({"keep_group": True}, "task 'toy': keep_group: set without a group"),
        ({"drop": ["progression"]}, "task 'toy': drop: the target 'progression' is dropped"),
        ({"positive": "yes"}, "task 'toy': positive: a mae task is a regression"),
        ({"id": "Toy Task"}, "task 'Toy Task': id: String should match pattern"),
        ({"id": None}, "an entry without an id: field 'id' is missing"),
    ],
)
def test_a_bad_catalogue_entry_is_one_line_naming_the_task_and_the_field(
    change: dict, expected: str, tmp_path: Path
) -> None:
    entry = {k: v for k, v in (GOOD | change).items() if v is not None}
    path = tmp_path / "catalogue.yaml"
    path.write_text(yaml.safe_dump([entry], sort_keys=False), encoding="utf-8")
    with pytest.raises(MappaError) as err:
        load_catalogue(path)
    assert str(err.value).startswith(f"{path}: {expected}") and "\n" not in str(err.value)


def test_catalogue_yaml_traps_and_duplicates_are_caught(tmp_path: Path) -> None:
    path, first = tmp_path / "catalogue.yaml", yaml.safe_dump([GOOD], sort_keys=False)
    cases = {
        # YAML reads an unquoted yes as true: the error says to quote it
        "- id: cls\n  metric: accuracy\n  positive: yes\n": "task 'cls': positive: Input should be a valid string "
        "(got True) (quote it",
        "- id: toy\n": "task 'toy': id: 'toy' is also task 'toy''s",
        "- id: twin\n": "task 'twin': table: ('sklearn', 'diabetes') is also task 'toy''s",
        "- id: [\n": "not valid YAML at line 13",  # the parser stops at the end of the file
    }
    for second, expected in cases.items():
        rest = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in GOOD.items() if f"{k}:" not in second)
        path.write_text(first + second + ("" if "[" in second else rest), encoding="utf-8")
        with pytest.raises(MappaError, match="^" + re.escape(f"{path}: {expected}")):
            load_catalogue(path)


def test_recipes_prepare_a_table_as_the_catalogue_asks() -> None:
    frame = pd.DataFrame({"grade": ["B", "A", "C", None], "cens": [0, 1, 1, 0], "target": [0, 1, 0, 2]})
    grades = Ordinal(recipe="ordinal", column="grade", order=("A", "B", "C")).apply(frame)["grade"]
    assert grades.iloc[:3].tolist() == [2, 1, 3] and pd.isna(grades.iloc[3])
    flagged = Indicator(recipe="indicator", column="target", equals=0, name="malignant").apply(frame)
    assert flagged["malignant"].tolist() == [1, 0, 1, 0] and "target" not in flagged
    assert flagged["malignant"].dtype == "int64"
    assert Complement(recipe="complement", column="cens", name="event").apply(frame)["event"].tolist() == [1, 0, 0, 1]
    assert AtLeast(recipe="at_least", column="target", minimum=1).apply(frame)["target"].tolist() == [1, 2]
    assert list(Rename(recipe="rename", columns={"cens": "censored"}).apply(frame)) == ["grade", "censored", "target"]


def test_eval_split_is_stratified_by_data_type_and_seeded() -> None:
    def rows() -> list[dict]:
        return [{"id": f"t{i:02d}", "data_type": "classification" if i % 2 else "regression"} for i in range(72)]

    first, again, other = rows(), rows(), rows()
    assign_splits(first, 42)
    assign_splits(again, 42)
    assign_splits(other, 7)
    evals = [r for r in first if r["split"] == "eval"]
    assert len(evals) == 8 and Counter(r["data_type"] for r in evals) == {"classification": 4, "regression": 4}
    assert first == again and first != other
    few = rows()[:9]
    assign_splits(few, 42)
    assert sum(r["split"] == "eval" for r in few) == 1


@pytest.mark.slow
def test_reference_team_solves_the_eval_tasks_of_the_full_benchmark(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The full build (a few minutes on 2 cores), then its 8 eval tasks through the sandbox again."""
    result = build_dsbench(tmp_path_factory.mktemp("full") / "bench")
    splits = Counter((r["split"], r["data_type"]) for r in result.tasks)
    assert len(result.tasks) >= 72 and splits[("eval", "classification")] + splits[("eval", "regression")] == 8
    assert abs(splits[("eval", "classification")] - splits[("eval", "regression")]) <= 1
    tasks = load_dsbench(result.root, "eval")
    with Sandbox(SandboxConfig()) as sb:  # the default limits, not the build's longer wall clock
        for task in tasks:
            run = run_reference(sb, task)
            assert run.score is not None and run.score.valid, (task.id, run.failure)
            assert run.score.score == pytest.approx(task.meta["reference_score"], abs=1e-6)
