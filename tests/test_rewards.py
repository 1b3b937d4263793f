"""Per-action rewards: coach scores or the outcome baseline, and which actions train (and why not)."""

from __future__ import annotations

import pytest

from mappa.errors import MappaError
from mappa.training.rewards import per_action_scores, reward_mode, select_actions
from mappa.types import Action, CoachScore, Episode, ExecResult, Task

TASK = Task(id="t", problem="2+3", answer="5", source="arithmetic")


def act(agent: str, score: float | None, *, coach: bool = True, **kw) -> Action:
    return Action(
        agent=agent, turn=0, messages=(), text="x", response_ids=kw.pop("response_ids", (1, 2)),
        logprobs=(-1.0, -1.0), coach=CoachScore(score=score) if coach else None, **kw,
    )  # fmt: skip


def episode(correct: bool | None, *actions: Action) -> Episode:
    return Episode(id="e", workflow="mathchat", task=TASK, actions=actions, correct=correct)


def test_coach_mode_reads_each_actions_own_score() -> None:
    ep = episode(False, act("s", 7.0), act("c", None), act("v", 2.5, coach=False))
    assert per_action_scores([ep], "coach") == [[7.0, None, None]]


def test_outcome_mode_gives_every_action_the_episodes_result() -> None:
    # The live coach could not know the outcome for the early agents (None); the reward step does.
    actions = (act("s", None), act("c", 3.0), act("v", 10.0))
    good, bad, unknown = episode(True, *actions), episode(False, *actions), episode(None, *actions)
    assert per_action_scores([good, bad, unknown], "outcome") == [[10.0] * 3, [0.0] * 3, [None] * 3]
    assert per_action_scores([], "outcome") == []


def test_reward_mode_follows_the_coach_backend_and_rejects_unknown_modes() -> None:
    assert reward_mode("outcome") == "outcome"
    assert {reward_mode(b) for b in ("rubric", "openai", "local")} == {"coach"}
    with pytest.raises(MappaError, match="reward mode"):
        per_action_scores([], "process")  # type: ignore[arg-type]


def test_select_actions_drops_what_must_not_train_and_counts_why() -> None:
    ep = episode(
        True,
        act("coder", 7.0),
        act("coder", None),  # unscored
        act("coder", 9.0, truncated=True),
        act("coder", 8.0, exec_result=ExecResult(ok=False, infra_error="pool died")),
        act("solver", 2.0),  # another agent's action
        act("coder", 4.0, response_ids=()),  # empty
    )
    kept, scores, dropped = select_actions([ep], per_action_scores([ep], "coach"), ["coder"], "skip", True)
    assert scores == [7.0] and all(a.agent == "coder" for a in kept)
    assert dropped == {"empty": 1, "infra_error": 1, "truncated": 1, "unscored": 1}
    _, scores, _ = select_actions([ep], per_action_scores([ep], "coach"), ["coder"], "neutral", False)
    assert scores == [7.0, 5.0, 9.0]
    # outcome mode: the same filters, every kept action scored with the episode's 10
    _, scores, dropped = select_actions([ep], per_action_scores([ep], "outcome"), ["coder", "solver"], "skip", True)
    assert scores == [10.0, 10.0, 10.0] and dropped["unscored"] == 0


def test_shared_group_selects_all_its_agents() -> None:
    ep = episode(False, act("s", 1.0), act("c", 2.0), act("v", 3.0))
    kept, scores, _ = select_actions([ep], per_action_scores([ep], "coach"), ["s", "c", "v"], "skip", True)
    assert [a.agent for a in kept] == ["s", "c", "v"] and scores == [1.0, 2.0, 3.0]
