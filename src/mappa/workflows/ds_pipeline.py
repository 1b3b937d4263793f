"""The data-science pipeline: Data Engineer -> Modeler -> Analyst on a Kaggle-style tabular task (method.md §5).

| agent         | turns (cap)           | must save                            | sees                                 |
|---------------|-----------------------|--------------------------------------|--------------------------------------|
| data_engineer | workflow.ds_max_turns | X_train.pkl, y_train.pkl, X_test.pkl | the task description and the files   |
| modeler       | workflow.ds_max_turns | model.pkl                            | + the Data Engineer's final message  |
| analyst       | workflow.ds_max_turns | submission.csv                       | + the Modeler's final message        |

Every agent after the first is warned about an earlier agent's required file that is missing.

The agents pass work through files: one workspace per episode, shared by every tool call of every agent,
starts with the task's `train.csv`, `test.csv`, `sample_submission.csv` and `description.txt` (copied from
`task.meta["task_dir"]`; the answers live elsewhere and never enter it). Each prompt lists the files present
and which files each earlier agent saved, warns about an earlier agent's required file that is missing, and
gives the earlier agents' final messages with their reasoning blocks removed. A file list, in a prompt or in
the coach's evidence, shows at most `mappa.tasks.files.MAX_LISTED` names (the required files present always
among them), then how many more. Every ```python block of an
action is joined into one snippet that runs in the workspace; the output comes back as
`<tool_response>...</tool_response>` together with the files now present. An agent stops at an action
without code, at its turn cap, or once its code ran cleanly and all its required files exist (its job is
done; the paper's agents stop only at the first two, which costs turns the demo cannot afford).

`Episode.correct` is a valid `submission.csv` (`mappa.tasks.tabular.score_submission`, which reads it as an
agent file: a link, a FIFO or an oversized file is an invalid submission with its reason); `Episode.meta`
holds the scores (`submission`: valid, reason, metric, score, gap, reference_fraction, and `paper`, the
paper's fair figures: `mappa.tasks.dsbench.metrics.paper_figures`, fallbacks for a failed run) and the required
files missing at the end (`missing_files`). The coach's evidence (`Action.evidence`, recorded live so a
replay rebuilds it) is the file list before and after the action and the files each earlier agent saved;
for the Analyst also the test-set evaluation of `submission.csv` as the action left it, the target's
statistics from `train.csv`, and the score cap those imply (`score_cap`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mappa.config import GenerationConfig, SandboxConfig, WorkflowConfig
from mappa.errors import MappaError
from mappa.protocols import ProgressFn, Runtime
from mappa.sandbox.codeblocks import extract_code_blocks, format_observation
from mappa.sandbox.workspace import snapshot
from mappa.tasks.answers import without_reasoning
from mappa.tasks.files import bounded_names
from mappa.types import Action, CoachContext, Episode, ExecResult, Message, Task
from mappa.workflows.base import (
    AgentSpec,
    Batch,
    EpisodeState,
    Turn,
    clip_middle,
    episode_meta,
    play_batch,
    run_stage,
    score_stage,
)

_TEAM = (
    "a data-science team of three agents (Data Engineer, then Modeler, then Analyst) that solves a Kaggle-style "
    "tabular task by passing files through one shared folder"
)
_TOOLS = (
    "Write Python in a ```python block: it runs in the shared folder (numpy, pandas, scipy and scikit-learn "
    "are installed, no internet) and its output comes back to you in <tool_response>. You can run code {turns} "
    "time(s); reply without a code block when you are done. Keep it short: each reply is cut off after {budget} "
    "tokens."
)

DATA_ENGINEER = AgentSpec(
    name="data_engineer",
    title="Data Engineer",
    role=(
        f"You are the Data Engineer, the first agent of {_TEAM}. The folder holds train.csv, test.csv, "
        "sample_submission.csv and description.txt. Load train.csv and test.csv with pandas, prepare the "
        "features the same way for both (numbers only, no missing values), and save three files with pickle: "
        "X_train.pkl (training features), y_train.pkl (the target) and X_test.pkl (test features, in the row "
        "order of test.csv). The Modeler trains on X_train.pkl and y_train.pkl; the Analyst predicts on "
        f"X_test.pkl. Print a short summary of what you did. {_TOOLS}"
    ),
    max_turns=4,
    tools=("python",),
    sees="the task description and the file list",
)

MODELER = AgentSpec(
    name="modeler",
    title="Modeler",
    role=(
        f"You are the Modeler, the second agent of {_TEAM}. The Data Engineer saved X_train.pkl, y_train.pkl "
        "and X_test.pkl. Load X_train.pkl and y_train.pkl (only files listed as present), fit a scikit-learn "
        "model suited to the task's metric, and save it to model.pkl with pickle. Print a short summary: the "
        f"model and a validation score. The Analyst uses model.pkl to predict. {_TOOLS}"
    ),
    max_turns=4,
    tools=("python",),
    sees="the task description, the file list and the Data Engineer's final message (no reasoning)",
)

ANALYST = AgentSpec(
    name="analyst",
    title="Analyst",
    role=(
        f"You are the Analyst, the last agent of {_TEAM}. The team succeeds only if you write a valid "
        "submission.csv. Load model.pkl and X_test.pkl, predict for every row of test.csv, and write "
        "submission.csv with exactly the columns of sample_submission.csv: the id column of test.csv, then the "
        "prediction (class probabilities when the metric asks for them). If a file is missing, work around it "
        f"with the files that are present. {_TOOLS}"
    ),
    max_turns=4,
    tools=("python",),
    sees="the task description, the file list with warnings, both earlier agents' final messages (no reasoning)",
)

SPECS = (DATA_ENGINEER, MODELER, ANALYST)
REQUIRED: dict[str, tuple[str, ...]] = {
    DATA_ENGINEER.name: ("X_train.pkl", "y_train.pkl", "X_test.pkl"),
    MODELER.name: ("model.pkl",),
    ANALYST.name: ("submission.csv",),
}
# File lists in prompts and evidence are bounded (`bounded_names`) but always show the required files present.
ALWAYS_LISTED = tuple(f for files in REQUIRED.values() for f in files)

# The task restated at the end of each first prompt: small models follow the last instruction they read.
ASK = {
    DATA_ENGINEER.name: "Write a ```python block that loads the data, prepares the features and saves X_train.pkl, "
    "y_train.pkl and X_test.pkl.",
    MODELER.name: "Write a ```python block that loads X_train.pkl and y_train.pkl, fits a model and saves it to "
    "model.pkl.",
    ANALYST.name: "Write a ```python block that loads model.pkl and X_test.pkl, predicts, and writes "
    "submission.csv in the format of sample_submission.csv.",
}

# Score caps for the Analyst from the real test metric (method.md §3), as (threshold, cap), best first. The
# paper's tables cover ROC-AUC/accuracy and RMSE as a share of the target's range; every metric is also capped
# by the share of the reference model's gain over a trivial prediction it reaches (DSBench mixes ten metrics),
# so a prediction no better than trivial (e.g. high accuracy from the majority class) is capped at 4.
PAPER_CAPS = ((0.85, 9), (0.75, 8), (0.65, 6), (0.55, 4))  # roc_auc, accuracy at least x; below: 3
RMSE_CAPS = ((10.0, 9), (25.0, 8), (50.0, 6))  # RMSE in % of the target's range below x; above: 4
REFERENCE_CAPS = ((0.9, 9), (0.7, 8), (0.4, 6), (0.1, 5))  # share of the reference's gain at least x; below: 4


def visible_files(workspace: Path) -> tuple[str, ...]:
    """The workspace's files as the agents see them: relative paths, sorted, without hidden files and caches
    (HOME points into the workspace, so libraries may leave `.cache` and `.config` there)."""
    return tuple(sorted(name for name in snapshot(workspace) if _visible(name)))


def _visible(name: str) -> bool:
    return not any(part.startswith(".") or part == "__pycache__" for part in Path(name).parts)


def listed(names: Sequence[str]) -> list[str]:
    """`names` as a prompt or the coach's evidence shows them: at most `MAX_LISTED`, the required files present
    always among them."""
    return bounded_names(names, keep=ALWAYS_LISTED)


def saved_files(result: ExecResult | None) -> tuple[str, ...]:
    """The files one code run created or changed (visible ones only)."""
    if result is None:
        return ()
    return tuple(sorted(f for f in {*result.files_created, *result.files_changed} if _visible(f)))


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


def missing_upstream(agent: str, files: Sequence[str]) -> dict[str, str]:
    """Required files of the agents before `agent` that are not among `files`: file -> the agent that owed it."""
    out: dict[str, str] = {}
    for spec in SPECS:
        if spec.name == agent:
            break
        out.update({f: spec.name for f in REQUIRED[spec.name] if f not in files})
    return out


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


def _step_cap(value: float, steps: Sequence[tuple[float, int]], floor: int, below: bool = False) -> int:
    for threshold, cap in steps:
        if (value < threshold) if below else (value >= threshold):
            return cap
    return floor


def score_cap(test: dict[str, Any], stats: dict[str, Any]) -> tuple[int | None, str]:
    """The highest score the Analyst's action may get given its test-set evaluation, and why (None: no valid
    submission, the blame rules apply instead)."""
    if not test["valid"] or test["score"] is None:
        return None, "no valid submission: the blame rules apply"
    share = test["reference_fraction"]
    caps = [
        (_step_cap(share, REFERENCE_CAPS, 4), f"{share:.0%} of the reference model's gain over a trivial prediction")
    ]
    metric, score = test["metric"], test["score"]
    if metric in ("roc_auc", "accuracy"):
        caps.append((_step_cap(score, PAPER_CAPS, 3), f"{metric} {score:.3f}"))
    elif metric == "rmse" and stats.get("range"):
        pct = 100 * score / stats["range"]
        caps.append((_step_cap(pct, RMSE_CAPS, 4, below=True), f"RMSE {pct:.1f}% of the target's range"))
    cap, why = min(caps)
    return cap, f"at most {cap}: {why}"


@dataclass
class Team:
    """One episode's file passing so far: each earlier agent's final message and the files it saved."""

    finals: dict[str, str] = field(default_factory=dict)  # agent -> final message, reasoning removed
    saved: dict[str, tuple[str, ...]] = field(default_factory=dict)  # agent -> files its code created or changed


class DsPipeline:
    """The data-science pipeline: `DsPipeline(cfg.workflow, cfg.generation, cfg.sandbox).run(tasks, runtime)`.

    Settings read once: the per-agent turn cap (`workflow.ds_max_turns`), the sampling settings and token caps
    (`gen`), the longest tool observation (`sandbox.observation_chars`) and whether workspaces are kept.
    """

    name = "ds_pipeline"

    def __init__(
        self,
        cfg: WorkflowConfig | None = None,
        gen: GenerationConfig | None = None,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        cfg = cfg or WorkflowConfig()
        sandbox = sandbox or SandboxConfig()
        self.gen = gen or GenerationConfig()
        self.observation_chars = sandbox.observation_chars
        self.keep_workspaces = sandbox.keep_workspaces
        self.specs = tuple(dataclasses.replace(s, max_turns=cfg.ds_max_turns) for s in SPECS)
        self.agents = tuple(s.name for s in self.specs)
        self._targets: dict[str, dict[str, Any]] = {}  # task id -> target statistics (train.csv read once)
        self._train_targets: dict[str, list[Any]] = {}  # task id -> train.csv's target column (read once)

    def role(self, spec: AgentSpec) -> str:
        return spec.role.format(budget=self.gen.max_new_tokens, turns=spec.max_turns)

    def spec(self, agent: str) -> AgentSpec:
        for s in self.specs:
            if s.name == agent:
                return s
        raise MappaError(f"agent {agent!r} is not part of workflow {self.name!r} ({', '.join(self.agents)})")

    # ---------------------------------------------------------------------------------------------- prompts
    def first_prompt(self, spec: AgentSpec, task: Task, files: Sequence[str], team: Team, budget: int | None) -> str:
        """The agent's first user turn: the task, the files present, what earlier agents saved and said."""
        lines = [f"Task description:\n{task.problem.strip()}", f"Files in the folder: {', '.join(listed(files))}"]
        for agent, saved in team.saved.items():
            lines.append(f"Saved by the {self.spec(agent).title}: {', '.join(saved) or 'nothing'}")
        owed: dict[str, list[str]] = {}
        for name, agent in missing_upstream(spec.name, files).items():
            owed.setdefault(agent, []).append(name)
        for agent, names in owed.items():
            what, it = (
                (f"{names[0]} is", "it")
                if len(names) == 1
                else (f"{', '.join(names[:-1])} and {names[-1]} are", "them")
            )
            lines.append(f"Warning: {what} missing: the {self.spec(agent).title} did not save {it}.")
        for agent, text in team.finals.items():
            lines.append(f"The {self.spec(agent).title}'s final message:\n{clip_middle(text, budget) or '(empty)'}")
        return "\n\n".join([*lines, ASK[spec.name]])

    def messages(
        self,
        spec: AgentSpec,
        task: Task,
        files: Sequence[str],
        team: Team,
        history: Sequence[tuple[Action, str]],
        budget: int | None,
    ) -> list[Message]:
        """The agent's chat: its first prompt, then its own earlier replies and their tool responses."""
        messages = [
            Message(role="system", content=self.role(spec)),
            Message(role="user", content=self.first_prompt(spec, task, files, team, budget)),
        ]
        for action, observation in history:
            messages.append(Message(role="assistant", content=clip_middle(action.text, budget)))
            messages.append(Message(role="user", content=clip_middle(observation, budget)))
        return messages

    def tool_response(self, spec: AgentSpec, result: ExecResult, files: Sequence[str]) -> str:
        """What a code run returns to its agent: the output, the files now present and its files still missing."""
        missing = [f for f in REQUIRED[spec.name] if f not in files]
        still = f"\nStill missing: {', '.join(missing)}" if missing else ""
        observation = format_observation(result, self.observation_chars)
        shown = ", ".join(listed(files))
        return f"<tool_response>\n{observation}\n\nFiles in the folder: {shown}{still}\n</tool_response>"

    # ------------------------------------------------------------------------------------------------- coach
    def evidence(self, spec: AgentSpec, state: EpisodeState, before: Sequence[str], team: Team) -> dict[str, Any]:
        """What the coach sees of an action beyond its messages, taken right after its code ran."""
        ev: dict[str, Any] = {
            "files_before": listed(before),
            "files_after": listed(visible_files(state.workspace)),
            "files_by_agent": {agent: listed(files) for agent, files in team.saved.items()},
            "missing_upstream": missing_upstream(spec.name, before),
        }
        if spec.name == ANALYST.name:
            test = self.test_evaluation(state)
            stats = self.target_statistics(state.task)
            cap, why = score_cap(test, stats)
            ev.update(test_evaluation=test, target_statistics=stats, score_cap=cap, score_cap_rule=why)
        return ev

    def test_evaluation(self, state: EpisodeState) -> dict[str, Any]:
        """`submission.csv` as it stands in the workspace, scored against the hidden answers."""
        from mappa.tasks.tabular import higher_is_better, score_submission

        score = score_submission(state.task, state.workspace / "submission.csv")
        meta = state.task.meta
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
        extra.update(
            {k: ev[k] for k in ("test_evaluation", "target_statistics", "score_cap", "score_cap_rule") if k in ev}
        )
        return CoachContext(
            task=task.problem,
            workflow=self.name,
            agent=spec.name,
            role=self.role(spec),
            is_final=spec.name == ANALYST.name,
            messages=action.messages,
            output=action.text,
            exec_result=result,
            observation="" if result is None else format_observation(result, self.observation_chars),
            files_visible=tuple(listed(ev.get("files_before", ()))),
            files_by_agent={agent: tuple(listed(files)) for agent, files in ev.get("files_by_agent", {}).items()},
            extra=extra,
        )

    # --------------------------------------------------------------------------------------------------- run
    def run(
        self, tasks: Sequence[Task], rt: Runtime, *, seed: int | None = None, progress: ProgressFn | None = None
    ) -> list[Episode]:
        """Play one episode per task, all in lockstep; returns episodes in task order."""
        if not tasks:
            return []
        for task in tasks:
            check_task(task)
        outcomes: dict[str, dict[str, Any]] = {}
        states = play_batch(
            tasks,
            rt,
            self.gen,
            lambda batch: self._play(batch, outcomes),
            actions_per_episode=sum(s.max_turns for s in self.specs),
            keep_workspaces=self.keep_workspaces,
            seed=seed,
            progress=progress,
        )
        return [self._episode(s, outcomes[s.id]) for s in states]

    def _stage(
        self, batch: Batch, spec: AgentSpec, turns: list[Turn], turn_index: int, teams: dict[int, Team]
    ) -> list[tuple[Turn, Action]]:
        before = {id(t.state): visible_files(t.state.workspace) for t in turns}
        done = run_stage(batch, spec, turns, turn_index=turn_index, extract_code=extract_code_blocks)
        done = [
            (
                t,
                a.model_copy(
                    update={"evidence": self.evidence(spec, t.state, before[id(t.state)], teams[id(t.state)])}
                ),
            )
            for t, a in done
        ]
        contexts = [self.context(t.state.task, a) for t, a in done]
        done = score_stage(done, contexts, batch.rt.scorer)
        for turn, action in done:
            turn.state.actions.append(action)
        batch.count.advance(len(turns))
        return done

    def _agent(self, batch: Batch, spec: AgentSpec, states: list[EpisodeState], teams: dict[int, Team]) -> None:
        """Up to `spec.max_turns` turns of one agent in every episode; records its final message and files."""
        start = {id(s): visible_files(s.workspace) for s in states}
        history: dict[int, list[tuple[Action, str]]] = {id(s): [] for s in states}
        saved: dict[int, list[str]] = {id(s): [] for s in states}
        final: dict[int, Action] = {}
        waiting = list(states)
        for k in range(spec.max_turns):
            turns = [
                Turn(
                    s,
                    lambda budget, s=s: self.messages(
                        spec, s.task, start[id(s)], teams[id(s)], history[id(s)], budget
                    ),
                )
                for s in waiting
            ]
            waiting = []
            for turn, action in self._stage(batch, spec, turns, k, teams):
                s, result = turn.state, action.exec_result
                final[id(s)] = action
                if result is None:  # a reply without code ends the agent's turns
                    continue
                saved[id(s)].extend(saved_files(result))
                files = visible_files(s.workspace)
                history[id(s)].append((action, self.tool_response(spec, result, files)))
                done = result.ok and all(f in files for f in REQUIRED[spec.name])
                if not done and k + 1 < spec.max_turns:
                    waiting.append(s)
            batch.count.drop((len(turns) - len(waiting)) * (spec.max_turns - k - 1))
        for s in states:
            if id(s) in final:
                teams[id(s)].finals[spec.name] = without_reasoning(final[id(s)].text).strip()
                teams[id(s)].saved[spec.name] = tuple(listed(list(dict.fromkeys(saved[id(s)]))))

    def _play(self, batch: Batch, outcomes: dict[str, dict[str, Any]]) -> None:
        for s in batch.states:
            stock_workspace(s.workspace, s.task)
        teams = {id(s): Team() for s in batch.states}
        live = list(batch.states)
        for j, spec in enumerate(self.specs):
            playing = [s for s in live if s.error is None]  # an episode whose prompt could not fit has stopped
            batch.count.drop((len(live) - len(playing)) * sum(x.max_turns for x in self.specs[j:]))
            live = playing
            self._agent(batch, spec, live, teams)
        for s in batch.states:  # scored while the workspaces still exist
            files = visible_files(s.workspace)
            test = self.test_evaluation(s)
            outcomes[s.id] = {
                "submission": test,
                "paper": self.paper_figures(s.task, s.workspace / "submission.csv", bool(test["valid"])),
                "missing_files": [f for agent in self.agents for f in REQUIRED[agent] if f not in files],
                "submitted": "submission.csv" in files,
            }

    def _episode(self, s: EpisodeState, outcome: dict[str, Any]) -> Episode:
        test = outcome["submission"]
        if not outcome["submitted"]:
            final_answer = None
        elif test["valid"]:
            final_answer = f"{test['metric']}={test['score']:.6g}"
        else:
            final_answer = f"invalid submission: {test['reason']}"
        submission = {k: test[k] for k in ("valid", "reason", "metric", "score", "gap", "reference_fraction")}
        submission["paper"] = outcome["paper"]  # the paper's fair figures (fallbacks when invalid)
        meta = {**episode_meta(s, self.keep_workspaces), "submission": submission}
        meta["missing_files"] = outcome["missing_files"]
        return Episode(
            id=s.id,
            workflow=self.name,
            task=s.task,
            actions=tuple(s.actions),
            final_answer=final_answer,
            correct=bool(test["valid"]),
            meta=meta,
        )
