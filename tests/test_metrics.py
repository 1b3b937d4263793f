"""The one episode summary, and the intervals that tell a gain from noise (checked against published values)."""

from __future__ import annotations

import math

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
    # Same 40 tasks twice: 10 improved, 2 worsened. Agresti-Min by hand: cells + 0.5 over 42,
    # 10.5/42 - 2.5/42 = 0.1905 +- 1.96 * sqrt((13/42 - 0.1905^2) / 42) = 0.0323 .. 0.3486
    before = [True] * 12 + [False] * 28
    after = [True] * 10 + [False] * 2 + [True] * 10 + [False] * 18
    g = accuracy_gain(episodes(before), episodes(after))
    assert g.paired and (g.improved, g.worsened) == (10, 2) and g.gain == pytest.approx(0.2)
    assert g.gain_ci == pytest.approx((0.0323, 0.3486), abs=1e-4) and g.significant
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
