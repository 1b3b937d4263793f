"""Rule-based answer checking: the final `\\boxed{...}` of a reply against the gold answer, via math-verify.

The rules, chosen so that a reward can never come from a stray number or a discarded candidate:
- reasoning is not the answer: text inside `<think>...</think>` (or another pair of `REASONING_MARKERS`) is
  ignored; an opening marker never closed (cut off by the token cap) hides the rest of the reply, and a
  closing marker with no opening one (the chat template opened the block in the prompt) hides what precedes it;
- the answer is the content of the last `\\boxed{...}` outside the reasoning: a reply that boxes a candidate,
  rejects it and boxes another answers with the last one (so boxing several answers gains nothing);
- a reply without a box counts only through an explicit final-answer statement with a plain number ("the
  answer is 80", "Answer: 80", "#### 80"): small models rarely box, and a stray number never counts;
- comparison is mathematical (math-verify + sympy): `080` = `80`, `1/2` = `0.5` = `\\frac{1}{2}`, `27.0` = `27`,
  `x=5` = `5`, `1,080` = `1080`, `336^\\circ` = `336`;
- a gold answer may list alternatives joined by " or " (AIME 2022-II-8 accepts 080 or 081): any one matches.
"""

from __future__ import annotations

import logging
import re
import threading

from math_verify import parse, verify

# math-verify times parsing out with SIGALRM, which only works in the main thread; elsewhere (coach threads)
# we run without its timeout, and its one-time warning about that is noise, not news.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_TIMEOUT_S = 5

# (opening, closing) markers of a reasoning block, as reasoning models (DeepSeek-R1, Qwen3) write them.
REASONING_MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("<thinking>", "</thinking>"))


def without_reasoning(text: str) -> str:
    """`text` with every reasoning block removed (see the module docstring for unclosed markers)."""
    for start, end in REASONING_MARKERS:
        close, open_ = text.find(end), text.find(start)
        if close >= 0 and (open_ < 0 or close < open_):  # the block was opened before the reply began
            text = text[close + len(end) :]
        while (open_ := text.find(start)) >= 0:
            close = text.find(end, open_ + len(start))
            text = text[:open_] if close < 0 else text[:open_] + text[close + len(end) :]
    return text


def boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` (and `\\fbox{...}`) in order, with nested braces matched."""
    out: list[str] = []
    i = 0
    while True:
        starts = [j for j in (text.find("\\boxed", i), text.find("\\fbox", i)) if j >= 0]
        if not starts:
            return out
        j = min(starts)
        k = j + (6 if text.startswith("\\boxed", j) else 5)
        while k < len(text) and text[k] == " ":
            k += 1
        if k >= len(text) or text[k] != "{":
            i = k
            continue
        depth, m = 0, k
        while m < len(text):
            if text[m] == "{":
                depth += 1
            elif text[m] == "}":
                depth -= 1
                if depth == 0:
                    break
            m += 1
        if depth != 0:  # unclosed box (e.g. cut off by the token cap): no answer
            return out
        out.append(text[k + 1 : m])
        i = m + 1


# "the answer is 80." / "Answer: $-3/4$" / "#### 1,080": a plain number right after an explicit marker, not followed
# by more arithmetic ("the answer is 16 + 22 = 38" states no single answer).
_STATED = re.compile(
    r"(?:answer\s+is|answer\s*:|####)\s*:?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?)(?![\d,]*\s*[-+*/^=×÷\d])(?![\d,.]*[A-Za-z_])",
    re.IGNORECASE,
)


def stated_answer(text: str) -> str | None:
    """The last explicitly stated plain-number answer of an unboxed reply, or None."""
    found = _STATED.findall(text)
    return found[-1].replace(" ", "").rstrip(",") if found else None


def _normalise(content: str) -> str:
    # "12." and "$12$" are the same answer; math-verify would read "12." as text.
    return content.strip().strip("$").strip().rstrip(".").strip()


def extract_answer(text: str) -> str | None:
    """The answer of a reply outside its reasoning: the last non-empty box, else an explicitly stated number."""
    text = without_reasoning(text)
    boxes = [b for b in (_normalise(c) for c in boxed_contents(text)) if b]
    return boxes[-1] if boxes else stated_answer(text)


def gold_alternatives(gold: str) -> list[str]:
    """ "080 or 081" -> ["080", "081"]; a plain gold answer -> [gold]."""
    return [g.strip() for g in gold.split(" or ") if g.strip()]


def _equal(gold: str, answer: str) -> bool:
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
    answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))


def check_answer(model_text: str, gold: str) -> bool:
    """True when the reply's final answer (`extract_answer`) equals the gold answer or one of its " or " alternatives."""
    answer = extract_answer(model_text)
    return answer is not None and any(_equal(g, answer) for g in gold_alternatives(gold))
