"""Rule-based per-action rewards for the Coder -> Reviewer team: `coach.backend: "rewards.py:score"`.

A plain function of the coach's evidence (`mappa.types.CoachContext`) returning 0-10, or None when the action
cannot be judged (the sandbox itself failed): mappa wraps it into a coach. It needs no LLM, so the example
trains offline. The paper's coach is an LLM that reads the same evidence and explains its score; switch to one
with `coach.backend: openai`, `coach.model` and `coach.base_url` (docs/coach.md).

Each rule reads the execution result of the action it judges, which the workflow puts in the context:

- Coder (judged on evidence only, never on the hidden tests): did its code define a function that returns the
  example's expected value?
- Reviewer (the final agent, judged with the ground truth): was its decision right? Approving code that passes
  the hidden tests, or fixing code that fails them, is right; approving failing code or breaking passing code
  is wrong.
"""

from __future__ import annotations

from mappa.types import CoachContext

# The Coder's example call: returned the expected value / a wrong value / raised / never ran (its code
# crashed, timed out or did not define the function before the call).
CODER_SCORES = {"pass": 10.0, "fail": 5.0, "error": 3.0, "missing": 1.0}


def coder_score(ctx: CoachContext) -> float:
    if ctx.extra.get("code") is None:
        return 0.0  # no ```python block: nothing for the team to run
    example = ctx.extra["example"]
    if example["status"] == "error" and example["got"].startswith("NameError"):
        return 2.0  # the code ran but never defined the requested function
    return CODER_SCORES[example["status"]]


def reviewer_score(ctx: CoachContext) -> float | None:
    coder_ok = ctx.extra["coder_tests"]["ok"]
    final_ok = ctx.extra["final_tests"]["ok"]
    decision = ctx.extra["verdict"]
    if decision == "unclear":
        return 1.0  # neither APPROVE nor code: the team falls back on the Coder's code without a review
    if decision == "approve":
        return None if coder_ok is None else (10.0 if coder_ok else 0.0)
    if final_ok is None:
        return None
    if final_ok:
        return 7.0 if coder_ok else 10.0  # a needless rewrite that still passes beats nothing, not a real fix
    return 0.0 if coder_ok else 3.0  # breaking working code is the worst; a failed fix at least tried


def score(ctx: CoachContext) -> float | None:
    """0-10 for one action of the team; None: unscored (left out of training, never a made-up score)."""
    if ctx.exec_result is not None and ctx.exec_result.infra_error is not None:
        return None  # the sandbox failed, not the agent
    if ctx.workflow != "coder_review" or not ({"example", "verdict"} & ctx.extra.keys()):
        return None  # not this team's evidence (mappa's start-up self-test sends a trivial context): no rule applies
    if ctx.agent == "coder":
        return coder_score(ctx)
    if ctx.agent == "reviewer":
        return reviewer_score(ctx)
    return None
