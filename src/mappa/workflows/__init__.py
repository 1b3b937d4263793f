"""Workflows: multiagent systems that play batches of episodes in lockstep.

A workflow is a small protocol (`mappa.workflows.base.Workflow`: `name`, `agents`, `specs`, `run(...)`) and
`WORKFLOWS` is the one explicit dict of them, name -> constructor taking a `WorkflowConfig`.

    workflow = build_workflow(cfg.workflow)          # MathChat(cfg.workflow)
    episodes = workflow.run(policy, tasks, sandbox=sandbox, gen=cfg.generation, scorer=coach)
"""

from __future__ import annotations

from collections.abc import Callable

from mappa.config import WorkflowConfig
from mappa.errors import MappaError
from mappa.workflows.base import AgentSpec, Scorer, Workflow
from mappa.workflows.mathchat import MathChat

WORKFLOWS: dict[str, Callable[[WorkflowConfig], Workflow]] = {
    "mathchat": MathChat,
}

__all__ = ["WORKFLOWS", "AgentSpec", "MathChat", "Scorer", "Workflow", "build_workflow"]


def build_workflow(cfg: WorkflowConfig) -> Workflow:
    """The configured workflow; an unknown name is a one-line MappaError listing the known ones."""
    if cfg.name not in WORKFLOWS:
        raise MappaError(f"workflow.name: unknown workflow {cfg.name!r} (known: {', '.join(sorted(WORKFLOWS))})")
    return WORKFLOWS[cfg.name](cfg)
