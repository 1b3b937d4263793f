"""The hidden unit tests of the Coder -> Reviewer team: parsing them, the harness that runs code against them in
the sandbox, and reading back what it printed.

A task's tests are lines `assert CALL == VALUE` (`Task.answer`, hidden; `meta.example`, shown to the agents).
The code under test is treated as an adversary (tests/test_example_team.py tries the attacks):
- only the calls go into the sandbox; the expected values stay on the host, which compares them by value and
  type with what came back (`True` is not `1`, and an object equal to everything is not a literal);
- the code runs in a forked child of the harness, which prefixes each result with a one-time nonce. The nonce
  comes from a file that the harness reads and deletes only after the fork, and the harness is not dumpable,
  so the code cannot learn it and text it prints is never taken for a result;
- in a hidden-test run the code's standard output goes to /dev/null.

Nothing here touches the sandbox: the workflow (team.py) writes the nonce file into a fresh workspace per run.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mappa.errors import MappaError
from mappa.types import ExecResult, Task
from mappa.workflows.codeblocks import format_observation

_TEST_LINE = "assert CALL == VALUE, e.g. assert add(2, 3) == 5"

NONCE_FILE = ".nonce"  # written by the host into the run's fresh workspace; the harness reads and deletes it

# Runs in the sandbox. The solution is a string literal here, so nothing it contains (an unclosed quote, a
# trailing backslash) can change the harness's own code. The solution runs in a forked child that never holds
# the nonce: the parent reads and deletes the nonce file only after the fork, while the child waits, and the
# parent is not dumpable, so the child cannot read its memory either. The child sends one line per call through
# a pipe; the parent prefixes each with the nonce. _QUIET (hidden runs): the child's fd 1 goes to /dev/null.
_HARNESS = """
import os, sys, traceback


def _child(go, results):
    os.read(go, 1)
    if _QUIET:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    out = os.fdopen(results, "w")
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(_SOLUTION, "<solution>", "exec"), ns)
    except SystemExit:
        pass
    for i, call in enumerate(_CALLS):
        try:
            line = "ok " + repr(eval(call, ns))
        except Exception as e:
            line = "error " + type(e).__name__ + ": " + str(e)
        out.write(str(i) + " " + line.replace("\\n", " ")[:2000] + "\\n")
        out.flush()


go_r, go_w = os.pipe()
res_r, res_w = os.pipe()
pid = os.fork()
if pid == 0:
    status = 0
    try:
        os.close(go_w)
        os.close(res_r)
        _child(go_r, res_w)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
os.close(go_r)
os.close(res_w)
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no reading this process's memory
except Exception:
    pass
with open(_NONCE_FILE) as f:
    nonce = f.read().strip()
os.remove(_NONCE_FILE)
os.write(go_w, b"x")
os.close(go_w)
with os.fdopen(res_r, "rb") as f:
    lines = f.read(1 << 20).decode("utf-8", "replace").splitlines()
for line in lines:
    sys.stdout.write(nonce + " " + line + "\\n")
sys.stdout.flush()
_, wait_status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(wait_status)
sys.exit(code if code >= 0 else 1)
"""


@dataclass(frozen=True)
class Check:
    """One unit test: a call that runs in the sandbox and the value it must return, which stays on the host."""

    call: str  # "add(2, 3)"
    expected: Any  # 5

    @property
    def text(self) -> str:
        return f"assert {self.call} == {self.expected!r}"

    @property
    def shown(self) -> str:
        """How an agent is shown the visible example."""
        return f"Example: {self.call} returns {self.expected!r}"


@dataclass(frozen=True)
class Outcome:
    """What one check gave: `status` is pass, fail (a wrong value), error (the call raised) or missing."""

    status: str
    got: str = ""  # the value's repr, or the exception

    def as_dict(self) -> dict[str, str]:
        return {"status": self.status, "got": self.got}


def parse_checks(text: str, where: str) -> list[Check]:
    """The checks of `text`, one `assert CALL == VALUE` a line (VALUE a Python literal); MappaError otherwise."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise MappaError(f"{where}: line {e.lineno}: not Python ({_TEST_LINE})") from None
    checks = []
    for node in tree.body:
        test = node.test if isinstance(node, ast.Assert) else None
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            raise MappaError(f"{where}: line {node.lineno}: expected {_TEST_LINE}")
        try:
            expected = ast.literal_eval(test.comparators[0])
        except ValueError:
            raise MappaError(f"{where}: line {node.lineno}: the expected value must be a literal") from None
        checks.append(Check(ast.unparse(test.left), expected))
    if not checks:
        raise MappaError(f"{where}: no tests ({_TEST_LINE})")
    return checks


def harness(code: str, checks: Sequence[Check], quiet: bool) -> str:
    """The snippet that runs `code`, then each check's call, printing `<nonce> <index> ok <repr>` (or `error
    <exception>`) per call; the nonce comes from the workspace's NONCE_FILE, never from this text."""
    calls = [c.call for c in checks]
    head = f"_SOLUTION = {code!r}\n_CALLS = {calls!r}\n_QUIET = {quiet!r}\n_NONCE_FILE = {NONCE_FILE!r}\n"
    return head + _HARNESS


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (so `True` does not pass for `1`, nor `(1,)` for `[1]`)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def _harness_line(line: str, nonce: str) -> tuple[int, str] | None:
    """(check index, `ok <repr>` or `error <exception>`) of a line the harness printed, else None."""
    parts = line.split(" ", 2)
    if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None


def read_outcomes(result: ExecResult, checks: Sequence[Check], nonce: str) -> list[Outcome]:
    """Each check's outcome from the harness's lines. A check with several lines (forged) fails."""
    lines: dict[int, list[str]] = {}
    for line in result.stdout.splitlines():
        found = _harness_line(line, nonce)
        if found is not None:
            lines.setdefault(found[0], []).append(found[1])
    out = []
    for i, check in enumerate(checks):
        seen = lines.get(i, [])
        if len(seen) != 1:
            out.append(Outcome("missing" if not seen else "fail", "" if not seen else "several results"))
            continue
        kind, _, got = seen[0].partition(" ")
        if kind != "ok":
            out.append(Outcome("error", got))
            continue
        try:  # the text is the code's to choose: anything that is not a plain literal fails
            value = ast.literal_eval(got)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            out.append(Outcome("fail", got))
            continue
        out.append(Outcome("pass" if same(value, check.expected) else "fail", got))
    return out


def passed(result: ExecResult, outcomes: Sequence[Outcome]) -> bool | None:
    """All checks passed in a run that exited cleanly; None when the sandbox itself failed (no verdict)."""
    if result.infra_error is not None:
        return None
    return result.ok and all(o.status == "pass" for o in outcomes)


def readable(result: ExecResult, checks: Sequence[Check], nonce: str) -> ExecResult:
    """`result` with the harness's lines shown as a REPL would (`>>> add(1, 2)` then `3`), the nonce gone."""
    kept = []
    for line in result.stdout.splitlines():
        found = _harness_line(line, nonce)
        if found is None or found[0] >= len(checks):
            kept.append(line)
        else:
            kept.append(f">>> {checks[found[0]].call}\n{found[1].partition(' ')[2]}")
    return result.model_copy(update={"stdout": "\n".join(kept) + ("\n" if kept else "")})


@dataclass(frozen=True)
class Spec:
    """A task's parsed tests: the visible example and the hidden checks."""

    example: Check
    hidden: tuple[Check, ...]


def task_spec(task: Task) -> Spec:
    example = task.meta.get("example")
    if not isinstance(example, str):
        raise MappaError(f"task {task.id}: meta.example must be one test line ({_TEST_LINE})")
    (check,) = parse_checks(example, f"task {task.id}: meta.example")[:1]
    return Spec(check, tuple(parse_checks(task.answer, f"task {task.id}: answer")))


@dataclass(frozen=True)
class Job:
    """One snippet to run: `code` against `checks`; `quiet` (hidden tests): what the code prints is dropped."""

    code: str
    checks: Sequence[Check]
    quiet: bool


@dataclass(frozen=True)
class Ran:
    """A job's result as the agents may see it (nonce lines shown as a REPL would) and its checks' outcomes."""

    result: ExecResult
    outcomes: list[Outcome]

    def summary(self) -> dict[str, Any]:
        return {"passed": sum(o.status == "pass" for o in self.outcomes), "total": len(self.outcomes)}


def example_evidence(check: Check, ran: Ran | None) -> dict[str, Any]:
    """What the coach is told of a visible example run (the agents see the same in the observation)."""
    outcome = ran.outcomes[0] if ran is not None else Outcome("missing")
    return {"call": check.call, "expected": repr(check.expected), **outcome.as_dict()}


def tests_evidence(checks: Sequence[Check], ran: Ran | None) -> dict[str, Any]:
    """What the coach of the final agent is told of a hidden-test run (never shown to an agent)."""
    if ran is None:
        return {"passed": 0, "total": len(checks), "ok": False, "first_failure": "no code"}
    failures = [f"{c.text} -> {o.status} {o.got}".rstrip() for c, o in zip(checks, ran.outcomes, strict=True)]
    first = next((f for f, o in zip(failures, ran.outcomes, strict=True) if o.status != "pass"), "")
    if not first and not ran.result.ok:
        first = format_observation(ran.result, 300)
    return {**ran.summary(), "ok": passed(ran.result, ran.outcomes), "first_failure": first}
