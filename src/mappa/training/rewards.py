"""Per-action rewards: the score each action trains with, and which actions train at all (method.md 2, 7).

Two reward modes, one pure step after the episodes are over:
  - "coach": each action's own coach score in [0, 10] (per-action process rewards, the method);
  - "outcome": every action of an episode gets 10 when the episode's final answer passes the rule-based
    check, else 0 (the paper's outcome-only baseline). A live coach cannot give this to the agents that act
    before the final one, since the outcome is not known yet when they are scored; here it is.
The trainer picks the mode from `coach.backend` (`outcome` selects the baseline; its live per-stage scores
are then only a record).

An action leaves the training batch, counted by reason, when it
  - is empty (no response tokens: nothing to put a gradient on);
  - ran code that hit a sandbox infra_error (the infrastructure failed, not the agent: never blamed);
  - was cut off by the token cap, with `train.drop_truncated` (its last token is not its decision);
  - has no score and `coach.on_unscored: skip` (nothing invents a reward; `neutral` gives it 5). Only the
    coach's own failures leave an action without a score: one whose own content the coach could not judge
    is judged on a cut of its evidence or scored 0 (`mappa.coach.judge`), never better off than one judged bad.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from mappa.errors import MappaError
from mappa.types import Action, Episode

RewardMode = Literal["coach", "outcome"]
DROP_REASONS = ("empty", "infra_error", "truncated", "unscored")
# What an unscored action trains with under `coach.on_unscored: neutral`, an explicit choice, never a default.
NEUTRAL_SCORE = 5.0


def reward_mode(coach_backend: str) -> RewardMode:
    """The reward mode a coach backend implies: the `outcome` backend is the outcome-only baseline."""
    return "outcome" if coach_backend == "outcome" else "coach"


def per_action_scores(
    episodes: Sequence[Episode], mode: RewardMode, outcome_weight: float = 0.0
) -> list[list[float | None]]:
    """scores[i][j] in [0, 10] for action j of episode i; None = unscored (unknown outcome, no coach score).

    `outcome_weight` w (`coach.outcome_weight`, coach mode): each scored action's score becomes
    (1 - w) * score + w * outcome, the outcome 10 or 0 by the episode's rule-based check; an episode whose outcome
    is unknown keeps its coach scores as they are (nothing is invented for the missing half)."""
    if mode not in ("coach", "outcome"):
        raise MappaError(f"reward mode {mode!r}: expected 'coach' or 'outcome'")
    if not 0.0 <= outcome_weight <= 1.0:
        raise MappaError(f"coach.outcome_weight: {outcome_weight:g} is outside 0-1")
    out: list[list[float | None]] = []
    for ep in episodes:
        outcome = None if ep.correct is None else (10.0 if ep.correct else 0.0)
        if mode == "outcome":
            out.append([outcome] * len(ep.actions))
            continue
        row = [a.coach.score if a.coach is not None else None for a in ep.actions]
        if outcome_weight and outcome is not None:
            row = [None if s is None else (1 - outcome_weight) * s + outcome_weight * outcome for s in row]
        out.append(row)
    return out


def _drop_reason(action: Action, score: float | None, on_unscored: str, drop_truncated: bool) -> str | None:
    if not action.response_ids:
        return "empty"
    if action.exec_result is not None and action.exec_result.infra_error:
        return "infra_error"
    if drop_truncated and action.truncated:
        return "truncated"
    if score is None and on_unscored == "skip":
        return "unscored"
    return None


def select_actions(
    episodes: Sequence[Episode],
    scores: Sequence[Sequence[float | None]],
    agents: Sequence[str],
    on_unscored: str,
    drop_truncated: bool,
) -> tuple[list[Action], list[float], dict[str, int]]:
    """The trainable actions of `agents`, their scores in [0, 10], and how many were dropped for each reason."""
    kept: list[Action] = []
    kept_scores: list[float] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for ep, ep_scores in zip(episodes, scores, strict=True):
        for action, score in zip(ep.actions, ep_scores, strict=True):
            if action.agent not in agents:
                continue
            why = _drop_reason(action, score, on_unscored, drop_truncated)
            if why is not None:
                dropped[why] += 1
                continue
            kept.append(action)
            kept_scores.append(NEUTRAL_SCORE if score is None else score)
    return kept, kept_scores, dropped


def untrained_groups(metrics: Mapping[str, float]) -> dict[str, dict[str, int]]:
    """The update groups that trained on no action in one step's row of metrics.jsonl (`agent/<g>/actions_trained`
    0), each with its actions left out by reason (`agent/<g>/dropped_<why>`): why a step moved none of its weights.
    For a run's files (`mappa report`); a live run reads its typed results (`mappa.training.update.GroupResult`)."""
    out: dict[str, dict[str, int]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "agent" and parts[2] == "actions_trained" and value == 0:
            group = parts[1]
            out[group] = {why: int(metrics.get(f"agent/{group}/dropped_{why}", 0)) for why in DROP_REASONS}
    return out


def alike_groups(metrics: Mapping[str, float]) -> list[str]:
    """The update groups that kept actions in one step's row of metrics.jsonl but took no optimizer step: the coach
    scored them alike, so there was nothing to learn from (`mappa.training.update.scores_differ`)."""
    return [
        key.split("/")[1]
        for key, value in metrics.items()
        if key.startswith("agent/") and key.endswith("/optimizer_steps") and value == 0
        and metrics.get(key.replace("/optimizer_steps", "/actions_trained"), 0) > 0
    ]  # fmt: skip


def no_training_reason(dropped: Mapping[str, int], max_new_tokens: int | None = None) -> str:
    """Why a group trained on no action, from its drop counts: "6 of 6 cut off at generation.max_new_tokens=128
    (train.drop_truncated)", each reason with the setting that drops it, so the fix is named with the cause."""
    total = sum(dropped.values())
    if not total:
        return "it played no action"
    cap = f"generation.max_new_tokens={max_new_tokens}" if max_new_tokens is not None else "the token cap"
    phrases = {
        "truncated": f"cut off at {cap} (train.drop_truncated)",
        "empty": "empty (no response tokens)",
        "infra_error": "hit a sandbox infrastructure error",
        "unscored": "unscored by the coach (coach.on_unscored: skip)",
    }
    ranked = sorted((why for why, n in dropped.items() if n), key=lambda why: -dropped[why])  # main cause first
    return ", ".join(f"{dropped[why]} of {total} {phrases.get(why, why)}" for why in ranked)
