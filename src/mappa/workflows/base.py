"""The pieces workflows share: agent specs, the coach's evidence of a turn-taking team, feedback notes, clipping.

How episodes play (many at once, their requests batched) is the runtime's: `mappa.workflows.runtime`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mappa.errors import MappaError
from mappa.types import Action, CoachContext, CoachScore, Task
from mappa.workflows.codeblocks import format_observation


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a workflow: who it is, how often it may act, what tools it has and what it sees."""

    name: str  # key of its weights in the policy, e.g. "code_executor"
    title: str  # how teammates call it, e.g. "Code Executor"
    role: str  # its system prompt
    max_turns: int  # turn cap within one episode
    tools: tuple[str, ...] = ()  # ("python",): every ```python block of an action runs
    sees: str = ""  # what it sees of earlier agents, for docs and the coach


def action_context(
    workflow: str, specs: Sequence[AgentSpec], task: Task, action: Action, *, final: str, observation_chars: int,
    extra: dict[str, Any] | None = None,
) -> CoachContext:  # fmt: skip
    """The coach's evidence for one action of a team whose agents take turns: exactly what its agent saw, its raw
    output, its tool call and result, the tools it had (judged on code only if it had a tool) and `extra`; the
    ground truth for the `final` agent's coach only (earlier agents are judged on evidence alone). The agent's role
    is its system prompt, as it saw it, or its title when it had none (`workflow.prompts: paper`)."""
    spec = next((s for s in specs if s.name == action.agent), None)
    if spec is None:
        names = ", ".join(s.name for s in specs)
        raise MappaError(f"agent {action.agent!r} is not part of workflow {workflow!r} ({names})")
    is_final, result = spec.name == final, action.exec_result
    return CoachContext(
        task=task.problem, workflow=workflow, agent=spec.name, role=system_prompt(action) or spec.title,
        is_final=is_final, messages=action.messages, output=action.text, exec_result=result,
        observation="" if result is None else format_observation(result, observation_chars),
        ground_truth=task.answer if is_final else None, extra={"tools": list(spec.tools), **(extra or {})},
    )  # fmt: skip


def system_prompt(action: Action) -> str:
    """The role the agent was given: its chat's system message ("" when it had none)."""
    first = action.messages[0] if action.messages else None
    return first.content if first is not None and first.role == "system" else ""


def feedback_note(agent: str, score: CoachScore) -> str:
    """The text later agents see of an earlier action's judgment when `workflow.show_coach_feedback` is on."""
    if score.score is None:
        return f"Coach feedback on {agent}: unscored."
    return f"Coach feedback on {agent} ({score.score:g}/10): {score.rationale}"


def clip_middle(text: str, budget: int | None) -> str:
    """Keep the head and tail of `text` within `budget` characters (None: unchanged), marking the cut."""
    if budget is None or len(text) <= budget:
        return text
    head = max(budget * 2 // 3, 0)
    tail = max(budget - head, 0)
    cut = len(text) - head - tail
    return text[:head] + f"\n[... {cut} characters cut to fit the context ...]\n" + (text[-tail:] if tail else "")
