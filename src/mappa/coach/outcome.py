"""The `outcome` coach: the paper's outcome-only baseline (method.md section 7).

Every action of an episode gets 10 when the episode's final answer passes the rule-based check,
else 0. For the data-science pipeline the check is a success (`Episode.correct`): a valid submission.csv
strictly better than every trivial prediction, so a copy of sample_submission.csv, a constant or noise earns 0
(docs/dsbench.md). The outcome is an episode-level fact, so the per-action scorer reads it from the context:
- `extra["episode_correct"]` (bool), set by whoever knows the outcome (the replay path
  `score_episodes`, or a workflow that scores after the episode ends), wins;
- otherwise the final agent's own output is checked against its ground truth, which is the
  episode's outcome by definition;
- a non-final action with neither is unscored (never a guess).
The trainer does not need these live scores: it gives every action its episode's outcome once the
episode is over (`mappa.training.rewards.per_action_scores(episodes, "outcome")`).
"""

from __future__ import annotations

from mappa.coach.rubric import RuleCoach
from mappa.types import CoachContext, CoachScore

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

        correct = check_answer(ctx.output, ctx.ground_truth, ctx.task)
    if correct is None:
        return CoachScore(
            score=None,
            error="outcome coach: the episode's outcome is not known yet for this non-final action "
            "(the trainer scores finished episodes; `mappa coach score` passes the outcome)",
            backend="outcome",
            model=VERSION,
        )
    return outcome_score(bool(correct))


def outcome_coach() -> RuleCoach:
    return RuleCoach("outcome", VERSION, outcome_context_score)
