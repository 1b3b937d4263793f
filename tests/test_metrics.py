"""The one episode summary, and the intervals that tell a gain from noise (checked against published values)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mappa.metrics import accuracy_gain, answered, episode_metrics, sources, wilson_interval
from mappa.types import Action, CoachScore, Episode, ExecResult, Task


def task(i: int, source: str = "arithmetic") -> Task:
    return Task(id=f"{source}-{i}", problem=f"p{i}", answer="1", source=source)


def act(agent: str, n: int, *, res: ExecResult | None = None, trunc: bool = False, score: float | None = None):
    coach = CoachScore(score=score) if score is not None else None
    return Action(agent=agent, turn=0, messages=(), text="", response_ids=tuple(range(n)), truncated=trunc,
                  exec_result=res, coach=coach)  # fmt: skip


def test_episode_metrics_pooled_per_source_per_agent() -> None:
    ok = ExecResult(ok=True, stdout="1", duration_s=0.5)
    bad = ExecResult(ok=False, stderr="Traceback", exit_code=1, duration_s=1.5, timed_out=True)
    e1 = Episode(
        id="1",
        workflow="w",
        task=task(1, "aime2025"),
        final_answer="1",
        correct=True,
        actions=(act("s", 10, score=4), act("c", 20, res=ok), act("c", 30, res=bad, trunc=True), act("v", 5)),
    )
    e2 = Episode(
        id="2",
        workflow="w",
        task=task(2, "amc"),
        actions=(act("s", 30, score=8), act("c", 2)),
        correct=False,
        meta={"error": "prompt too long"},
    )
    e3 = Episode(id="3", workflow="w", task=task(3, "amc"), actions=(), correct=True, final_answer="1")  # fmt: skip
    m = episode_metrics([e1, e2, e3], ["s", "c", "v"], "eval")
    assert m["eval/accuracy"] == pytest.approx(2 / 3) and m["eval/episodes"] == 3
    assert m["eval/answered_rate"] == pytest.approx(2 / 3) and m["eval/stopped_rate"] == pytest.approx(1 / 3)
    assert m["eval/aime2025/accuracy"] == 1.0 and m["eval/aime2025/episodes"] == 1
    assert m["eval/amc/accuracy"] == 0.5 and m["eval/amc/episodes"] == 2
    assert sources(m, "eval") == ["aime2025", "amc"]
    assert m["eval/sandbox/runs"] == 2 and m["eval/sandbox/time_s"] == 2.0
    assert m["eval/sandbox/error_rate"] == 0.5 and m["eval/sandbox/timeout_rate"] == 0.5
    assert m["eval/s/response_tokens"] == 20 and m["eval/s/score_mean"] == 6 and m["eval/s/scored"] == 2
    assert m["eval/c/tool_use_rate"] == pytest.approx(2 / 3) and m["eval/c/code_error_rate"] == 0.5
    assert m["eval/c/truncation_rate"] == pytest.approx(1 / 3) and m["eval/c/actions_per_episode"] == 1.0
    assert math.isnan(m["eval/v/score_mean"]) and m["eval/v/scored"] == 0


def test_tabular_success_is_its_own_rate_beside_the_valid_rate() -> None:
    """A success (better than every trivial prediction) drives the accuracy; the paper's valid rate stays beside
    it. Episodes recorded before the success rule carry no `success`: no success rate is made up for them."""

    def tabular(i: int, valid: bool, success: bool | None) -> Episode:
        sub = {"valid": valid, "gap": 0.5 if valid else 0.0, "reference_fraction": 1.0 if valid else 0.0}
        sub |= {} if success is None else {"success": success}
        t = Task(id=f"t{i}", problem="", answer="", source="dsbench", meta={"data_type": "regression"})
        return Episode(id=str(i), workflow="ds_pipeline", task=t, correct=bool(success), meta={"submission": sub})

    m = episode_metrics([tabular(1, True, True), tabular(2, True, False), tabular(3, False, False)], [], "eval")
    assert m["eval/accuracy"] == pytest.approx(1 / 3) and m["eval/tabular/success_rate"] == pytest.approx(1 / 3)
    assert m["eval/tabular/valid_rate"] == pytest.approx(2 / 3)  # a sample copy is valid and no success
    assert m["eval/tabular/regression/success_rate"] == pytest.approx(1 / 3)
    old = episode_metrics([tabular(1, True, None), tabular(2, False, None)], [], "eval")
    assert "eval/tabular/success_rate" not in old and old["eval/tabular/valid_rate"] == 0.5


def test_episode_metrics_of_nothing_is_zeros_not_an_error() -> None:
    m = episode_metrics([], ["s"], "train")
    assert m["train/accuracy"] == 0.0 and m["train/s/actions"] == 0.0 and sources(m, "train") == []


def test_wilson_interval_published_values() -> None:
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    # Newcombe (1998) example: 81/263 -> 0.2553 to 0.3662
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def episodes(outcomes: list[bool], n_tasks: int | None = None) -> list[Episode]:
    n = n_tasks or len(outcomes)
    return [Episode(id=str(i), workflow="w", task=task(i % n), correct=c) for i, c in enumerate(outcomes)]


def test_unpaired_gain_matches_newcombes_hybrid_score_interval() -> None:
    # Newcombe (1998), unpaired example: 56/70 - 48/80 = 0.2, method 10 interval 0.0524 to 0.3339
    before = episodes([True] * 48 + [False] * 32)
    after = episodes([True] * 56 + [False] * 14)
    g = accuracy_gain(before, after)
    assert not g.paired and g.gain == pytest.approx(0.2)
    assert g.gain_ci == pytest.approx((0.0524, 0.3339), abs=1e-4) and g.significant


def test_paired_gain_uses_the_pairing_and_counts_changes() -> None:
    # Same 40 tasks twice, one sample each: 10 improved, 2 worsened. Agresti-Min by hand with t on 39 degrees of
    # freedom: cells + 0.5 over 42, 10.5/42 - 2.5/42 = 0.1905 +- 2.0227 * sqrt((13/42 - 0.1905^2) / 42),
    # 0.0273 .. 0.3536
    before = [True] * 12 + [False] * 28
    after = [True] * 10 + [False] * 2 + [True] * 10 + [False] * 18
    g = accuracy_gain(episodes(before), episodes(after))
    assert g.paired and (g.improved, g.worsened) == (10, 2) and g.gain == pytest.approx(0.2)
    assert g.gain_ci == pytest.approx((0.0273, 0.3536), abs=1e-4) and g.significant
    assert g.before_ci == pytest.approx(wilson_interval(12, 40)) and g.after_ci == pytest.approx(
        wilson_interval(20, 40)
    )
    # the same accuracies on other tasks (no pairing): wider, since here the tasks that stayed the same add no noise
    other = [Episode(id=str(i), workflow="w", task=task(100 + i), correct=c) for i, c in enumerate(after)]
    unpaired = accuracy_gain(episodes(before), other)
    assert not unpaired.paired and unpaired.gain == pytest.approx(0.2)
    assert unpaired.gain_ci[1] - unpaired.gain_ci[0] > g.gain_ci[1] - g.gain_ci[0]


def test_no_change_is_within_noise() -> None:
    same = [True, False] * 8
    g = accuracy_gain(episodes(same), episodes(same))
    assert g.gain == 0 and g.gain_ci[0] < 0 < g.gain_ci[1] and not g.significant
    small = accuracy_gain(episodes([False] * 16), episodes([True] * 2 + [False] * 14))  # +12.5 pp on 16 tasks
    assert not small.significant


def test_the_answered_share_is_paired_like_accuracy() -> None:
    # 8 tasks: 2 answered before (1 right), 7 answered after (1 right): accuracy flat, the format moved.
    def run(answers: list[str | None]) -> list[Episode]:
        return [
            Episode(id=str(i), workflow="w", task=task(i), final_answer=a, correct=a == "1")
            for i, a in enumerate(answers)
        ]

    before = run(["1", "7", None, None, None, None, None, None])
    after = run(["1", "7", "3", "4", "5", "6", "8", None])
    assert accuracy_gain(before, after).gain == 0
    g = accuracy_gain(before, after, answered)
    assert g.paired and (g.improved, g.worsened) == (5, 0)
    assert (g.before, g.after) == (pytest.approx(0.25), pytest.approx(0.875)) and g.significant


# ---------------------------------------------------------------------------------------------------- clusters
def samples(outcomes: list[list[bool]], first: int = 0) -> list[Episode]:
    """One episode per sample: outcomes[t] are the samples of task t."""
    return [
        Episode(id=f"{t}-{j}", workflow="w", task=task(first + t), correct=c)
        for t, row in enumerate(outcomes)
        for j, c in enumerate(row)
    ]


def test_repeated_samples_of_a_task_do_not_narrow_the_gain() -> None:
    """Each sample copied 4 times is the same evidence about the same tasks: every interval stays as it was."""
    rng = np.random.default_rng(0)
    before = [[bool(rng.random() < 0.3)] for _ in range(24)]
    after = [[bool(rng.random() < 0.5)] for _ in range(24)]
    once = accuracy_gain(samples(before), samples(after))
    four = accuracy_gain(samples([r * 4 for r in before]), samples([r * 4 for r in after]))
    assert four.gain == pytest.approx(once.gain) and four.paired and four.tasks == once.tasks == 24
    for a, b in ((once.gain_ci, four.gain_ci), (once.before_ci, four.before_ci), (once.after_ci, four.after_ci)):
        assert b == pytest.approx(a)
    # unpaired (the after evaluation on other tasks): the same, through Newcombe on task-clustered intervals
    other = accuracy_gain(samples(before), samples(after, first=100))
    other4 = accuracy_gain(samples([r * 4 for r in before]), samples([r * 4 for r in after], first=100))
    assert not other.paired and other4.gain_ci == pytest.approx(other.gain_ci)


def test_clustered_gain_by_hand() -> None:
    # 5 tasks x 2 samples; per-task differences in share right d = +1, +1/2, +1/2, 0, -1/2 (sum 3/2, sum d^2 7/4).
    # Agresti-Min's adjustment adds half a task at +1, half at -1 and one at 0: N = 7, centre 1.5/7 = 0.214286,
    # variance (7/4 + 1)/7 - 0.214286^2 = 0.346939, se sqrt(0.346939/7) = 0.222627, t(4 df) 2.776445:
    # 0.214286 -+ 0.618111 = -0.403825 .. 0.832397. The gain itself is the mean difference, 0.3.
    before = [[False, False], [False, True], [False, False], [True, False], [True, True]]
    after = [[True, True], [True, True], [True, False], [False, True], [True, False]]
    g = accuracy_gain(samples(before), samples(after))
    assert g.paired and g.tasks == 5 and (g.improved, g.worsened) == (3, 1)
    assert (g.before, g.after, g.gain) == (pytest.approx(0.4), pytest.approx(0.7), pytest.approx(0.3))
    assert g.gain_ci == pytest.approx((-0.403825, 0.832397), abs=1e-6) and not g.significant
    # each accuracy: Wilson at the tasks' effective count p(1-p) / (sum_t (share_t - p)^2 / T^2); before:
    # shares 0, 1/2, 0, 1/2, 1 around 0.4: 0.70 / 25 = 0.028, so 0.24 / 0.028 = 8.57 effective samples of 10
    n_eff = 0.24 / 0.028
    assert g.before_ci == pytest.approx(wilson_interval(0.4 * n_eff, n_eff))


def test_the_paired_interval_covers_task_dependent_gains() -> None:
    """Training that helps some tasks and hurts others, 4 samples per task: the samples of one task are not
    independent evidence, and an interval that treats them so misses the true gain far more than 5% of the time."""
    rng = np.random.default_rng(1)
    hits, reps, tasks, k = 0, 200, 16, 4
    pop = rng.normal(-0.85, 1.5, 400_000)  # the population of tasks: its mean gain is what the interval is for
    truth = float(np.mean(1 / (1 + np.exp(-pop - rng.normal(0.0, 3.0, pop.size))) - 1 / (1 + np.exp(-pop))))
    for _ in range(reps):
        base = rng.normal(-0.85, 1.5, tasks)
        p0, p1 = 1 / (1 + np.exp(-base)), 1 / (1 + np.exp(-base - rng.normal(0.0, 3.0, tasks)))
        b = [list(rng.random(k) < p) for p in p0]
        a = [list(rng.random(k) < p) for p in p1]
        lo, hi = accuracy_gain(samples(b), samples(a)).gain_ci
        hits += lo <= truth <= hi
    assert hits / reps >= 0.92
