"""The `outcome` coach: the paper's outcome-only baseline (method.md section 7).

Every action of an episode gets 10 when the episode's final answer passes the rule-based check,
else 0. The outcome is an episode-level fact, so the per-action scorer reads it from the context:
- `extra["episode_correct"]` (bool), set by whoever knows the outcome (the replay path
  `score_episodes`, or a workflow that scores after the episode ends), wins;
- otherwise the final agent's own output is checked against its ground truth, which is the
  episode's outcome by definition;
- a non-final action with neither is unscored (never a guess).
`outcome_episodes` applies the baseline to finished episodes directly, which is what a trainer
running outcome-only should use once an episode's `correct` is known.
"""

from __future__ import annotations

from collections.abc import Sequence

from mappa.types import CoachContext, CoachScore, Episode

VERSION = "outcome-v1"


def outcome_score(correct: bool | None) -> CoachScore:
    if correct is None:
        return CoachScore(
            score=None,
            error="outcome unknown: the episode has no rule-based correctness",
            backend="outcome",
            model=VERSION,
        )
    return CoachScore(
        score=10.0 if correct else 0.0,
        rationale="episode's final answer is correct" if correct else "episode's final answer is wrong",
        answer_correct=correct,
        backend="outcome",
        model=VERSION,
    )


def outcome_context_score(ctx: CoachContext) -> CoachScore:
    correct = ctx.extra.get("episode_correct")
    if correct is None and ctx.is_final and ctx.ground_truth is not None:
        from mappa.tasks import check_answer

        correct = check_answer(ctx.output, ctx.ground_truth)
    if correct is None:
        return CoachScore(
            score=None,
            error="outcome coach: the episode's outcome is not known yet for this non-final action "
            "(score finished episodes with outcome_episodes / score_episodes)",
            backend="outcome",
            model=VERSION,
        )
    return outcome_score(bool(correct))


def outcome_episodes(episodes: Sequence[Episode]) -> list[Episode]:
    """Every action of each episode scored 10/0 from `episode.correct` (None: unscored)."""
    out = []
    for ep in episodes:
        score = outcome_score(ep.correct)
        out.append(ep.model_copy(update={"actions": tuple(a.model_copy(update={"coach": score}) for a in ep.actions)}))
    return out


class OutcomeCoach:
    name = "outcome"
    model = VERSION
    version = VERSION
    cacheable = False

    def __init__(self) -> None:
        from mappa.coach import CallCounters

        self.counters = CallCounters()

    async def score(self, ctx: CoachContext) -> CoachScore:
        return outcome_context_score(ctx)

    async def aclose(self) -> None:
        return None
