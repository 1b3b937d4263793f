"""A copy of a task's table among the files agent code can read would let it label the test rows: the scan finds
such copies however they are written, the sandbox hides them, and a run leaves out a task whose copy stays readable.

Everything is real: the agent environment (.venv-agents, and small virtualenvs made from its interpreter with
planted files), the sandbox under each confinement, the library's own test file that holds the Titanic table.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import os
import random
import subprocess
import zipfile
from pathlib import Path

import pytest

from mappa.config import SandboxConfig
from mappa.sandbox import Sandbox, confine, new_workspace, remove_workspace, run_python
from mappa.sandbox.allowlist import AGENT_ROOT, MAX_COVER_SIBLINGS, agent_env, record_covers
from mappa.sandbox.execute import Limits, run_cold
from mappa.sandbox.tables_probe import check_tables, env_identity, scan_tables
from mappa.sandbox.tables_scan import cell_hash, name_key, normalise
from mappa.tasks.dsbench.build import _finish, _staging_for, prepare_task, select_specs
from mappa.tasks.dsbench.catalogue import load_frame
from mappa.tasks.dsbench.fingerprints import FINGERPRINTS_FILE, compute_fingerprints, load_fingerprints, withheld

REPO = Path(__file__).resolve().parents[1]
AGENT_PYTHON = REPO / ".venv-agents" / "bin" / "python"
# The library test file that holds the Titanic table, labels and all (scikit-learn's OpenML fixture, id 40945).
FIXTURE = "sklearn/datasets/tests/data/openml/id_40945/data-v1-dl-16826755.arff.gz"
TASKS = ["titanic_survival", "diamond_prices"]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not AGENT_PYTHON.exists(), reason="no agent environment (make venv)"),
]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Covers and scans are recorded in the cache: each test has its own."""
    monkeypatch.setenv("MAPPA_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    """A two-task mini-DSBench as the build lays it out (without the reference run)."""
    root = tmp_path_factory.mktemp("bench")
    rows = []
    for spec in select_specs(TASKS):
        item = prepare_task(spec, root, 42)
        rows.append({**item.row, "split": "train"})
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def fingerprints(bench) -> dict:
    return load_fingerprints(bench)


@pytest.fixture(scope="module", params=["bwrap", "fallback"])
def mode(request) -> str:
    if request.param == "bwrap" and confine.bwrap_problem() is not None:
        pytest.skip(confine.bwrap_problem())
    if not confine.detect_confinement(request.param).hides_host:
        pytest.skip("this fallback cannot hide the host: runs with hidden answers are refused there")
    return request.param


def _fixture(env) -> tuple[str, str]:
    """The library's Titanic file: its path on the host, and as agent code sees it."""
    host = str(next(Path(os.path.realpath(env.venv)).glob(f"lib/python3*/site-packages/{FIXTURE}")))
    return host, env.inside(host, AGENT_ROOT)


def _venv(where: Path) -> Path:
    """A small agent environment made from the real one's interpreter; its site-packages is bound into the view."""
    subprocess.run([str(AGENT_PYTHON), "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    return next(where.glob("lib/python3*/site-packages"))


def _titanic() -> list[dict]:
    """The Titanic table as its R package ships it ('1st', 'survived'/'died'), one dict per passenger."""
    frame = load_frame(select_specs(["titanic_survival"])[0])
    return frame.to_dict("records")


def _plant_copies(data: Path) -> dict[str, str]:
    """Copies of the Titanic table written as other people would; file name -> what makes it different."""
    rows = _titanic()
    random.Random(0).shuffle(rows)
    yes = {"survived": "Yes", "died": "No"}

    def age(r: dict) -> str:
        return "NA" if r["age"] != r["age"] else f"{r['age']:.4f}"

    buf = io.StringIO()
    out = csv.writer(buf, quoting=csv.QUOTE_ALL)
    out.writerow(["PARCH", "SibSp", " Age ", "Sex", "Survived", "Remarks", "Pclass"])
    for n, r in enumerate(rows):  # remarks with 0-3 commas inside their quotes
        remark = ", ".join(["boarded"] + ["at Southampton", "with family", "deck C"][: n % 4])
        out.writerow([r["parch"], r["sibsp"], age(r), r["sex"].upper(), yes[r["survived"]], remark, r["pclass"]])
    (data / "passengers.csv").write_text(buf.getvalue())
    tsv = "".join(
        f"{r['sex']}\t{r['age']}\t{r['sibsp']}\t{r['parch']}\t{int(r['survived'] == 'survived')}\n" for r in rows
    )
    (data / "people.tsv.gz").write_bytes(gzip.compress(tsv.encode()))
    records = [
        {
            "s": r["sex"],
            "a": None if r["age"] != r["age"] else r["age"],
            "sp": r["sibsp"],
            "pc": r["parch"],
            "y": r["survived"][0],
        }
        for r in rows
    ]
    with zipfile.ZipFile(data / "bundle.zip", "w") as z:
        z.writestr("inside/titanic.json", json.dumps({"meta": {"n": len(rows)}, "records": records}))
    (data / "table.dat").write_text(
        "".join(f"  {r['age']}   {r['sex']}  {r['sibsp']} {r['parch']}   {yes[r['survived']]}\n" for r in rows)
    )
    # A decoy: the same passengers with their fates shuffled labels nothing.
    fates = [r["survived"] for r in rows]
    random.Random(1).shuffle(fates)
    decoy = "".join(f"{r['sex']},{age(r)},{r['sibsp']},{r['parch']},{f}\n" for r, f in zip(rows, fates, strict=True))
    (data / "decoy.csv").write_text("sex,age,sibsp,parch,survived\n" + decoy)
    return {
        "passengers.csv": "columns reordered and renamed, quoted (commas inside), numbers reformatted, classes Yes/No",
        "people.tsv.gz": "gzip, tabs, no header, target as 0/1",
        "bundle.zip!inside/titanic.json": "JSON records in a zip, other names, classes as s/d",
        "table.dat": "whitespace-aligned, no header",
    }


def test_cells_are_written_one_way():
    assert normalise("  29.0000 ") == normalise(29) == normalise(29.0) == normalise("2.9e1") == "29"
    assert normalise('"Female"') == normalise("female ") == "female"
    assert normalise("NA") == normalise(None) == normalise(float("nan")) == normalise("?") == ""
    assert normalise(0.91666666) == normalise("0.916667") != normalise("0.9167")
    assert normalise(True) == normalise("TRUE") == "1"


def test_the_build_writes_fingerprints_beside_the_benchmark(tmp_path):
    out = tmp_path / "bench"
    staging = _staging_for(out)
    _finish(out, staging, [prepare_task(s, staging, 42) for s in select_specs(["diamond_prices"])], 42)
    assert json.loads((out / FINGERPRINTS_FILE).read_text())["digest"] == compute_fingerprints(out)["digest"]
    assert [p.name for p in (out / "tasks" / "diamond_prices").iterdir() if "fingerprint" in p.name] == []


def test_the_fingerprint_samples_training_rows_only(bench, fingerprints):
    titanic = next(t for t in fingerprints["tasks"] if t["id"] == "titanic_survival")
    assert titanic["classification"] and titanic["classes"] == 2 and len(titanic["rows"]) == 200
    with (bench / "tasks" / "titanic_survival" / "train.csv").open() as f:
        header, *rows = list(csv.reader(f))
    cols = [header.index(n) for n in ("pclass", "sex", "age", "sibsp", "parch")]
    assert [name_key(header[i]) for i in cols] == titanic["names"][:-1]
    train = {tuple(cell_hash(normalise(r[i])) for i in cols) for r in rows}
    assert all(tuple(row[:-1]) in train for row in titanic["rows"])  # no test row: their labels stay out
    assert load_fingerprints(bench)["digest"] == fingerprints["digest"]  # read back, not computed again


def test_the_library_copy_of_the_titanic_table_is_found_from_inside(mode, fingerprints):
    conf = confine.detect_confinement(mode)
    folder = os.path.dirname(_fixture(conf.env)[1])
    result = scan_tables(conf, fingerprints["tasks"], [folder], budget_s=60)
    hits = [m for m in result["matches"] if m["path"].endswith(FIXTURE)]
    assert [m["task"] for m in hits] == ["titanic_survival"], result
    assert hits[0]["precision"] == 1.0 and hits[0]["rows"] >= 50 and hits[0]["target"] == "survived"


def test_reformatted_copies_are_found_and_a_decoy_is_not(tmp_path, fingerprints):
    site = _venv(tmp_path / "env")
    data = site / "somelib" / "tests" / "data"
    data.mkdir(parents=True)
    planted = dict.fromkeys(_plant_copies(data), "titanic_survival")
    # A regression table: all 53,940 diamonds (the task samples 8,000), bzip2, ';', columns reversed, prices as 326.000
    diamonds = load_frame(select_specs(["diamond_prices"])[0])
    text = diamonds[diamonds.columns[::-1]].to_csv(index=False, sep=";", float_format="%.3f")
    (data / "diamonds.csv.bz2").write_bytes(bz2.compress(text.encode()))
    planted["diamonds.csv.bz2"] = "diamond_prices"
    conf = confine.detect_confinement("auto", str(tmp_path / "env" / "bin" / "python"))
    inside = conf.env.inside(str(data), AGENT_ROOT)
    result = scan_tables(conf, fingerprints["tasks"], [inside], budget_s=60)
    found = {m["path"].removeprefix(inside + "/"): m["task"] for m in result["matches"]}
    assert found == planted, result


def test_a_found_copy_is_covered_for_every_snippet_and_the_check_is_cached(tmp_path, fingerprints, mode):
    site = _venv(tmp_path / "env")
    data = site / "somelib" / "data"
    data.mkdir(parents=True)
    _plant_copies(data)
    (data / "notes.txt").write_text("kept\n")
    conf = confine.detect_confinement(mode, str(tmp_path / "env" / "bin" / "python"))
    check = check_tables(conf, fingerprints, roots=[AGENT_ROOT], budget_s=60)
    assert len(check.found) == 4 and check.dropped == {} and not check.cached
    assert "covered 4 copies" in check.lines()[0]
    ws = new_workspace()
    try:
        d = conf.env.inside(str(data), AGENT_ROOT)
        code = f"import os\nprint(sorted(os.listdir({d!r})), open({d!r} + '/notes.txt').read())"
        r = run_cold(code, ws, Limits(timeout_s=30), conf)  # agent code of this environment
    finally:
        remove_workspace(ws)
    assert r.ok and r.stdout.strip() == "['decoy.csv', 'notes.txt'] kept", r.stderr
    again = check_tables(conf, fingerprints, roots=[AGENT_ROOT], budget_s=60)
    assert again.cached and again.found == check.found


def test_a_copy_that_cannot_be_covered_drops_its_task(tmp_path, fingerprints):
    site = _venv(tmp_path / "env")
    crowded = site / "crowded"
    crowded.mkdir()
    for n in range(MAX_COVER_SIBLINGS + 1):
        (crowded / f"f{n:03d}.txt").write_text("x\n")
    rows = _titanic()
    lines = [f"{r['sex']},{r['age']},{r['sibsp']},{r['parch']},{r['survived']}\n" for r in rows]
    (crowded / "titanic.csv").write_text("sex,age,sibsp,parch,survived\n" + "".join(lines))
    conf = confine.detect_confinement("auto", str(tmp_path / "env" / "bin" / "python"))
    check = check_tables(conf, fingerprints, roots=[AGENT_ROOT], budget_s=60)
    where = conf.env.inside(str(crowded / "titanic.csv"), AGENT_ROOT)
    assert check.dropped == {"titanic_survival": where}
    assert (
        check.lines()[0]
        == f"sandbox: task titanic_survival dropped: agent code can read a copy of its table at {where}"
    )


@pytest.mark.parametrize("how", ["cold", "pool"])
def test_the_real_library_copy_is_hidden_once_recorded(mode, how):
    env = agent_env(None)
    host, inside = _fixture(env)
    record_covers(env, [host])
    code = (
        "import os, importlib\n"
        f"p = {inside!r}\n"
        "print(os.path.exists(p), sorted(n for n in os.listdir(os.path.dirname(p)) if n.endswith('.gz')))\n"
        "importlib.import_module('sklearn.datasets.tests.data.openml.id_40945')\n"
        "from sklearn.ensemble import RandomForestClassifier\n"
        "print('ok')"
    )
    ws = new_workspace()
    try:
        if how == "cold":
            r = run_python(code, ws, confinement=mode, timeout_s=60)
        else:
            with Sandbox(SandboxConfig(pool=True, preload=["numpy"], confinement=mode, timeout_s=60)) as sb:
                r = sb.run(code, ws)
    finally:
        remove_workspace(ws)
    assert r.ok, r.stderr
    assert (
        r.stdout.split("\n")[0]
        == "False ['api-v1-jd-40945.json.gz', 'api-v1-jdf-40945.json.gz', 'api-v1-jdq-40945.json.gz']"
    )


def test_the_scan_is_redone_when_a_package_is_installed_not_when_bytecode_is_written(tmp_path):
    site = _venv(tmp_path / "env")
    env = agent_env(str(tmp_path / "env" / "bin" / "python"))
    before = env_identity(env)
    (site / "__pycache__").mkdir()
    (site / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"")
    assert env_identity(env) == before
    (site / "newlib").mkdir()
    assert env_identity(env) != before


@pytest.mark.slow
def test_a_run_leaves_out_a_task_whose_copy_stays_readable(tmp_path, bench):
    from mappa.api import check_hidden_answers
    from mappa.config import Config
    from mappa.tasks.tabular import load_dsbench

    site = _venv(tmp_path / "env")
    crowded = site / "crowded"
    crowded.mkdir()
    for n in range(MAX_COVER_SIBLINGS + 1):
        (crowded / f"f{n:03d}.txt").write_text("x\n")
    _plant_copies(crowded)
    cfg = Config().model_copy(
        update={
            "tasks": Config().tasks.model_copy(
                update={"train": ["dsbench"], "eval": ["dsbench"], "dsbench_dir": str(bench)}
            ),
            "sandbox": SandboxConfig(python=str(tmp_path / "env" / "bin" / "python")),
        }
    )
    lines = check_hidden_answers(cfg)
    assert lines is not None and "sandbox: task titanic_survival dropped" in lines
    assert list(withheld(bench)) == ["titanic_survival"]
    assert [t.id for t in load_dsbench(bench, "train")] == ["diamond_prices"]


@pytest.mark.slow
def test_the_whole_view_of_the_real_agent_environment_holds_one_copy(fingerprints):
    conf = confine.detect_confinement("auto")
    check = check_tables(conf, fingerprints)
    assert check.found == (("titanic_survival", _fixture(conf.env)[1]),)
    assert check.dropped == {} and not check.unfinished
    print(f"scan: {check.files} files seen, {check.read} read, {check.seconds} s")
