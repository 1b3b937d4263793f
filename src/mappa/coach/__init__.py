"""The coach: a 0-10 score with a rationale for every action (method.md section 3).

A coach is a small async protocol (`mappa.protocols.Coach`: `score(context) -> CoachScore`); the
backends live in one explicit dict, `COACHES`. `build_coach` wraps the chosen backend in a
`CoachRunner`, which adds what every backend needs alike: a concurrency limit, the SQLite judgment
cache, accounting (calls, cache hits, retries, failures, unscored, replies cut at the token cap, replies
without log-probs, truncated contexts, latency, tokens, cost), and the score caps the evidence carries
(`mappa.coach.caps`), enforced in code on every backend's score rather than left to the coach's compliance.

Unscored is a first-class outcome, and the coach's alone: when a reply has no score line after one
follow-up, or the endpoint fails after its retries, `CoachScore.score` is None. Nothing here invents a score;
`coach.on_unscored` decides whether such an action is left out of training or neutral (`mappa.training.rewards`).
An action's own content never leaves it unscored (`mappa.coach.judge`: cut to fit, or the worst score), and
the runner shows every coach the context's text readable (`readable_context`): a control character or lone
surrogate an agent left could otherwise not be hashed, sent or read.
"""

from mappa.coach.parse import expected_score, parse_answer_correct, parse_score
from mappa.coach.prompts import TEMPLATES, build_messages
from mappa.coach.runner import COACHES, CoachRunner, build_coach

__all__ = [
    "COACHES",
    "TEMPLATES",
    "CoachRunner",
    "build_coach",
    "build_messages",
    "expected_score",
    "parse_answer_correct",
    "parse_score",
]
