"""The `rubric` coach: deterministic rules over the evidence. Rules, not AI feedback.

It reads the same `CoachContext` an AI coach gets and applies fixed checks, so the offline demo
trains on a real, if blunt, per-action signal:
- empty output: 0;
- the final agent (with a ground truth): final answer checked with `mappa.tasks.check_answer`;
- an agent whose role calls for code (the role text mentions code or Python, or required files
  are declared): code present, ran, errored, timed out, printed something, saved what it must
  (read from the action's `ExecResult`, not from the observation text);
- any other agent: a substantive reply that commits to a result scores above one that does not.
Non-final agents are never judged against the ground truth, even if a context carries one.
Every score comes with a one-line rationale naming the rules that fired.

The data-science pipeline (`workflow == "ds_pipeline"`) has its own rules (`ds_score`), over the file
receipts the workflow records; a missing required file is its producer's fault, never a later agent's, and a
required file present but not what it claims (its receipt from the sandbox: empty, garbage, the wrong rows, an
unfitted model) counts as missing:
- no code: 7 for a closing message once the agent's required files exist, else 1;
- code ran: 8 with all its required files saved and a printed summary (7 silent); a required file
  missing: 2, or 4 when an earlier agent's required file was missing too (it could not have made it);
- code failed: 4 when the failure is an earlier agent's missing file (FileNotFoundError with one
  missing, or its name in the traceback) or one that was there but not usable, 5 when its own files were
  saved before the error, else 2;
- the Analyst, whose context carries the test-set evaluation: a success (valid and better than every trivial
  prediction) scores 6 + 4 x (share of the reference model's gain reached, at most 1); a valid submission
  that is no success 3; an invalid one at most 2, unless an earlier agent's missing file caused it (then the
  rules above, 4). The score caps (from the test metric, for no success, for an invalid submission, for a
  file that is not what it claims) are applied to these scores as to every coach's, by `CoachRunner`
  (`mappa.coach.caps`), not by these rules.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from mappa.coach.caps import unusable_files
from mappa.protocols import CallCounters
from mappa.types import CoachContext, CoachScore

RULES_VERSION = "rubric-v5"

_BOXED_RE = re.compile(r"\\boxed\s*\{")
_NUMBER_RE = re.compile(r"\d")


def _has_code(text: str) -> bool:
    # The workflows' own fence rules, so the coach sees code exactly where the workflow would have run some.
    from mappa.workflows.codeblocks import extract_code_blocks

    return bool(extract_code_blocks(text))


def _wants_code(ctx: CoachContext) -> bool:
    # The workflow declares each agent's tools; reading the role text instead would judge an agent that
    # merely mentions a teammate's code as a code agent. Contexts without the declaration fall back to it.
    if "tools" in ctx.extra:
        return "python" in ctx.extra["tools"] or bool(ctx.extra.get("required_files"))
    role = ctx.role.lower()
    return "code" in role or "python" in role or bool(ctx.extra.get("required_files"))


def _final(ctx: CoachContext) -> tuple[float, str, bool | None]:
    # The same extraction as the rule-based evaluation, so the coach and the accuracy never disagree.
    from mappa.tasks import check_answer, extract_answer

    if extract_answer(ctx.output) is None:
        return 0.0, "final agent gave no final answer (\\boxed{} or 'the answer is N')", False
    if check_answer(ctx.output, ctx.ground_truth or "", ctx.task):
        return 10.0, "final answer matches the reference", True
    return 2.0, "final answer given but it does not match the reference", False


def _code_agent(ctx: CoachContext) -> tuple[float, list[str]]:
    result = ctx.exec_result
    if not _has_code(ctx.output):
        return 1.0, ["no runnable ```python block"]
    if result is None:
        return 3.0, ["code present but no tool output recorded"]
    why: list[str] = []
    if result.timed_out:
        score, why = 2.0, ["code timed out"]
    elif not result.ok:
        score, why = 3.0, ["code raised an error"]
    elif not result.stdout.strip():
        score, why = 5.0, ["code ran but printed nothing"]
    else:
        score, why = 8.0, ["code ran and printed a result"]
    required = tuple(ctx.extra.get("required_files", ()))
    if required:
        seen = set(ctx.files_visible) | set(ctx.extra.get("files_saved", ()))
        missing = [f for f in required if f not in seen]
        if missing:
            score = min(score, 4.0)
            why.append("missing " + ", ".join(missing))
        else:
            why.append("saved all required files")
    return score, why


def _other_agent(ctx: CoachContext) -> tuple[float, list[str]]:
    text = ctx.output.strip()
    if len(text) < 20:
        return 2.0, ["reply too short to help"]
    if _BOXED_RE.search(text) or _NUMBER_RE.search(text):
        return 6.0, ["substantive reply that commits to a result"]
    return 4.0, ["reply commits to no result"]


def _ds_code(ctx: CoachContext) -> tuple[float, list[str], bool]:
    """The file rules of the data-science pipeline; also whether an upstream file's absence caused the failure."""
    ex = ctx.extra
    after = set(ex.get("files_after", ctx.files_visible))
    unusable = unusable_files(ctx)  # present, but its receipt says it is not what it claims: not saved
    missing = [f for f in ex.get("required_files", ()) if f not in after or f in unusable]
    score, why, caused = _ds_files(ctx, missing, ex.get("missing_upstream", {}))
    return score, [*why, *(f"{name} is not usable ({reason})" for name, reason in unusable.items())], caused


def _ds_files(ctx: CoachContext, missing: list[str], upstream: dict[str, str]) -> tuple[float, list[str], bool]:
    result = ctx.exec_result
    owed = ", ".join(f"{name} ({agent})" for name, agent in upstream.items())
    if not _has_code(ctx.output):
        if not missing:
            return 7.0, ["no code: a closing message, its required files are saved"], False
        return 1.0, ["no runnable ```python block", "missing " + ", ".join(missing)], False
    if result is None:
        return 3.0, ["code present but no tool output recorded"], False
    if result.ok:
        if not missing:
            if result.stdout.strip():
                return 8.0, ["code ran", "saved all required files"], False
            return 7.0, ["code ran", "saved all required files", "printed nothing"], False
        not_saved = "code ran but did not save " + ", ".join(missing)
        if upstream:
            return 4.0, [not_saved, f"earlier agents' files were missing: {owed}"], True
        return 2.0, [not_saved + " (its own files)"], False
    named = any(name in result.stderr for name in upstream)
    # An earlier agent's file that was there but not usable (its receipt): loading it fails however it is written.
    spoiled = any(name in ctx.files_visible for name in upstream)
    if named or spoiled or (upstream and "FileNotFoundError" in result.stderr):
        return 4.0, [f"code failed on a missing or unusable upstream file: {owed} (the producer's fault)"], True
    if not missing:
        return 5.0, ["code raised an error after its required files were saved"], False
    failed = "code timed out" if result.timed_out else "code raised an error"
    return 2.0, [failed, "missing " + ", ".join(missing)], False


def ds_score(ctx: CoachContext) -> tuple[float, list[str]]:
    """The data-science pipeline's rules (module docstring): file receipts, then the Analyst's submission."""
    score, why, upstream_caused = _ds_code(ctx)
    test = ctx.extra.get("test_evaluation") if ctx.is_final else None
    if test is None:
        return score, why
    if test["valid"] and test.get("success") is False:
        return 3.0, [f"valid submission but no success: {test.get('trivial') or 'no better than a trivial one'}"]
    if test["valid"]:  # a success (evidence recorded before the success rule: every valid submission)
        share = min(max(float(test["reference_fraction"]), 0.0), 1.0)
        score = 6.0 + 4.0 * share
        why = [f"valid submission: {test['metric']} {test['score']:.4g}, {share:.0%} of the reference model's gain"]
        # The score cap is not applied here: CoachRunner applies it to every coach's score (mappa.coach.caps).
        return round(score, 2), why
    if not upstream_caused and score > 2.0:
        score = 2.0
    return score, [*why, f"submission invalid: {test['reason']}"]


def rubric_score(ctx: CoachContext) -> CoachScore:
    """The rules applied to one context (sync; the coach below wraps it in the async protocol)."""
    t0 = time.perf_counter()
    answer_correct: bool | None = None
    if not ctx.output.strip():
        score, why = 0.0, ["empty output"]
    elif ctx.workflow == "ds_pipeline":
        score, why = ds_score(ctx)
    elif ctx.is_final and ctx.ground_truth is not None:
        score, reason, answer_correct = _final(ctx)
        why = [reason]
        if _has_code(ctx.output) and ctx.exec_result is not None and not ctx.exec_result.ok:
            score, why = max(0.0, score - 1.0), [*why, "its code raised an error"]
    elif _wants_code(ctx):
        score, why = _code_agent(ctx)
    else:
        score, why = _other_agent(ctx)
    rationale = f"rules: {'; '.join(why)}."
    return CoachScore(
        score=score,
        rationale=rationale,
        raw_reply=f"{rationale}\nPROCESS_SCORE: {score:g}",
        answer_correct=answer_correct,
        latency_s=time.perf_counter() - t0,
        backend="rubric",
        model=RULES_VERSION,
    )


class RuleCoach:
    """A coach that applies a function of the context: free and instant, so never cached (a cache would only
    hide rule changes) and never counted as calls."""

    cacheable = False

    def __init__(self, name: str, version: str, rules: Callable[[CoachContext], CoachScore]) -> None:
        self.name = name
        self.model = self.version = version
        self.rules = rules
        self.counters = CallCounters()

    async def score(self, ctx: CoachContext) -> CoachScore:
        return self.rules(ctx)

    async def aclose(self) -> None:
        return None


def rubric_coach() -> RuleCoach:
    return RuleCoach("rubric", RULES_VERSION, rubric_score)
