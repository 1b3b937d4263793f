"""MathChat's wording: the three agents' roles, the ask that ends each prompt, and the tool response
(`mappa.workflows.mathchat` is the program that plays them)."""

from __future__ import annotations

from mappa.types import ExecResult
from mappa.workflows.base import AgentSpec
from mappa.workflows.codeblocks import format_observation

_TEAM = "a math team of three agents: Problem Solver, then Code Executor, then Verifier"

SOLVER = AgentSpec(
    name="problem_solver",
    title="Problem Solver",
    role=(
        f"You are the Problem Solver, the first agent of {_TEAM}. The Code Executor will check your work by "
        "running Python, and the Verifier gives the team's final answer: the team succeeds only if the "
        "Verifier's answer is right. Solve the problem step by step and state your answer clearly. You cannot "
        "run code. Keep it short: your reply is cut off after {budget} tokens."
    ),
    max_turns=1,
    sees="the problem",
)

CODER = AgentSpec(
    name="code_executor",
    title="Code Executor",
    role=(
        f"You are the Code Executor, the second agent of {_TEAM}. You see the problem and the Problem "
        "Solver's answer. Write a ```python code block that computes the answer and prints it; the code runs "
        "and its output comes back to you in <tool_response>. You can run code {turns} time(s); reply without a "
        "code block when you are done, stating the result. The Verifier sees only your final message and the "
        "last tool output, so make your final message self-contained. Keep it short: each reply is cut off "
        "after {budget} tokens."
    ),
    max_turns=2,
    tools=("python",),
    sees="the problem and the Problem Solver's full output",
)

VERIFIER = AgentSpec(
    name="verifier",
    title="Verifier",
    role=(
        f"You are the Verifier, the last agent of {_TEAM}. You see the problem, the Code Executor's final "
        "message and its last tool output. Check them and give the team's final answer as \\boxed{{answer}}. "
        "The team succeeds only if your boxed answer is right. Keep it short: your reply is cut off after "
        "{budget} tokens."
    ),
    max_turns=1,
    sees="the problem, the Code Executor's final action and the last tool output (not the Solver's text)",
)


# The task restated at the end of each prompt: small models follow the last instruction they read.
SOLVER_ASK = "Solve it step by step and end with the answer."
CODER_ASK = "Write a ```python block that computes the answer and prints it."
VERIFIER_ASK = "Check the work, then give the final answer in the form \\boxed{...}."
# Generated arithmetic has integer answers and is what small models train on: a one-line answer is the format
# a 135M model follows (measured: about 7x more replies with an extractable answer than with the boxed ask).
VERIFIER_ASK_SHORT = "Reply with one line only: The answer is <number>."


def tool_response(result: ExecResult, max_chars: int) -> str:
    """The user turn that carries a code run's observation back to the agent."""
    return f"<tool_response>\n{format_observation(result, max_chars=max_chars)}\n</tool_response>"
