"""Workflows: multiagent systems, each a short program over one episode (`async def play(task, team, tools)`).

A workflow is a small protocol (`mappa.protocols.Workflow`: `name`, `agents`, `max_actions`, `play`, `context`,
`check_task`) and `WORKFLOWS` is the one explicit dict of them, name -> constructor taking the config sections it
reads. The valid names are `WorkflowConfig.name`'s (a test checks both agree). The runtime plays many episodes at
once and batches what they ask for (`mappa.workflows.runtime`):

    workflow = build_workflow(cfg)                       # MathChat(cfg.workflow, cfg.sandbox)
    episodes = play(workflow, tasks, Runtime(generator, sandbox, scorer=coach), sampling=..., seed=step_seed)
"""

from __future__ import annotations

from collections.abc import Callable

from mappa.config import BUILTIN_WORKFLOWS, Config, SandboxConfig, WorkflowConfig
from mappa.plugins import check_instance, check_workflow, load_object
from mappa.protocols import Runtime, Workflow
from mappa.workflows.base import AgentSpec, feedback_note
from mappa.workflows.ds_pipeline import DsPipeline
from mappa.workflows.mathchat import MathChat
from mappa.workflows.runtime import EpisodeStopped, Reply, Team, Tools, play

WORKFLOWS: dict[str, Callable[[WorkflowConfig, SandboxConfig], Workflow]] = {
    "mathchat": MathChat,
    "ds_pipeline": DsPipeline,
}

__all__ = [
    "WORKFLOWS",
    "AgentSpec",
    "DsPipeline",
    "EpisodeStopped",
    "MathChat",
    "Reply",
    "Runtime",
    "Team",
    "Tools",
    "Workflow",
    "build_workflow",
    "feedback_note",
    "play",
]


def build_workflow(cfg: Config) -> Workflow:
    """The configured workflow, reading `cfg.workflow` and `cfg.sandbox`. A `workflow.name` that is an import path
    is a plug-in (`mappa.plugins`), built the same way and checked against the protocol."""
    name = cfg.workflow.name
    if name in BUILTIN_WORKFLOWS:
        return WORKFLOWS[name](cfg.workflow, cfg.sandbox)
    factory = load_object(name, "workflow.name")
    check_workflow(factory, "workflow.name")
    workflow = factory(cfg.workflow, cfg.sandbox)
    check_instance(workflow, "workflow.name")
    return workflow
