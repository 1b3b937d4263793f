"""One data-science episode in flight (`mappa.workflows.ds_pipeline`): all of its state in one record.

DsEpisode
  team      Team           what the agents done so far passed on: final messages, the files each saved and (with
                           workflow.show_coach_feedback) the coach's note on each final message
  turns     AgentTurns     the agent now playing: the files it started with, its chat so far, what it saved
  receipts  dict           the latest receipts of the required pickles present (`mappa.tasks.dsbench.receipts`)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mappa.types import Action


@dataclass
class Team:
    """One episode's file passing so far: each earlier agent's final message and the files it saved."""

    finals: dict[str, str] = field(default_factory=dict)  # agent -> final message, reasoning removed
    saved: dict[str, tuple[str, ...]] = field(default_factory=dict)  # agent -> files its code created or changed
    notes: dict[str, str] = field(default_factory=dict)  # agent -> the coach's note on its final action, when shown


@dataclass
class AgentTurns:
    """One agent's turns in one episode so far."""

    start: tuple[str, ...] = ()  # the files present when it began (its first prompt lists them)
    # the receipts when it began: earlier agents' files are judged as it found them, so a file it deletes or
    # spoils itself is never an earlier agent's fault
    start_receipts: dict[str, dict] = field(default_factory=dict)
    before: tuple[str, ...] = ()  # the files present before its latest action (the coach's evidence)
    history: list[tuple[Action, str]] = field(default_factory=list)  # its actions with code, and their tool responses
    saved: list[str] = field(default_factory=list)  # the files its code created or changed, in order, repeats kept
    final: Action | None = None  # its latest action: the last one once it stopped


@dataclass
class DsEpisode:
    """Everything the pipeline keeps of one episode while it plays (the runtime keeps its actions and timings)."""

    team: Team = field(default_factory=Team)
    turns: AgentTurns = field(default_factory=AgentTurns)
    receipts: dict[str, dict] = field(default_factory=dict)  # file -> receipt, after the latest code run
