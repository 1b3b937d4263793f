"""The analysis of run files: the bias monitor, the hacking alarm and blame on synthetic episodes whose answer is
known; the report of a real tiny 2-step run and of a killed one; the commands' one-line errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from helpers import MATHCHAT_AGENTS, TH, act, make_episode, mappa, one_line_error, synthetic, write_run

from mappa.analysis.bias import bias_monitor, coach_vs_truth
from mappa.analysis.blame import blame, blame_table, failure_kind
from mappa.analysis.compare import compare_runs
from mappa.analysis.hacking import hacking_checks
from mappa.analysis.report import SECTIONS, build_report, write_report
from mappa.analysis.runs import load_run
from mappa.analysis.sections import Plots, specialisation
from mappa.config import AnalysisConfig, dump_config
from mappa.errors import MappaError
from mappa.metrics import linear_trend, mean_interval
from mappa.types import ExecResult

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------------------------------- statistics
def test_mean_interval_and_linear_trend() -> None:
    m, (lo, hi) = mean_interval([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and lo < 2.5 < hi and hi - lo == pytest.approx(2 * 1.959963984540054 * (5 / 3 / 4) ** 0.5)
    t = linear_trend([1, 2, 3, 4], [0.0, 1.0, 2.0, 3.0])
    assert t.slope == pytest.approx(1.0) and t.rise == pytest.approx(3.0) and t.rise_ci == pytest.approx((3.0, 3.0))
    assert math.isnan(linear_trend([1, 1, 1], [0, 1, 2]).rise)  # x never moves: no trend


# ---------------------------------------------------------------------------------------------------- bias
def test_a_coach_biased_on_one_stratum_is_flagged_and_only_there() -> None:
    rows = bias_monitor(synthetic(bias=2.5), TH)
    flagged = [(b.agent, b.dimension, b.stratum) for b in rows if b.alarm]
    assert flagged == [("verifier", "source", "b")]
    b = next(r for r in rows if r.alarm)
    assert b.gap[0] > TH.bias_gap and b.gap[1][0] > 0 and "points vs the other strata" in b.alarm


def test_an_unbiased_coach_is_not_flagged() -> None:
    for seed in range(3):
        rows = bias_monitor(synthetic(seed=seed), TH)
        assert rows and not [b for b in rows if b.alarm]
        # the outcome explains the verifier's scores: its per-source gaps sit near 0 though accuracy differs
        assert all(abs(b.gap[0]) < 0.6 for b in rows if b.agent == "verifier")


def test_a_bias_that_grows_over_training_is_flagged_as_drift() -> None:
    th = AnalysisConfig(bias_gap=10.0)  # only the drift can fire
    rows = bias_monitor(synthetic(drift=4.0), th)
    flagged = [b for b in rows if b.alarm]
    assert [(b.agent, b.stratum) for b in flagged] == [("verifier", "b")] and "drifted" in flagged[0].alarm


def test_coach_vs_truth_counts_the_confusion_table() -> None:
    eps = [
        make_episode(0, 1, True, (5, 5, 9)),  # high score, right: agree
        make_episode(1, 1, False, (5, 5, 8)),  # high score, wrong: a false pass
        make_episode(2, 2, False, (5, 5, 1)),  # low score, wrong: agree
    ]
    eps.append(eps[0].model_copy(update={"actions": (*eps[0].actions[:2], act("verifier", 9.0, verdict=False))}))
    ct = coach_vs_truth(eps, TH)
    assert ct.table == {(True, True): 1, (True, False): 1, (False, False): 1, (False, True): 1}
    assert ct.agreement == 0.5 and ct.from_verdict == 1 and ct.per_step == {1: (1, 3), 2: (1, 1)}


# ---------------------------------------------------------------------------------------------------- hacking
def test_rising_scores_with_flat_accuracy_raise_the_hacking_alarm() -> None:
    checks = {c.agent: c for c in hacking_checks(synthetic(coder_rise=0.8), MATHCHAT_AGENTS, TH)}
    assert checks["code_executor"].alarm and "scores rose" in checks["code_executor"].alarm
    assert checks["code_executor"].score[1][0] > 0 and checks["code_executor"].excess[1][0] > 0
    assert checks["problem_solver"].alarm is None and checks["verifier"].alarm is None


def test_flat_scores_or_scores_rising_with_accuracy_raise_no_alarm() -> None:
    for eps in (synthetic(), synthetic(accuracy_rise=0.08)):
        assert not [c for c in hacking_checks(eps, MATHCHAT_AGENTS, TH) if c.alarm]


def test_the_hacking_alarm_names_episodes_that_show_it() -> None:
    eps = synthetic(coder_rise=1.0)
    check = next(c for c in hacking_checks(eps, MATHCHAT_AGENTS, TH) if c.agent == "code_executor")
    by_id = {e.id: e for e in eps}
    assert check.examples and all(by_id[i].correct is False and s >= TH.high_score for i, _, s in check.examples)


# ---------------------------------------------------------------------------------------------------- blame
def test_the_lowest_scored_action_of_a_failed_episode_is_named() -> None:
    failing = ExecResult(ok=False, exit_code=1, stderr="Traceback...\nZeroDivisionError: division by zero")
    e = make_episode(0, 3, False, (6.0, 2.0, 4.0), result=failing)
    e = e.model_copy(
        update={"actions": (*e.actions[:2], act("code_executor", 1.5, turn=1, result=failing), e.actions[2])}
    )
    ok = make_episode(1, 3, True, (6.0, 0.0, 9.0))
    rows = blame([e, ok], {"code_executor"})
    assert len(rows) == 1  # only the failed episode
    r = rows[0]
    assert (r.agent, r.turn, r.score, r.kind, r.step) == ("code_executor", 1, 1.5, "code error", 3)
    assert r.rationale == "code_executor judged 1.5" and "ZeroDivisionError" in r.tool
    assert blame_table(rows) == {"code_executor": {"code error": 1}}


@pytest.mark.parametrize(
    ("result", "meta", "answer", "kind"),
    [
        (ExecResult(ok=False, timed_out=True), {}, "7", "timeout"),
        (ExecResult(ok=False, exit_code=1, stderr="FileNotFoundError: 'model.pkl'"), {}, "7", "missing file"),
        (ExecResult(ok=True), {"missing_files": ["model.pkl"]}, "7", "missing file"),
        (ExecResult(ok=False, exit_code=1, stderr="NameError"), {}, "7", "code error"),
        (ExecResult(ok=False, memory_exceeded=True), {}, "7", "code error"),
        (None, {}, "7", "no code"),
        (ExecResult(ok=True, stdout="7"), {}, None, "no answer"),
        (ExecResult(ok=True, stdout="7"), {}, "8", "wrong answer"),
        (ExecResult(ok=True), {"error": "prompt too long"}, None, "stopped"),
        (ExecResult(ok=False, infra_error="pool died"), {}, "8", "wrong answer"),  # infra faults blame no one
    ],
)
def test_failure_kinds(result: ExecResult | None, meta: dict, answer: str | None, kind: str) -> None:
    e = make_episode(0, 1, False, (5, 5, 2), answer=answer)
    coder = e.actions[1].model_copy(update={"exec_result": result})
    e = e.model_copy(update={"actions": (e.actions[0], coder, e.actions[2]), "meta": {**e.meta, **meta}})
    assert failure_kind(e, {"code_executor"}) == kind


# ---------------------------------------------------------------------------------------------------- run dirs


def test_report_of_a_synthetic_run_has_every_section_and_the_alarms(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "biased", synthetic(bias=2.5, coder_rise=0.8)))
    report = build_report([run], [TH])
    page = report.html()
    for name in ("alarms", *SECTIONS):
        assert f'data-section="{name}"' in page, name
    assert any("coach bias on verifier, source=b" in a for a in report.alarms)
    assert any("reward hacking? code_executor" in a for a in report.alarms)
    assert page.count("<svg") == report.figures >= 10
    assert "mappa probe" not in page and "KL from the base" in page  # the probe rows were drawn
    assert not re.findall(r'(?:src|href)="(?!#|data:)|url\((?!#)|@import', page)  # nothing to fetch
    size = write_report(report, tmp_path / "r.html")
    assert size == len((tmp_path / "r.html").read_bytes())


def test_report_without_probes_says_how_to_make_them(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", synthetic(steps=2, per_step=6), probes=False))
    with Plots() as plots:
        assert f"mappa probe {run.path}" in specialisation(run, plots) and plots.count == 0


def test_load_run_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(MappaError, match="run directory not found"):
        load_run(tmp_path / "nope")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(MappaError, match="not a directory"):
        load_run(tmp_path / "file.txt")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.md").write_text("hello")
    with pytest.raises(MappaError, match="not a mappa run directory"):
        load_run(tmp_path / "foreign")


def kill_mid_step(run_dir: Path, dest: Path) -> Path:
    """A copy of a run as a kill mid-step leaves it: no final eval, no checkpoint of the step, torn last lines."""
    shutil.copytree(run_dir, dest)
    for p in ("eval/final.jsonl", "checkpoints", "report.html"):
        target = dest / p
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    for name in ("episodes.jsonl", "metrics.jsonl"):
        with (dest / name).open("a") as f:
            f.write('{"id": "torn-epis')
    return dest


def test_a_killed_run_loads_with_notes(tmp_path: Path) -> None:
    run_dir = kill_mid_step(write_run(tmp_path / "run", synthetic(steps=3, per_step=6)), tmp_path / "killed")
    run = load_run(run_dir)
    assert len(run.episodes) == 18 and run.steps == [1, 2, 3] and list(run.evals) == ["start"]
    assert any("unreadable" in n for n in run.notes) and any("no final evaluation" in n for n in run.notes)
    summary = compare_runs([run])[0]
    assert summary.final_tag == "start" and summary.gain is None and summary.steps == 3
    assert len(blame(run.episodes, run.code_agents)) == sum(e.correct is False for e in run.episodes)


def test_thresholds_come_from_the_run_config_and_set(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", synthetic(steps=2, per_step=3), evals=False, probes=False))
    assert run.thresholds().bias_gap == AnalysisConfig().bias_gap
    assert run.thresholds(["analysis.bias_gap=0.25"]).bias_gap == 0.25
    with pytest.raises(MappaError, match="analysis"):
        run.thresholds(["train.steps=3"])
    with pytest.raises(MappaError, match="bias_gap"):
        run.thresholds(["analysis.bias_gap=-1"])


def test_compare_pairs_runs_that_evaluated_the_same_tasks(tmp_path: Path) -> None:
    a = load_run(write_run(tmp_path / "a", synthetic(seed=1, steps=2, per_step=12)))
    b = load_run(write_run(tmp_path / "b", synthetic(seed=2, steps=2, per_step=12), coach={"backend": "outcome"}))
    first, second = compare_runs([a, b])
    assert first.vs_first is None and first.differs == ""
    assert second.vs_first is not None and second.vs_first.paired and second.differs == "coach.backend=outcome"
    assert second.vs_first.gain == pytest.approx(second.final[0] - first.final[0])


# ---------------------------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-step training run of a tiny random model (rubric coach, real sandbox), trained once."""
    import torch
    from helpers import tiny_cfg

    from mappa.training.trainer import train

    tmp = tmp_path_factory.mktemp("tiny")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = tiny_cfg(tmp, "logging.report_to=[]")
        (tmp / "run").mkdir()
        (tmp / "run" / "run.json").write_text('{"mappa_run": 1}')  # marked, as `mappa train` marks it
        (tmp / "run" / "config.yaml").write_text(dump_config(cfg))
        train(cfg, tmp / "run")
    finally:
        torch.set_num_threads(threads)
    return tmp / "run"


def test_report_of_a_tiny_two_step_run(tiny_run: Path, tmp_path: Path) -> None:
    proc = mappa("report", str(tiny_run), "--out", str(tmp_path / "report.html"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"report: {tmp_path / 'report.html'}"
    page = (tmp_path / "report.html").read_text()
    for name in ("alarms", *SECTIONS):
        assert f'data-section="{name}"' in page, name
    assert page.count("<svg") >= 5 and "<script" not in page
    # two steps support no trend and no stratum comparison: the report says so and raises nothing
    assert "too little data to judge" in proc.stderr and not re.search(r"^alarm ", proc.stderr, re.M)
    assert page.index('data-section="summary"') < page.index('data-section="alarms"')


def test_blame_and_compare_on_a_tiny_run_and_its_killed_copy(tiny_run: Path, tmp_path: Path) -> None:
    killed = kill_mid_step(tiny_run, tmp_path / "killed")
    proc = mappa("blame", str(killed))
    assert proc.returncode == 0, proc.stderr
    assert "training episodes failed" in proc.stdout and "unreadable" in proc.stdout
    proc = mappa("compare", str(tiny_run), str(killed), "--json", str(tmp_path / "c.json"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["name"] for r in rows] == ["run", "killed"] and rows[0]["final_tag"] == "final"
    assert rows[1]["final_tag"] == "start" and rows[1]["vs_first"]["paired"]
    proc = mappa("report", str(killed))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"report: {killed / 'report.html'}"
    assert "no final evaluation" in proc.stderr


@pytest.mark.parametrize("command", ["report", "blame", "compare"])
def test_missing_and_foreign_directories_are_one_line_errors(command: str, tmp_path: Path) -> None:
    assert "no-run: run directory not found" in one_line_error(mappa(command, str(tmp_path / "no-run")))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.csv").write_text("a,b\n")
    assert "not a mappa run directory" in one_line_error(mappa(command, str(tmp_path / "foreign")))


def test_the_report_draws_what_mappa_probe_writes(tiny_run: Path, tmp_path: Path) -> None:
    """The contract with `mappa probe`: its probe.jsonl rows become the specialisation section's plot and table."""
    from mappa.analysis.probe import probe_run

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    probe_run(run_dir, prompts_per_role=2)
    run = load_run(run_dir)
    assert run.probes and not [n for n in run.notes if "probe" in n]
    assert {r["probe"] for r in run.probes} >= {"kl_base", "general_nll", "role_nll"}
    with Plots() as plots:
        html = specialisation(run, plots)
        assert plots.count == 1 and "KL from the base" in html and "general-text NLL" in html
    assert "NLL of each role's prompts" in html and ("(+" in html or "(-" in html)  # differences from the base


def test_config_diff_fills_defaults_before_comparing() -> None:
    """A run written before a setting existed ran with its default: not a difference. A real one is named, and
    a config this version cannot read is still compared as written."""
    from mappa.analysis.compare import config_diff

    old = {"seed": 42, "train": {"steps": 3}}
    assert config_diff(old, {"seed": 42, "train": {"steps": 3, "keep_checkpoints": 2}}) == ""
    assert config_diff(old, {"seed": 43, "train": {"steps": 3}}) == "seed=43"
    assert (
        config_diff(old, {"seed": 42, "train": {"steps": 3}, "coach": {"backend": "outcome"}})
        == "coach.backend=outcome"
    )
    assert config_diff({"foreign": 1}, {"foreign": 2}) == "foreign=2"


@pytest.mark.parametrize(("n_runs", "panel_legends", "figure_legends"), [(2, 3, 0), (5, 0, 1)])
def test_comparison_legend_per_panel_or_once_under_many_runs(
    tmp_path: Path, n_runs: int, panel_legends: int, figure_legends: int
) -> None:
    """A few runs: a legend in each panel; many: their names would cover the panels, so one legend under all."""
    from mappa.analysis.sections import comparison

    runs = [load_run(write_run(tmp_path / f"r{i}", synthetic(seed=i, steps=2, per_step=6))) for i in range(n_runs)]
    with Plots() as plots:
        html_text = comparison(runs, plots)
    svg = html_text[html_text.index("<svg") : html_text.index("</svg>")]
    assert len(re.findall(r'id="f\d+-legend_\d+"', svg)) == panel_legends + figure_legends
    names = re.findall(r">(r\d)</text>|<text[^>]*>\s*<!--\s*(r\d)\s*-->", svg)
    assert {a or b for a, b in names} == {f"r{i}" for i in range(n_runs)}  # every run named in a legend
