"""Comparisons of arms trained on several seeds: the interval over seeds holds the seed-to-seed variation that
the per-task interval leaves out, one seed says so, and every figure names the coach it came from. Synthetic run
directories whose per-seed accuracies are set exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import make_episode, mappa, tiny_cfg, write_run

from mappa.analysis.compare import coach_label, compare_arms, compare_runs, group_arms, seed_gain
from mappa.analysis.runs import RunData, load_run
from mappa.analysis.sections import Plots, comparison
from mappa.analysis.stats import paired_t_power, t_interval, welch_interval
from mappa.config import dump_config

pytestmark = pytest.mark.integration

TASKS = 40


def episodes(correct: int, samples: int = 1) -> list:
    """Two steps of TASKS tasks x `samples` episodes each; the last step (the final evaluation) has `correct` right
    answers on the first tasks (every sample alike), so two arms of one seed are paired task by task."""
    return [
        make_episode(i, step, i < correct, (5.0, 5.0, 5.0)).model_copy(update={"id": f"e{step}-{i}-{j}"})
        for step in (1, 2)
        for i in range(TASKS)
        for j in range(samples)
    ]


def arm_runs(root: Path, arm: str, correct: dict[int, int], samples: int = 1, **cfg) -> list[RunData]:
    return [
        load_run(write_run(root / f"{arm}-seed{s}", episodes(k, samples), seed=s, **cfg)) for s, k in correct.items()
    ]


REF = {42: 12, 43: 20, 44: 28}  # 30%, 50%, 70%: the seed moves accuracy a lot


# ---------------------------------------------------------------------------------------------------- statistics
def test_t_interval_uses_student_quantiles_and_needs_two_values() -> None:
    from scipy.stats import t

    m, (lo, hi) = t_interval([0.1, 0.3, 0.2])
    assert m == pytest.approx(0.2) and hi - lo == pytest.approx(2 * t.ppf(0.975, 2) * 0.1 / math.sqrt(3))
    assert math.isnan(t_interval([0.1])[1][0])
    d, (lo, hi) = welch_interval([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])
    assert d == pytest.approx(0.3) and lo < 0.3 < hi


def test_power_grows_with_seeds_and_is_alpha_without_a_gap() -> None:
    assert paired_t_power(0.0, 1.0, 10) == pytest.approx(0.05, abs=1e-9)
    assert paired_t_power(1.0, 2.0, 5) < paired_t_power(1.0, 2.0, 20) < paired_t_power(1.0, 2.0, 60)


# ---------------------------------------------------------------------------------------------------- arms
def test_seed_interval_is_wider_than_the_per_task_one_when_seeds_vary(tmp_path: Path) -> None:
    """Gains of +30, -20, +10 pp across seeds: the pooled per-task interval looks tight, the seed one does not."""
    runs = arm_runs(tmp_path, "process", REF) + arm_runs(
        tmp_path, "outcome", {42: 24, 43: 12, 44: 32}, coach={"backend": "outcome"}
    )
    (ref, none), (other, gain) = compare_arms(runs)
    assert none is None and [ref.name, other.name] == ["process", "outcome"]
    assert other.differs == "coach.backend=outcome" and len(ref.runs) == len(other.runs) == 3
    assert gain is not None and gain.paired and gain.seeds == (42, 43, 44) and not gain.one_seed
    assert gain.per_seed == pytest.approx((0.3, -0.2, 0.1))
    mean, (lo, hi) = gain.over_seeds
    assert mean == pytest.approx(gain.per_task.gain) == pytest.approx(0.2 / 3)
    task_lo, task_hi = gain.per_task.gain_ci
    assert gain.per_task.paired and gain.per_task.n_after == 3 * TASKS
    assert hi - lo > 3 * (task_hi - task_lo) and lo < 0 < hi
    with Plots() as plots:
        html = comparison(runs, plots)  # the report's comparison section: the same two figures
    assert "over 3 seeds" in html and "seed variation left out" in html and "leaves out the variation" not in html


def test_samples_of_one_task_count_once_in_the_per_task_and_run_gains(tmp_path: Path) -> None:
    """The final evaluations hold each task 4 times with the same outcome: the same evidence as once, so neither
    the pooled per-task interval nor a run's difference from the first run may narrow."""
    other = {42: 24, 43: 12, 44: 32}
    widths = []
    for samples in (1, 4):
        root = tmp_path / str(samples)
        runs = arm_runs(root, "a", REF, samples) + arm_runs(root, "b", other, samples, coach={"backend": "outcome"})
        gain = compare_arms(runs)[1][1]
        vs_first = compare_runs([runs[0], runs[3]])[1].vs_first
        assert gain is not None and gain.per_task is not None and vs_first is not None
        assert gain.per_task.tasks == 3 * TASKS and vs_first.paired and vs_first.tasks == TASKS
        widths.append([*gain.per_task.gain_ci, *vs_first.gain_ci, gain.over_seeds[0], *gain.over_seeds[1]])
    assert widths[1] == pytest.approx(widths[0])


def test_consistent_gains_over_seeds_are_told_from_noise(tmp_path: Path) -> None:
    runs = arm_runs(tmp_path, "a", REF) + arm_runs(
        tmp_path, "b", {42: 20, 43: 29, 44: 35}, coach={"backend": "outcome"}
    )
    gain = compare_arms(runs)[1][1]
    assert gain is not None and gain.over_seeds[1][0] > 0  # +20, +22.5, +17.5 pp on every seed


def test_arms_on_different_seeds_are_compared_unpaired() -> None:
    ref = {s: episodes(k)[TASKS:] for s, k in REF.items()}
    other = {s + 10: episodes(k)[TASKS:] for s, k in REF.items()}
    gain = seed_gain(ref, other)
    assert not gain.paired and gain.over_seeds[0] == pytest.approx(0.0) and len(gain.seeds) == 6


def test_runs_group_into_arms_by_every_setting_but_the_seed(tmp_path: Path) -> None:
    runs = arm_runs(tmp_path, "x", {42: 1, 43: 2}) + arm_runs(tmp_path, "y", {42: 1}, train={"steps": 7})
    arms = group_arms(runs)
    assert [a.name for a in arms] == ["x", "y"] and arms[1].differs == "train.steps=7"


# ---------------------------------------------------------------------------------------------------- the coach
@pytest.mark.parametrize(
    ("coach", "words"),
    [
        ({}, "rule-based process rewards (rubric coach)"),
        ({"backend": "outcome"}, "outcome-only rewards"),
        ({"backend": "openai", "model": "gpt-4o-mini", "base_url": "http://h:8000/v1"}, "LLM coach gpt-4o-mini"),
        ({"backend": "local", "model": "smollm2-135m-instruct"}, "LLM coach smollm2-135m-instruct (in-process)"),
    ],
)
def test_the_coach_is_named_from_the_config(coach: dict, words: str) -> None:
    assert words in coach_label({"coach": coach} if coach else {})


# ---------------------------------------------------------------------------------------------------- output
def test_compare_command_gives_the_seed_interval_and_names_the_coach(tmp_path: Path) -> None:
    arm_runs(tmp_path, "process", REF)
    arm_runs(tmp_path, "llm", {42: 24, 43: 12, 44: 32}, coach={"backend": "openai", "model": "judge-7b"})
    dirs = [str(tmp_path / f"{arm}-seed{s}") for arm in ("process", "llm") for s in REF]
    proc = mappa("compare", *dirs, "--json", str(tmp_path / "c.json"))
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "over 3 seeds" in out and "rule-based process rewards (rubric coach)" in out
    assert "LLM coach judge-7b" in out and "seed variation left" in out and "WARNING" not in out
    rows = json.loads((tmp_path / "c.json").read_text())
    assert {r["arm"] for r in rows} == {"process", "llm"} and all(r["coach"] for r in rows)
    assert sum(r["arm_vs_first"] is not None for r in rows) == 3


def test_one_seed_says_the_interval_leaves_seed_variation_out(tmp_path: Path) -> None:
    a = arm_runs(tmp_path, "process", {42: 12})
    b = arm_runs(tmp_path, "outcome", {42: 20}, coach={"backend": "outcome"})
    gain = compare_arms(a + b)[1][1]
    assert gain is not None and gain.one_seed and gain.seeds == (42,)
    proc = mappa("compare", str(tmp_path / "process-seed42"), str(tmp_path / "outcome-seed42"))
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "WARNING: one seed per arm" in out and "leaves out the variation between training seeds" in out
    with Plots() as plots:
        html = comparison(a + b, plots)
    assert "leaves out the variation between training seeds" in html and "rubric coach" in html


# ---------------------------------------------------------------------------------------------------- the benchmark
@pytest.fixture(scope="module")
def bench():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_process_vs_outcome.py"
    spec = importlib.util.spec_from_file_location("bench_pvo_seeds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_prints_its_power_calculation(bench, capsys: pytest.CaptureFixture[str]) -> None:
    plan = bench.main(["--power-only"])["power"]
    out = capsys.readouterr().out
    assert plan["gap"] == pytest.approx(1 / 32) and plan["power"] >= 0.8 and plan["steps"] == 3
    assert f"{plan['seeds']} seeds x {plan['tasks']} held-out tasks x 3 steps" in out and "this run: 3 seeds" in out
    bigger = bench.main(["--power-only", "--gap", "6"])["power"]  # a larger gap needs fewer seeds
    assert bigger["seeds"] < plan["seeds"] and "given with --gap" in capsys.readouterr().out


def test_coach_set_becomes_coach_overrides(bench) -> None:
    assert bench.coach_overrides(["backend=openai model=m", "coach.base_url=http://h/v1"]) == [
        "coach.backend=openai", "coach.model=m", "coach.base_url=http://h/v1",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench.coach_overrides(["openai"])


@pytest.mark.parametrize("n_seeds", [3, 1])
def test_the_bench_gives_gaps_over_seeds_and_names_coaches(
    bench, tmp_path: Path, n_seeds: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "run_analysis", lambda *a: None)  # compare/report have their own tests
    seeds = [42, 43, 44][:n_seeds]
    finals = {"process": REF, "outcome": {42: 24, 43: 12, 44: 32}}
    runs = {}
    for arm, correct in finals.items():
        cfg = {"coach": {"backend": "outcome"}} if arm == "outcome" else {}
        for s in seeds:
            runs[(arm, s)] = write_run(tmp_path / f"{arm}-seed{s}", episodes(correct[s]), seed=s, **cfg)
    summary = bench.summarise(tmp_path, list(finals), seeds, runs)
    out = capsys.readouterr().out
    gap = summary["gaps"]["process-outcome"]
    assert gap["paired"] and gap["seeds"] == n_seeds and gap["gain"] == pytest.approx(-sum(
        finals["outcome"][s] - finals["process"][s] for s in seeds) / TASKS / n_seeds)  # fmt: skip
    assert summary["arms"]["process"]["coach"] == "rule-based process rewards (rubric coach)"
    assert "rubric coach" in out and "outcome-only rewards" in out and "per task:" in out
    if n_seeds == 3:
        lo, hi = gap["ci_over_seeds"]
        assert hi - lo > 3 * (gap["ci"][1] - gap["ci"][0]) and "over 3 seeds" in out and "WARNING: one seed" not in out
    else:
        assert gap["ci_over_seeds"] is None and "WARNING: one seed per arm" in out


def test_the_bench_says_what_each_arm_learned_over_seeds(
    bench, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "run_analysis", lambda *a: None)
    # per seed: (right, answered) at the start evaluation (step 1) and the final one (step 2)
    plan = {42: ((4, 10), (8, 30)), 43: ((2, 20), (10, 30)), 44: ((6, 10), (8, 40))}
    runs = {}
    for arm in ("process", "outcome"):
        for s, evals in plan.items():
            if arm == "outcome" and s == 44:  # this arm's start differs on 4 tasks: right 10, not 6
                evals = ((10, 10), evals[1])
            eps = [
                make_episode(i, step, i < right, (5.0, 5.0, 5.0), answer="7" if i < said else None)
                for step, (right, said) in zip((1, 2), evals, strict=True)
                for i in range(TASKS)
            ]
            runs[(arm, s)] = write_run(tmp_path / f"{arm}-seed{s}", eps, seed=s)
    summary = bench.summarise(tmp_path, ["process", "outcome"], list(plan), runs)
    arm = summary["arms"]["process"]
    out = capsys.readouterr().out
    assert not summary["same_start"] and summary["start_differs"] == {44: 4}
    assert "seed 44: 4 of 40 start episodes differ between arms (right answers 6 vs 10)" in out
    acc, said = arm["learned_accuracy"], arm["learned_answered"]
    assert acc["per_seed"] == pytest.approx([4 / TASKS, 8 / TASKS, 2 / TASKS])
    assert said["per_seed"] == pytest.approx([20 / TASKS, 10 / TASKS, 30 / TASKS])
    lo, hi = acc["ci_over_seeds"]
    assert acc["gain"] == pytest.approx(14 / 3 / TASKS) and lo < 0 < acc["gain"] < hi  # 3 seeds, t on 2 d.f.: wide
    assert (
        "learned, accuracy: 10.0% -> 21.7%; gain +11.7 pp" in out
        and "learned, answered: 33.3% -> 83.3%; gain +50.0 pp" in out
        and "over 3 seeds" in out
    )


def test_so_far_summarises_only_the_seeds_every_arm_finished(
    bench, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "run_analysis", lambda *a: None)
    argv = ["--so-far", "--seeds", "3", "--arms", "process,outcome", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="no seed has finished in every arm"):
        bench.main(argv)
    arm_runs(tmp_path, "process", REF)  # every seed
    arm_runs(tmp_path, "outcome", {42: 24, 43: 12}, coach={"backend": "outcome"})  # seed 44 still running
    summary = bench.main(argv)
    out = capsys.readouterr().out
    assert summary["seeds"] == [42, 43] and summary["planned_seeds"] == 3 and summary["interim"]
    assert summary["gaps"]["process-outcome"]["per_seed"] == pytest.approx([-12 / TASKS, 8 / TASKS])
    assert "interim: 2 of 3 planned seeds" in out and (tmp_path / "interim.json").is_file()
    assert not (tmp_path / "summary.json").exists()  # the final summary's name stays for the finished benchmark


def test_one_seed_json_has_null_not_nan(tmp_path: Path) -> None:
    arm_runs(tmp_path, "process", {42: 12})
    arm_runs(tmp_path, "outcome", {42: 20}, coach={"backend": "outcome"})
    dirs = [str(tmp_path / "process-seed42"), str(tmp_path / "outcome-seed42")]
    assert mappa("compare", *dirs, "--json", str(tmp_path / "c.json")).returncode == 0
    text = (tmp_path / "c.json").read_text()
    rows = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert rows[1]["arm_vs_first"]["over_seeds"][1] == [None, None] and rows[1]["seed"] == 42


def test_an_arm_that_moves_no_weight_is_a_result_not_a_failure(bench, tmp_path: Path) -> None:
    """An outcome-only arm at a low base rate can score every action of every step alike: `mappa train` exits 3
    (nothing moved), and the bench keeps the run as that arm's result instead of stopping the benchmark."""
    (tmp_path / "flat.py").write_text("def score(ctx):\n    return 0.0\n")
    cfg = tiny_cfg(
        tmp_path, "logging.report_to=[]", "train.self_test=false", f"coach.backend={tmp_path}/flat.py:score"
    )
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    run_dir = tmp_path / "outcome-seed1"
    assert bench.train_arm(str(tmp_path / "config.yaml"), run_dir, ["seed=1"]) > 0
    assert (run_dir / "eval" / "final.jsonl").is_file()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(v == 0 for r in rows for k, v in r.items() if k.endswith("/optimizer_steps"))
    assert bench.train_arm(str(tmp_path / "config.yaml"), run_dir, ["seed=1"]) == 0.0  # finished: reused
