"""The data-science pipeline: Data Engineer -> Modeler -> Analyst on a Kaggle-style tabular task (method.md §5).

| agent         | turns (cap)           | must save                            | sees                                 |
|---------------|-----------------------|--------------------------------------|--------------------------------------|
| data_engineer | workflow.ds_max_turns | X_train.pkl, y_train.pkl, X_test.pkl | the task description and the files   |
| modeler       | workflow.ds_max_turns | model.pkl                            | + the Data Engineer's final message  |
| analyst       | workflow.ds_max_turns | submission.csv                       | + the Modeler's final message        |

Every agent after the first is warned about an earlier agent's required file that is missing or not usable.

The agents pass work through files: one workspace per episode, shared by every tool call of every agent,
starts with the task's `train.csv`, `test.csv`, `sample_submission.csv` and `description.txt` (copied from
`task.meta["task_dir"]`; the answers live elsewhere and never enter it). Each prompt lists the files present
and which files each earlier agent saved, warns about an earlier agent's required file that is missing, and
gives the earlier agents' final messages with their reasoning blocks removed (the wording: `ds_prompts`). A
file list, in a prompt or in the coach's evidence, shows at most `mappa.tasks.files.MAX_LISTED` names (the
required files present always among them), then how many more. Every ```python block of an action is joined
into one snippet that runs in the workspace; the output comes back as `<tool_response>...</tool_response>`
together with the files now present and those of its own that are not usable yet. An agent stops at an action
without code, at its turn cap, or once its code ran cleanly and all its required files exist and count (its job
is done; the paper's agents stop only at the first two, which costs turns the demo cannot afford:
`workflow.ds_stop_when_done: false` plays the paper's rule). With `workflow.prompts: paper` the agents get the
published templates instead (`mappa.workflows.paper_prompts`: no system prompt, the file lists and warning as the
published code wrote them, a bare tool response); with `workflow.show_coach_feedback` each agent's first prompt
also carries the coach's note on every earlier agent's final message it is shown. While a batch plays, all of an
episode's state is one record (`ds_state.DsEpisode`).

Receipts: after every code run the required pickles present are checked inside the sandbox, in the workspace
(`mappa.tasks.dsbench.receipts`: X_train a table of 1..n_train rows, y_train its target column, X_test exactly
test.csv's rows, model a fitted estimator; a restricted unpickler, never a load on the host). A file counts as
saved only with a receipt that is ok: for the stop rule, the warnings, the blame of earlier agents (judged on
the files as the agent found them when it began) and the coach's evidence (`receipts`).

`Episode.correct` is a **success**: a valid `submission.csv` that is strictly better than every trivial
prediction (`mappa.tasks.tabular.score_submission`, which reads it as an agent file: a link, a FIFO or an
oversized file is an invalid submission with its reason; a copy of sample_submission.csv, a constant or noise
is valid but no success). `Episode.meta` holds the scores (`submission`: valid, success, reason, trivial,
metric, score, trivial_score, gap, reference_fraction, and `paper`, the paper's fair figures:
`mappa.tasks.dsbench.metrics.paper_figures`, fallbacks for an invalid submission) and the required files missing
or not usable at the end (`missing_files`). The coach's evidence (`Action.evidence`, recorded live so a replay
rebuilds it) is the file list before and after the action, the files each earlier agent saved and the
receipts; for the Analyst also the test-set evaluation of `submission.csv` as the action left it and the
target's statistics from `train.csv`, from which the coach derives the Analyst's score cap (`mappa.coach.caps`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from mappa.config import SandboxConfig, WorkflowConfig
from mappa.errors import MappaError
from mappa.sandbox.workspace import snapshot
from mappa.tasks.answers import without_reasoning
from mappa.tasks.files import visible_names
from mappa.types import Action, CoachContext, Episode, ExecResult, Message, Task
from mappa.workflows import ds_prompts
from mappa.workflows.base import AgentSpec, clip_middle, feedback_note, system_prompt
from mappa.workflows.codeblocks import extract_code_blocks, format_observation
from mappa.workflows.ds_prompts import _TOOLS as _TOOLS  # the agents' tool text (a test checks their packages)
from mappa.workflows.ds_prompts import (
    ANALYST,
    DATA_ENGINEER,
    MODELER,
    REQUIRED,
    SPECS,
    Receipts,
    listed,
    missing_upstream,
    unusable,
)
from mappa.workflows.ds_state import AgentTurns, DsEpisode, Team
from mappa.workflows.runtime import Reply, Tools
from mappa.workflows.runtime import Team as Players

__all__ = ["ANALYST", "DATA_ENGINEER", "MODELER", "REQUIRED", "SPECS", "DsPipeline", "Team"]

# What `Episode.meta["submission"]` keeps of the final test-set evaluation (with `paper`, the paper's figures).
SUBMISSION_KEYS = ("valid", "success", "reason", "trivial", "metric", "score", "trivial_score", "gap",
                   "reference_fraction")  # fmt: skip


def visible_files(workspace: Path) -> tuple[str, ...]:
    """The workspace's files as the agents see them (`mappa.tasks.files.visible_names`)."""
    return visible_names(snapshot(workspace).files)


def saved_files(result: ExecResult | None) -> tuple[str, ...]:
    """The files one code run created or changed (visible ones only)."""
    return () if result is None else visible_names([*result.files_created, *result.files_changed])


def check_task(task: Task) -> Path:
    """The task's directory of public files; a task without one is a one-line MappaError."""
    from mappa.tasks.tabular import TASK_FILES  # the tabular stack (pandas) loads only when a tabular task plays

    task_dir = task.meta.get("task_dir")
    if not task_dir:
        raise MappaError(
            f"task {task.id!r}: no meta['task_dir'] (ds_pipeline plays tabular tasks: tasks.train: [dsbench])"
        )
    for name in TASK_FILES:
        if not (Path(task_dir) / name).is_file():
            raise MappaError(f"task {task.id!r}: {Path(task_dir) / name} not found")
    return Path(task_dir)


def stock_workspace(workspace: Path, task: Task) -> None:
    """Copy the task's public files into a fresh workspace, owned like the workspace (a sandbox uid as root)."""
    from mappa.tasks.tabular import TASK_FILES  # all a workspace gets: never the answers

    src = check_task(task)
    owner = workspace.stat()
    for name in TASK_FILES:
        shutil.copyfile(src / name, workspace / name)
        if os.geteuid() == 0:
            os.chown(workspace / name, owner.st_uid, owner.st_gid)


def target_statistics(task: Task) -> dict[str, Any]:
    """The target column of `train.csv`: class shares (classification) or its spread (regression)."""
    import pandas as pd

    target = task.meta["target"]
    y = pd.read_csv(Path(task.meta["task_dir"]) / "train.csv", usecols=[target])[target].dropna()
    if task.meta.get("data_type") == "classification":
        shares = y.astype(str).value_counts(normalize=True)
        return {
            "column": target,
            "rows": int(y.size),
            "classes": int(shares.size),
            "majority_share": round(float(shares.iloc[0]), 4),
            "class_shares": {str(k): round(float(v), 4) for k, v in shares.head(10).items()},
        }
    v = y.astype(float)
    q1, median, q3 = (float(x) for x in v.quantile([0.25, 0.5, 0.75]))
    stats = {"mean": v.mean(), "std": v.std(), "min": v.min(), "max": v.max(), "median": median, "iqr": q3 - q1}
    stats["range"] = stats["max"] - stats["min"]
    return {"column": target, "rows": int(v.size), **{k: float(f"{float(x):.4g}") for k, x in stats.items()}}


class DsPipeline:
    """The data-science pipeline, one episode at a time (`play`); built with the settings it reads, once: the
    per-agent turn cap (`workflow.ds_max_turns`), the stop rule (`ds_stop_when_done`), whose prompts the agents get
    (`prompts`), the coach's notes shown (`show_coach_feedback`), the cap rules (`ds_caps`) and the longest tool
    observation (`sandbox.observation_chars`). How it samples is the runtime's call (`mappa.workflows.runtime`)."""

    name = "ds_pipeline"

    def __init__(self, cfg: WorkflowConfig | None = None, sandbox: SandboxConfig | None = None) -> None:
        cfg = cfg or WorkflowConfig()
        self.observation_chars = (sandbox or SandboxConfig()).observation_chars
        self.paper = cfg.prompts == "paper"  # the published prompts (`mappa.workflows.paper_prompts`)
        self.stop_when_done = cfg.ds_stop_when_done
        self.show_feedback = cfg.show_coach_feedback
        self.cap_rules = cfg.ds_caps  # recorded in the evidence, so a replay applies the same caps
        self.specs = tuple(dataclasses.replace(s, max_turns=cfg.ds_max_turns) for s in SPECS)
        self.agents = tuple(s.name for s in self.specs)
        self.max_actions = sum(s.max_turns for s in self.specs)
        self._targets: dict[str, dict[str, Any]] = {}  # task id -> target statistics (train.csv read once)
        self._train_targets: dict[str, list[Any]] = {}  # task id -> train.csv's target column (read once)
        self._rows: dict[str, tuple[int, int]] = {}  # task id -> rows of train.csv and test.csv (read once)

    def check_task(self, task: Task) -> None:
        check_task(task)

    def role(self, spec: AgentSpec, budget: int) -> str:
        return spec.role.format(budget=budget, turns=spec.max_turns)

    def spec(self, agent: str) -> AgentSpec:
        for s in self.specs:
            if s.name == agent:
                return s
        raise MappaError(f"agent {agent!r} is not part of workflow {self.name!r} ({', '.join(self.agents)})")

    # ---------------------------------------------------------------------------------------------- prompts
    def first_prompt(
        self,
        spec: AgentSpec,
        task: Task,
        files: Sequence[str],
        team: Team,
        budget: int | None,
        receipts: Receipts | None = None,
    ) -> str:
        """The agent's first user turn (`ds_prompts.first_prompt`, or `paper_first_prompt`)."""
        if self.paper:
            return ds_prompts.paper_first_prompt(spec, task, files, team, budget)
        return ds_prompts.first_prompt(spec, task, files, team, budget, receipts)

    def messages(
        self, spec: AgentSpec, task: Task, turns: AgentTurns, team: Team, tokens: int, cut: int | None
    ) -> list[Message]:
        """The agent's chat: its first prompt (the files it began with), then its own earlier replies and their
        tool responses; embedded text cut to `cut` characters (None: whole), `tokens` its reply's cap."""
        first = Message(
            role="user", content=self.first_prompt(spec, task, turns.start, team, cut, turns.start_receipts)
        )
        # the paper's agents had no system prompt: their template is the whole first message
        messages = [first] if self.paper else [Message(role="system", content=self.role(spec, tokens)), first]
        for action, observation in turns.history:
            messages.append(Message(role="assistant", content=clip_middle(action.text, cut)))
            messages.append(Message(role="user", content=clip_middle(observation, cut)))
        return messages

    def tool_response(
        self, spec: AgentSpec, result: ExecResult, files: Sequence[str], problems: Mapping[str, str] | None = None
    ) -> str:
        """What a code run returns to its agent (`ds_prompts.tool_response`, or `paper_tool_response`)."""
        if self.paper:
            return ds_prompts.paper_tool_response(result, self.observation_chars)
        return ds_prompts.tool_response(spec, result, files, self.observation_chars, problems)

    # ------------------------------------------------------------------------------------------------- coach
    def evidence(
        self,
        spec: AgentSpec,
        task: Task,
        workspace: Path,
        before: Sequence[str],
        team: Team,
        *,
        owed: Mapping[str, str] | None = None,
        receipts: Receipts | None = None,
    ) -> dict[str, Any]:
        """What the coach sees of an action beyond its messages, taken right after its code ran: `owed`, the
        earlier agents' files missing or unusable when the agent began (default: those missing from `before`),
        and `receipts`, those of the required pickles now present."""
        after = visible_files(workspace)
        ev: dict[str, Any] = {
            "files_before": listed(before),
            "files_after": listed(after),
            "files_by_agent": {agent: listed(files) for agent, files in team.saved.items()},
            "missing_upstream": dict(missing_upstream(spec.name, before) if owed is None else owed),
        }
        if receipts is not None:
            ev["receipts"] = {name: dict(r) for name, r in receipts.items() if name in after}
        if self.cap_rules != "mappa":  # recorded only when not the default: older evidence reads as the default
            ev["cap_rules"] = self.cap_rules
        if spec.name == ANALYST.name:
            ev.update(
                test_evaluation=self.test_evaluation(task, workspace), target_statistics=self.target_statistics(task)
            )
        return ev

    def test_evaluation(self, task: Task, workspace: Path) -> dict[str, Any]:
        """`submission.csv` as it stands in the workspace, scored against the hidden answers."""
        from mappa.tasks.tabular import higher_is_better, score_submission

        score = score_submission(task, workspace / "submission.csv")
        meta = task.meta
        return {
            **dataclasses.asdict(score),
            "higher_is_better": higher_is_better(score.metric),
            "baseline_score": meta.get("baseline_score"),
            "reference_score": meta.get("reference_score"),
        }

    def paper_figures(self, task: Task, submission: Path, valid: bool) -> dict[str, float]:
        """The paper's figures of an episode's submission (`mappa.tasks.dsbench.metrics.paper_figures`), or the
        fair fallbacks when it is invalid; {} when the task's own files cannot give them (they are a report's,
        never a reason to stop an episode)."""
        from mappa.tasks.dsbench.metrics import CLASSIFICATION_METRICS, fallback_figures, paper_figures
        from mappa.tasks.dsbench.submission import canonical, read_submission, read_text_csv

        meta = task.meta
        metric, target = str(meta.get("metric", "")), meta.get("target")
        try:
            if task.id not in self._train_targets:
                column = read_text_csv(Path(meta["task_dir"]) / "train.csv", "train.csv")[target]
                values = [canonical(v) for v in column if v.strip()]
                self._train_targets[task.id] = values if metric in CLASSIFICATION_METRICS else list(map(float, values))
            y_train = self._train_targets[task.id]
            if valid:
                y_true, y_pred, labels = read_submission(task, submission)
                return paper_figures(metric, y_true, y_pred, y_train, labels)
            answers = read_text_csv(Path(meta["answer_path"]), "answer file")[target]
            y_true = list(answers) if metric in CLASSIFICATION_METRICS else [float(v) for v in answers]
            return fallback_figures(metric, y_true, y_train)
        except Exception:  # noqa: BLE001 - a task whose files do not give the figures has none
            return {}

    def target_statistics(self, task: Task) -> dict[str, Any]:
        if task.id not in self._targets:
            self._targets[task.id] = target_statistics(task)
        return self._targets[task.id]

    def task_rows(self, task: Task) -> tuple[int, int]:
        """Rows of the task's train.csv and test.csv (its own files), which the receipts expect."""
        if task.id not in self._rows:
            import pandas as pd

            task_dir, column = Path(task.meta["task_dir"]), task.meta["id_column"]
            n_train, n_test = (len(pd.read_csv(task_dir / f, usecols=[column])) for f in ("train.csv", "test.csv"))
            self._rows[task.id] = (n_train, n_test)
        return self._rows[task.id]

    async def check_receipts(self, task: Task, tools: Tools) -> Receipts:
        """The receipts of the required pickles present in the workspace, from one check run in the sandbox. A
        check that fails vouches for nothing."""
        from mappa.tasks.dsbench.receipts import RECEIPT_FILES, expectations, failed, parse_receipts, receipt_code

        present = [f for f in RECEIPT_FILES if f in visible_files(tools.workspace)]
        if not present:
            return {}
        want = expectations(*self.task_rows(task))
        result = await tools.python(receipt_code({f: want[f] for f in present}))
        stopped = {"timed out": result.timed_out, "memory limit": result.memory_exceeded}
        why = next((k for k, hit in stopped.items() if hit), "sandbox failure" if result.infra_error else None)
        return (
            failed(present, f"the check did not finish ({why})")
            if why is not None
            else parse_receipts(result.stdout, present)
        )

    def context(self, task: Task, action: Action) -> CoachContext:
        """The coach's evidence for one action: its exact input and output, its tool call, the recorded files
        (before, after, per earlier agent) and, for the Analyst, the test-set evaluation."""
        spec = self.spec(action.agent)
        ev = action.evidence
        result = action.exec_result
        extra: dict[str, Any] = {
            "tools": list(spec.tools),
            "required_files": list(REQUIRED[spec.name]),
            "files_after": listed(ev.get("files_after", ())),
            "files_saved": listed(saved_files(result)),
            "missing_upstream": dict(ev.get("missing_upstream", {})),
        }
        # Older recorded evidence may also hold a `score_cap`; it is not passed on: the coach derives the cap.
        extra.update({k: ev[k] for k in ("test_evaluation", "target_statistics", "receipts", "cap_rules") if k in ev})
        return CoachContext(
            task=task.problem,
            workflow=self.name,
            agent=spec.name,
            role=system_prompt(action) or spec.title,  # the paper's agents had no system prompt
            is_final=spec.name == ANALYST.name,
            messages=action.messages,
            output=action.text,
            exec_result=result,
            observation="" if result is None else format_observation(result, self.observation_chars),
            files_visible=tuple(listed(ev.get("files_before", ()))),
            files_by_agent={agent: tuple(listed(files)) for agent, files in ev.get("files_by_agent", {}).items()},
            extra=extra,
        )

    # ----------------------------------------------------------------------------------------------------- play
    async def play(self, task: Task, team: Players, tools: Tools) -> Episode:
        """Every agent in turn on the task's files; the episode scored while its workspace exists."""
        stock_workspace(tools.workspace, task)
        ep = DsEpisode()
        for spec in self.specs:
            await self._agent(spec, task, team, tools, ep)
        return self._episode(task, team, tools.workspace, ep)

    async def _agent(self, spec: AgentSpec, task: Task, team: Players, tools: Tools, ep: DsEpisode) -> None:
        """Up to `spec.max_turns` turns of one agent; it stops at a reply without code, or (`ds_stop_when_done`)
        once its code ran cleanly and its required files exist and count. Records its final message, the files it
        saved and, when later agents are shown it, the coach's note on that message."""
        turns = ep.turns = AgentTurns(start=visible_files(tools.workspace), start_receipts=dict(ep.receipts))
        owed = missing_upstream(spec.name, turns.start, turns.start_receipts)
        tokens = team.sampling.max_new_tokens
        for _ in range(spec.max_turns):
            before = visible_files(tools.workspace)
            reply = await team.generate(spec.name, partial(self.messages, spec, task, turns, ep.team, tokens))
            action = await self._run(spec, task, team, tools, ep, reply, before, owed)
            turns.final, result = action, action.exec_result
            if result is None:  # a reply without code ends the agent's turns
                break
            turns.saved.extend(saved_files(result))
            files = visible_files(tools.workspace)
            problems = self.problems(spec, files, ep.receipts, action.evidence)
            turns.history.append((action, self.tool_response(spec, result, files, problems)))
            if self.stop_when_done and result.ok and all(f in files for f in REQUIRED[spec.name]) and not problems:
                break
        if turns.final is not None:
            ep.team.finals[spec.name] = without_reasoning(turns.final.text).strip()
            ep.team.saved[spec.name] = tuple(listed(list(dict.fromkeys(turns.saved))))
            if self.show_feedback and turns.final.coach is not None:  # no coach (evaluation): no note to show
                ep.team.notes[spec.name] = feedback_note(spec.title, turns.final.coach)

    async def _run(
        self, spec: AgentSpec, task: Task, team: Players, tools: Tools, ep: DsEpisode, reply: Reply,
        before: Sequence[str], owed: Mapping[str, str],
    ) -> Action:  # fmt: skip
        """The reply's code run, the receipts of its files taken, its evidence recorded; scored."""
        blocks = extract_code_blocks(reply.text)
        result = await tools.python("\n\n".join(blocks)) if blocks else None
        if result is not None:
            ep.receipts = await self.check_receipts(task, tools)
        evidence = self.evidence(spec, task, tools.workspace, before, ep.team, owed=owed, receipts=ep.receipts)
        return await team.commit(reply, result, evidence)

    @staticmethod
    def problems(
        spec: AgentSpec, files: Sequence[str], receipts: Receipts, evidence: Mapping[str, Any]
    ) -> dict[str, str]:
        """The agent's required files present but not usable: pickles by their receipts, the submission by its
        check (its format only: the agents never see a test score)."""
        out = {f: why for f, why in unusable(files, receipts).items() if f in REQUIRED[spec.name]}
        test = evidence.get("test_evaluation")
        if test and not test["valid"] and "submission.csv" in files:
            out["submission.csv"] = str(test["reason"])
        return out

    def _episode(self, task: Task, team: Players, workspace: Path, ep: DsEpisode) -> Episode:
        """The finished episode, its submission scored against the hidden answers (the Analyst's last evaluation
        when it acted last: nothing ran since)."""
        files = visible_files(workspace)
        last = team.actions[-1] if team.actions else None
        recorded = last.evidence.get("test_evaluation") if last is not None and last.agent == ANALYST.name else None
        test = recorded or self.test_evaluation(task, workspace)
        if "submission.csv" not in files:
            final_answer = None
        elif test["success"]:
            final_answer = f"{test['metric']}={test['score']:.6g}"
        elif test["valid"]:
            final_answer = f"{test['metric']}={test['score']:.6g} (no success: {test['trivial']})"
        else:
            final_answer = f"invalid submission: {test['reason']}"
        submission = {k: test[k] for k in SUBMISSION_KEYS}
        # the paper's fair figures (fallbacks when invalid)
        submission["paper"] = self.paper_figures(task, workspace / "submission.csv", bool(test["valid"]))
        bad = {**unusable(files, ep.receipts), **({} if test["valid"] else {"submission.csv": test["reason"]})}
        missing = [f for agent in self.agents for f in REQUIRED[agent] if f not in files or f in bad]
        meta = {"submission": submission, "missing_files": missing}
        return team.episode(final_answer=final_answer, correct=bool(test["success"]), meta=meta)
