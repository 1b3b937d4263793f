"""The two agents of the Coder -> Reviewer team: who they are (their role prompts) and how a reply is read.

`CODER` and `REVIEWER` are the `AgentSpec`s the workflow (team.py) plays in this order. `{budget}` in a role is
filled with `generation.max_new_tokens`. A reply's code is its ```python blocks (`solution`); the Reviewer's
reply is a rewrite when it has code, an approval when it says APPROVE, else unclear (`verdict`).
"""

from __future__ import annotations

import re

from mappa.workflows.base import AgentSpec
from mappa.workflows.codeblocks import extract_code_blocks

_TEAM = "a programming team of two agents: Coder, then Reviewer"

CODER = AgentSpec(
    name="coder",
    title="Coder",
    role=(
        f"You are the Coder, the first agent of {_TEAM}. Write the requested Python function in one ```python "
        "block. It will run, followed by the example call, and the Reviewer will see your code and the output. "
        "Keep it short: your reply is cut off after {budget} tokens."
    ),
    max_turns=1,
    tools=("python",),
    sees="the task and the visible example",
)

REVIEWER = AgentSpec(
    name="reviewer",
    title="Reviewer",
    role=(
        f"You are the Reviewer, the last agent of {_TEAM}. You see the task, the Coder's code and what running "
        "the example printed. If the code is correct, reply APPROVE. Otherwise reply with the corrected function "
        "in one ```python block. The team succeeds only if the final code passes hidden tests. Keep it short: "
        "your reply is cut off after {budget} tokens."
    ),
    max_turns=1,
    tools=("python",),
    sees="the task, the example, the Coder's code and (by default) the example's output",
)

_APPROVE = re.compile(r"\bAPPROVE", re.IGNORECASE)


def solution(text: str) -> str | None:
    """The code of a reply: its ```python blocks joined in order; None without any."""
    blocks = extract_code_blocks(text)
    return "\n\n".join(blocks) if blocks else None


def verdict(text: str) -> str:
    """The Reviewer's decision: rewrite (it wrote code), approve, or unclear."""
    if solution(text) is not None:
        return "rewrite"
    return "approve" if _APPROVE.search(text) else "unclear"
