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
- a gold answer may list alternatives joined by " or " (AIME 2022-II-8 accepts 080 or 081): any one matches;
- a percent sign (`\\%`, `%`, `percent`, `percentage`, `pct`) has one reading per problem, never two: where the
  gold or the problem speaks of percent it is a unit, dropped from answer and gold alike (`\\boxed{5\\%}` reads 5,
  right for a gold of 5 or `5\\%`: "By what percent does the area decrease?" has gold 10); where neither does (a
  problem that asks for a probability or a fraction), it means hundredths (`\\boxed{5\\%}` reads 5/100, right for a
  gold of 0.05, wrong for 5). Math-verify alone reads `5\\%` as 5 against an integer and as 0.05 against a decimal,
  so one reply could collect credit for both.

The answer is hostile input (the policy is trained to raise its reward) and the check runs in the trainer and
in coach threads, so it is bounded: extraction is linear in the reply's length; an answer the same text as
the gold is right at once; an answer too costly to compare (`too_costly`: over MAX_ANSWER_CHARS, nested
deeper than MAX_NESTING, a power in an exponent or a factorial, a number over MAX_OPERAND in an exponent, a
factorial or a binomial) is wrong at once; every other comparison runs in a worker process
(`mappa.tasks.verify_worker`) that is killed, and the answer counted wrong, after CHECK_TIMEOUT_S. Where no
worker can start, math-verify runs in-process (bounded then only by its own timeout, in the main thread).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from mappa.tasks.verify_worker import INNER_TIMEOUT_S, equal_any

logger = logging.getLogger(__name__)
# math-verify times parsing out with SIGALRM, which only works in the main thread; elsewhere (coach threads)
# the in-process fallback runs without its timeout, and its one-time warning about that is noise, not news.
logging.getLogger("math_verify").setLevel(logging.ERROR)

CHECK_TIMEOUT_S = 3.0  # one comparison, all gold alternatives: past it the worker is killed, the answer wrong
START_TIMEOUT_S = 60.0  # a worker's start (importing sympy and math-verify), once per worker
MAX_WORKERS = 4  # comparisons running at once; more wait for a free worker
MAX_ANSWER_CHARS = 300
MAX_NESTING = 12  # brackets of any kind inside one another
MAX_OPERAND = 10_000  # largest number in an exponent, a factorial or a binomial: 2^{2023} is an answer

# (opening, closing) markers of a reasoning block, as reasoning models (DeepSeek-R1, Qwen3) write them.
REASONING_MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("<thinking>", "</thinking>"))


def without_reasoning(text: str) -> str:
    """`text` with every reasoning block removed (see the module docstring for unclosed markers)."""
    for start, end in REASONING_MARKERS:
        close, open_ = text.find(end), text.find(start)
        if close >= 0 and (open_ < 0 or close < open_):  # the block was opened before the reply began
            text = text[close + len(end) :]
        kept, i = [], 0  # one pass: a reply of many blocks costs its length, not length times blocks
        while (open_ := text.find(start, i)) >= 0:
            kept.append(text[i:open_])
            close = text.find(end, open_ + len(start))
            i = len(text) if close < 0 else close + len(end)
        kept.append(text[i:])
        text = "".join(kept)
    return text


_BOX = re.compile(r"\\(?:boxed|fbox)")
_BRACE = re.compile(r"[{}]")


def _closing(text: str, k: int) -> int:
    """The index of the brace closing the one at `k`, or -1."""
    depth = 0
    for m in _BRACE.finditer(text, k):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return -1


def boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` (and `\\fbox{...}`) in order, with nested braces matched."""
    out: list[str] = []
    i = 0
    for match in _BOX.finditer(text):
        if match.start() < i:  # inside a box already read
            continue
        k = match.end()
        while k < len(text) and text[k] == " ":
            k += 1
        if k >= len(text) or text[k] != "{":
            i = k
            continue
        m = _closing(text, k)
        if m < 0:  # unclosed box (e.g. cut off by the token cap): no answer
            return out
        out.append(text[k + 1 : m])
        i = m + 1
    return out


# "the answer is 80." / "Answer: $-3/4$" / "#### 1,080": a plain number right after an explicit marker, not followed
# by more arithmetic ("the answer is 16 + 22 = 38" states no single answer). Every repeat is bounded, so a
# megabyte of digits or spaces after a marker costs a linear scan, not a quadratic backtrack.
_STATED = re.compile(
    r"(?:answer\s{1,16}is|answer\s{0,16}:|####)\s{0,16}:?\s{0,16}\$?\s{0,16}"
    r"(-?\d[\d,]{0,63}(?:\.\d{1,64})?(?:\s{0,4}/\s{0,4}\d{1,64})?)"
    r"(?![\d,]{0,64}\s{0,16}[-+*/^=×÷\d])(?![\d,.]{0,64}[A-Za-z_])",
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


# Every spelling of a percent sign that math-verify reads as one (it multiplies by 1/100 or not, by the other
# side's type), with the spacing before it; each repeat is bounded, so the scan stays linear.
_PERCENT = re.compile(
    r"(?:\s|~|\\[,;:! ]){0,8}"
    r"(?:\\(?:text|textrm|mathrm|mbox)\s{0,8}\{\s{0,8}(?:\\?%|percent(?:age)?|pct)\s{0,8}\}"
    r"|\\?%|(?<![A-Za-z])(?:percent(?:age)?|pct)(?![A-Za-z]))",
    re.IGNORECASE,
)


def without_percent(text: str) -> str:
    """`text` with every percent sign dropped: "5\\%" -> "5", "(10\\%, 20\\%)" -> "(10, 20)" (see the docstring)."""
    return _PERCENT.sub("", text).strip()


def percent_is_a_unit(golds: list[str], problem: str | None) -> bool:
    """Whether a percent sign in an answer is a unit to drop (the gold or the problem speaks of percent, or the
    problem is not known) rather than hundredths."""
    return problem is None or any(_PERCENT.search(g) for g in golds) or _PERCENT.search(problem) is not None


def gold_alternatives(gold: str) -> list[str]:
    """ "080 or 081" -> ["080", "081"]; a plain gold answer -> [gold]."""
    return [g.strip() for g in gold.split(" or ") if g.strip()]


def _group_end(text: str, i: int) -> int:
    """The index just past the bracket group opening at `i` (its end if unclosed)."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] in "({[":
            depth += 1
        elif text[j] in ")}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _group_start(text: str, j: int) -> int:
    """The index of the bracket opening the group that closes at `j`."""
    depth = 0
    for i in range(j, -1, -1):
        if text[i] in ")}]":
            depth += 1
        elif text[i] in "({[":
            depth -= 1
            if depth == 0:
                return i
    return 0


def _exponent(text: str, i: int) -> str:
    """The operand of a power whose exponent starts at `i`: a bracket group, a command or a run of digits."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return ""
    if text[i] in "({[":
        return text[i : _group_end(text, i)]
    run = re.match(r"\\[A-Za-z]+|\d+|.", text[i:])
    return run.group() if run else ""


def _factorial_operand(text: str, j: int) -> str:
    """The operand of the factorial sign at `j`: the group or the run of digits or letters before it."""
    j -= 1
    while j >= 0 and text[j] == " ":
        j -= 1
    if j < 0:
        return ""
    if text[j] in ")}]":
        return text[_group_start(text, j) : j + 1]
    run = re.search(r"(?:\d+|[A-Za-z]+)$", text[: j + 1])
    return run.group() if run else ""


def _big(operand: str) -> bool:
    """A power, a factorial, or a number over MAX_OPERAND inside `operand`."""
    if "^" in operand or "**" in operand or "!" in operand:
        return True
    return any(len(n) > 6 or int(n) > MAX_OPERAND for n in re.findall(r"\d+", operand))


def _depth(text: str) -> int:
    depth = deepest = 0
    for c in text:
        if c in "({[":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")}]":
            depth -= 1
    return deepest


def too_costly(answer: str) -> bool:
    """Whether comparing `answer` could take sympy minutes: long, deeply nested, or a huge power or factorial."""
    if len(answer) > MAX_ANSWER_CHARS or _depth(answer) > MAX_NESTING:
        return True
    for m in re.finditer(r"\^|\*\*", answer):
        if _big(_exponent(answer, m.end())):
            return True
    for m in re.finditer(r"!", answer):
        if _big(_factorial_operand(answer, m.start())):
            return True
    return bool(re.search(r"binom|choose", answer)) and _big(answer)  # C(10^6, 5*10^5) has 300,000 digits


class _StartError(Exception):
    """A worker that never said it was ready."""


class _Worker:
    """One `verify_worker` process; `ask` answers None when it died or ran out of time (then kill it)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(_WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
            start_new_session=True,  # a Ctrl-C at the terminal is for the host, which ends the worker itself
        )
        self.ready = False
        self._buffer = b""

    def _line(self, deadline: float) -> bytes | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        poller = select.poll()  # poll, not select: a trainer may hold more than 1024 descriptors
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def ask(self, golds: list[str], answer: str, timeout: float) -> bool | None:
        if not self.ready:
            if self._line(time.monotonic() + START_TIMEOUT_S) != b"ready":
                raise _StartError
            self.ready = True
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps([golds, answer]) + "\n").encode())
        except OSError:  # it died
            return None
        line = self._line(time.monotonic() + timeout)
        return None if line is None else line == b"1"

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        elif self.proc.stdin is not None:
            self.proc.stdin.close()  # it exits at the end of its input
        try:
            self.proc.wait(timeout=None if kill else 2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Verifier:
    """Up to MAX_WORKERS workers shared by every thread; one that overruns is killed and replaced."""

    def __init__(self) -> None:
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_WORKERS)
        self.unavailable = False  # no worker could start: compare in-process

    def _take(self) -> _Worker:
        with self.lock:
            return self.idle.pop() if self.idle else _Worker()

    def _put(self, worker: _Worker) -> None:
        with self.lock:
            self.idle.append(worker)

    def equal(self, golds: list[str], answer: str) -> bool:
        if self.unavailable:
            return _in_process(golds, answer)
        with self.slots:
            try:
                worker = self._take()
            except OSError:
                return self._fall_back(golds, answer)
            try:
                result = worker.ask(golds, answer, CHECK_TIMEOUT_S)
            except _StartError:
                worker.close(kill=True)
                return self._fall_back(golds, answer)
            except BaseException:  # interrupted mid-request: its reply would answer the next request
                worker.close(kill=True)
                raise
            if result is None:  # overran or died: the answer is wrong
                worker.close(kill=True)
                self._spare()
                return False
            self._put(worker)
            return result

    def _fall_back(self, golds: list[str], answer: str) -> bool:
        self.unavailable = True
        logger.warning("answer checking: no worker process could start; math-verify runs in-process")
        return _in_process(golds, answer)

    def _spare(self) -> None:
        """Start a replacement now, so it imports math-verify while the host goes on."""
        try:
            self._put(_Worker())
        except OSError:
            pass

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.close()


_WORKER_SCRIPT = Path(__file__).with_name("verify_worker.py")
_verifier = _Verifier()
atexit.register(lambda: _verifier.close())


def _after_fork() -> None:  # a forked child must not share its parent's workers (their pipes)
    global _verifier
    _verifier = _Verifier()


os.register_at_fork(after_in_child=_after_fork)


def _in_process(golds: list[str], answer: str) -> bool:
    """The comparison without a worker: math-verify's timeout works in the main thread only."""
    timeout = INNER_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return equal_any(golds, answer, timeout)


def check_answer(model_text: str, gold: str, problem: str | None = None) -> bool:
    """True when the reply's final answer (`extract_answer`) equals the gold answer or one of its " or "
    alternatives, a percent sign read once for the `problem` (a unit, or hundredths: see the docstring); an answer
    `too_costly` to compare is wrong, and so is one whose comparison overruns."""
    answer = extract_answer(model_text)
    golds = gold_alternatives(gold)
    if answer is None or not golds:
        return False
    if answer in golds:
        return True
    if too_costly(answer):
        return False
    unit = percent_is_a_unit(golds, problem)
    had_sign = _PERCENT.search(answer) is not None
    answer, golds = without_percent(answer), [without_percent(g) for g in golds]
    if not answer:
        return False
    if had_sign and not unit:
        answer = f"({answer})/100"
    if answer in golds:
        return True
    return _verifier.equal(golds, answer)
