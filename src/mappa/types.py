"""Typed, frozen records that flow through mappa: tasks, actions, tool results, coach scores, episodes.

Every record is a frozen pydantic model so it round-trips through JSONL losslessly
(`record.model_dump_json()` / `Record.model_validate_json(line)`) and rejects unknown fields.
Token-level data is stored as tuples of ints/floats (one entry per token), not tensors, so that
episodes are plain data; the trainer turns them into padded tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mappa.errors import MappaError


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Message(Record):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Task(Record):
    id: str
    problem: str
    answer: str  # gold answer as text ("80", "\\frac{1}{2}"); several accepted answers joined by " or "
    source: str  # "aime", "amc", "math500", "gsm8k", "arithmetic", ...
    meta: dict[str, Any] = Field(default_factory=dict)


class ExecResult(Record):
    """What happened when one snippet of agent code ran in the sandbox."""

    ok: bool  # exited 0, no limit hit, no infra error
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    memory_exceeded: bool = False
    killed_signal: int | None = None
    duration_s: float = 0.0
    files_created: tuple[str, ...] = ()  # at most MAX_LISTED names each (the workspace's files are agent input)
    files_changed: tuple[str, ...] = ()
    files_omitted: int = 0  # names created or changed beyond those listed
    # The workspace was left with more files and directories than the sandbox walks (a flood): the listing is cut,
    # and the run has failed by the agent's doing (never an infra_error).
    workspace_flooded: bool = False
    # Set when the sandbox itself failed (could not start, pool died, ...): the action is then kept
    # out of the rewards instead of being blamed for an infrastructure fault.
    infra_error: str | None = None


class CoachScore(Record):
    """One coach judgment of one action. `score is None` means unscored: never invent a reward."""

    score: float | None  # 0..10, or None when the reply had no parseable score or the call failed
    rationale: str = ""
    raw_reply: str = ""
    error: str | None = None
    answer_correct: bool | None = None  # only for the final agent
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    backend: str = ""
    model: str = ""
    cached: bool = False
    # Input messages left out of the coach's prompt (wholly or in part) to fit `coach.max_context_tokens`;
    # 0: the coach saw the agent's exact input. Other cuts are stated at the head of the rationale.
    truncated_inputs: int = 0


class CoachContext(Record):
    """The declared, audited evidence a coach sees for one action (method.md section 3); what a reward function
    `f(ctx: CoachContext)` is called with, once per action.

    Built by the workflow (`Workflow.context(task, action)`), which alone knows what the agent saw, live and again
    when recorded episodes are replayed through another coach. The task reaches the coach only through it: `task`
    is the problem text, `ground_truth` the gold answer (`Task.answer`) for the final agent only, so that earlier
    agents are judged on the evidence, not on the answer. Anything else of the task a rule needs (`Task.meta`,
    `Task.id`, the answer for an earlier agent's rule) the workflow puts into `extra`, e.g. from
    `Action.evidence`, which is recorded with the episode and never shown to an agent.
    """

    task: str  # the task's problem text (`Task.problem`), as the team was given it; not the Task record
    workflow: str  # the workflow's name (`Workflow.name`), e.g. "mathchat": a rule can tell its own team's actions
    agent: str  # the acting agent's name, one of `Workflow.agents`
    role: str  # the agent's role description (its system prompt)
    is_final: bool  # the last agent of the workflow: the only one whose coach sees `ground_truth`
    messages: tuple[Message, ...]  # the agent's exact input (every message it saw, in order)
    output: str  # its raw output (`Action.text`)
    exec_result: ExecResult | None = None  # its tool call's result (exit, stdout, stderr, limits); None: no tool ran
    observation: str = ""  # the tool output as the agent saw it (sandbox.observation_chars); "" without a tool
    files_visible: tuple[str, ...] = ()  # file-passing workflows: files the agent could see
    files_by_agent: dict[str, tuple[str, ...]] = Field(default_factory=dict)  # files each earlier agent saved
    ground_truth: str | None = None  # the gold answer (`Task.answer`), for the final agent only; None otherwise
    # The workflow's own evidence: test results, a verdict, the task's metadata it chose to pass (built-in
    # workflows add "tools", the agent's tools). A rule reads it with .get(): a context of another workflow (the
    # start-up self-test's, a replay's) may lack a key.
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _observation_needs_a_tool(self) -> CoachContext:
        if self.exec_result is None and self.observation:
            raise ValueError("observation given but exec_result is None: an observation comes from a tool call")
        return self


class Action(Record):
    """One full generation of one agent, plus the tool call it triggered and its coach score."""

    agent: str
    turn: int  # 0-based turn index of this agent within the episode
    messages: tuple[Message, ...]  # exactly the chat the agent saw (full multi-turn context)
    text: str  # decoded response
    prompt_ids: tuple[int, ...] = ()  # (P,) chat-templated prompt tokens
    response_ids: tuple[int, ...] = ()  # (T,) sampled tokens, EOS included when generated
    logprobs: tuple[float, ...] = ()  # (T,) log pi_old(a_t | s) at sampling time
    truncated: bool = False  # hit the per-action token cap without EOS
    exec_result: ExecResult | None = None  # None: the action held no code
    coach: CoachScore | None = None
    # What the coach is shown beyond the agent's messages, recorded so a replay rebuilds the same context; never
    # shown to the agent (file-passing workflows: the files before and after the action, the Analyst's test score).
    evidence: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def sampled(cls, agent: str, turn: int, messages: Sequence[Message], generation: Any, **fields: Any) -> Action:
        """The action of one sampled response (a `mappa.policy.policy.Generation`, or a server's) to `messages`."""
        g = generation
        return cls(agent=agent, turn=turn, messages=tuple(messages), text=g.text, prompt_ids=tuple(g.prompt_ids),
                   response_ids=tuple(g.response_ids), logprobs=tuple(g.logprobs), truncated=g.truncated, **fields)  # fmt: skip


class Episode(Record):
    id: str
    workflow: str
    task: Task
    actions: tuple[Action, ...] = ()
    final_answer: str | None = None  # the final agent's extracted answer text
    correct: bool | None = None  # rule-based outcome check against task.answer
    meta: dict[str, Any] = Field(default_factory=dict)


R = TypeVar("R", bound=Record)


def write_jsonl(path: str | Path, records: list[Record], append: bool = False) -> None:
    """Write one JSON line per record; flushes so a killed process leaves whole lines behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for rec in records:
            f.write(rec.model_dump_json() + "\n")
        f.flush()


def read_jsonl(path: str | Path, cls: type[R]) -> list[R]:
    """Read records of type `cls`; a malformed line raises MappaError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise MappaError(f"{path}: file not found")
    out: list[R] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(cls.model_validate_json(line))
            except ValidationError as e:
                first = e.errors()[0]
                loc = ".".join(str(p) for p in first["loc"]) or "line"
                raise MappaError(
                    f"{path}:{lineno}: not a valid {cls.__name__} record ({loc}: {first['msg']})"
                ) from None
    return out
