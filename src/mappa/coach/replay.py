"""Score recorded rollouts again (`mappa coach score`): the contexts are rebuilt, then judged in one pass.

Replaying lets you compare coaches (backends, models, templates) on identical rollouts at no
generation cost, and re-scoring with the same coach costs zero calls thanks to the cache. The
contexts are rebuilt by the episode's workflow exactly as during the rollout (the role is the
system prompt the agent actually got), so a replay hits the judgments cached while training.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from mappa.coach.runner import CoachRunner
from mappa.config import BUILTIN_WORKFLOWS, Config, WorkflowConfig
from mappa.errors import MappaError
from mappa.protocols import ProgressFn, Workflow
from mappa.types import CoachContext, Episode
from mappa.workflows import build_workflow


def episode_contexts(episode: Episode, workflow: Workflow, *, outcome: bool = False) -> list[CoachContext]:
    """One CoachContext per action of a recorded episode, as its workflow built them live."""
    out = []
    for action in episode.actions:
        try:
            ctx = workflow.context(episode.task, action)
        except MappaError as e:
            raise MappaError(f"episode {episode.id}: {e}") from None
        if action.messages and action.messages[0].role == "system":
            ctx = ctx.model_copy(update={"role": action.messages[0].content})
        if outcome:
            # Only the outcome baseline reads this; AI coaches never see the episode's result.
            ctx = ctx.model_copy(update={"extra": {**ctx.extra, "episode_correct": episode.correct}})
        out.append(ctx)
    return out


def _workflow_for(cfg: Config, name: str) -> Workflow:
    """The workflow that recorded episodes under `name`: a built-in by that name, or the config's plug-in
    (`workflow.name: module:name`) when the workflow it builds calls itself `name`."""
    if cfg.workflow.name not in BUILTIN_WORKFLOWS:
        plugin = build_workflow(cfg)
        if plugin.name == name:
            return plugin
    try:
        section = WorkflowConfig.model_validate({**cfg.workflow.model_dump(), "name": name})
    except ValidationError:
        raise MappaError(
            f"episodes: workflow {name!r} is not a known workflow (a plug-in's: give its config, whose workflow.name "
            "imports it)"
        ) from None
    return build_workflow(cfg.model_copy(update={"workflow": section}))


def score_episodes(
    runner: CoachRunner, episodes: Sequence[Episode], cfg: Config, progress: ProgressFn | None = None
) -> list[Episode]:
    """Episodes with every action's `coach` replaced by `runner`'s judgment (one batched, cached pass).

    Each episode's workflow is built from `cfg` (its `workflow`, `generation` and `sandbox` settings) under the
    name the episode records.
    """
    workflows: dict[str, Workflow] = {}
    contexts: list[CoachContext] = []
    for ep in episodes:
        if ep.workflow not in workflows:
            workflows[ep.workflow] = _workflow_for(cfg, ep.workflow)
        contexts.extend(episode_contexts(ep, workflows[ep.workflow], outcome=runner.coach.name == "outcome"))
    scores = iter(runner.score_many(contexts, progress))
    return [
        ep.model_copy(update={"actions": tuple(a.model_copy(update={"coach": next(scores)}) for a in ep.actions)})
        for ep in episodes
    ]
