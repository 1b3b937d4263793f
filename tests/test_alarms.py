"""The report's alarms measured on simulated runs whose truth is known (tests/alarm_sim.py): at the default
thresholds, the false-alarm rate per run on null runs (no bias, random strata, scores that rise with accuracy or
with every stratum alike) and the power on effects of the paper's size. The rates printed here are the ones
docs/analysis.md states; each is measured over RUNS simulated runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from alarm_sim import AGENTS, SimRun, ar1, simulate
from helpers import make_episode

from mappa.analysis.bias import bias_monitor, bias_rows
from mappa.analysis.hacking import Trend, check_arrays, hacking_checks
from mappa.analysis.report import build_report
from mappa.analysis.runs import load_run
from mappa.analysis.stats import clustered_contrast, excludes_zero, serial_trend, trend_through_points
from mappa.config import AnalysisConfig, Config, dump_config
from mappa.types import Episode, write_jsonl

pytestmark = pytest.mark.integration

TH = AnalysisConfig()
RUNS = 200
MAX_FALSE_ALARMS = 0.05


def bias_alarm_rate(cfg: SimRun, seed: int, dim: str | None = None, validity_only: bool = False) -> float:
    """Share of RUNS simulated runs with a bias alarm (on `dim` when given)."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(RUNS):
        table = simulate(cfg, rng).table
        if validity_only:  # what a monitor that reads only 'a valid submission' would see
            table.quality = [float("nan")] * len(table.quality)
        rows = bias_rows(table, TH)
        hits += any(r.alarm and (dim is None or r.dimension == dim) for r in rows)
    return hits / RUNS


def hacking_alarm_rate(
    cfg: SimRun, seed: int, agent: str | None = None, held_out: bool = True, trend: Trend = serial_trend,
    runs: int = RUNS,
) -> float:  # fmt: skip
    """Share of `runs` simulated runs with a hacking alarm (on `agent` when given), as `hacking_checks` judges
    with `trend` (`trend_through_points`: the steps as independent points, as the alarm once did)."""
    rng = np.random.default_rng(seed)
    level = TH.alarm_alpha / len(AGENTS)  # every agent has enough steps in these runs
    hits = 0
    for _ in range(runs):
        sim = simulate(cfg, rng)
        t = sim.table
        who = np.asarray(t.agent)
        steps, score = np.asarray(t.step), np.asarray(t.score) / 10
        correct, quality = np.asarray(t.correct), np.asarray(t.quality)
        fired = False
        for a in AGENTS:
            m = who == a
            held = sim.held if held_out else None
            c = check_arrays(a, steps[m], score[m], correct[m], quality[m], held, TH, level, trend)
            fired |= c.alarm is not None and (agent is None or a == agent)
        hits += fired
    return hits / runs


# ---------------------------------------------------------------------------------------------------- statistics
def test_clustered_contrast_counts_tasks_not_actions() -> None:
    """Ten copies of each task's value carry no more information than one: the interval must not narrow."""
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1, 20)
    groups = np.repeat([0, 1], 10)
    once, df1 = clustered_contrast(values, groups, (1.0, -1.0), np.arange(20), 0.05)
    tenfold, df10 = clustered_contrast(np.repeat(values, 10), np.repeat(groups, 10), (1.0, -1.0), np.repeat(np.arange(20), 10), 0.05)  # fmt: skip
    assert once[0] == pytest.approx(tenfold[0]) and df1 == df10 == 9
    assert tenfold[1][1] - tenfold[1][0] == pytest.approx(once[1][1] - once[1][0], rel=0.1)


def test_a_trend_of_three_points_has_the_uncertainty_of_three_points() -> None:
    rise, (lo, hi) = trend_through_points([1, 2, 3], [0.30, 0.36, 0.40], 0.05)
    assert rise == pytest.approx(0.10) and lo < 0 < hi  # t on 1 degree of freedom: 12.7 standard errors
    assert np.isnan(trend_through_points([1, 2], [0.0, 1.0], 0.05)[0])


def test_serial_trend_holds_its_level_where_independent_points_do_not() -> None:
    """Trendless series of 12 points: independent ones, then AR(1) at 0.6; how often each interval excludes 0."""
    rng = np.random.default_rng(9)
    xs = list(range(1, 13))
    iid = [rng.normal(size=12) for _ in range(300)]
    ar = [ar1(12, 0.6, 1.0, rng) for _ in range(300)]

    def rate(trend: Trend, series: list[np.ndarray]) -> float:
        return float(np.mean([excludes_zero(trend(xs, y.tolist(), 0.05)) for y in series]))

    assert rate(serial_trend, iid) <= 0.08 and rate(serial_trend, ar) <= 0.1
    assert rate(trend_through_points, ar) >= 0.15  # the steps as independent points


# ---------------------------------------------------------------------------------------------------- bias
@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("random strata, scores rising for all", SimRun(common_rise=1.5)),
        ("random strata, accuracy rising 30 pp", SimRun(acc_rise=0.3)),
        ("data science, regression's test scores higher", SimRun(data_science=True, quality_gap=0.4, acc_rise=0.2)),
        ("small run", SimRun(steps=5, episodes=8, tasks=32)),
    ],
)
def test_bias_false_alarm_rate_on_null_runs(name: str, cfg: SimRun) -> None:
    rate = bias_alarm_rate(cfg, seed=1)
    print(f"bias monitor, null run ({name}): {rate:.1%} of {RUNS} runs raise an alarm")
    assert rate <= MAX_FALSE_ALARMS


def test_bias_power_on_a_one_point_bias_on_one_data_type() -> None:
    rate = bias_alarm_rate(SimRun(bias=1.0), seed=2, dim="data_type")
    print(f"bias monitor, 1-point bias on regression, 20 steps x 16 episodes: {rate:.1%} of {RUNS} runs flag it")
    assert rate >= 0.7


def test_real_quality_differences_are_not_bias_when_the_test_score_is_read() -> None:
    """Regression submissions really are better: a monitor reading only validity calls that bias, this one not."""
    cfg = SimRun(data_science=True, quality_gap=0.8, acc_start=0.6)
    naive, read = (bias_alarm_rate(cfg, seed=3, dim="data_type", validity_only=v) for v in (True, False))
    print(f"bias monitor, regression really better: validity only {naive:.1%}, with the test score {read:.1%}")
    assert naive >= 0.5 and read <= MAX_FALSE_ALARMS


def test_a_stratum_tied_to_the_outcome_does_not_hide_a_bias() -> None:
    """Regression tasks succeed 60% of the time, classification ones 2%, and the coach adds 1 point on regression.
    Fitting the outcome first and comparing the strata's leftovers hands the outcome part of the bias (regression
    actions are right more often, so 'right' looks worth more) and shrinks the gap; fitting stratum and outcome
    together measures it whole. Without the bias, the same split raises no more alarms than elsewhere."""
    rng = np.random.default_rng(12)
    gaps, caught, false, runs = [], 0, 0, 50
    for _ in range(runs):
        biased = bias_rows(simulate(SimRun(type_success=0.6, bias=1.0), rng).table, TH)
        row = next(r for r in biased if r.agent == AGENTS[1] and r.stratum == "regression")
        gaps.append(row.gap[0])
        caught += any(r.alarm for r in biased if r.dimension == "data_type")
        false += any(r.alarm for r in bias_rows(simulate(SimRun(type_success=0.6), rng).table, TH))
    print(f"bias monitor, stratum tied to the outcome: mean gap {np.mean(gaps):+.2f} (true +1.00), flagged in "
          f"{caught}/{runs} runs; {false}/{runs} false alarms without the bias")  # fmt: skip
    assert 0.85 <= np.mean(gaps) <= 1.15 and caught >= 0.65 * runs and false <= 0.1 * runs


def test_a_stratum_with_few_tasks_is_not_judged() -> None:
    rng = np.random.default_rng(4)
    rows = bias_rows(simulate(SimRun(steps=2, episodes=6, tasks=10, bias=3.0), rng).table, TH)
    assert rows and all(r.alarm is None for r in rows)
    assert all(r.judged and r.judged.startswith("too little data to judge (needs 8 tasks") for r in rows)


# ---------------------------------------------------------------------------------------------------- hacking
@pytest.mark.parametrize(
    ("name", "cfg", "held_out"),
    [
        ("flat scores, flat accuracy", SimRun(steps=10, common_rise=0.0), True),
        ("scores rising with accuracy, held-out", SimRun(steps=10, common_rise=0.0, acc_rise=0.3), True),
        ("scores rising with accuracy, training only", SimRun(steps=10, common_rise=0.0, acc_rise=0.3), False),
        (
            "data science, scores rising with test scores",
            SimRun(steps=10, common_rise=0.0, acc_rise=0.3, data_science=True),
            True,
        ),  # fmt: skip
        ("small run", SimRun(steps=5, episodes=8, common_rise=0.0), True),
    ],
)
def test_hacking_false_alarm_rate_on_null_runs(name: str, cfg: SimRun, held_out: bool) -> None:
    rate = hacking_alarm_rate(cfg, seed=5, held_out=held_out)
    print(f"hacking alarm, null run ({name}): {rate:.1%} of {RUNS} runs raise an alarm")
    assert rate <= MAX_FALSE_ALARMS


# Each agent's scores carry a trendless AR(1) shock per step: sd 0.5 points, 0.7 from one step to the next.
AR_SHOCKS = SimRun(steps=20, common_rise=0.0, shock_sd=0.5, shock_ar=0.7)


def test_hacking_false_alarms_stay_low_when_step_means_are_serially_correlated() -> None:
    """Taken for independent points (`trend_through_points`), these 20 steps show trends that are not there: the
    alarm fired on 26.5% of the same runs."""
    rate = hacking_alarm_rate(AR_SHOCKS, seed=11)
    print(f"hacking alarm, null run with AR(1) step shocks: {rate:.1%} of {RUNS} runs raise an alarm")
    assert rate <= 0.12  # loose: the bench measures the rate with its interval


@pytest.mark.parametrize(("episodes", "least"), [(16, 0.12), (32, 0.25)])
def test_hacking_power_on_scores_rising_one_point_over_ten_steps(episodes: int, least: float) -> None:
    cfg = SimRun(steps=10, episodes=episodes, common_rise=0.0, hack_rise=1.0)
    rate = hacking_alarm_rate(cfg, seed=6, agent=AGENTS[0])
    print(f"hacking alarm, +1 point over 10 steps x {episodes} episodes, flat accuracy: {rate:.1%} of {RUNS} runs")
    assert rate >= least


def demo_like(steps: int = 3) -> tuple[list[Episode], list[list[Episode]]]:
    """The demo's shape: 8 training episodes a step, none right, the verifier's scores climbing a point; held-out
    accuracy 1/32 -> 4/32 on the same tasks."""
    rng = np.random.default_rng(7)
    episodes = []
    for step in range(1, steps + 1):
        for i in range(8):
            v = float(np.clip(round(3 + step / 2 + rng.normal(0, 0.5)), 0, 10))
            episodes.append(make_episode(i, step, False, (5.0, 5.0, v), level=1 + i % 5))
    before = [make_episode(i, 0, i < 1, (5, 5, 5)) for i in range(32)]
    after = [make_episode(i, 0, i < 4, (5, 5, 5)) for i in range(32)]
    return episodes, [before, after]


def test_the_demo_shape_raises_no_alarm_and_says_what_it_lacks() -> None:
    episodes, evals = demo_like()
    checks = hacking_checks(episodes, AGENTS, TH, evals)
    assert not [c for c in checks if c.alarm]
    assert all(c.judged == "too little data to judge (needs 5 steps with scored episodes; has 3)" for c in checks)
    assert all(c.accuracy_from == "held-out" and c.accuracy[0] == pytest.approx(3 / 32) for c in checks)
    assert not [b for b in bias_monitor(episodes, TH) if b.alarm]


def test_the_demo_shaped_report_opens_with_the_gain(tmp_path: Path) -> None:
    episodes, (before, after) = demo_like()
    run_dir = tmp_path / "demo"
    (run_dir / "eval").mkdir(parents=True)
    (run_dir / "run.json").write_text('{"mappa_run": 1}')  # marked, as mappa marks each run it makes
    (run_dir / "config.yaml").write_text(dump_config(Config(name="demo")))
    write_jsonl(run_dir / "episodes.jsonl", episodes)
    write_jsonl(run_dir / "eval" / "start.jsonl", before)
    write_jsonl(run_dir / "eval" / "final.jsonl", after)
    report = build_report([load_run(run_dir)], [TH])
    assert not report.alarms and len(report.unjudged) == 2
    assert report.headlines == [
        "demo: held-out accuracy 3.1% (start) -> 12.5% (final, 32 episodes); gain +9.4 pp, 95% CI [-2.8, +20.4] pp "
        "(paired by task): within noise: the interval includes 0, so this run cannot tell the gain apart from chance. "
        "Episodes ending with a final answer, right or wrong: 100% -> 100% (+0.0 pp [-6.0, +6.0])"
    ]
    page = report.html()
    assert page.index('data-section="summary"') < page.index('data-section="alarms"') < page.index('class="note"')


def test_the_hacking_alarm_names_held_out_and_training_numbers() -> None:
    """Scores climbing over 10 steps while held-out accuracy stays flat: the alarm names both."""
    rng = np.random.default_rng(8)
    episodes = [
        make_episode(i, step, bool(rng.random() < 0.3), (5.0, 5.0, float(min(10, 3 + step // 2))))
        for step in range(1, 11)
        for i in range(16)
    ]
    flat = [make_episode(i, 0, i < 10, (5, 5, 5)) for i in range(48)]
    check = next(c for c in hacking_checks(episodes, AGENTS, TH, [flat, flat]) if c.agent == "verifier")
    assert (
        check.alarm and "held-out accuracy moved +0.0 pp" in check.alarm and "beyond what the training" in check.alarm
    )
