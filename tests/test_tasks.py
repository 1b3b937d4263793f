"""Task loaders, the arithmetic generator and rule-based answer checking."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mappa.config import TasksConfig
from mappa.errors import MappaError
from mappa.tasks import SOURCES, check_answer, extract_answer, load_source, load_tasks, normalise_problem
from mappa.tasks.answers import boxed_contents, without_reasoning
from mappa.tasks.arithmetic import arithmetic_tasks
from mappa.tasks.math import gsm8k_answer

SHARED = Path(os.environ.get("MAPPA_DATA_DIR") or Path(__file__).resolve().parents[1].parent / "shared/data/math")
needs_data = pytest.mark.skipif(not (SHARED / "AIME_1983_2024.json").is_file(), reason="math data not present")


# ------------------------------------------------------------------------------------------------ answers
@pytest.mark.parametrize(
    ("text", "gold", "expected"),
    [
        ("so the answer is \\boxed{080}", "80", True),
        ("\\boxed{80}", "080", True),
        ("\\boxed{1/2}", "0.5", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{3}{4}}", "0.75", True),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True),
        ("\\boxed{27}", "27.0", True),
        ("\\boxed{1,080}", "1080", True),
        ("\\boxed{x = 5}", "5", True),
        ("\\boxed{336}", "336^\\circ", True),
        ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}", True),
        ("\\boxed{12.}", "12", True),  # a sentence-final period inside the box
        ("\\boxed{ $42$ }", "42", True),
        ("\\boxed{\\frac{1}{2}} and again \\boxed{1/2}", "0.5", True),  # two boxes, one value
        ("\\boxed{7} ... \\boxed{7}", "7", True),  # the same answer twice is one answer
        ("first \\boxed{80} then \\boxed{81}", "80", False),  # the last box is the answer
        ("first \\boxed{80} then \\boxed{81}", "81", True),
        ("The answer is 80.", "80", True),  # no box: an explicit final-answer statement counts
        ("So the answer is: 80, as computed", "80", True),
        ("#### 1,080", "1080", True),
        ("Answer: $-3/4$", "-0.75", True),
        ("I counted 80 apples in total.", "80", False),  # a missing box and no statement: a stray number
        ("The answer is 16 + 22 = 38", "38", False),  # no single stated answer
        ("The answer is 80x", "80", False),
        ("the answer is 80 \\boxed{81}", "80", False),  # a box outranks a statement
        ("\\boxed{}", "5", False),
        ("\\boxed{79}", "80", False),
        ("\\boxed{\\frac{1}{3}}", "0.33", False),
        ("\\boxed{081}", "080 or 081", True),  # AIME 2022-II-8 accepts both
        ("\\boxed{80}", "080 or 081", True),
        ("\\boxed{82}", "080 or 081", False),
        ("\\boxed{\\frac{1", "1", False),  # a box cut off by the token cap
    ],
)
def test_check_answer_tricky_formats(text: str, gold: str, expected: bool) -> None:
    assert check_answer(text, gold) is expected


# ------------------------------------------------------------------------------------------------ percent answers
# A percent sign is a unit, as the data writes percent answers ("By what percent does the square's area
# decrease?" has gold 10): `\boxed{5\%}` reads 5, so it is right for a gold of 5 or 5\%, and never also for 0.05.
PERCENT_SPELLINGS = (
    "{}\\%", "{}%", "{} percent", "{}percent", "{} Percent", "{}\\text{\\%}", "{}\\text{ percent}", "{}\\,\\%",
    "{} pct", "{} percentage",
)  # fmt: skip


@pytest.mark.parametrize("number", ["5", "12.5", "-2.5"])
@pytest.mark.parametrize("spelling", PERCENT_SPELLINGS)
def test_a_percent_answer_is_its_number_never_its_hundredth(spelling: str, number: str) -> None:
    reply = f"\\boxed{{{spelling.replace('{}', number, 1)}}}"
    hundredth = str(float(number) / 100)
    assert check_answer(reply, number) and check_answer(reply, f"{number}\\%")
    assert not check_answer(reply, hundredth)  # else one reply collects credit for two different golds


@pytest.mark.parametrize(
    ("text", "gold", "expected"),
    [
        ("\\boxed{5}", "5\\%", True),  # the gold says percent; the bare number is its number
        ("\\boxed{5}", "5 percent", True),
        ("\\boxed{0.05}", "5\\%", False),  # a fraction is not the percent's number
        ("\\boxed{\\frac{1}{20}}", "5\\%", False),
        ("\\boxed{0.5}", "50\\%", False),
        ("\\boxed{50\\%}", "0.5", False),
        ("\\boxed{50\\%}", "\\frac{1}{2}", False),
        ("\\boxed{25\\%}", "\\frac14", False),  # a problem that asks for a fraction gets one
        ("\\boxed{100\\%}", "1", False),
        ("\\boxed{150\\%}", "150", True),
        ("The answer is 25%.", "25", True),  # a stated answer reads the same way
        ("The answer is 25%.", "0.25", False),
        ("\\boxed{5\\% + 0}", "5", True),  # inside an expression the sign is the same unit, dropped
        ("\\boxed{5\\% + 0}", "0.05", False),
        ("\\boxed{(10\\%, 20\\%)}", "(10, 20)", True),
        ("\\boxed{(10\\%, 20\\%)}", "(0.1, 0.2)", False),
        ("\\boxed{\\%}", "5", False),  # a sign alone is no answer
        ("\\boxed{0.05}", "5", False),  # without a sign nothing changes
        ("\\boxed{5}", "0.05", False),
    ],
)
def test_check_answer_percent_cases(text: str, gold: str, expected: bool) -> None:
    assert check_answer(text, gold) is expected


@pytest.mark.parametrize(
    ("problem", "gold", "expected"),
    [
        ("A die is loaded. What is the probability of a six? Give a decimal.", "0.05", True),  # hundredths here
        ("A die is loaded. What is the probability of a six? Give a decimal.", "5", False),
        ("How many apples are left?", "5", False),  # a count is not a percent
        ("By what percent does the price fall?", "5", True),  # a unit here
        ("By what percent does the price fall?", "0.05", False),
        ("What share of the class, in %, passed?", "5", True),
    ],
)
def test_a_percent_sign_has_one_reading_per_problem(problem: str, gold: str, expected: bool) -> None:
    # The problem decides whether 5% means 5 or 0.05; for no problem does one reply collect both golds.
    assert check_answer("\\boxed{5\\%}", gold, problem) is expected
    assert check_answer("\\boxed{5\\%}", "5", problem) != check_answer("\\boxed{5\\%}", "0.05", problem)


@needs_data
def test_what_percent_problems_take_the_percent_sign() -> None:
    # math500's percent questions carry the bare percent as their gold; a reply with the sign is right
    asked = [t for t in load_source("math500", TasksConfig(data_dir=str(SHARED)), "eval", 0)
             if "what percent" in t.problem.lower()]  # fmt: skip
    assert asked and all(t.answer == "10" for t in asked)
    for t in asked:
        assert check_answer(f"\\boxed{{{t.answer}\\%}}", t.answer, t.problem)
        assert not check_answer(f"\\boxed{{{t.answer}\\%}}", str(int(t.answer) / 100), t.problem)


# Reasoning that boxes candidates: only the final answer outside the reasoning counts.
WRONG_THEN_RIGHT = (
    "<think>Try 6 * 8 = \\boxed{48}? No: the problem says 6 * 7, so \\boxed{42}.</think>\n"
    "I first boxed \\boxed{48} by mistake; the correct product is 42.\n\nFinal answer: \\boxed{42}"
)
RIGHT_THEN_WRONG = (
    "<think>6 * 7 = \\boxed{42}, but let me add one more for safety.</think>\n"
    "It looked like \\boxed{42}, but the final answer is \\boxed{43}"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (WRONG_THEN_RIGHT, True),
        (RIGHT_THEN_WRONG, False),
        ("<think>the answer is \\boxed{42}</think> The answer is \\boxed{41}", False),  # reasoning never answers
        ("<think>so it is \\boxed{41}... no, 42</think>The answer is 42.", True),  # a statement outside counts
        ("<think>\\boxed{42} is it, I am sure", False),  # cut off while reasoning: no answer
        ("the block opened in the prompt: \\boxed{41}</think> \\boxed{42}", True),
        ("the block opened in the prompt: \\boxed{42}</think> so \\boxed{41}", False),
        ("<thinking>\\boxed{41}</thinking> \\boxed{42}", True),  # the other reasoning markers
        ("a <think>\\boxed{1}</think> b \\boxed{42} c <think>\\boxed{2}</think> d", True),  # several blocks
    ],
)
def test_check_answer_reads_the_final_answer_outside_reasoning(text: str, expected: bool) -> None:
    assert check_answer(text, "42") is expected


def test_without_reasoning_keeps_only_the_reply() -> None:
    assert without_reasoning("<think>a</think>b<think>c</think>d") == "bd"
    assert without_reasoning("a</think>b") == "b"
    assert without_reasoning("a<think>b") == "a"
    assert extract_answer(WRONG_THEN_RIGHT) == "42"
    assert extract_answer(RIGHT_THEN_WRONG) == "43"


def test_boxed_contents_match_nested_braces() -> None:
    assert boxed_contents("a \\boxed{\\frac{1}{2}} b \\fbox{3} c \\boxed {x^{2}}") == ["\\frac{1}{2}", "3", "x^{2}"]
    assert extract_answer("\\boxed{1} then \\boxed{ 2. }") == "2"
    assert extract_answer("no box, no answer 12") is None
    assert extract_answer("the answer is 12. Later: the answer is 13.") == "13"


def test_gsm8k_answer_strips_thousands_separators() -> None:
    assert gsm8k_answer("She makes 9 * 2 = $18.\n#### 1,080") == "1080"
    with pytest.raises(ValueError):
        gsm8k_answer("no marker")


# --------------------------------------------------------------------------------------------- arithmetic
def test_arithmetic_is_seeded_disjoint_and_levelled() -> None:
    train = arithmetic_tasks(300, [1, 2, 3, 4, 5], "train", seed=7, eval_size=60)
    again = arithmetic_tasks(300, [1, 2, 3, 4, 5], "train", seed=7, eval_size=60)
    other = arithmetic_tasks(300, [1, 2, 3, 4, 5], "train", seed=8, eval_size=60)
    evals = arithmetic_tasks(60, [1, 2, 3, 4, 5], "eval", seed=7, eval_size=60)
    assert [t.problem for t in train] == [t.problem for t in again]
    assert [t.problem for t in train] != [t.problem for t in other]
    assert not {t.problem for t in train} & {t.problem for t in evals}
    assert len({t.problem for t in train}) == 300  # no duplicates within a split
    assert {t.meta["level"] for t in train} == {1, 2, 3, 4, 5}
    assert all(t.answer.isdigit() and t.source == "arithmetic" for t in train + evals)


def test_arithmetic_answers_are_right() -> None:
    tasks = {t.meta["level"]: t for t in arithmetic_tasks(10, [1, 2, 3, 4, 5], "train", seed=1, eval_size=10)}
    # level 1 "What is a + b?" and friends: recompute from the numbers in the text
    nums = [int(x) for x in __import__("re").findall(r"\d+", tasks[1].problem)]
    assert int(tasks[1].answer) == sum(nums)
    # level 3: boxes of `per`, `n` boxes, `loose`, gives `give`
    per, n, loose, give = (int(x) for x in __import__("re").findall(r"\d+", tasks[3].problem))
    assert int(tasks[3].answer) == per * n + loose - give
    # level 4: n boxes of per shared among kids, + extra - spent
    n, per, kids, extra, spent = (int(x) for x in __import__("re").findall(r"\d+", tasks[4].problem))
    assert (n * per) % kids == 0 and int(tasks[4].answer) == n * per // kids + extra - spent


def test_arithmetic_bad_level_is_a_user_error() -> None:
    with pytest.raises(MappaError, match="arithmetic_levels"):
        arithmetic_tasks(5, [9], "train", seed=0, eval_size=5)


def test_load_tasks_arithmetic_needs_no_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAPPA_DATA_DIR", str(tmp_path / "missing"))
    cfg = TasksConfig(arithmetic_train_size=40, arithmetic_eval_size=8, train_size=10)
    a = load_tasks(["arithmetic"], cfg, "train", seed=3)
    b = load_tasks(["arithmetic"], cfg, "train", seed=3)
    assert len(a) == 10 and a == b
    assert len(load_tasks(["arithmetic"], cfg, "eval", seed=3)) == 8


# ------------------------------------------------------------------------------------------------ math data
def test_unknown_source_and_missing_dir_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(MappaError, match="unknown task source 'aimee'"):
        load_tasks(["aimee"], TasksConfig(), "train", seed=0)
    with pytest.raises(MappaError, match="math data directory .*missing.* not found"):
        load_tasks(["aime"], TasksConfig(data_dir=str(tmp_path / "missing")), "eval", seed=0)
    with pytest.raises(MappaError, match="AIME_1983_2024.json: data file not found"):
        load_tasks(["aime"], TasksConfig(data_dir=str(tmp_path)), "eval", seed=0)


def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
    (tmp_path / "gsm8k_test.jsonl").write_text(good + "\n" + good + "\n{not json\n")
    with pytest.raises(MappaError, match=r"gsm8k_test.jsonl:3: malformed JSON line"):
        load_tasks(["gsm8k_test"], TasksConfig(data_dir=str(tmp_path)), "eval", seed=0)
    (tmp_path / "gsm8k_test.jsonl").write_text(good + "\n" + json.dumps({"question": "q", "answer": "no marker"}))
    with pytest.raises(MappaError, match=r"gsm8k_test.jsonl:2: answer has no '#### N' line"):
        load_tasks(["gsm8k_test"], TasksConfig(data_dir=str(tmp_path)), "eval", seed=0)


def test_normalise_problem_ignores_layout_and_diagrams() -> None:
    a = "Let $x$ , $y$ be \\tfrac{1}{2}. [asy] draw((0,0)--(1,1)); [/asy] Find  $x+y$ ."
    b = "Let x, y be \\frac{1}{2}.\nFind x + y."
    assert normalise_problem(a) == normalise_problem(b)


@needs_data
def test_every_data_file_loads_into_one_schema() -> None:
    cfg = TasksConfig(data_dir=str(SHARED))
    math_sources = [name for name in SOURCES if name not in ("arithmetic", "dsbench")]  # dsbench: test_dsbench.py
    sizes = {name: len(load_source(name, cfg, "eval", 0)) for name in math_sources}
    assert sizes == {
        "aime": 933,
        "aime2025": 30,
        "aime_eval32": 32,
        "amc": 117,
        "amc_eval32": 32,
        "math500": 500,
        "gsm8k": 7473,
        "gsm8k_test": 1319,
    }
    aime = {t.id: t for t in load_source("aime", cfg, "eval", 0)}
    assert aime["aime-2022-II-8"].answer == "080 or 081"
    assert check_answer("\\boxed{81}", aime["aime-2022-II-8"].answer)
    amc = load_source("amc", cfg, "eval", 0)
    assert amc[0].answer == "142" and all("." not in t.answer for t in amc)  # 142.0 -> "142"
    gsm = load_source("gsm8k", cfg, "eval", 0)
    assert all("," not in t.answer and "####" not in t.answer for t in gsm)
    for name in math_sources:
        t = load_source(name, cfg, "eval", 0)[0]
        assert t.problem and t.answer and t.id and t.source == name


@needs_data
def test_training_pool_drops_eval_problems_by_text() -> None:
    cfg = TasksConfig(data_dir=str(SHARED), eval=["aime_eval32"])
    train = load_tasks(["aime"], cfg, "train", seed=42)
    held = {normalise_problem(t.problem) for t in load_source("aime_eval32", cfg, "eval", 0)}
    assert len(train) == 933 - 18  # 18 eval problems removed: 16 exact, 1 with a diagram, 1 copy-edited
    assert not {normalise_problem(t.problem) for t in train} & held
    ids = {t.id for t in train}
    assert "aime-2022-I-11" not in ids  # same problem, its eval copy has no [asy] diagram
    assert "aime-2024-II-8" not in ids  # its eval copy says "outside ... externally" (a copy-editing slip)
    assert "aime-1983-1" in ids
    amc_train = load_tasks(["amc"], cfg, "train", seed=42)
    assert len(amc_train) == 117 - 32  # amc_eval32 is always held out of training
    gsm = load_tasks(["gsm8k"], TasksConfig(data_dir=str(SHARED), eval=["gsm8k_test"]), "train", seed=0)
    assert len(gsm) == 7473  # disjoint already; nothing to remove


@needs_data
def test_seeded_draw_of_512_aime_problems() -> None:
    cfg = TasksConfig(data_dir=str(SHARED), train_size=512)
    a = load_tasks(["aime"], cfg, "train", seed=42)
    assert len(a) == 512 and a == load_tasks(["aime"], cfg, "train", seed=42)
    assert a != load_tasks(["aime"], cfg, "train", seed=43)
    with pytest.raises(MappaError, match="train_size: 5000 requested"):
        load_tasks(["aime"], TasksConfig(data_dir=str(SHARED), train_size=5000), "train", seed=42)


@needs_data
def test_the_paper_draw_is_the_published_codes_512() -> None:
    """tasks.train_draw: paper draws as the published code: numpy's RandomState(42).choice(933, 512, replace=False)
    over the file's rows, sorted (its first and last picks below); mappa's draw is another 512."""
    cfg = TasksConfig(data_dir=str(SHARED), train_size=512, eval=["aime2025", "amc_eval32"], train_draw="paper")
    paper = load_tasks(["aime"], cfg, "train", seed=42)
    assert len(paper) == 512
    assert [t.id for t in paper[:5]] == ["aime-1983-1", "aime-1983-3", "aime-1983-4", "aime-1983-6", "aime-1983-7"]
    assert [t.id for t in paper[-3:]] == ["aime-2024-II-11", "aime-2024-II-13", "aime-2024-II-14"]
    ours = load_tasks(["aime"], cfg.model_copy(update={"train_draw": "mappa"}), "train", seed=42)
    assert {t.id for t in ours} != {t.id for t in paper}
    # The published draw holds 10 of aime_eval32's problems (the paper evaluated on AIME 2025 and AMC instead):
    # evaluating on them with this draw is refused, never silently trained on or silently shrunk.
    with pytest.raises(MappaError, match=r"tasks.train_draw: paper.*10 .*aime_eval32"):
        load_tasks(["aime"], cfg.model_copy(update={"eval": ["aime_eval32"]}), "train", seed=42)


@needs_data
def test_training_only_on_eval_sets_is_refused() -> None:
    with pytest.raises(MappaError, match="no problems left"):
        load_tasks(["aime2025"], TasksConfig(data_dir=str(SHARED)), "train", seed=0)


@needs_data
def test_gold_answers_check_against_themselves() -> None:
    # every gold answer, boxed, must pass its own check: catches a loader that mangles answers
    cfg = TasksConfig(data_dir=str(SHARED))
    for name in ("aime2025", "aime_eval32", "amc_eval32"):
        for t in load_source(name, cfg, "eval", 0):
            assert check_answer(f"\\boxed{{{t.answer.split(' or ')[0]}}}", t.answer), (name, t.answer)
