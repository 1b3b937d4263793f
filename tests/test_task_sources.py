"""Task sources from outside the package: JSONL files, `datasets` directories and loader functions, read from real
files in a temporary directory, through the config loader, `load_tasks` and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mappa.cli import main
from mappa.config import TasksConfig, load_config
from mappa.errors import MappaError
from mappa.tasks import answer_locations, load_source, load_tasks
from mappa.tasks import sources as sources_module
from mappa.types import Task


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def write_config(directory: Path, train: list[str], eval_: list[str] | None = None, **tasks: Any) -> Path:
    path = directory / "config.yaml"
    path.write_text(json.dumps({"tasks": {"train": train, "eval": eval_ or ["arithmetic"], **tasks}}))
    return path


def problems(tasks: list[Task]) -> list[str]:
    return [t.problem for t in tasks]


GOOD = [
    {"id": "a", "problem": "What is 1 + 1?", "answer": 2},
    "",
    {"id": 7, "problem": "What is 27 / 1?", "answer": 27.0, "meta": {"level": 2}},
    "   ",
    {"id": "c", "problem": "What is 3 / 2?", "answer": 1.5, "source": "mine"},
    {"id": "d", "problem": "Simplify 2/4.", "answer": "\\frac{1}{2}"},
]


# ------------------------------------------------------------------------------------------------ jsonl
def test_jsonl_rows_load_with_their_types(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    path = write_jsonl(tmp_path / "data" / "algebra.jsonl", GOOD)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a byte-order mark, as some editors write
    cfg = load_config(write_config(tmp_path, ["jsonl:data/algebra.jsonl"]))
    assert answer_locations(cfg.tasks) == [tmp_path / "data"]  # the probe checks agent code cannot see it
    tasks = load_tasks(cfg.tasks.train, cfg.tasks, "train", cfg.seed)
    assert [(t.id, t.answer, t.source) for t in tasks] == [
        ("a", "2", "algebra"),  # numbers become text; the source defaults to the file's stem
        ("7", "27", "algebra"),  # 27.0 is the whole number 27
        ("c", "1.5", "mine"),
        ("d", "\\frac{1}{2}", "algebra"),
    ]
    assert tasks[1].meta == {"level": 2} and tasks[0].meta == {}
    assert all(isinstance(t, Task) for t in tasks)


BAD_LINES = [
    ('{"id": "b", "problem": "x", "answer": "1"', "invalid JSON (Expecting ',' delimiter"),
    ('[1, 2, 3]', "expected an object with id, problem and answer, got list"),
    ('{"id": "b", "answer": "1"}', "missing 'problem'"),
    ('{"problem": "x", "answer": "1"}', "missing 'id'"),
    ('{"id": "b", "problem": "x", "answer": null}', "missing 'answer'"),
    ('{"id": "b", "problem": 5, "answer": "1"}', "'problem' must be a string, got int"),
    ('{"id": "b", "problem": "x", "answer": true}', "'answer' must be a string or a number, got bool"),
    ('{"id": ["b"], "problem": "x", "answer": "1"}', "'id' must be a string, got list"),
    ('{"id": "b", "problem": "  ", "answer": "1"}', "'problem' is empty"),
    ('{"id": "b", "problem": "x", "answer": NaN}', "'answer' is nan"),
    ('{"id": "b", "problem": "x", "answer": "1", "meta": [1]}', "'meta' must be an object"),
    ('{"id": "b", "problem": "x", "answer": "1", "solution": "..."}', "unknown field 'solution'"),
    ('{"id": "b", "problem": "x", "answer": "1", "split": "test"}', "'split' must be 'train' or 'eval'"),
    ('{"id": "a", "problem": "x", "answer": "1"}', "duplicate id 'a' (first at line 1)"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "expected"), BAD_LINES)
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [{"id": "a", "problem": "y", "answer": "2"}, "", line])
    cfg = load_config(write_config(tmp_path, ["jsonl:train.jsonl"]))
    with pytest.raises(MappaError) as err:
        load_tasks(cfg.tasks.train, cfg.tasks, "train", cfg.seed)
    message = str(err.value)
    assert message.startswith(f"{path}:3: {expected}"), message  # line 3: blank lines count
    assert "\n" not in message


def test_bad_bytes_and_a_long_line_are_not_quoted(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"id": "a", "problem": "\xff", "answer": "1"}\n')
    with pytest.raises(MappaError, match=rf"^{path}:1: not UTF-8 text \(byte 25\)$"):
        load_source(f"jsonl:{path}", TasksConfig(), "train", 0)
    secret = "S" * 5000
    write_jsonl(path, [f'{{"id": "a", "problem": "{secret}", "answer": 1,}}'])
    with pytest.raises(MappaError) as err:
        load_source(f"jsonl:{path}", TasksConfig(), "train", 0)
    assert f"{path}:1: invalid JSON" in str(err.value)
    assert str(err.value).count("S") <= sources_module.QUOTED_CHARS


def test_size_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    long = json.dumps({"id": "b", "problem": "x" * sources_module.MAX_LINE_BYTES, "answer": "1"})
    path.write_text(json.dumps({"id": "a", "problem": "y", "answer": "2"}) + "\n" + long + "\n")
    with pytest.raises(MappaError, match=rf"^{path}:2: line longer than the 1,048,576 bytes allowed$"):
        load_source(f"jsonl:{path}", TasksConfig(), "train", 0)
    monkeypatch.setattr(sources_module, "MAX_FILE_BYTES", 1000)  # the real limit is 512 MiB
    with pytest.raises(MappaError, match=rf"^{path}: [\d,]+ bytes, more than the 1,000 a task file may have$"):
        load_source(f"jsonl:{path}", TasksConfig(), "train", 0)


def test_missing_and_empty_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(MappaError, match=rf"^{tmp_path / 'nope.jsonl'}: task file not found"):
        load_source(f"jsonl:{tmp_path / 'nope.jsonl'}", TasksConfig(), "train", 0)
    with pytest.raises(MappaError, match=r"not a regular file"):
        load_source(f"jsonl:{tmp_path}", TasksConfig(), "train", 0)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(MappaError, match=r"empty.jsonl: no tasks for tasks.train \(no rows\)"):
        load_source(f"jsonl:{tmp_path / 'empty.jsonl'}", TasksConfig(), "train", 0)


def test_split_field_and_one_file_for_both(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "problem": "Train only?", "answer": 1, "split": "train"},
        {"id": "b", "problem": "Eval only?", "answer": 2, "split": "eval"},
        {"id": "c", "problem": "Both?", "answer": 3},
    ]
    write_jsonl(tmp_path / "all.jsonl", rows)
    cfg = load_config(write_config(tmp_path, ["jsonl:all.jsonl"], ["jsonl:all.jsonl"])).tasks
    assert problems(load_source(cfg.train[0], cfg, "train", 0)) == ["Train only?", "Both?"]
    assert problems(load_tasks(cfg.eval, cfg, "eval", 0)) == ["Eval only?", "Both?"]
    # training loses the rows evaluation also sees
    assert problems(load_tasks(cfg.train, cfg, "train", 0)) == ["Train only?"]

    write_jsonl(tmp_path / "all.jsonl", [rows[2]])  # no split field: the same tasks for both
    with pytest.raises(MappaError, match=r"no problems left .* give two files"):
        load_tasks(cfg.train, cfg, "train", 0)
    write_jsonl(tmp_path / "all.jsonl", [rows[0]])
    with pytest.raises(MappaError, match=r"no tasks for tasks.eval \(all 1 rows have split: train\)"):
        load_tasks(cfg.eval, cfg, "eval", 0)


def test_training_pool_dedup_held_out_and_seeded_draw(tmp_path: Path) -> None:
    train = [{"id": f"t{i}", "problem": f"What is {i} + {i}?", "answer": 2 * i} for i in range(12)]
    train.append({"id": "again", "problem": "what is 3+3", "answer": 6})  # t3 written differently: one problem
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "eval.jsonl", [{"id": "e1", "problem": "WHAT IS 5 + 5 ?", "answer": 10}])
    cfg = load_config(write_config(tmp_path, ["jsonl:train.jsonl"], ["jsonl:eval.jsonl"], train_size=6)).tasks
    pool = load_tasks(cfg.train, cfg.model_copy(update={"train_size": None}), "train", 0)
    assert len(pool) == 11 and "again" not in {t.id for t in pool} and "t5" not in {t.id for t in pool}
    drawn = load_tasks(cfg.train, cfg, "train", 42)
    assert len(drawn) == 6 and drawn == load_tasks(cfg.train, cfg, "train", 42)
    assert {t.id for t in drawn} <= {t.id for t in pool}
    assert drawn != load_tasks(cfg.train, cfg, "train", 43)
    with pytest.raises(MappaError, match=r"tasks.train_size: 20 requested but .* has only 11 tasks"):
        load_tasks(cfg.train, cfg.model_copy(update={"train_size": 20}), "train", 0)


def test_relative_path_from_set_is_against_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "mine.jsonl", GOOD)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["tasks.eval=[jsonl:mine.jsonl]"])
    assert len(load_tasks(cfg.tasks.eval, cfg.tasks, "eval", 0)) == 4


def test_unknown_source_lists_the_accepted_forms() -> None:
    with pytest.raises(MappaError) as err:
        load_source("jsnl", TasksConfig(), "train", 0)
    message = str(err.value)
    assert message.startswith("tasks.train: unknown task source 'jsnl' (built-in: arithmetic, aime,")
    assert "'jsonl:PATH', 'hf:NAME[:SPLIT]', or a loader 'module:name' / 'file.py:name'" in message


# ------------------------------------------------------------------------------------------------ the CLI
def test_cli_bad_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD[0], {"id": "b", "problem": "x"}])
    config = write_config(tmp_path, ["jsonl:train.jsonl"])
    proc = subprocess.run(
        [sys.executable, "-m", "mappa.cli", "rollout", str(config), "--episodes", "1", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, cwd=tmp_path.parent, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines == [f"mappa: error: {path}:2: missing 'answer'"]
    assert not (tmp_path / "o").exists()


def test_cli_missing_file_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.jsonl"
    argv = ["rollout", "--set", f"tasks.train=[jsonl:{tmp_path}/gone.jsonl]", "--episodes", "1", "--out", str(out)]
    assert main([*argv[:1], str(write_config(tmp_path, ["arithmetic"])), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err == f"mappa: error: {tmp_path}/gone.jsonl: task file not found (jsonl:{tmp_path}/gone.jsonl)\n"


# ---------------------------------------------------------------------------------------------- loaders
LOADER = """
from mappa.types import Task


def load(split, seed):
    yield Task(id="t0", problem="What is 3 + 3?", answer="6", source="mine")
    yield {"id": f"{split}-{seed}", "problem": f"What is {seed} + 1 in {split}?", "answer": seed + 1}


def bad(split, seed):
    return [{"id": "x", "problem": "p", "answer": "1"}, {"id": "y", "problem": "q", "answer": [1]}]


def crash(split, seed):
    raise KeyError("the data server is down")


def scalar(split, seed):
    return 5
"""


def test_loader_plugin_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "loader.py").write_text(LOADER)
    cfg = load_config(write_config(tmp_path, ["loader.py:load"], ["loader.py:load"]), ["seed=4"])
    assert cfg.tasks.train == [f"{tmp_path / 'loader.py'}:load"]  # anchored beside the config file
    evaluation = load_tasks(cfg.tasks.eval, cfg.tasks, "eval", cfg.seed)
    assert [(t.id, t.problem, t.answer, t.source) for t in evaluation] == [
        ("t0", "What is 3 + 3?", "6", "mine"),
        ("eval-4", "What is 4 + 1 in eval?", "5", "loader"),  # dict rows: the module's name is the source
    ]
    train = load_tasks(cfg.tasks.train, cfg.tasks, "train", cfg.seed)
    assert [t.id for t in train] == ["train-4"]  # t0 is an evaluation problem too
    assert answer_locations(cfg.tasks) == []  # a loader's data: unknown (the sandbox's allowlist hides it)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bad", "row 1: 'answer' must be a string or a number, got list"),
        ("crash", "failed: KeyError: 'the data server is down'"),
        ("scalar", "returned int, not an iterable of tasks"),
    ],
)
def test_a_bad_loader_is_one_line(tmp_path: Path, name: str, expected: str) -> None:
    (tmp_path / "loader.py").write_text(LOADER)
    cfg = load_config(write_config(tmp_path, [f"loader.py:{name}"]))
    with pytest.raises(MappaError) as err:
        load_tasks(cfg.tasks.train, cfg.tasks, "train", 0)
    assert str(err.value) == f"tasks.train: loader {tmp_path / 'loader.py'}:{name} {expected}"


# ---------------------------------------------------------------------------------------------- datasets
def test_datasets_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without the package raises
    with pytest.raises(MappaError, match=r"^hf:x: the datasets package is not installed: pip install 'mappa-rl\["):
        load_source("hf:x", TasksConfig(), "train", 0)


def test_hf_directory_loads_and_is_an_answer_location(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    data = {"problem": ["What is 1 + 1?", "What is 2 + 2?"], "answer": [2, 4], "notes": ["x", "y"]}
    datasets.Dataset.from_dict(data).save_to_disk(str(tmp_path / "plain"))
    splits = {
        "train": datasets.Dataset.from_dict({"id": ["a"], "problem": ["p?"], "answer": ["1"], "meta": [{"k": 1}]}),
        "test": datasets.Dataset.from_dict({"id": ["b"], "problem": ["q?"], "answer": ["2"], "meta": [{"k": 2}]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "both"))
    cfg = load_config(write_config(tmp_path, ["hf:plain"], ["hf:both:test"])).tasks
    assert cfg.train == [f"hf:{tmp_path / 'plain'}"] and cfg.eval == [f"hf:{tmp_path / 'both'}:test"]
    train = load_tasks(cfg.train, cfg, "train", 0)
    assert [(t.id, t.answer, t.source, t.meta) for t in train] == [
        ("plain:0", "2", "plain", {}),
        ("plain:1", "4", "plain", {}),
    ]
    assert [(t.id, t.meta) for t in load_tasks(cfg.eval, cfg, "eval", 0)] == [("b", {"k": 2})]
    assert {tmp_path / "plain", tmp_path / "both"} <= set(answer_locations(cfg))

    with pytest.raises(MappaError, match=r"holds the splits train, test; name one: hf:.*both:train$"):
        load_source(f"hf:{tmp_path / 'both'}", cfg, "eval", 0)
    with pytest.raises(MappaError, match=r"no split 'dev' \(splits: train, test\)$"):
        load_source(f"hf:{tmp_path / 'both'}:dev", cfg, "eval", 0)


def test_hf_bad_columns_and_rows_are_one_line(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"question": ["p?"], "solution": ["1"]}).save_to_disk(str(tmp_path / "raw"))
    with pytest.raises(MappaError, match=r"^hf:.*raw: no column 'problem' \(columns: question, solution\)$"):
        load_source(f"hf:{tmp_path / 'raw'}", TasksConfig(), "train", 0)
    rows = {"id": ["a", "b", "c"], "problem": ["p?", "q?", "r?"], "answer": ["1", None, "3"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "gap"))
    with pytest.raises(MappaError, match=r"^hf:.*gap row 1: missing 'answer'$"):
        load_source(f"hf:{tmp_path / 'gap'}", TasksConfig(), "train", 0)


def test_hf_hub_id_is_never_downloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("datasets")
    import datasets.config

    monkeypatch.delenv(sources_module.DOWNLOADS_ENV, raising=False)
    before = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(MappaError) as err:
        load_source("hf:mappa-test/not-a-dataset:train", TasksConfig(), "eval", 0)
    message = str(err.value)
    assert message.startswith("hf:mappa-test/not-a-dataset:train: no directory mappa-test/not-a-dataset and no ")
    assert "MAPPA_ALLOW_DOWNLOADS=1" in message and "\n" not in message
    assert "offline" in message.lower()  # refused before any request, not after a failed one
    assert datasets.config.HF_HUB_OFFLINE == before  # the switch is put back as it was
    from huggingface_hub import constants

    assert Path(constants.HF_HUB_CACHE) in answer_locations(TasksConfig(eval=["hf:mappa-test/not-a-dataset"]))
