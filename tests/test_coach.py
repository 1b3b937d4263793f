"""The coach without a network: parsing, expected score, prompts, rubric and outcome coaches, cache, runner."""

from __future__ import annotations

import math
import multiprocessing as mp
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest
from helpers import coach_context as ctx  # the Code Executor's context; kw replace fields
from pydantic import ValidationError

from mappa.coach import COACHES, build_coach, parse_score
from mappa.coach.cache import JudgmentCache, cache_key, context_hash
from mappa.coach.parse import TokenLogprob, expected_score, parse_answer_correct, rationale_of
from mappa.coach.prompts import (
    MIN_FIELD_CHARS,
    TEMPLATES,
    Cut,
    EvidenceTooLong,
    build_messages,
    fit_prompt,
    follow_up_message,
    render_context,
    template_for,
)
from mappa.coach.rubric import rubric_score
from mappa.coach.tokens import byte_count, token_counter
from mappa.config import BUILTIN_COACHES, BUILTIN_WORKFLOWS, CoachConfig, WorkflowConfig
from mappa.errors import MappaError
from mappa.types import Action, CoachScore, Episode, ExecResult, Message, Task

GROUND_TRUTH = "SECRET-ANSWER-4242"


NO_TOOL = dict(exec_result=None, observation="")


def failed(stderr: str, **kw) -> dict:
    """A tool call that failed, as the context carries it."""
    return dict(exec_result=ExecResult(ok=False, exit_code=1, stderr=stderr, **kw), observation=f"[stderr]\n{stderr}")


# ------------------------------------------------------------------------------------------------ parse_score
@pytest.mark.parametrize(
    "text, expected",
    [
        ("ANALYSIS: fine.\nPROCESS_SCORE: 7", 7.0),
        ("PROCESS_SCORE: 7.5", 7.5),
        ("process_score:8", 8.0),
        ("Process Score = 6", 6.0),
        ("**PROCESS_SCORE:** 9", 9.0),
        ("**PROCESS_SCORE: 9**", 9.0),
        ("`PROCESS_SCORE`: `4`", 4.0),
        ("PROCESS-SCORE: [3]", 3.0),
        ("PROCESS_SCORE: 7/10", 7.0),
        ("PROCESS_SCORE: 12", 10.0),
        ("PROCESS_SCORE: -3", 0.0),
        ("PROCESS_SCORE: 6,5", 6.5),
        ("end with PROCESS_SCORE: x.\nMy verdict.\nPROCESS_SCORE: 2", 2.0),
        ("PROCESS_SCORE: 7\nANSWER_CORRECT: 1\n\n---\n", 7.0),  # the verdict block may end the reply in any order
    ],
)
def test_parse_score_variants(text: str, expected: float) -> None:
    assert parse_score(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Step 3 is wrong; I would give it 7 out of 10.",
        "Score: 8",
        "PROCESS_SCORE: x",
        "PROCESS_SCORE:",
        "",
        "The answer 42 appears in step 2.",
        # Two different scores: which is the coach's own is a guess, so none is (the follow-up asks again).
        "Reply in the form PROCESS_SCORE: 5 ... then actually PROCESS_SCORE: 8",
    ],
)
def test_parse_score_never_takes_a_stray_number(text: str) -> None:
    assert parse_score(text) is None


def test_answer_correct_and_rationale() -> None:
    reply = "ANALYSIS: the box holds 5, matching the reference.\n**PROCESS_SCORE:** 9\nANSWER_CORRECT: 1"
    assert parse_answer_correct(reply) is True
    assert parse_answer_correct("ANSWER_CORRECT: 0") is False
    assert parse_answer_correct("no verdict") is None
    assert rationale_of(reply) == "ANALYSIS: the box holds 5, matching the reference."


# -------------------------------------------------------------------------------------------- expected score
def toks(*pieces: str, top: dict[int, dict[str, float]] | None = None) -> tuple[TokenLogprob, ...]:
    top = top or {}
    out = []
    for i, p in enumerate(pieces):
        alts = top.get(i, {p: 0.0})
        out.append(TokenLogprob(p, alts.get(p, 0.0), tuple(alts.items())))
    return tuple(out)


def test_expected_score_is_probability_weighted_mean() -> None:
    pieces = ("ANALYSIS: ok", "\n", "PROCESS", "_SCORE", ":", " ", "7", "\n")
    tokens = toks(*pieces, top={6: {"7": math.log(0.5), "8": math.log(0.3), "6": math.log(0.2)}})
    assert expected_score(tokens) == pytest.approx(0.5 * 7 + 0.3 * 8 + 0.2 * 6)


def test_expected_score_renormalises_and_ignores_non_numeric_alternatives() -> None:
    pieces = ("PROCESS_SCORE:", " 4")
    top = {1: {" 4": math.log(0.6), " 5": math.log(0.2), " four": math.log(0.2)}}
    assert expected_score(toks(*pieces, top=top)) == pytest.approx((0.6 * 4 + 0.2 * 5) / 0.8)


def test_expected_score_splits_one_and_ten() -> None:
    # "10" sampled as "1","0": P("1") = 0.8 of which P("0" next) = 0.75 -> 10, else 1; P("9") = 0.2.
    pieces = ("PROCESS_SCORE: ", "1", "0")
    top = {1: {"1": math.log(0.8), "9": math.log(0.2)}, 2: {"0": math.log(0.75), "\n": math.log(0.25)}}
    want = 0.8 * (0.75 * 10 + 0.25 * 1) + 0.2 * 9
    assert expected_score(toks(*pieces, top=top)) == pytest.approx(want)


def test_expected_score_keeps_the_sampled_decimal_value() -> None:
    pieces = ("PROCESS_SCORE: ", "7", ".", "5")
    top = {1: {"7": math.log(0.5), "6": math.log(0.5)}}
    assert expected_score(toks(*pieces, top=top)) == pytest.approx(0.5 * 7.5 + 0.5 * 6)


def test_expected_score_falls_back_when_it_cannot_tell() -> None:
    assert expected_score(toks("no", " marker", " 7")) is None
    assert expected_score(toks("PROCESS_SCORE:", " high")) is None
    # Most of the probability on non-numbers: the mean would be over a sliver of the distribution.
    top = {1: {" 7": math.log(0.2), " x": math.log(0.8)}}
    assert expected_score(toks("PROCESS_SCORE:", " 7", top=top)) is None
    assert expected_score(()) is None


# ------------------------------------------------------------------------------------------------- prompts
def test_prompt_never_renders_ground_truth_for_non_final_agents() -> None:
    leaked = ctx(is_final=False, ground_truth=GROUND_TRUTH)
    for template in TEMPLATES.values():
        text = "\n".join(m["content"] for m in build_messages(leaked, template))
        assert GROUND_TRUTH not in text
        # the paper's MathChat text names ANSWER_CORRECT to every agent (its wording); ours only to the final one
        assert "ANSWER_CORRECT" not in text or template.name == "mathchat_paper"
    assert "ANSWER_CORRECT" not in follow_up_message(False)["content"]


def test_prompt_renders_ground_truth_for_the_final_agent() -> None:
    final = ctx(agent="verifier", is_final=True, ground_truth=GROUND_TRUTH, output="\\boxed{5}")
    text = build_messages(final, template_for("", "mathchat"))[1]["content"]
    assert GROUND_TRUTH in text
    assert "ANSWER_CORRECT" in text
    assert "ANSWER_CORRECT" in follow_up_message(True)["content"]


def test_prompt_holds_the_evidence() -> None:
    c = ctx(
        **failed("Traceback: ZeroDivisionError"),
        files_visible=("X_train.pkl",),
        files_by_agent={"data_engineer": ("X_train.pkl",)},
        extra={"roc_auc": 0.81, "episode_correct": True},
    )
    text = render_context(c)
    for needle in ("What is 2 + 3?", c.role, "Problem: 2 + 3", "print(2 + 3)", "ZeroDivisionError", "X_train.pkl"):
        assert needle in text
    assert "roc_auc: 0.81" in text
    assert "episode_correct" not in text  # bookkeeping for the outcome coach, never shown to an AI coach
    assert "no tool used" not in text and "left out" not in text
    assert "no tool used" in render_context(ctx(**NO_TOOL))  # the words are for the coach; code reads exec_result


def test_prompt_sends_input_and_output_whole() -> None:
    long_input, long_output = "I" * 50_000 + "END-OF-INPUT", "O" * 50_000 + "END-OF-OUTPUT"
    c = ctx(messages=(Message(role="user", content=long_input),), output=long_output)
    text = render_context(c)
    assert long_input in text and long_output in text and "omitted" not in text and "left out" not in text
    assert fit_prompt(c, TEMPLATES["mathchat"], None, byte_count)[1].messages == 0  # no budget: nothing is cut


def test_templates_are_versioned_and_selectable() -> None:
    assert template_for("", "mathchat").name == "mathchat"
    assert template_for("", "ds_pipeline").name == "ds_pipeline"
    assert template_for("", "some_new_workflow").name == "generic"
    assert template_for("generic", "mathchat").name == "generic"
    assert len({t.version for t in TEMPLATES.values()}) == len(TEMPLATES)


PAPER_TEXTS = {  # sha256 of the published coach prompts (ltjed/multiagent-coaching@ed66921), never edited here
    "MATHCHAT": "2c794ef38103152dd092e1521db0703a7c24fb7b8e59d2460ddfa757d6232851",
    "DS_PIPELINE": "0ace93c0b4af730b3263ee2f73cd3d467f88b84702d96223c164c873d69cd720",
}


@pytest.mark.parametrize("name", sorted(PAPER_TEXTS))
def test_the_paper_coach_texts_are_the_published_ones(name: str) -> None:
    import hashlib

    from mappa.coach import paper_templates

    assert hashlib.sha256(getattr(paper_templates, name).encode()).hexdigest() == PAPER_TEXTS[name]


def test_the_paper_templates_fill_the_published_text_with_fenced_evidence() -> None:
    """coach.template: mathchat_paper: the published text with its fields filled as the published coach filled them
    (the agent's title as its role, "N/A" where it had no ground truth or no tool call), every agent-written value
    fenced; the text around the fields is the published one, word for word."""
    from mappa.coach.paper_templates import MATHCHAT

    verifier = ctx(agent="verifier", is_final=True, ground_truth=GROUND_TRUTH, output="\\boxed{5}", **NO_TOOL)
    system, user = build_messages(verifier, template_for("mathchat_paper", "mathchat"))
    text = user["content"]
    assert text.startswith(MATHCHAT.split("{")[0])  # the published opening, up to its first field
    for piece in MATHCHAT.split("\n\n")[1:3]:  # its workflow description, verbatim
        assert piece in text
    assert "**Current agent being evaluated:**\nVerifier\n" in text  # the title, as the published code passed it
    assert "**Environment feedback for the agent's tool call (if applicable):**\nN/A (no tools used)" in text
    assert "**Ground truth answer (if applicable):**\n<<<EVIDENCE-" in text and GROUND_TRUTH in text
    assert "\\boxed{5}" in text and "fenced" not in text and "EVIDENCE-" in system["content"]
    coder = build_messages(ctx(), template_for("mathchat_paper", "mathchat"))[1]["content"]
    assert "**Ground truth answer (if applicable):**\nN/A\n" in coder and "print(2 + 3)" in coder
    assert coder.rstrip().endswith("write the PROCESS_SCORE line alone.")  # where the parser reads the verdict
    ours = build_messages(verifier, template_for("", "mathchat"))[1]["content"]
    assert "You are evaluating a specific agent" not in ours  # the default stays ours


def test_the_data_science_paper_template_shows_files_and_the_enforced_cap() -> None:
    analyst = ctx(
        workflow="ds_pipeline", agent="analyst", is_final=True, files_visible=("X_train.pkl",),
        files_by_agent={"data_engineer": ("X_train.pkl",), "modeler": ()},
        extra={"test_evaluation": {"valid": False, "metric": "roc_auc", "score": None, "reason": "no file"},
               "target_statistics": {"rows": 9}, "missing_upstream": {"X_test.pkl": "data_engineer"},
               "cap_rules": "paper"},
    )  # fmt: skip
    text = build_messages(analyst, template_for("ds_pipeline_paper", "ds_pipeline"))[1]["content"]
    assert "**Current agent:**\nanalyst\n" in text and "**Role of the current agent:**\nanalyst\n" in text
    assert '- Data Engineer saved: "X_train.pkl"' in text and "- Modeler saved: NO FILES SAVED" in text
    assert "Hard cap on this action's score: at most 5" in text  # the paper's rules: an upstream file missing
    first = build_messages(ctx(workflow="ds_pipeline", agent="data_engineer"), template_for("ds_pipeline_paper", ""))
    assert "(This is the first agent - no previous files)" in first[1]["content"]
    assert "**Ground truth evaluation results (computed metrics):**\nN/A\n" in first[1]["content"]


def _literal(model: type, field: str) -> set[str]:
    return set(get_args(model.model_fields[field].annotation))


def test_valid_names_are_the_configs() -> None:
    # One list of names per setting: the config's; the dicts must serve exactly those names.
    from mappa.workflows import WORKFLOWS

    assert set(COACHES) == set(BUILTIN_COACHES)  # any other name must be a plug-in's import path
    assert set(TEMPLATES) == _literal(CoachConfig, "template") - {""}
    assert set(WORKFLOWS) == set(BUILTIN_WORKFLOWS)
    with pytest.raises(ValidationError, match="neither one of rubric, outcome, openai, local"):
        CoachConfig(backend="rubrik")
    with pytest.raises(ValidationError, match="neither one of mathchat, ds_pipeline"):
        WorkflowConfig(name="mathchta")
    with pytest.raises(ValidationError, match="template"):
        CoachConfig(template="nope")


# --------------------------------------------------------------------------------------- context budget
def _turns(n: int, size: int) -> tuple[Message, ...]:
    return tuple(Message(role="user" if i % 2 else "assistant", content=f"<m{i}>" + "x" * size) for i in range(n))


def test_fit_prompt_cuts_the_oldest_input_first_and_never_the_output() -> None:
    template = TEMPLATES["mathchat"]
    c = ctx(messages=_turns(6, 2000), output="OUT" * 1000)
    full = byte_count(build_messages(c, template))
    budget = full - 3000  # the two oldest messages (about 4 kB) hold more than the excess
    messages, cut = fit_prompt(c, template, budget, byte_count)
    text = messages[1]["content"]
    assert byte_count(messages) <= budget
    assert (cut.dropped, cut.messages) == (1, 2) and 0 < cut.chars < 2005  # m0 out, the head of m1 out
    assert "OUT" * 1000 in text  # the output is whole
    assert "<m0>" not in text and "<m1>" not in text and all(f"<m{i}>" in text for i in range(2, 6))
    assert "[messages 0-0 left out]" in text and f"first {cut.chars} characters of this message left out" in text
    assert "cut to fit your context: 2 of its 6 messages" in text
    # The cut is as small as it can be: one character less does not fit.
    tighter = build_messages(c, template, type(cut)(cut.dropped, cut.chars - 1))
    assert byte_count(tighter) > budget


def test_fit_prompt_cuts_every_field_to_its_head_and_tail_once_the_input_is_out() -> None:
    template = TEMPLATES["mathchat"]
    c = ctx(messages=_turns(2, 100), output="HEAD" + "O" * 10_000 + "TAIL", observation="x" * 3_000)
    messages, cut = fit_prompt(c, template, 5_000, byte_count)
    text = messages[1]["content"]
    assert byte_count(messages) <= 5_000 and cut.dropped == 2  # the input goes first
    assert MIN_FIELD_CHARS <= cut.field_chars < 3_000 and cut.fields == 2  # the output and the observation
    assert "HEAD" in text and "TAIL" in text and "characters cut from the middle of this text" in text
    assert "2 fields cut to" in cut.describe() and "2 of the agent's input messages" in cut.describe()
    # The limit is as large as fits: one character more does not.
    assert byte_count(build_messages(c, template, replace(cut, field_chars=cut.field_chars + 1))) > 5_000


def test_fit_prompt_gives_up_below_the_smallest_field_and_on_a_budget_under_the_template() -> None:
    template = TEMPLATES["mathchat"]
    c = ctx(output="O" * 10_000, observation="x" * 10_000, task="t" * 10_000, role="r" * 10_000)
    empty = byte_count(build_messages(c, template, Cut(len(c.messages), 0, 0)))
    with pytest.raises(EvidenceTooLong, match=f"every field cut to {MIN_FIELD_CHARS} characters"):
        fit_prompt(c, template, empty + 10, byte_count)  # the template fits, its fields at their least do not
    with pytest.raises(MappaError, match="coach.max_context_tokens: the mathchat prompt needs"):
        fit_prompt(c, template, empty - 1, byte_count)


def test_token_counter_prefers_a_local_tokenizer_and_falls_back_to_bytes(tmp_path: Path) -> None:
    from mappa.policy.models import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    messages = [{"role": "user", "content": "hello world " * 50}]
    count, name, specials = token_counter("", str(tmp_path / "tok"))
    assert name.startswith("tokenizer") and 0 < count(messages) < byte_count(messages)
    assert "<|im_end|>" in specials  # broken up in agent text, so that it cannot end the coach's turn
    count, name, specials = token_counter("", "some-api-model-not-on-disk")
    assert name == "UTF-8 bytes" and count is byte_count and specials == ()
    with pytest.raises(MappaError, match="coach.tokenizer"):
        token_counter(str(tmp_path / "missing"), "m")


# -------------------------------------------------------------------------------------------------- rubric
def test_rubric_ignores_ground_truth_for_non_final_agents() -> None:
    # A Problem Solver whose text happens to contain the reference must not score higher for it.
    solver = dict(agent="problem_solver", role="You are the Problem Solver.", **NO_TOOL)
    plain = rubric_score(ctx(output="I think the answer is \\boxed{7} after some steps.", **solver))
    leaked = rubric_score(ctx(output="I think the answer is \\boxed{7} after some steps.", ground_truth="7", **solver))
    assert plain.score == leaked.score
    assert leaked.answer_correct is None
    assert "reference" not in leaked.rationale


@pytest.mark.parametrize(
    "kw, lo, hi, phrase",
    [
        (dict(output="   "), 0, 0, "empty output"),
        (dict(output="I would just guess."), 0, 2, "no runnable"),
        (failed("Traceback (most recent call last):\nZeroDivisionError: division by zero"), 2, 4, "error"),
        (failed("", timed_out=True), 1, 3, "timed out"),
        (dict(exec_result=ExecResult(ok=True, exit_code=0), observation="[no output]"), 4, 6, "printed nothing"),
        (NO_TOOL, 2, 4, "no tool output"),
        (dict(), 7, 9, "ran and printed"),
    ],
)
def test_rubric_code_agent_rules(kw: dict, lo: float, hi: float, phrase: str) -> None:
    s = rubric_score(ctx(**kw))
    assert lo <= s.score <= hi
    assert phrase in s.rationale
    assert s.rationale.startswith("rules:")


def test_rubric_final_agent_checks_the_answer() -> None:
    final = dict(agent="verifier", role="You are the Verifier.", is_final=True, ground_truth="5", **NO_TOOL)
    right = rubric_score(ctx(output="The code printed 5, so \\boxed{5}.", **final))
    wrong = rubric_score(ctx(output="Hmm, \\boxed{6}.", **final))
    none = rubric_score(ctx(output="It is five, I believe.", **final))
    assert right.score == 10 and right.answer_correct is True
    assert wrong.score < 5 and wrong.answer_correct is False
    assert none.score == 0 and none.answer_correct is False
    # an explicit unboxed statement counts exactly as the rule-based evaluation counts it
    stated = rubric_score(ctx(output="The tool printed 5. The answer is 5.", **final))
    assert stated.score == 10 and stated.answer_correct is True


def test_rubric_judges_code_only_for_agents_with_the_tool() -> None:
    # The Solver's role mentions the Code Executor and Python, but it has no tool: it must not be
    # judged on missing code blocks.
    role = "You are the Problem Solver. The Code Executor will check your work by running Python."
    solver = rubric_score(
        ctx(
            agent="problem_solver",
            role=role,
            output="2 + 3 = 5, so the answer is 5.",
            extra={"tools": []},
            **NO_TOOL,
        )
    )
    coder = rubric_score(ctx(output="2 + 3 = 5, so the answer is 5.", extra={"tools": ["python"]}, **NO_TOOL))
    assert "no runnable" not in solver.rationale and solver.score >= 5
    assert "no runnable" in coder.rationale and coder.score <= 2


def test_rubric_required_files() -> None:
    de = dict(
        role="Data Engineer: save files with Python code.", extra={"required_files": ["X_train.pkl", "X_test.pkl"]}
    )
    missing = rubric_score(ctx(files_visible=("X_train.pkl",), **de))
    complete = rubric_score(ctx(files_visible=("X_train.pkl", "X_test.pkl"), **de))
    assert missing.score <= 4 and "X_test.pkl" in missing.rationale
    assert complete.score > missing.score


# ------------------------------------------------------------------------------------------------- outcome
def test_outcome_per_context() -> None:
    runner = build_coach(CoachConfig(backend="outcome"), "mathchat")
    final = ctx(is_final=True, ground_truth="5", output="\\boxed{5}")
    early = ctx(is_final=False)
    known = ctx(is_final=False, extra={"episode_correct": False})
    s_final, s_early, s_known = runner.score_many([final, early, known])
    assert s_final.score == 10.0
    assert s_early.score is None and "not known" in s_early.error  # never a guess
    assert s_known.score == 0.0


# --------------------------------------------------------------------------------------------------- cache
def test_context_hash_is_canonical_and_sensitive() -> None:
    a = ctx(extra={"x": 1, "y": 2})
    b = ctx(extra={"y": 2, "x": 1})
    assert context_hash(a) == context_hash(b)
    assert context_hash(a) != context_hash(ctx(output="different"))
    assert cache_key("openai", "m", "v1", "h") != cache_key("openai", "m", "v2", "h")
    assert cache_key("openai", "m", "v1", "h") != cache_key("local", "m", "v1", "h")


def test_cache_roundtrip(tmp_path: Path) -> None:
    cache = JudgmentCache(tmp_path / "c.sqlite")
    score = CoachScore(score=6.5, rationale="ok", raw_reply="PROCESS_SCORE: 6.5", backend="openai", model="m")
    cache.put("k", score, backend="openai", model="m", template_version="v", ctx_hash="h")
    assert cache.get("k") == score
    assert cache.get("other") is None
    cache.close()
    reopened = JudgmentCache(tmp_path / "c.sqlite")
    assert reopened.get("k") == score and len(reopened) == 1


def _writer(path: str, worker: int, n: int) -> None:
    cache = JudgmentCache(path)
    for i in range(n):
        s = CoachScore(score=float(i % 11), rationale=f"w{worker}")
        cache.put(f"{worker}-{i}", s, backend="b", model="m", template_version="v", ctx_hash=str(i))
        assert cache.get(f"{worker}-{i}") is not None
    cache.close()


@pytest.mark.integration  # processes racing on one SQLite file: tens of seconds
def test_cache_is_safe_under_concurrent_writers(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.sqlite")
    JudgmentCache(path).close()  # create the schema once, as the first run would
    procs = [mp.get_context("spawn").Process(target=_writer, args=(path, w, 100)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    cache = JudgmentCache(path)
    assert len(cache) == 400
    assert cache.get("3-99").rationale == "w3"


def test_unwritable_cache_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MappaError, match="coach.cache_path"):
        JudgmentCache(blocker / "sub" / "c.sqlite")


# -------------------------------------------------------------------------------------------------- runner
def test_runner_rubric_accounting_and_order() -> None:
    runner = build_coach(CoachConfig(backend="rubric"), "mathchat")
    contexts = [ctx(output=" "), ctx(), ctx(**failed("ValueError: bad"))]
    seen: list[tuple[int, int]] = []
    scores = runner.score_many(contexts, lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert [s.score for s in scores] == [rubric_score(c).score for c in contexts]
    # The runner is the workflow's scorer callable.
    assert [s.score for s in runner(contexts)] == [s.score for s in runner.score_many(contexts)]
    stats = runner.stats()
    assert stats["judgments"] == 9 and stats["calls"] == 0 and stats["cache_hits"] == 0 and stats["unscored"] == 0
    assert stats["truncated_contexts"] == 0
    assert runner.cache is None  # free rules are not cached
    runner.close()


def test_build_coach_errors() -> None:
    with pytest.raises(MappaError, match="coach.model"):
        build_coach(CoachConfig(backend="openai", base_url="http://127.0.0.1:9/v1"), "mathchat")
    with pytest.raises(MappaError, match="coach.model"):
        build_coach(CoachConfig(backend="local"), "mathchat")


def test_the_local_coach_asks_a_cut_reply_again_with_more_room(tmp_path: Path) -> None:
    """The tiny random model never stops by itself: every reply hits its cap (thinking budget + max_tokens), is asked
    again with twice the reply's room in a call of its own, and stays unscored, counted in coach/cut_rate."""
    from mappa.policy.models import tiny_model_and_tokenizer
    from mappa.policy.policy import Policy

    model, tokenizer = tiny_model_and_tokenizer()
    policy = Policy.from_model(model, tokenizer, ["code_executor"])
    generate, caps = policy.generate, []

    def recording(agent, conversations, **kw):  # the real generate, its caps kept for the test
        caps.append((len(conversations), kw["max_new_tokens"]))
        return generate(agent, conversations, **kw)

    policy.generate = recording
    cfg = CoachConfig(backend="local", max_tokens=16, thinking_budget=8, max_context_tokens=4096, cache=False)
    with build_coach(cfg, "mathchat", policy=policy) as runner:
        scores = runner.score_many([ctx(output="a"), ctx(output="b")])
        stats = runner.stats()
    assert caps == [(2, 8 + 16), (2, 8 + 32)]  # both judgments in one call, then both again with more room
    assert all(s.score is None and s.error.startswith("no PROCESS_SCORE line: the reply was cut") for s in scores)
    assert (stats["replies"], stats["cut_replies"], stats["cut_rate"]) == (4, 4, 1.0)
    assert stats["replies_without_logprobs"] == 0  # the local model always has them


# -------------------------------------------------------------------------------------------------- replay
def _recorded(workflow: str = "mathchat", agent: str = "verifier") -> Episode:
    task = Task(id="t", problem="What is 2 + 3?", answer="5", source="arithmetic")
    action = Action(
        agent=agent, turn=0, messages=(Message(role="system", content="the role it got"),), text="\\boxed{5}"
    )
    return Episode(id="e7", workflow=workflow, task=task, actions=(action,), correct=True)


def test_replay_rebuilds_contexts_and_rejects_what_it_cannot() -> None:
    from mappa.coach.replay import score_episodes
    from mappa.config import load_config

    cfg = load_config(None)
    runner = build_coach(CoachConfig(backend="rubric"), "mathchat")
    seen: list[tuple[int, int]] = []
    (ep,) = score_episodes(runner, [_recorded()], cfg, lambda done, total: seen.append((done, total)))
    assert ep.actions[0].coach.score == 10.0 and seen == [(1, 1)]
    with pytest.raises(MappaError, match="workflow 'nope' is not a known workflow"):
        score_episodes(runner, [_recorded(workflow="nope")], cfg)
    with pytest.raises(MappaError, match="episode e7: agent 'analyst' is not part of workflow 'mathchat'"):
        score_episodes(runner, [_recorded(agent="analyst")], cfg)
