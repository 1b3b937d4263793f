"""Code-block extraction (tolerant of small models' fences) and the tool observation format."""

from __future__ import annotations

import pytest

from mappa.types import ExecResult
from mappa.workflows.codeblocks import extract_code_blocks, format_observation

FENCE = "```"


@pytest.mark.parametrize(
    ("text", "blocks"),
    [
        (f"Let me compute.\n{FENCE}python\nprint(1 + 1)\n{FENCE}\nDone.", ["print(1 + 1)"]),
        (f"{FENCE}py\nx = 2\n{FENCE}\n{FENCE}Python3\nprint(x)\n{FENCE}", ["x = 2", "print(x)"]),
        (f"{FENCE}\nprint('bare fence')\n{FENCE}", ["print('bare fence')"]),
        (f"{FENCE}\npython\nprint('tag on its own line')\n{FENCE}", ["print('tag on its own line')"]),
        (f"{FENCE}python print(3){FENCE}", ["print(3)"]),
        (f"Here is the code: {FENCE}python\nprint(4)\n{FENCE}", ["print(4)"]),
        (f"    {FENCE}python\n    if True:\n        print(5)\n    {FENCE}", ["if True:\n    print(5)"]),
        (f"{FENCE}python\nprint(6)", ["print(6)"]),  # generation stopped before the closing fence
        (f"{FENCE}python\nprint(7)\n{FENCE}python\nprint(8)\n{FENCE}", ["print(7)", "print(8)"]),  # never closed
        (f"{FENCE}python\nprint(9){FENCE}\nThe answer is 9.", ["print(9)"]),
        ("~~~python\nprint(10)\n~~~", ["print(10)"]),
        (f"{FENCE}output\n42\n{FENCE}\n{FENCE}bash\nls\n{FENCE}\n{FENCE}json\n{{}}\n{FENCE}", []),
        (f"{FENCE}python\n\n{FENCE}", []),
        ("No code here, the answer is \\boxed{42}.", []),
        (f"{FENCE}python\ns = '''a\n\nb'''\nprint(s)\n{FENCE}", ["s = '''a\n\nb'''\nprint(s)"]),
    ],
)
def test_extract_code_blocks(text, blocks):
    assert extract_code_blocks(text) == blocks


THINK = f"<think>\nTry it:\n{FENCE}python\nprint('draft')\n{FENCE}\n</think>\n"


@pytest.mark.parametrize(
    ("text", "blocks"),
    [
        (THINK + "The answer is 4.", []),  # the only code is inside the reasoning: nothing runs
        (THINK + f"{FENCE}python\nprint('reply')\n{FENCE}", ["print('reply')"]),
        (f"<thinking>\n{FENCE}python\nprint(1)\n{FENCE}\n</thinking>Done.", []),
        # the chat template opened the reasoning in the prompt: the reply starts inside it
        (f"{FENCE}python\nprint('draft')\n{FENCE}\n</think>\n{FENCE}python\nprint(2)\n{FENCE}", ["print(2)"]),
        # generation stopped while thinking: the unclosed block hides its code
        (f"{FENCE}python\nprint(3)\n{FENCE}\n<think>\n{FENCE}python\nprint('draft')", ["print(3)"]),
        # a fence left open inside the reasoning does not swallow the reply's code
        (f"<think>\n{FENCE}python\nx = 1\n</think>\n{FENCE}python\nprint(4)\n{FENCE}", ["print(4)"]),
    ],
)
def test_code_inside_reasoning_does_not_run(text, blocks):
    assert extract_code_blocks(text) == blocks


def test_observation_of_a_clean_run_is_its_stdout():
    r = ExecResult(ok=True, exit_code=0, stdout="42\n")
    assert format_observation(r) == "42"
    assert format_observation(ExecResult(ok=True, exit_code=0)) == "[no output]"


def test_observation_shows_stderr_and_failure_status():
    r = ExecResult(ok=False, exit_code=1, stdout="partial\n", stderr="Traceback ...\nValueError: x\n")
    assert format_observation(r) == "partial\n[stderr]\nTraceback ...\nValueError: x\n[exit code 1]"
    r = ExecResult(ok=False, timed_out=True, killed_signal=9, duration_s=10.02)
    assert format_observation(r) == "[timed out after 10.0 s: the process was killed]"
    r = ExecResult(ok=False, exit_code=1, memory_exceeded=True, stderr="MemoryError\n")
    assert format_observation(r).endswith("[memory limit exceeded]")
    r = ExecResult(ok=False, infra_error="the pool server exited")
    assert format_observation(r) == "[sandbox error: the pool server exited]"


def test_observation_is_bounded_keeping_the_start_of_stdout_and_the_end_of_stderr():
    stdout = "".join(f"line {i}\n" for i in range(2000))
    stderr = "Traceback (most recent call last):\n" + "  frame\n" * 500 + "KeyError: 'price'\n"
    r = ExecResult(ok=False, exit_code=1, stdout=stdout, stderr=stderr)
    obs = format_observation(r, max_chars=500)
    assert len(obs) <= 500
    assert obs.startswith("line 0\nline 1\n")
    assert "KeyError: 'price'" in obs and obs.endswith("[exit code 1]")
    assert "chars cut" in obs
    # A short stdout leaves the rest of the budget to stderr.
    r = ExecResult(ok=False, exit_code=1, stdout="ok\n", stderr=stderr)
    obs = format_observation(r, max_chars=500)
    assert obs.startswith("ok\n[stderr]\n") and len(obs) <= 500 and len(obs) > 400
