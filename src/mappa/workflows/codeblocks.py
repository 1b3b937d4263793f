"""Helpers for the workflows: pull Python code out of a model's text, and turn an ExecResult into the
tool observation the next turn sees.

Which code runs (the fence rules):
- Only the reply counts, not its reasoning: every `<think>...</think>` (or `<thinking>`) block is removed
  first (`mappa.tasks.answers.without_reasoning`), so draft code a reasoning model writes while thinking
  neither runs nor makes the action a tool call. A reasoning block never closed (generation stopped while
  thinking) removes everything after its opening marker; a closing marker with no opening one (the chat
  template opened the block in the prompt) removes everything before it.
- Small models get fences wrong in predictable ways, all accepted: ```py / ```Python / ```python3 /
  ~~~python, a bare ``` fence, the language on its own line after the fence, indented fences, a fence on
  the same line as the code (```python print(1)```), and a final block never closed because generation
  stopped (it runs up to the end of the reply).
- Fences tagged as another language (```text, ```output, ```bash, ```json, ...) are not code to run.
"""

from __future__ import annotations

import re
import textwrap

from mappa.tasks.answers import without_reasoning
from mappa.types import ExecResult

_PYTHON_TAGS = {"", "python", "python3", "py", "py3", "ipython", "python:run", "pycon"}
_MIDLINE_OPEN = re.compile(r"([^\s`])[ \t]*((?:```|~~~)(?:python3?|py)[ \t]*\n)", re.IGNORECASE)
_FENCE = re.compile(r"^[ \t]*(```|~~~)[ \t]*([\w:+.-]*)[ \t]*(.*)$")


def _clean(lines: list[str]) -> str:
    return textwrap.dedent("\n".join(lines)).strip("\n")


def extract_code_blocks(text: str) -> list[str]:
    """The Python code blocks of `text` outside its reasoning blocks, in order; empty blocks are dropped."""
    blocks: list[str] = []
    text = without_reasoning(text)
    # "Here is the code: ```python" opens a block mid-line: move the fence to its own line.
    text = _MIDLINE_OPEN.sub(r"\1\n\2", text)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, tag, rest = m.group(1), m.group(2).lower(), m.group(3)
        if rest.endswith(fence):
            # ```python print(1)``` on one line
            if tag in _PYTHON_TAGS and rest[: -len(fence)].strip():
                blocks.append(rest[: -len(fence)].strip())
            i += 1
            continue
        body: list[str] = [rest] if rest.strip() else []
        j = i + 1
        next_i = len(lines)
        while j < len(lines):
            m2 = _FENCE.match(lines[j])
            if m2 and m2.group(1) == fence:
                if m2.group(2) and not m2.group(3):
                    next_i = j  # a new opening fence: this block was never closed
                    break
                if not m2.group(2) and not m2.group(3).strip(" `~"):
                    next_i = j + 1  # the closing fence
                    break
            stripped = lines[j].rstrip()
            if stripped.endswith(fence) and not m2:
                body.append(stripped[: -len(fence)])  # code``` closing on the last code line
                next_i = j + 1
                break
            body.append(lines[j])
            j += 1
        if tag == "" and body and body[0].strip().lower() in ("python", "python3", "py"):
            body = body[1:]  # ```\npython\ncode
        if tag in _PYTHON_TAGS:
            code = _clean(body)
            if code:
                blocks.append(code)
        i = next_i
    return blocks


def _head(text: str, n: int) -> str:
    if len(text) <= n:
        return text
    return text[: max(0, n - 40)] + f"\n[... {len(text) - max(0, n - 40)} chars cut]"


def _tail(text: str, n: int) -> str:
    if len(text) <= n:
        return text
    return f"[{len(text) - max(0, n - 40)} chars cut ...]\n" + text[len(text) - max(0, n - 40) :]


def format_observation(result: ExecResult, max_chars: int = 2000) -> str:
    """stdout, then `[stderr]` and its text, then a status line when the run failed; at most `max_chars`.

    When too long, stdout keeps its beginning and stderr its end (where a traceback says what went wrong).
    """
    status = ""
    if result.infra_error:
        status = f"[sandbox error: {result.infra_error}]"
    elif result.timed_out:
        status = f"[timed out after {result.duration_s:.1f} s: the process was killed]"
    elif result.memory_exceeded:
        status = "[memory limit exceeded]"
    elif result.workspace_flooded:
        status = "[the workspace holds too many files and folders: the sandbox stopped listing them]"
    elif result.killed_signal is not None:
        status = f"[killed by signal {result.killed_signal}]"
    elif result.exit_code not in (0, None):
        status = f"[exit code {result.exit_code}]"
    out, err = result.stdout.rstrip("\n"), result.stderr.rstrip("\n")
    budget = max_chars - len(status) - (len("\n[stderr]\n") if err else 0) - 2
    if len(out) + len(err) > budget:
        err_share = min(len(err), max(budget // 2, budget - len(out)))
        out = _head(out, budget - err_share)
        err = _tail(err, err_share)
    parts = [out] if out else []
    if err:
        parts.append("[stderr]\n" + err)
    if status:
        parts.append(status)
    text = "\n".join(parts) if parts else "[no output]"
    return text[:max_chars]
