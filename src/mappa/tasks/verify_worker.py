"""The math-verify comparison behind `mappa.tasks.answers.check_answer`, and the worker process that runs it.

sympy may hold the interpreter for minutes on a short hostile answer (`9^{9^{8}}` is evaluated) and no signal
or thread can stop it, so the host runs the comparison here, in a process it can kill:

    python -I verify_worker.py     # stdin: one JSON line [golds, answer] per request; stdout: "1" or "0"

It prints "ready" once math-verify and sympy are loaded and exits at the end of its input. The file imports
nothing of mappa (it runs as a script, isolated, so no folder of mappa shadows the standard library) and
limits its own address space, so an answer that asks for gigabytes fails here instead of in the host.
"""

from __future__ import annotations

import json
import logging
import sys

MEMORY_BYTES = 2 << 30  # the worker's address space: loaded, it holds about 100 MB
INNER_TIMEOUT_S = 2  # math-verify's own timeout per step (SIGALRM: it works in this process's main thread)


def equal_any(golds: list[str], answer: str, timeout: int | None) -> bool:
    """Whether `answer` equals one of `golds` mathematically (math-verify; `timeout`: its own per-step limit)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException  # a BaseException

    try:
        answer_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
        if not answer_parsed:
            return False
        for gold in golds:
            gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
            if gold_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=timeout):
                return True
    except (Exception, TimeoutException):  # noqa: BLE001 - an answer math-verify cannot handle is not equal
        return False
    return False


def _limit_memory() -> None:
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_BYTES, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not every platform has it; the host's deadline still holds
        pass


def main() -> None:
    _limit_memory()
    logging.disable(logging.WARNING)  # math-verify logs every answer it cannot parse
    # sympy and the LaTeX parser load before "ready", so the first request is timed like every other
    equal_any(["1/2"], "\\frac{1}{2}", None)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            golds, answer = json.loads(line)
            ok = equal_any([str(g) for g in golds], str(answer), INNER_TIMEOUT_S)
        except (ValueError, TypeError, MemoryError, RecursionError):
            ok = False
        sys.stdout.write("1\n" if ok else "0\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
