"""Coder -> Reviewer: a two-agent programming team defined outside the mappa package (docs/your-team.md).

| agent    | turns | tools  | sees                                                                          |
|----------|-------|--------|-------------------------------------------------------------------------------|
| coder    | 1     | python | the task and one visible example call                                         |
| reviewer | 1     | python | the task, the example, the Coder's code and what running the example printed  |

The Coder writes the function in a ```python block; it runs in the sandbox followed by the visible example
call. The Reviewer approves (a reply saying APPROVE) or rewrites the function in its own ```python block, which
runs against the example too. The final code (the rewrite, else the Coder's) then runs against the task's
HIDDEN unit tests, `Task.answer`: lines `assert CALL == VALUE`. No agent ever sees them, and every run gets a
fresh workspace, so files an earlier run wrote cannot reach the hidden tests.

This file is the workflow: the prompts, the two stages, the sandbox runs and the records. It imports its
siblings by plain name, as a script would: the plug-in loader puts this directory first on `sys.path` (so a
sibling's name should be one no installed package uses):
- roles.py: the two agents' role prompts and how a reply is read (its code, the Reviewer's verdict);
- hidden_tests.py: parsing the tests, the harness that runs code against them, and why it cannot be fooled.

Settings (`workflow.options`): `show_example_result` (default true): whether the Reviewer sees what running
the example printed. Turning it off shows what a team loses without the execution result.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from hidden_tests import (
    NONCE_FILE,
    Job,
    Ran,
    Spec,
    example_evidence,
    harness,
    read_outcomes,
    readable,
    task_spec,
    tests_evidence,
)
from hidden_tests import same as same  # re-exported: tests/test_example_team.py reaches the pieces through here
from roles import CODER, REVIEWER, solution, verdict

from mappa.config import GenerationConfig, SandboxConfig, WorkflowConfig
from mappa.errors import MappaError
from mappa.protocols import GenerationLike, ProgressFn, Runtime
from mappa.sandbox import new_workspace, remove_workspace
from mappa.sandbox.codeblocks import format_observation
from mappa.types import Action, CoachContext, Episode, Message, Task
from mappa.workflows.base import (
    AgentSpec,
    Batch,
    EpisodeState,
    Turn,
    action_context,
    clip_middle,
    episode_meta,
    fit_messages,
    play_batch,
    score_stage,
)

OPTIONS = {"show_example_result": True}


def run_jobs(rt: Runtime, jobs: Sequence[Job]) -> list[Ran]:
    """Run every job in one `run_many` call, each in a fresh workspace holding its own nonce (removed after), so
    files an earlier run left behind cannot reach it."""
    if not jobs:
        return []
    nonces = [secrets.token_hex(16) for _ in jobs]
    workspaces = []
    try:
        for n in nonces:
            workspaces.append(new_workspace({NONCE_FILE: n.encode()}))
        items = [(harness(j.code, j.checks, j.quiet), ws) for j, ws in zip(jobs, workspaces, strict=True)]
        results = rt.sandbox.run_many(items)
    finally:
        for ws in workspaces:
            remove_workspace(ws)
    return [
        Ran(readable(r, j.checks, n), read_outcomes(r, j.checks, n))
        for j, n, r in zip(jobs, nonces, results, strict=True)
    ]


class CoderReviewer:
    """The team: `CoderReviewer(cfg.workflow, cfg.generation, cfg.sandbox).run(tasks, Runtime(...))`.

    Reads `workflow.options` (see OPTIONS), the sampling settings and token caps (`gen`), and from `sandbox`
    the longest observation an agent and the coach see. `sandbox.keep_workspaces` keeps only each episode's
    own workspace, which stays empty: every run has a fresh workspace of its own, removed after it.
    """

    name = "coder_review"

    def __init__(
        self,
        cfg: WorkflowConfig | None = None,
        gen: GenerationConfig | None = None,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        cfg = cfg or WorkflowConfig()
        sandbox = sandbox or SandboxConfig()
        for key, value in cfg.options.items():
            if key not in OPTIONS:
                raise MappaError(f"workflow.options: unknown key {key!r} (known: {', '.join(OPTIONS)})")
            if type(value) is not type(OPTIONS[key]):
                raise MappaError(f"workflow.options.{key}: expected {type(OPTIONS[key]).__name__}, got {value!r}")
        self.show_example_result = cfg.options.get("show_example_result", OPTIONS["show_example_result"])
        self.gen = gen or GenerationConfig()
        self.observation_chars = sandbox.observation_chars
        self.keep_workspaces = sandbox.keep_workspaces
        self.specs = (CODER, REVIEWER)
        self.agents = tuple(s.name for s in self.specs)

    def role(self, spec: AgentSpec) -> str:
        return spec.role.format(budget=self.gen.max_new_tokens)

    # ---------------------------------------------------------------------------------------------- prompts
    def coder_messages(self, task: Task, spec: Spec) -> list[Message]:
        ask = "Write the function in one ```python block."
        return [
            Message(role="system", content=self.role(CODER)),
            Message(role="user", content=f"Task:\n{task.problem}\n\n{spec.example.shown}\n\n{ask}"),
        ]

    def reviewer_messages(
        self, task: Task, spec: Spec, coder: Action, observation: str, budget: int | None
    ) -> list[Message]:
        """The Reviewer's chat: the task, the example, the Coder's code and (by default) the example's output."""
        head = f"Task:\n{task.problem}\n\n{spec.example.shown}"
        code = solution(coder.text)
        if code is None:
            body = "The Coder wrote no code. Write the function in one ```python block."
        else:
            body = f"The Coder's code:\n```python\n{clip_middle(code, budget)}\n```"
            if self.show_example_result:
                body += f"\n\nRunning it with the example printed:\n{clip_middle(observation, budget)}"
            body += "\n\nReply APPROVE if it is correct, else the corrected function in one ```python block."
        return [Message(role="system", content=self.role(REVIEWER)), Message(role="user", content=f"{head}\n\n{body}")]

    # ------------------------------------------------------------------------------------------------- coach
    def context(self, task: Task, action: Action) -> CoachContext:
        """The coach's evidence for one action: what its agent saw, its output, the example run (the tool result)
        and, for the Reviewer only, how the final code did on the hidden tests (`extra`, from `Action.evidence`);
        the hidden tests are the Reviewer's coach's ground truth only."""
        return action_context(
            self.name, self.specs, self.role, task, action, final=REVIEWER.name,
            observation_chars=self.observation_chars, extra=action.evidence,
        )  # fmt: skip

    # --------------------------------------------------------------------------------------------------- run
    def run(
        self, tasks: Sequence[Task], rt: Runtime, *, seed: int | None = None, progress: ProgressFn | None = None
    ) -> list[Episode]:
        """Play one episode per task, all in lockstep; returns episodes in task order."""
        specs = [task_spec(t) for t in tasks]  # a malformed test line stops here, before anything runs
        if not tasks:
            return []
        outcome: dict[str, dict[str, Any]] = {}
        states = play_batch(
            tasks,
            rt,
            self.gen,
            lambda batch: self._play(batch, specs, outcome),
            actions_per_episode=len(self.specs),
            keep_workspaces=self.keep_workspaces,
            seed=seed,
            progress=progress,
        )
        return [self._episode(s, outcome.get(s.id)) for s in states]

    def _generate(self, batch: Batch, spec: AgentSpec, turns: Sequence[Turn]) -> list[tuple[Turn, GenerationLike]]:
        """One batched generation for the turns whose prompt fits the context cap (the others end their episode).
        Returns (turn, generation) pairs whose `turn.build` gives back the fitted messages the agent saw."""
        live, prompts = [], []
        cap = self.gen.max_context_tokens
        for turn in turns:
            fitted = fit_messages(batch.rt.policy, turn.build, cap)
            if fitted is None:
                turn.state.error = f"{spec.name}: prompt exceeds generation.max_context_tokens={cap}"
                continue
            messages, _, clipped = fitted
            turn.state.clipped_prompts += clipped
            live.append(Turn(turn.state, lambda budget, m=messages: m))
            prompts.append(messages)
        if not live:
            return []
        g = self.gen
        generations = batch.rt.policy.generate(
            spec.name, prompts, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens,
            max_context_tokens=g.max_context_tokens, seed=batch.stage_seeds([t.state for t in live]),
            batch_size=g.batch_size,
        )  # fmt: skip
        return list(zip(live, generations, strict=True))

    def _finish(self, batch: Batch, stage: list[tuple[Turn, Action]], asked: int) -> None:
        """Score a stage's actions in one scorer call and record them; report progress."""
        contexts = [self.context(t.state.task, a) for t, a in stage]
        for turn, action in score_stage(stage, contexts, batch.rt.scorer):
            turn.state.actions.append(action)
        batch.count.advance(asked)

    def _play(self, batch: Batch, specs: Sequence[Spec], outcome: dict[str, dict[str, Any]]) -> None:
        spec_of = {id(s): sp for s, sp in zip(batch.states, specs, strict=True)}
        turns = [Turn(s, lambda budget, s=s: self.coder_messages(s.task, spec_of[id(s)])) for s in batch.states]
        coded = self._play_coder(batch, turns, spec_of)
        batch.count.drop(len(batch.states) - len(coded))
        turns = [
            Turn(s, lambda budget, s=s, a=a, o=o: self.reviewer_messages(s.task, spec_of[id(s)], a, o, budget))
            for s, a, o in coded
        ]
        self._play_reviewer(batch, turns, spec_of, outcome)

    def _play_coder(
        self, batch: Batch, turns: list[Turn], spec_of: dict[int, Spec]
    ) -> list[tuple[EpisodeState, Action, str]]:
        """The Coder's stage: its code runs with the example call. Returns each live episode with the Coder's
        action and the observation the Reviewer is shown."""
        generated = self._generate(batch, CODER, turns)
        codes = [solution(g.text) for _, g in generated]
        jobs = {
            i: Job(code, [spec_of[id(turn.state)].example], quiet=False)
            for i, ((turn, _), code) in enumerate(zip(generated, codes, strict=True))
            if code is not None
        }
        ran = dict(zip(jobs, run_jobs(batch.rt, list(jobs.values())), strict=True))
        stage, shown = [], []
        for i, (turn, g) in enumerate(generated):
            r = ran.get(i)
            result = None if r is None else r.result
            turn.state.sandbox_s += 0.0 if result is None else result.duration_s
            evidence = {"code": codes[i], "example": example_evidence(spec_of[id(turn.state)].example, r)}
            stage.append(
                (turn, Action.sampled(CODER.name, 0, turn.build(None), g, exec_result=result, evidence=evidence))
            )
            shown.append("[no code]" if result is None else format_observation(result, self.observation_chars))
        self._finish(batch, stage, len(turns))
        return [(t.state, t.state.actions[-1], o) for (t, _), o in zip(stage, shown, strict=True)]

    def _play_reviewer(
        self, batch: Batch, turns: list[Turn], spec_of: dict[int, Spec], outcome: dict[str, dict[str, Any]]
    ) -> None:
        """The Reviewer's stage: a rewrite runs with the example call; then the Coder's code and the rewrite run
        against the hidden tests (one sandbox call for all), and the Reviewer is scored knowing how they did."""
        generated = self._generate(batch, REVIEWER, turns)
        jobs: list[Job] = []
        slots = []  # per action: indexes into jobs of (rewrite's example run, Coder's hidden run, rewrite's hidden run)
        for turn, g in generated:
            spec, state = spec_of[id(turn.state)], turn.state
            coder_code, rewrite = state.actions[-1].evidence["code"], solution(g.text)
            slot = []
            for job in (
                Job(rewrite, [spec.example], quiet=False) if rewrite else None,
                Job(coder_code, spec.hidden, quiet=True) if coder_code else None,
                Job(rewrite, spec.hidden, quiet=True) if rewrite else None,
            ):
                slot.append(None if job is None else len(jobs))
                jobs += [] if job is None else [job]
            slots.append(slot)
        ran = run_jobs(batch.rt, jobs)
        stage = []
        for (turn, g), slot in zip(generated, slots, strict=True):
            example, coder_tests, rewrite_tests = (None if k is None else ran[k] for k in slot)
            spec, state = spec_of[id(turn.state)], turn.state
            state.sandbox_s += sum(r.result.duration_s for r in (example, coder_tests, rewrite_tests) if r is not None)
            decision = verdict(g.text)
            final = rewrite_tests if decision == "rewrite" else coder_tests
            evidence = {
                "verdict": decision,
                "code": solution(g.text),
                "example": example_evidence(spec.example, example) if decision == "rewrite" else None,
                "coder_tests": tests_evidence(spec.hidden, coder_tests),
                "final_tests": tests_evidence(spec.hidden, final),
            }
            outcome[state.id] = evidence
            result = None if example is None else example.result
            stage.append(
                (turn, Action.sampled(REVIEWER.name, 0, turn.build(None), g, exec_result=result, evidence=evidence))
            )
        self._finish(batch, stage, len(turns))

    def _episode(self, s: EpisodeState, outcome: dict[str, Any] | None) -> Episode:
        """`correct`: the final code passed every hidden test (None: the sandbox failed, so nobody knows)."""
        final = None if outcome is None else outcome["final_tests"]
        code = None
        if outcome is not None:
            code = outcome["code"] if outcome["verdict"] == "rewrite" else s.actions[0].evidence["code"]
        meta = episode_meta(s, self.keep_workspaces)
        if outcome is not None:
            meta.update(verdict=outcome["verdict"], coder_tests=outcome["coder_tests"], final_tests=final)
        return Episode(
            id=s.id,
            workflow=self.name,
            task=s.task,
            actions=tuple(s.actions),
            final_answer=code,
            correct=False if final is None else final["ok"],
            meta=meta,
        )
