"""Blame: for each failed episode the action the coach scored lowest (method.md section 6), and why it failed.

The failure kind is read from the episode's records, first match wins:
  stopped       the episode ended early (`Episode.meta["error"]`, e.g. a prompt that could not fit)
  timeout       the last code that ran hit the time limit
  missing file  the last code that ran could not find a file (FileNotFoundError), or the episode lists
                missing files (`meta["missing_files"]`)
  code error    the last code that ran failed otherwise (exit code, memory limit)
  no code       no code ran although the run has code agents (agents that ran code in some episode)
  no answer     the final agent gave no answer the rule-based check could read
  wrong answer  an answer, and it was wrong
Code runs that failed for infrastructure reasons (`ExecResult.infra_error`) are not the agents' doing and
are passed over.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from mappa.analysis.runs import step_of
from mappa.trace import lowest_scored
from mappa.types import Episode, ExecResult

KINDS = ("stopped", "timeout", "missing file", "code error", "no code", "no answer", "wrong answer")


@dataclass(frozen=True)
class Blame:
    episode: str
    step: int
    task: str
    source: str
    kind: str  # one of KINDS
    agent: str | None  # the lowest-scored action's agent; None when the coach scored no action
    turn: int | None
    score: float | None
    rationale: str  # the coach's evidence for that score
    tool: str  # what that action's code did: "no code", "ok", "timed out", "exit 1: <last stderr line>"


def _missing_file(r: ExecResult) -> bool:
    return "FileNotFoundError" in r.stderr or "No such file or directory" in r.stderr


def failure_kind(episode: Episode, code_agents: set[str]) -> str:
    """The kind of failure of a failed episode (module docstring)."""
    if "error" in episode.meta:
        return "stopped"
    runs = [a.exec_result for a in episode.actions if a.exec_result is not None and not a.exec_result.infra_error]
    last = runs[-1] if runs else None
    if last is not None and last.timed_out:
        return "timeout"
    if episode.meta.get("missing_files") or (last is not None and _missing_file(last)):
        return "missing file"
    if last is not None and not last.ok:
        return "code error"
    wrote_code = any(a.exec_result is not None for a in episode.actions)  # infra failures included
    if not wrote_code and code_agents & {a.agent for a in episode.actions}:
        return "no code"
    return "no answer" if episode.final_answer is None else "wrong answer"


def tool_status(r: ExecResult | None) -> str:
    if r is None:
        return "no code"
    if r.infra_error:
        return f"infra error: {r.infra_error}"
    if r.ok:
        return "ok"
    if r.timed_out:
        return "timed out"
    if r.memory_exceeded:
        return "memory limit"
    last = next((x for x in reversed(r.stderr.strip().splitlines()) if x.strip()), "")
    return f"exit {r.exit_code}" + (f": {last.strip()[:160]}" if last else "")


def blame(episodes: Sequence[Episode], code_agents: set[str]) -> list[Blame]:
    """One row per failed episode (`correct is False`), in file order."""
    out = []
    for e in episodes:
        if e.correct is not False:
            continue
        worst = lowest_scored(e)
        c = worst.coach if worst is not None else None
        out.append(
            Blame(
                episode=e.id, step=step_of(e), task=e.task.id, source=e.task.source,
                kind=failure_kind(e, code_agents),
                agent=worst.agent if worst is not None else None,
                turn=worst.turn if worst is not None else None,
                score=c.score if c is not None else None,
                rationale=c.rationale.strip() if c is not None else "",
                # an agent without a code tool has no code to report
                tool=tool_status(worst.exec_result) if worst is not None and worst.agent in code_agents else "-",
            )
        )  # fmt: skip
    return out


def blame_table(rows: Sequence[Blame]) -> dict[str, Counter[str]]:
    """agent ("unscored" when no action was scored) -> failure kind -> failed episodes."""
    table: dict[str, Counter[str]] = defaultdict(Counter)
    for r in rows:
        table[r.agent or "unscored"][r.kind] += 1
    return dict(table)


def blame_by_step(rows: Sequence[Blame]) -> dict[int, Counter[str]]:
    """step -> agent -> failed episodes blamed on it."""
    out: dict[int, Counter[str]] = defaultdict(Counter)
    for r in rows:
        out[r.step][r.agent or "unscored"] += 1
    return dict(sorted(out.items()))


def kinds_by_step(rows: Sequence[Blame]) -> dict[int, Counter[str]]:
    """step -> failure kind -> failed episodes."""
    out: dict[int, Counter[str]] = defaultdict(Counter)
    for r in rows:
        out[r.step][r.kind] += 1
    return dict(sorted(out.items()))
