"""Score caps: upper bounds on an action's score, derived in code from the evidence and enforced in code.

A coach is told the cap (the `ds_pipeline` prompt shows it), but a coach's compliance is no guarantee:
an LLM coach can be talked past it by the very evidence it judges. So `CoachRunner` applies every cap
here to every backend's score on the way out (cache hits included; the cache keeps the coach's own
judgment), and the rationale records that the cap applied and by which rule.

The caps are the coach's policy, computed here from the evidence a workflow records: a live run and a replay
of its recorded episodes (`mappa coach score`) get the same caps because they rebuild the same evidence. The
caps a context gets, the tightest applying:

- the final agent's submission (`CoachContext.extra["test_evaluation"]`, with `["target_statistics"]`, which
  `ds_pipeline` records for the Analyst): a success capped by the test metric and the share of the reference
  model's gain it reaches (method.md §3); a valid submission that is no success (no better than a trivial
  prediction) at TRIVIAL_CAP or lower; a missing or invalid one at INVALID_CAP, or INVALID_UPSTREAM_CAP when an
  earlier agent's required file was missing or unusable (`extra["missing_upstream"]`), both at most every cap
  a trivial submission can get, so writing nothing never beats writing the trivial prediction
  (`submission_cap`);
- a required file the agent saved that does not hold what it claims (`extra["receipts"]`, recorded by
  `ds_pipeline` from a check inside the sandbox): at most RECEIPT_CAP, as for a file not saved;
- a cap the context states (`extra["score_cap"]`, a number or None, with `extra["score_cap_rule"]`, why), for
  a workflow with a rule of its own; like every cap it can only lower a score.

Which rules cap the final agent's submission is the evidence's to say (`extra["cap_rules"]`, recorded by
`ds_pipeline` from `workflow.ds_caps`): "mappa" (the default, above) or "paper", the published coach prompt's rules
alone (`paper_cap`): its metric tables, RMSE as a share of the target's IQR rather than its range when the target
is outlier-heavy, the upstream-fault exception (clear evidence of an earlier agent's failure lifts the cap to 8,
never lowers it) and 2, or 5 with an earlier agent's file missing, for no valid submission. The paper's caps on
the Data Engineer and the Modeler (at most 6 for poor features, 5 for a near-random model) hang on the outcome,
which no evidence holds when those agents are scored (the published coach saw "N/A" there too): its coach
prompt states them, no code enforces them.

A new kind of cap is one more reader in `_READERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mappa.types import CoachContext, CoachScore

Cap = tuple[float, str]  # (the highest score allowed, the rule that sets it)

# Caps of a submission from the real test metric, as (threshold, cap), best first. The paper's tables cover
# ROC-AUC/accuracy and RMSE as a share of the target's range; every metric is also capped by the share of the
# reference model's gain over a trivial prediction it reaches (DSBench mixes ten metrics), so a prediction no
# better than trivial (e.g. high accuracy from the majority class) is capped at 4.
PAPER_CAPS = ((0.85, 9), (0.75, 8), (0.65, 6), (0.55, 4))  # roc_auc, accuracy at least x; below: 3
RMSE_CAPS = ((10.0, 9), (25.0, 8), (50.0, 6))  # RMSE in % of the target's range below x; above: 4
REFERENCE_CAPS = ((0.9, 9), (0.7, 8), (0.4, 6), (0.1, 5))  # share of the reference's gain at least x; below: 4
# A submission that is no success, and one that is missing or invalid. The lowest cap a trivial submission can get
# is PAPER_CAPS' floor (3), so an invalid one stays at or below it even when an earlier agent is to blame: the
# blame rules' upstream exception lifts it from 2 to 3, never above what the trivial prediction would earn.
TRIVIAL_CAP = 4
INVALID_CAP = 2
INVALID_UPSTREAM_CAP = 3
RECEIPT_CAP = 4  # a required file present but not what it claims (empty, garbage, the wrong rows, unfitted)
# The published coach prompt's own numbers (dsbench_ds_pipeline.yaml of the published code): the exception for an
# Analyst with clear evidence of an upstream failure ("up to 8, never 10"), the score of one that failed for an
# upstream file ("3-5") and of the culprit of a missing submission ("0-2"); and when a target counts as
# outlier-heavy, so that RMSE is graded as a share of its IQR ("use % of IQR ... in such cases"): a range over 8
# IQRs wide, which no normal sample of up to a million rows reaches (about 7.3 at a million).
PAPER_UPSTREAM_EXCEPTION = 8
PAPER_INVALID_UPSTREAM_CAP = 5
PAPER_INVALID_CAP = 2
PAPER_OUTLIER_RANGE_IQR = 8.0
CAP_RULES = ("mappa", "paper")


def _step_cap(value: float, steps: Sequence[tuple[float, int]], floor: int, below: bool = False) -> int:
    for threshold, cap in steps:
        if (value < threshold) if below else (value >= threshold):
            return cap
    return floor


def score_cap(
    test: Mapping[str, Any], stats: Mapping[str, Any], upstream: Mapping[str, str] | None = None, rules: str = "mappa"
) -> tuple[int | None, str]:
    """The highest score a submission's action may get given its test-set evaluation (`test`), the target's
    statistics (`stats`) and the earlier agents' required files missing or unusable when its agent began
    (`upstream`: file -> agent), and why (None: no rule caps it); by `rules` (`CAP_RULES`: "paper" is `paper_cap`)."""
    if rules == "paper":
        return paper_cap(test, stats, upstream)
    metric, score, share = test.get("metric"), test.get("score"), test.get("reference_fraction")
    if not test.get("valid") or score is None:
        reason = str(test.get("reason") or "no submission")
        if upstream:
            why = f"no valid submission ({reason}); earlier agents' files were missing or unusable: {_owed(upstream)}"
            return INVALID_UPSTREAM_CAP, f"at most {INVALID_UPSTREAM_CAP}: {why}"
        return INVALID_CAP, f"at most {INVALID_CAP}: no valid submission ({reason})"
    caps = []
    if test.get("success") is False:  # evidence recorded before the success rule has no "success": metric caps only
        caps.append((TRIVIAL_CAP, f"no better than a trivial prediction ({test.get('trivial') or 'no success'})"))
    if share is not None:  # a task without a reference score has no share of its gain
        gain = f"{share:.0%} of the reference model's gain over a trivial prediction"
        caps.append((_step_cap(share, REFERENCE_CAPS, 4), gain))
    if metric in ("roc_auc", "accuracy"):
        caps.append((_step_cap(score, PAPER_CAPS, 3), f"{metric} {score:.3f}"))
    elif metric == "rmse" and stats.get("range"):
        pct = 100 * score / stats["range"]
        caps.append((_step_cap(pct, RMSE_CAPS, 4, below=True), f"RMSE {pct:.1f}% of the target's range"))
    if not caps:
        return None, f"no rule caps {metric}"
    cap, why = min(caps)
    return cap, f"at most {cap}: {why}"


def _owed(upstream: Mapping[str, str]) -> str:
    return ", ".join(f"{name} ({agent})" for name, agent in list(upstream.items())[:5])


def paper_cap(
    test: Mapping[str, Any], stats: Mapping[str, Any], upstream: Mapping[str, str] | None = None
) -> tuple[int | None, str]:
    """`score_cap` by the published coach prompt's rules alone: ROC-AUC/accuracy and RMSE tables (RMSE as a share of
    the IQR when the target spans over `PAPER_OUTLIER_RANGE_IQR` IQRs), no cap for another metric; an earlier
    agent's missing or unusable file (`upstream`) lifts the cap to `PAPER_UPSTREAM_EXCEPTION`; no valid submission:
    `PAPER_INVALID_CAP`, or `PAPER_INVALID_UPSTREAM_CAP` when an earlier agent's file was missing."""
    metric, score = test.get("metric"), test.get("score")
    if not test.get("valid") or score is None:
        reason = str(test.get("reason") or "no submission")
        if upstream:
            cap, why = PAPER_INVALID_UPSTREAM_CAP, f"no valid submission ({reason}) for want of {_owed(upstream)}"
        else:
            cap, why = PAPER_INVALID_CAP, f"no valid submission ({reason})"
        return cap, f"at most {cap} (the paper's rules): {why}"
    found: tuple[int, str] | None = None
    if metric in ("roc_auc", "accuracy"):
        found = _step_cap(score, PAPER_CAPS, 3), f"{metric} {score:.3f}"
    elif metric == "rmse" and stats.get("range"):
        span, iqr = float(stats["range"]), float(stats.get("iqr") or 0.0)
        if iqr > 0 and span > PAPER_OUTLIER_RANGE_IQR * iqr:  # outlier-heavy: the range flatters the RMSE
            found = _step_cap(100 * score / iqr, RMSE_CAPS, 4, below=True), f"RMSE {100 * score / iqr:.1f}% of the IQR"
        else:
            found = (
                _step_cap(100 * score / span, RMSE_CAPS, 4, below=True),
                f"RMSE {100 * score / span:.1f}% of the range",
            )
    if found is None:
        return None, f"no rule of the paper's caps {metric}"
    cap, why = found
    if upstream and cap < PAPER_UPSTREAM_EXCEPTION:
        cap, why = PAPER_UPSTREAM_EXCEPTION, f"{why}, but earlier agents failed it: {_owed(upstream)}"
    return cap, f"at most {cap} (the paper's rules): {why}"


def submission_cap(ctx: CoachContext) -> tuple[int | None, str] | None:
    """`score_cap` of the final agent's recorded test-set evaluation, by the rules the evidence names
    (`extra["cap_rules"]`, default "mappa"); None when the context carries no evaluation."""
    test = ctx.extra.get("test_evaluation")
    if not ctx.is_final or not test:
        return None
    stats, upstream = ctx.extra.get("target_statistics") or {}, ctx.extra.get("missing_upstream") or {}
    return score_cap(test, stats, upstream, str(ctx.extra.get("cap_rules") or "mappa"))


def _submission(ctx: CoachContext) -> Cap | None:
    found = submission_cap(ctx)
    if found is None or found[0] is None:
        return None
    return float(found[0]), found[1]


def _stated(ctx: CoachContext) -> Cap | None:
    cap = ctx.extra.get("score_cap")
    if cap is None:
        return None
    return float(cap), str(ctx.extra.get("score_cap_rule") or f"at most {float(cap):g}")


def unusable_files(ctx: CoachContext) -> dict[str, str]:
    """The agent's required files present after the action whose receipt says they are not what they claim:
    file -> why. Evidence recorded without receipts counts every present file (nothing to go on)."""
    receipts = ctx.extra.get("receipts") or {}
    after = set(ctx.extra.get("files_after", ctx.files_visible))
    out = {}
    for name in ctx.extra.get("required_files", ()):
        receipt = receipts.get(name)
        if name in after and isinstance(receipt, Mapping) and receipt.get("ok") is not True:
            out[name] = str(receipt.get("why") or "not what it claims")
    return out


def _receipts(ctx: CoachContext) -> Cap | None:
    bad = unusable_files(ctx)
    if not bad:
        return None
    why = "; ".join(f"{name}: {reason}" for name, reason in list(bad.items())[:5])
    return float(RECEIPT_CAP), f"at most {RECEIPT_CAP}: a required file does not hold what it claims ({why})"


_READERS: tuple[Callable[[CoachContext], Cap | None], ...] = (_submission, _receipts, _stated)


def score_caps(ctx: CoachContext) -> list[Cap]:
    """Every cap the context's evidence sets (empty: none)."""
    return [cap for read in _READERS if (cap := read(ctx)) is not None]


def cap_shown(ctx: CoachContext) -> tuple[float | None, str]:
    """The cap a coach is told: the tightest with its rule, or (None, why no cap applies; empty: no rule)."""
    caps = score_caps(ctx)
    if caps:
        return min(caps)
    found = submission_cap(ctx)
    return None, "" if found is None else found[1]


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
