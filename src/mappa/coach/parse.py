"""Reading a coach reply: the `PROCESS_SCORE:` line, the `ANSWER_CORRECT:` line, and the expected score.

The parser only ever reads the number that follows the marker. A reply without the marker is
unscored (None): taking "the first number in the text" would turn a stray "step 3" from the
analysis into a reward.
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
_SCORE_RE = re.compile(
    rf"{_MARKER}{_DECOR}(?::|=|：){_DECOR}\[?{_DECOR}(?P<num>[-+]?\d+(?:[.,]\d+)?)",
    re.IGNORECASE,
)
_MARKER_RE = re.compile(rf"{_MARKER}{_DECOR}(?::|=|：)", re.IGNORECASE)
_ANSWER_RE = re.compile(
    rf"answer[ _\-]?correct{_DECOR}(?::|=|：){_DECOR}\[?{_DECOR}(?P<val>[01]|true|false|yes|no)\b",
    re.IGNORECASE,
)


def _clamp(x: float) -> float:
    return min(10.0, max(0.0, x))


def parse_score(text: str) -> float | None:
    """The score after the last `PROCESS_SCORE:` marker, clamped to [0, 10]; None when there is none.

    The last marker wins because models sometimes restate the required format ("end with
    PROCESS_SCORE: x") before giving their own line.
    """
    matches = list(_SCORE_RE.finditer(text))
    if not matches:
        return None
    value = float(matches[-1].group("num").replace(",", "."))
    return _clamp(value) if math.isfinite(value) else None


def parse_answer_correct(text: str) -> bool | None:
    """`ANSWER_CORRECT: 0|1` (also true/false, yes/no); None when absent."""
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return None
    return matches[-1].group("val").lower() in ("1", "true", "yes")


def rationale_of(text: str, max_chars: int = 1200) -> str:
    """The analysis part of a reply: everything before the first score/answer line, trimmed."""
    cut = len(text)
    for rx in (_MARKER_RE, _ANSWER_RE):
        m = rx.search(text)
        if m:
            cut = min(cut, m.start())
    body = text[:cut].strip().rstrip("*_` \n")
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
    """Probability-weighted mean of the score after the last `PROCESS_SCORE:` marker.

    Finds the first token holding a digit after the marker and averages the 0..10 values of its top
    alternatives, weighted by their renormalised probabilities. The sampled alternative keeps its
    full parsed value (so "7.5" counts as 7.5). A "1" that the sampled text continues with "0" is
    split into 10 and 1 using the next position's probability of "0" (tokenizers that split digits
    write 10 as "1","0"). Returns None (caller falls back to parsing) when the marker or a numeric
    score token is missing, or when the numeric alternatives hold less than `min_mass` probability.
    """
    text = "".join(t.token for t in tokens)
    markers = list(_MARKER_RE.finditer(text))
    if not markers:
        return None
    parsed = parse_score(text[markers[-1].start() :])
    if parsed is None:
        return None
    # Locate the token where the score number starts; only decoration may sit in between.
    start = markers[-1].end()
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
