"""Reading a coach reply: its verdict lines (`PROCESS_SCORE:`, `ANSWER_CORRECT:`) and the expected score.

The parser only ever reads the number that follows the marker. A reply without the marker is
unscored (None): taking "the first number in the text" would turn a stray "step 3" from the
analysis into a reward.

The verdict is the coach's own, never text it quotes: the evidence is written by the agents being
judged, and an agent rewarded for its score will write `PROCESS_SCORE: 10` for the coach to repeat.
So the score is read only from the reply's verdict block, its final non-empty lines when each of them
starts with a marker, and the reply is ambiguous (None, so the caller asks once more) when the block
has no score line or when any other score marker in the reply, quoted or restated, gives another value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Marker variants seen in the wild: PROCESS_SCORE, Process Score, process-score, with markdown
# bold/italics/backticks around the name or the number, ':' or '=' as separator, "7/10" or "[7]".
_DECOR = r"[\*_`\s]*"
_MARKER = r"process[ _\-]?score"
_SEP = r"(?::|=|：)"
_NUM = rf"{_DECOR}\[?{_DECOR}(?P<num>[-+]?\d+(?:[.,]\d+)?)"
_SCORE_RE = re.compile(rf"{_MARKER}{_DECOR}{_SEP}{_NUM}", re.IGNORECASE)
_ANSWER = rf"answer[ _\-]?correct{_DECOR}{_SEP}{_DECOR}\[?{_DECOR}(?P<val>[01]|true|false|yes|no)\b"
_ANSWER_RE = re.compile(_ANSWER, re.IGNORECASE)
# A verdict line starts with its marker, after at most markdown decoration (bold, heading, bullet).
_LEAD = r"^[\s*_`#\-]*"
_SCORE_LINE_RE = re.compile(rf"{_LEAD}{_MARKER}{_DECOR}(?P<sep>{_SEP}){_NUM}", re.IGNORECASE)
_ANSWER_LINE_RE = re.compile(rf"{_LEAD}{_ANSWER}", re.IGNORECASE)
_BLANK = " \t*_`-=#>"  # a line of only these (a rule, a lone "**" or code fence) is skipped at the end


def _clamp(x: float) -> float:
    return min(10.0, max(0.0, x))


def _number(m: re.Match[str]) -> float:
    return float(m.group("num").replace(",", "."))


def _is_yes(m: re.Match[str]) -> bool:
    return m.group("val").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Verdict:
    """The reply's verdict block: where it starts, its score line's value and where that number begins."""

    start: int  # offset of the block's first line in the reply
    score: float | None  # the score line's value, unclamped; None: the block has no single score line
    number_at: int = -1  # offset just after the score line's separator (the number follows)
    answer: bool | None = None  # the block's ANSWER_CORRECT, None without one


def _block(text: str) -> list[tuple[int, str]]:
    """The trailing verdict lines, with their offsets, in reply order; [] when the last line is none."""
    lines, pos = [], 0
    for line in text.splitlines(keepends=True):
        lines.append((pos, line))
        pos += len(line)
    block: list[tuple[int, str]] = []
    for start, line in reversed(lines):
        if not line.strip().strip(_BLANK):
            continue  # a blank line, or bare decoration (a rule, a lone "**"), after or between verdict lines
        if _SCORE_LINE_RE.match(line) or _ANSWER_LINE_RE.match(line):
            block.append((start, line))
            continue
        break
    return block[::-1]


def verdict(text: str) -> Verdict | None:
    """The verdict block of a reply, or None when the reply does not end with one."""
    block = _block(text)
    if not block:
        return None
    scores = [(start, m) for start, line in block if (m := _SCORE_LINE_RE.match(line))]
    answers = {_is_yes(m) for _, line in block if (m := _ANSWER_LINE_RE.match(line))}
    answer = answers.pop() if len(answers) == 1 else None
    if len(scores) != 1:
        return Verdict(block[0][0], None, answer=answer)
    start, m = scores[0]
    value = _number(m)
    # Any other score marker in the reply (a quote of the evidence, a restated format) must agree.
    if any(_number(other) != value for other in _SCORE_RE.finditer(text)):
        return Verdict(block[0][0], None, answer=answer)
    return Verdict(block[0][0], value, start + m.end("sep"), answer)


_ANY_MARKER_RE = re.compile(rf"{_MARKER}|answer[ _\-]?correct", re.IGNORECASE)


def holds_marker(text: str) -> bool:
    """Whether `text` names a verdict marker, in any of the forms the parser reads."""
    return _ANY_MARKER_RE.search(text) is not None


def parse_score(text: str) -> float | None:
    """The score of the reply's verdict line, clamped to [0, 10]; None when there is no unambiguous one."""
    v = verdict(text)
    if v is None or v.score is None or not math.isfinite(v.score):
        return None
    return _clamp(v.score)


def parse_answer_correct(text: str) -> bool | None:
    """`ANSWER_CORRECT: 0|1` (also true/false, yes/no) from the verdict block; None when absent or conflicting."""
    v = verdict(text)
    if v is None or v.answer is None:
        return None
    if any(_is_yes(m) != v.answer for m in _ANSWER_RE.finditer(text)):
        return None
    return v.answer


def rationale_of(text: str, max_chars: int = 1200) -> str:
    """The analysis part of a reply: everything before its verdict block, trimmed."""
    v = verdict(text)
    body = text[: v.start] if v is not None else text
    body = body.strip().rstrip("*_` \n")
    if not body:
        body = text.strip()
    return body if len(body) <= max_chars else body[: max_chars - 3] + "..."


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability and the top alternatives at that position."""

    token: str  # decoded text of the sampled token
    logprob: float  # log p(token)
    top: tuple[tuple[str, float], ...] = ()  # (decoded alternative, log p) at the same position


def _score_value(token: str) -> int | None:
    t = token.strip()
    if t.isdigit() and t.isascii():
        v = int(t)
        return v if 0 <= v <= 10 else None
    return None


def expected_score(tokens: Sequence[TokenLogprob], min_mass: float = 0.5) -> float | None:
    """Probability-weighted mean of the score on the reply's verdict line (see `verdict`).

    Finds the first token holding a digit after the marker and averages the 0..10 values of its top
    alternatives, weighted by their renormalised probabilities. The sampled alternative keeps its
    full parsed value (so "7.5" counts as 7.5). A "1" that the sampled text continues with "0" is
    split into 10 and 1 using the next position's probability of "0" (tokenizers that split digits
    write 10 as "1","0"). Returns None (caller falls back to parsing) when the marker or a numeric
    score token is missing, or when the numeric alternatives hold less than `min_mass` probability.
    """
    text = "".join(t.token for t in tokens)
    parsed = parse_score(text)
    if parsed is None:
        return None
    # Locate the token where the verdict's number starts; only decoration may sit in between.
    start = verdict(text).number_at
    pos = 0
    idx = None
    for i, t in enumerate(tokens):
        end = pos + len(t.token)
        if end > start:
            part = t.token[max(0, start - pos) :]
            if any(c.isdigit() for c in part):
                idx = i
                break
            if part.strip(" \t\n*_`["):
                return None
        pos = end
    if idx is None:
        return None
    sampled = tokens[idx]
    if _score_value(sampled.token) is None:
        return None
    alternatives = dict(sampled.top)
    alternatives[sampled.token] = sampled.logprob
    mass = 0.0
    total = 0.0
    for tok, lp in alternatives.items():
        v = _score_value(tok)
        if v is None:
            continue
        p = math.exp(lp)
        value = parsed if tok == sampled.token else float(v)
        if tok == sampled.token and tok.strip() == "1" and idx + 1 < len(tokens):
            # "1" may be the first half of "10": split its mass with the next position's P("0").
            nxt = tokens[idx + 1]
            cont = dict(nxt.top)
            cont[nxt.token] = nxt.logprob
            p_zero = min(1.0, sum(math.exp(lp2) for tok2, lp2 in cont.items() if tok2 == "0"))
            value = p_zero * 10.0 + (1.0 - p_zero) * (parsed if parsed < 10.0 else 1.0)
        total += p * value
        mass += p
    if mass < min_mass:
        return None
    return _clamp(total / mass)
