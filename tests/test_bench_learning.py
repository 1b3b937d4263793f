"""bench/bench_learning.py: the pilot sizes the benchmark by a power calculation, the main seeds give the held-out
gain with a t interval over seeds, the arms reuse the main runs, and finished runs are never trained again.
Training is replaced by run directories whose start and final accuracies are set exactly; the end-to-end run on a
tiny model is the slow test at the bottom."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import ROOT, make_episode, write_run

from mappa.types import Action

pytestmark = pytest.mark.integration

TASKS = 20


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "bench" / "bench_learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_episodes(start: int, final: int) -> list:
    """Start evaluation (step 1) with `start` right answers, final (step 2) with `final`, on the same TASKS tasks."""
    return [
        make_episode(i, step, i < k, (5.0, 5.0, 5.0)) for step, k in ((1, start), (2, final)) for i in range(TASKS)
    ]


def fake_training(bench, monkeypatch: pytest.MonkeyPatch, gains: dict[str, dict[int, tuple[int, int]]]) -> list:
    """`train_arm` writes a finished run with the (start, final) right answers given per arm and seed, and records
    each call; a run already there is reused, as the real one does."""
    calls: list = []

    def train_arm(config: str, run_dir: Path, overrides: list[str]) -> float:
        if (run_dir / "eval" / "final.jsonl").is_file():
            return 0.0
        seed = int(next(o for o in overrides if o.startswith("seed=")).split("=")[1])
        arm = run_dir.name.split("-seed")[0]
        calls.append((arm, seed, tuple(overrides)))
        write_run(run_dir, run_episodes(*gains[arm][seed]), seed=seed)
        return 1.0

    monkeypatch.setattr(bench.pvo, "train_arm", train_arm)
    monkeypatch.setattr(bench.pvo, "run_analysis", lambda *a: None)
    return calls


def test_power_needs_more_seeds_for_a_smaller_or_noisier_gain(bench) -> None:
    def pilot(per_seed: list[float], start: float = 0.0, final: float = 0.4, tasks: int = 32) -> dict:
        return {"accuracy": {"per_seed": per_seed, "start": start, "final": final}, "tasks_per_seed": tasks}

    big = bench.power(pilot([0.40, 0.45]))
    assert big["seeds"] == bench.MIN_SEEDS and big["power"] >= 0.8  # a large, steady gain: the floor of 5 seeds
    small = bench.power(pilot([0.05, 0.15], final=0.1))
    noisy = bench.power(pilot([0.40, -0.10]))
    assert small["seeds"] is None or small["seeds"] > big["seeds"]
    assert noisy["seeds"] is None or noisy["seeds"] > big["seeds"]
    # two pilot seeds that agree exactly have no spread: the binomial floor stands in, the plan is not a free lunch
    same = bench.power(pilot([0.10, 0.10], final=0.1))
    assert same["sample_sd"] == 0 and same["sd"] == pytest.approx(same["sd_floor"]) and same["sd"] > 0
    assert same["sd_floor"] == pytest.approx((0.1 * 0.9 / 32) ** 0.5)


def test_pilot_sizes_the_main_run_and_the_arms_reuse_it(
    bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    steady = {s: (0, 8 + s % 3) for s in range(1, 200)}  # +40-50 pp a seed
    calls = fake_training(bench, monkeypatch, {"process": steady, "outcome": {s: (0, 0) for s in steady}})
    summary = bench.main(["--out", str(tmp_path), "--arms", "process,outcome", "--set", "train.lr=1e-4"])
    out = capsys.readouterr().out
    pilot_seeds = [s for arm, s, _ in calls if s >= bench.PILOT_FIRST]
    main_seeds = [s for arm, s, _ in calls if arm == "process" and s < bench.PILOT_FIRST]
    assert pilot_seeds == [101, 102] and main_seeds == list(range(1, summary["power"]["seeds"] + 1))
    assert summary["power"]["seeds"] == bench.MIN_SEEDS  # a steady +40 pp gain needs no more than the minimum
    assert all("train.lr=1e-4" in o and "model.name=qwen2.5-coder-0.5b-instruct" in o for _, _, o in calls)
    assert [s for arm, s, o in calls if arm == "outcome"] == main_seeds  # same seeds, outcome rewards
    assert all("coach.backend=outcome" in o for arm, _, o in calls if arm == "outcome")
    acc = summary["main"]["accuracy"]
    assert acc["start"] == 0 and acc["gain"] == pytest.approx(sum(8 + s % 3 for s in main_seeds) / 5 / TASKS)
    assert acc["ci_over_seeds"][0] > 0 and "beyond noise" in out and "pilot accuracy" in out
    assert summary["arms"]["gaps"]["process-outcome"]["gain"] == pytest.approx(acc["gain"])
    assert json.loads((tmp_path / "summary.json").read_text())["main"]["hours"]["runs"] == 5
    n = len(calls)
    again = bench.main(["--out", str(tmp_path), "--arms", "process,outcome", "--set", "train.lr=1e-4"])
    assert len(calls) == n and again["main"]["accuracy"] == summary["main"]["accuracy"]  # nothing trained again


def test_arms_on_fewer_seeds_say_the_smallest_difference_they_can_find(
    bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gains = {s: (0, s % 4) for s in range(1, 200)}  # gains of 0-15 pp a seed: a spread to size the arms by
    calls = fake_training(bench, monkeypatch, {"process": gains, "shared": {s: (0, 1) for s in gains}})
    summary = bench.main(["--out", str(tmp_path), "--seeds", "6", "--arms", "process,shared", "--arm-seeds", "3"])
    assert [s for arm, s, _ in calls if arm == "process"] == [101, 102, 1, 2, 3, 4, 5, 6]
    assert [s for arm, s, _ in calls if arm == "shared"] == [1, 2, 3]  # the arms on the first three main seeds
    assert all("model.agent_weights=shared" in o for arm, _, o in calls if arm == "shared")
    plan = summary["arms_power"]
    per_seed = summary["main"]["accuracy"]["per_seed"]
    mean = sum(per_seed) / 6
    assert plan["difference_sd"] == pytest.approx((2 * sum((g - mean) ** 2 for g in per_seed) / 5) ** 0.5)
    d = plan["detectable"]  # the smallest difference found with 80% power, to the nearest 0.1 pp
    assert (
        bench.paired_t_power(d, plan["difference_sd"], 3)
        >= 0.8
        > bench.paired_t_power(d - 0.001, plan["difference_sd"], 3)
    )
    assert bench.arms_power(summary["main"], 12)["detectable"] < d  # more seeds find a smaller difference
    assert f"{d * 100:.1f} pp or more is found with 80% power" in capsys.readouterr().out
    assert summary["arms"]["gaps"]["process-shared"]["gain"] == pytest.approx(
        sum(s % 4 - 1 for s in (1, 2, 3)) / 3 / TASKS
    )


def test_a_gain_within_noise_is_called_so(
    bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    up_and_down = {1: (5, 9), 2: (5, 2), 3: (5, 6), 4: (5, 3), 5: (5, 8), 101: (5, 7), 102: (5, 4)}
    fake_training(bench, monkeypatch, {"process": up_and_down})
    summary = bench.main(["--out", str(tmp_path), "--seeds", "5"])
    lo, hi = summary["main"]["accuracy"]["ci_over_seeds"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  main accuracy"))
    assert lo < 0 < hi and line.endswith("within noise")


def test_so_far_summarises_the_finished_main_seeds_and_trains_nothing(
    bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gains = {101: (0, 9), 102: (0, 8), 1: (0, 10), 2: (0, 6), 3: (1, 9)}
    calls = fake_training(bench, monkeypatch, {"process": gains})
    with pytest.raises(SystemExit, match="the pilot has not finished"):
        bench.main(["--so-far", "--out", str(tmp_path)])
    for s in (101, 102, 1, 2, 3):  # as a benchmark stopped during seed 4 leaves them
        d = tmp_path / ("pilot" if s > 100 else "") / f"process-seed{s}"
        bench.pvo.train_arm("", d, [f"seed={s}"])
        (d.parent / f"{d.name}.time.json").write_text('{"wall_s": 600, "cpu_s": 1100}')
    (tmp_path / "process-seed4").mkdir()  # started, not finished
    n = len(calls)
    summary = bench.main(["--so-far", "--out", str(tmp_path)])
    assert len(calls) == n and summary["interim"] and summary["planned_seeds"] == bench.MIN_SEEDS
    assert summary["main"]["seeds"] == [1, 2, 3] and summary["main"]["hours"]["cpu_h"] == pytest.approx(
        3 * 1100 / 3600
    )
    assert summary["main"]["accuracy"]["per_seed"] == pytest.approx([10 / TASKS, 6 / TASKS, 8 / TASKS])
    assert "interim: 3 of 5 planned main seeds" in capsys.readouterr().out and (tmp_path / "interim.json").is_file()
    assert not (tmp_path / "summary.json").exists()


def test_quick_runs_two_seeds_on_fewer_tasks_without_a_pilot(bench, tmp_path: Path, monkeypatch) -> None:
    calls = fake_training(bench, monkeypatch, {"process": {1: (0, 6), 2: (1, 5)}})
    summary = bench.main(["--quick", "--out", str(tmp_path)])
    assert [s for _, s, _ in calls] == [1, 2] and all("tasks.arithmetic_eval_size=16" in o for *_, o in calls)
    assert summary["quick"]["accuracy"]["per_seed"] == pytest.approx([6 / TASKS, 4 / TASKS])
    assert "pilot" not in summary and (tmp_path / "quick" / "summary.json").is_file()


def test_bad_arms_and_settings_fail_before_training(bench, tmp_path: Path, monkeypatch) -> None:
    calls = fake_training(bench, monkeypatch, {})
    with pytest.raises(SystemExit, match="unknown arm"):
        bench.main(["--out", str(tmp_path), "--arms", "process,coached"])
    for bad in (["--arm-seeds", "3"], ["--arms", "process,outcome", "--arm-seeds", "1"]):
        with pytest.raises(SystemExit, match="--arm-seeds .*needs --arms and at least 2 seeds"):
            bench.main(["--out", str(tmp_path), *bad])
    with pytest.raises(Exception, match="no_such_key"):
        bench.main(["--out", str(tmp_path), "--set", "train.no_such_key=1"])
    assert calls == []


def test_right_number_reads_the_final_replys_last_number(bench) -> None:
    ep = make_episode(0, 1, False, (5.0, 5.0, 5.0))  # gold 7

    def said(text: str) -> bool:
        last = Action(**{**ep.actions[-1].model_dump(), "text": text})
        return bench.right_number(ep.model_copy(update={"actions": (*ep.actions[:-1], last)}))

    assert said("7") and said("It is 3 + 4 = 7.") and said("The answer is 7")
    assert not said("7 or maybe 8") and not said("no number") and not said("17")


@pytest.mark.slow  # two tiny training runs end to end: about a minute
def test_quick_on_a_tiny_model(bench, tmp_path: Path) -> None:
    from helpers import TINY

    sets = [*TINY, "train.prompts_per_step=2", "train.samples_per_prompt=1", "train.drop_truncated=false"]
    args = ["--quick", "--setting", "smollm-demo", "--eval-size", "3", "--out", str(tmp_path)]
    summary = bench.main([*args, *(x for o in [*sets, "train.steps=1"] for x in ("--set", o))])
    acc = summary["quick"]["accuracy"]
    assert summary["quick"]["tasks_per_seed"] == 3 and len(acc["per_seed"]) == 2 and summary["hours"]["cpu_h"] > 0
