"""Coach prompt templates, one per workflow, versioned (the version is part of the cache key).

A template turns a `CoachContext` into chat messages. The ground truth is rendered only when the
context belongs to the final agent (`is_final`): earlier agents are judged on the evidence they
produced, never on the answer they could not see. Bump a template's `version` whenever its text
changes, so cached judgments made with the old wording are not reused.

The coach sees the agent's exact input and raw output, whole. Only when a prompt would exceed the
coach's context budget does `fit_prompt` leave out the agent's oldest input messages (the newest part
of the last one it touches is kept), never the output; the prompt says where and how much was cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mappa.types import CoachContext

ChatMessages = list[dict[str, str]]
TokenCount = Callable[[ChatMessages], int]  # tokens of a chat prompt, as the coach model counts them


@dataclass(frozen=True)
class Template:
    name: str
    version: str
    system: str  # the coach's standing instructions
    rubric: str  # what a good action looks like in this workflow


_OUTPUT_FORMAT = """Reply in this format:
ANALYSIS: a few sentences on what the action did well or badly, citing the evidence.
PROCESS_SCORE: a number from 0 to 10 (decimals allowed)"""

_OUTPUT_FORMAT_FINAL = _OUTPUT_FORMAT + "\nANSWER_CORRECT: 1 if the agent's final answer matches the reference, else 0"

_SYSTEM = """You are a coach for a team of AI agents that solve tasks together. You rate ONE action of ONE \
agent: given the agent's role and exactly the input it had, how much did its output help the team succeed?
You are not judging the team's final result; judge this action on its own evidence: the input the agent \
saw, what it wrote, and what its tool call printed. Do not punish an agent for a mistake made upstream \
that it could not have fixed. Be strict and consistent: 0 = harmful or empty, 5 = partly useful with \
clear problems, 8 = solid, 10 = perfect."""

MATHCHAT = Template(
    name="mathchat",
    version="mathchat-v2",
    system=_SYSTEM,
    rubric="""The team solves a competition math problem in three steps: a Problem Solver reasons about it \
(no tools), a Code Executor writes Python that is run and its output returned, and a Verifier combines \
the evidence into a final answer in \\boxed{...}. The team succeeds only if the Verifier's answer is right.
Rate the action on:
- usefulness: does it move the team toward the right answer, given what this agent was shown?
- role: the Problem Solver sets up a correct approach; the Code Executor writes runnable code in a \
```python block that computes what is needed and prints it; the Verifier checks the evidence, fixes \
errors it can see, and states one final answer in \\boxed{...};
- economy: it stays focused and within its length budget; rambling or repetition costs points;
- honesty about evidence: claims that contradict the tool output cost points.""",
)

DS_PIPELINE = Template(
    name="ds_pipeline",
    version="ds_pipeline-v3",
    system=_SYSTEM,
    rubric="""The team builds a submission for a Kaggle-style tabular machine-learning task through files in one \
shared folder that starts with train.csv, test.csv, sample_submission.csv and description.txt. The Data Engineer \
must save X_train.pkl, y_train.pkl and X_test.pkl; the Modeler must save model.pkl; the Analyst must write \
submission.csv in the format of sample_submission.csv. The team succeeds only if submission.csv is valid. Each \
agent sees the files present and the earlier agents' final messages; its code runs in the folder.
Rate the action on:
- its role's required files (see the files before and after the action) and whether its code ran;
- root cause, never an upstream failure: a missing required file is the fault of the agent that had to save \
it. FileNotFoundError for X_test.pkl is the Data Engineer's fault, for model.pkl the Modeler's; KeyError or \
TypeError with both present is the Analyst's. The culprit gets 0-2; an agent that failed only because an \
upstream file was missing gets 3-5; text with no runnable code gets 0-2 (a short closing message after the \
agent's files were saved is fine);
- 10 is exceptional; 8-9: ran, saved everything, sound method; 6-7: minor issues; 4-5: errors or missing \
outputs;
- the Analyst only: its score must not exceed the hard cap given with the test-set evaluation. The cap comes \
from the real test metric: ROC-AUC/accuracy >= 0.85 or RMSE < 10% of the target's range: at most 9; \
0.75-0.85 / 10-25%: 8; 0.65-0.75 / 25-50%: 6; 0.55-0.65 / > 50%: 4; below 0.55: 3; for every metric also by \
the share of the reference model's gain over a trivial prediction reached (>= 90%: 9, >= 70%: 8, >= 40%: 6, \
>= 10%: 5, less: 4), so high accuracy from predicting the majority class scores about 4.""",
)

GENERIC = Template(
    name="generic",
    version="generic-v2",
    system=_SYSTEM,
    rubric="""Rate the action on how much it helped the team, given the agent's role and input: correct \
reasoning, runnable code when code is called for, consistency with the tool output, and focus.""",
)

TEMPLATES: dict[str, Template] = {t.name: t for t in (MATHCHAT, DS_PIPELINE, GENERIC)}


def template_for(name: str, workflow: str) -> Template:
    """The configured template (`coach.template`, checked by the config), else the workflow's own, else generic."""
    return TEMPLATES[name] if name else TEMPLATES.get(workflow, GENERIC)


@dataclass(frozen=True)
class Cut:
    """What the prompt leaves out of the agent's input: the `dropped` oldest messages, then the first `chars`
    characters of the next one. The default cuts nothing."""

    dropped: int = 0
    chars: int = 0

    @property
    def messages(self) -> int:
        """Input messages left out wholly or in part."""
        return self.dropped + (self.chars > 0)


NO_CUT = Cut()


def _input_section(ctx: CoachContext, cut: Cut) -> list[str]:
    if not cut.messages:
        return ["## The agent's exact input", *(f"[{i}] {m.role}:\n{m.content}" for i, m in enumerate(ctx.messages))]
    parts = [
        f"## The agent's input (cut to fit your context: {cut.messages} of its {len(ctx.messages)} messages, "
        "oldest first; the output below is complete)"
    ]
    if cut.dropped:
        parts.append(f"[messages 0-{cut.dropped - 1} left out]")
    for i in range(cut.dropped, len(ctx.messages)):
        m = ctx.messages[i]
        text = m.content
        if i == cut.dropped and cut.chars:
            text = f"[... first {cut.chars} characters of this message left out ...]\n{text[cut.chars :]}"
        parts.append(f"[{i}] {m.role}:\n{text}")
    return parts


def render_context(ctx: CoachContext, cut: Cut = NO_CUT) -> str:
    """The evidence block of the user prompt. Ground truth appears only for the final agent."""
    parts = [
        f"## Task\n{ctx.task}",
        f"## Agent\n{ctx.agent}" + (" (the final agent of the team)" if ctx.is_final else ""),
        f"## Role\n{ctx.role}",
        *_input_section(ctx, cut),
    ]
    parts.append(f"## The agent's output (this action)\n{ctx.output}")
    # The coach reads the words; code decides by exec_result, never by this text.
    parts.append(f"## Tool observation\n{'no tool used' if ctx.exec_result is None else ctx.observation}")
    if ctx.files_visible or ctx.files_by_agent:
        parts.append("## Files the agent could see\n" + (", ".join(ctx.files_visible) or "(none)"))
        saved = [f"- {agent}: {', '.join(files) or '(nothing)'}" for agent, files in ctx.files_by_agent.items()]
        parts.append("## Files saved by each earlier agent\n" + ("\n".join(saved) or "(none)"))
    parts.extend(_file_passing_sections(ctx))
    if ctx.extra:
        # Workflow evidence such as test-set metrics; never the ground truth for non-final agents.
        shown = {k: v for k, v in ctx.extra.items() if k not in _HIDDEN_EXTRA and k not in _FILE_PASSING_EXTRA}
        if shown:
            parts.append("## Further evidence\n" + "\n".join(f"- {k}: {v}" for k, v in sorted(shown.items())))
    if ctx.is_final and ctx.ground_truth is not None:
        parts.append(f"## Reference answer (for the final agent only)\n{ctx.ground_truth}")
    return "\n\n".join(parts)


# Keys of CoachContext.extra that are bookkeeping, not evidence for the coach.
_HIDDEN_EXTRA = frozenset({"episode_correct", "episode_id", "action_index"})
# Keys of CoachContext.extra that file-passing workflows (ds_pipeline) fill and `_file_passing_sections` shows.
_FILE_PASSING_EXTRA = frozenset(
    {"files_after", "files_saved", "required_files", "missing_upstream", "test_evaluation", "target_statistics",
     "score_cap", "score_cap_rule"}
)  # fmt: skip


def _file_passing_sections(ctx: CoachContext) -> list[str]:
    """The file receipts of a file-passing workflow: files after the action, what it had to save and what is
    missing upstream; for the final agent the test-set evaluation of its submission and its score cap."""
    ex = ctx.extra
    parts = []
    if "files_after" in ex:
        after = ", ".join(ex["files_after"]) or "(none)"
        saved = ", ".join(ex.get("files_saved", ())) or "(none)"
        parts.append(f"## Files after the action\n{after}\nCreated or changed by it: {saved}")
    if ex.get("required_files"):
        missing = [f for f in ex["required_files"] if f not in ex.get("files_after", ctx.files_visible)]
        status = f"missing after the action: {', '.join(missing)}" if missing else "all present after the action"
        parts.append(f"## Files this agent must save\n{', '.join(ex['required_files'])} ({status})")
    if ex.get("missing_upstream"):
        owed = [f"- {name} (the {agent}'s)" for name, agent in ex["missing_upstream"].items()]
        parts.append("## Required files of earlier agents missing before the action\n" + "\n".join(owed))
    if ctx.is_final and "test_evaluation" in ex:
        test = "\n".join(f"- {k}: {v}" for k, v in ex["test_evaluation"].items())
        stats = "\n".join(f"- {k}: {v}" for k, v in ex.get("target_statistics", {}).items())
        parts.append(f"## Test-set evaluation of submission.csv after the action (final agent only)\n{test}")
        parts.append(f"## Target statistics (train.csv)\n{stats}")
        parts.append(f"## Hard cap on this action's score\n{ex.get('score_cap_rule', 'none')}")
    return parts


def build_messages(ctx: CoachContext, template: Template, cut: Cut = NO_CUT) -> ChatMessages:
    """OpenAI-style chat messages for one judgment."""
    fmt = _OUTPUT_FORMAT_FINAL if ctx.is_final and ctx.ground_truth is not None else _OUTPUT_FORMAT
    user = f"{template.rubric}\n\n{render_context(ctx, cut)}\n\n{fmt}"
    return [{"role": "system", "content": template.system}, {"role": "user", "content": user}]


class EvidenceTooLong(Exception):
    """Even with all of the agent's input left out, the prompt exceeds the coach's budget."""


def fit_prompt(
    ctx: CoachContext, template: Template, budget: int | None, count: TokenCount
) -> tuple[ChatMessages, Cut]:
    """The judgment's messages within `budget` prompt tokens (None: no limit), and what was cut to get there.

    Whole oldest input messages go first; then the newest part of the last one dropped is given back, as much
    as fits (found by bisection on the cut point). Raises EvidenceTooLong when the task, role and output alone
    exceed the budget: the output is never cut.
    """
    messages = build_messages(ctx, template)
    if budget is None or count(messages) <= budget:
        return messages, NO_CUT
    for dropped in range(1, len(ctx.messages) + 1):
        messages = build_messages(ctx, template, Cut(dropped))
        if count(messages) <= budget:
            break
    else:
        n = count(build_messages(ctx, template, Cut(len(ctx.messages))))
        raise EvidenceTooLong(
            f"coach prompt needs {n} tokens without any of the agent's input; the budget is {budget}"
        )
    best, cut = messages, Cut(dropped)
    text = ctx.messages[dropped - 1].content
    lo, hi = 1, len(text) - 1  # characters cut from the head of the last dropped message
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = build_messages(ctx, template, Cut(dropped - 1, mid))
        if count(trial) <= budget:
            best, cut, hi = trial, Cut(dropped - 1, mid), mid - 1
        else:
            lo = mid + 1
    return best, cut


def follow_up_message(ctx: CoachContext) -> dict[str, str]:
    """The one follow-up sent when a reply lacks the score line: ask for exactly the required lines."""
    lines = "PROCESS_SCORE: <number from 0 to 10>"
    if ctx.is_final and ctx.ground_truth is not None:
        lines += "\nANSWER_CORRECT: <0 or 1>"
    return {
        "role": "user",
        "content": f"Your reply did not contain the required line. Reply now with exactly:\n{lines}",
    }
