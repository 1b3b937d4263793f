"""Score caps: upper bounds on an action's score that code derives from the evidence, enforced in code.

A coach is told the cap (the `ds_pipeline` prompt shows it), but a coach's compliance is no guarantee:
an LLM coach can be talked past it by the very evidence it judges. So `CoachRunner` applies every cap
here to every backend's score on the way out (cache hits included; the cache keeps the coach's own
judgment), and the rationale records that the cap applied and by which rule.

The caps a context carries, in `CoachContext.extra`:
- `score_cap` (a number, or None for no cap) with `score_cap_rule` (why), set by the `ds_pipeline`
  workflow for the Analyst from the submission's test-set metric (`mappa.workflows.ds_pipeline.score_cap`).
A new kind of cap is one more reader in `_READERS`.
"""

from __future__ import annotations

from collections.abc import Callable

from mappa.types import CoachContext, CoachScore

Cap = tuple[float, str]  # (the highest score allowed, the rule that sets it)


def _ds_cap(ctx: CoachContext) -> Cap | None:
    cap = ctx.extra.get("score_cap")
    if cap is None:
        return None
    return float(cap), str(ctx.extra.get("score_cap_rule") or f"at most {float(cap):g}")


_READERS: tuple[Callable[[CoachContext], Cap | None], ...] = (_ds_cap,)


def score_caps(ctx: CoachContext) -> list[Cap]:
    """Every cap the context carries (empty: none)."""
    return [cap for read in _READERS if (cap := read(ctx)) is not None]


def apply_caps(ctx: CoachContext, result: CoachScore) -> CoachScore:
    """`result` with its score lowered to the context's tightest cap, the rationale saying so; unchanged when the
    score is within every cap or unscored. Applying it twice changes nothing."""
    caps = score_caps(ctx)
    if result.score is None or not caps:
        return result
    cap, rule = min(caps)
    if result.score <= cap:
        return result
    note = f"[capped at {cap:g} from {result.score:g} by rule: {rule}]"
    rationale = f"{result.rationale} {note}" if result.rationale else note
    return result.model_copy(update={"score": cap, "rationale": rationale})
