"""What the data-science agents (`mappa.workflows.ds_pipeline`) are told: their roles, the files each must save,
their first prompt and the tool response to a code run; ours, or the paper's (`workflow.prompts: paper`:
`paper_first_prompt`, `paper_tool_response`, the templates in `mappa.workflows.paper_prompts`).

A file list, in a prompt or in the coach's evidence, shows at most `mappa.tasks.files.MAX_LISTED` names (the
required files present always among them), then how many more. A required file counts as saved only when its
receipt (`mappa.tasks.dsbench.receipts`, taken in the sandbox) says it holds what it claims: one that is present
but empty, garbage, of the wrong rows or unfitted is named as not usable, with why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mappa.tasks.files import bounded_names
from mappa.types import ExecResult, Task
from mappa.workflows import paper_prompts as paper
from mappa.workflows.base import AgentSpec, clip_middle
from mappa.workflows.codeblocks import format_observation
from mappa.workflows.ds_state import Team

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
TITLES = {s.name: s.title for s in SPECS}
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


def listed(names: Sequence[str]) -> list[str]:
    """`names` as a prompt or the coach's evidence shows them: at most `MAX_LISTED`, the required files present
    always among them."""
    return bounded_names(names, keep=ALWAYS_LISTED)


Receipts = Mapping[str, Mapping[str, Any]]  # file -> its receipt (ok, kind, rows, columns, why)


def unusable(files: Sequence[str], receipts: Receipts | None) -> dict[str, str]:
    """Files among `files` whose receipt says they do not hold what they claim: file -> why."""
    return {f: str(r.get("why") or "not what it claims") for f, r in (receipts or {}).items()
            if f in files and r.get("ok") is not True}  # fmt: skip


def missing_upstream(agent: str, files: Sequence[str], receipts: Receipts | None = None) -> dict[str, str]:
    """Required files of the agents before `agent` that are not among `files`, or are there but not usable by
    their receipts: file -> the agent that owed it."""
    bad = unusable(files, receipts)
    out: dict[str, str] = {}
    for spec in SPECS:
        if spec.name == agent:
            break
        out.update({f: spec.name for f in REQUIRED[spec.name] if f not in files or f in bad})
    return out


def _warnings(agent: str, files: Sequence[str], receipts: Receipts | None) -> list[str]:
    """One warning per earlier agent whose required files are missing; one per file that is not usable."""
    bad = unusable(files, receipts)
    owed: dict[str, list[str]] = {}
    for name, owner in missing_upstream(agent, files).items():
        owed.setdefault(owner, []).append(name)
    lines = []
    for owner, names in owed.items():
        one = len(names) == 1
        what, it = (f"{names[0]} is", "it") if one else (f"{', '.join(names[:-1])} and {names[-1]} are", "them")
        lines.append(f"Warning: {what} missing: the {TITLES[owner]} did not save {it}.")
    for name, owner in missing_upstream(agent, files, receipts).items():
        if name in bad:
            lines.append(f"Warning: {name} is not usable ({bad[name]}): the {TITLES[owner]} did not save it properly.")
    return lines


def first_prompt(
    spec: AgentSpec, task: Task, files: Sequence[str], team: Team, budget: int | None, receipts: Receipts | None = None
) -> str:
    """The agent's first user turn: the task, the files present (`receipts`: theirs when it began), what earlier
    agents saved and said (their final messages cut in the middle to `budget` characters; None: whole), and the
    coach's note on each of those messages when it is shown (`Team.notes`)."""
    lines = [f"Task description:\n{task.problem.strip()}", f"Files in the folder: {', '.join(listed(files))}"]
    lines += [f"Saved by the {TITLES[agent]}: {', '.join(saved) or 'nothing'}" for agent, saved in team.saved.items()]
    lines += _warnings(spec.name, files, receipts)
    for agent, text in team.finals.items():
        lines.append(f"The {TITLES[agent]}'s final message:\n{clip_middle(text, budget) or '(empty)'}")
        lines += [team.notes[agent]] if agent in team.notes else []
    return "\n\n".join([*lines, ASK[spec.name]])


def paper_first_prompt(spec: AgentSpec, task: Task, files: Sequence[str], team: Team, budget: int | None) -> str:
    """The agent's first user turn as the published code wrote it (`workflow.prompts: paper`,
    `mappa.workflows.paper_prompts`): its template filled with the task, the files present (the Analyst's with the
    published warning) and the earlier agents' final messages (cut in the middle to `budget` characters); then the
    coach's notes on those messages when they are shown."""
    shown = listed(files)
    summary = {agent: clip_middle(text, budget) for agent, text in team.finals.items()}
    if spec.name == DATA_ENGINEER.name:
        text = paper.DS_DATA_ENGINEER.format(
            task_description=task.problem, available_files_list=paper.files_list(shown)
        )
    elif spec.name == MODELER.name:
        text = paper.DS_MODELER.format(
            task_description=task.problem, available_files_list=paper.files_list(shown),
            preprocessing_summary=summary.get(DATA_ENGINEER.name, ""),
        )  # fmt: skip
    else:
        text = paper.DS_ANALYST.format(
            task_description=task.problem, available_files_list=paper.analyst_files_list(shown),
            preprocessing_summary=summary.get(DATA_ENGINEER.name, ""), model_summary=summary.get(MODELER.name, ""),
        )  # fmt: skip
    notes = [team.notes[agent] for agent in team.finals if agent in team.notes]
    return "\n\n".join([text, *notes])


def paper_tool_response(result: ExecResult, observation_chars: int) -> str:
    """What a code run returns to its agent with the paper's prompts: the output alone, as the published code sent
    it (marti/worlds/steps/mcp_step.py, lines 103-104)."""
    return f"<tool_response>\n{format_observation(result, observation_chars)}\n</tool_response>"


def tool_response(
    spec: AgentSpec,
    result: ExecResult,
    files: Sequence[str],
    observation_chars: int,
    problems: Mapping[str, str] | None = None,
) -> str:
    """What a code run returns to its agent: the output, the files now present, its files still missing and
    those present but not usable (`problems`: file -> why, from their receipts or the submission's check)."""
    missing = [f for f in REQUIRED[spec.name] if f not in files]
    still = f"\nStill missing: {', '.join(missing)}" if missing else ""
    bad = [f"{f} ({why})" for f, why in (problems or {}).items() if f in REQUIRED[spec.name] and f in files]
    still += f"\nNot usable yet: {'; '.join(bad)}" if bad else ""
    observation = format_observation(result, observation_chars)
    shown = ", ".join(listed(files))
    return f"<tool_response>\n{observation}\n\nFiles in the folder: {shown}{still}\n</tool_response>"
