"""Workflows: multiagent systems that play batches of episodes in lockstep.

A workflow is a small protocol (`mappa.protocols.Workflow`: `name`, `agents`, `run(tasks, runtime)`,
`context(task, action)`) and `WORKFLOWS` is the one explicit dict of them, name -> constructor taking the
config sections it reads. The valid names are `WorkflowConfig.name`'s (a test checks both agree).

    workflow = build_workflow(cfg)                       # MathChat(cfg.workflow, cfg.generation, cfg.sandbox)
    episodes = workflow.run(tasks, Runtime(policy, sandbox, scorer=coach), seed=step_seed)
"""

from __future__ import annotations

from collections.abc import Callable

from mappa.config import BUILTIN_WORKFLOWS, Config, GenerationConfig, SandboxConfig, WorkflowConfig
from mappa.plugins import check_instance, check_workflow, load_object
from mappa.protocols import Runtime, Workflow
from mappa.workflows.base import AgentSpec, feedback_note
from mappa.workflows.ds_pipeline import DsPipeline
from mappa.workflows.mathchat import MathChat

WORKFLOWS: dict[str, Callable[[WorkflowConfig, GenerationConfig, SandboxConfig], Workflow]] = {
    "mathchat": MathChat,
    "ds_pipeline": DsPipeline,
}

__all__ = [
    "WORKFLOWS",
    "AgentSpec",
    "DsPipeline",
    "MathChat",
    "Runtime",
    "Workflow",
    "build_workflow",
    "feedback_note",
]


def build_workflow(cfg: Config, gen: GenerationConfig | None = None) -> Workflow:
    """The configured workflow, reading `cfg.workflow`, `cfg.sandbox` and `gen` (default `cfg.generation`;
    evaluation passes its own sampling settings). A `workflow.name` that is an import path is a plug-in
    (`mappa.plugins`), built the same way and checked against the protocol."""
    name = cfg.workflow.name
    if name in BUILTIN_WORKFLOWS:
        return WORKFLOWS[name](cfg.workflow, gen or cfg.generation, cfg.sandbox)
    factory = load_object(name, "workflow.name")
    check_workflow(factory, "workflow.name")
    workflow = factory(cfg.workflow, gen or cfg.generation, cfg.sandbox)
    check_instance(workflow, "workflow.name")
    return workflow
