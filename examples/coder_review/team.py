"""Coder -> Reviewer: a two-agent programming team defined outside the mappa package (docs/your-team.md).

| agent    | turns | tools  | sees                                                                          |
|----------|-------|--------|-------------------------------------------------------------------------------|
| coder    | 1     | python | the task and one visible example call                                         |
| reviewer | 1     | python | the task, the example, the Coder's code and what running the example printed  |

The Coder writes the function in a ```python block; it runs in the sandbox followed by the visible example
call. The Reviewer approves (a reply saying APPROVE) or rewrites the function in its own ```python block, which
runs against the example too. The final code (the rewrite, else the Coder's) then runs against the task's
HIDDEN unit tests, `Task.answer`: lines `assert CALL == VALUE`. No agent ever sees them.

The tests treat the code as an adversary (tests/test_example_team.py tries the attacks):
- only the calls go into the sandbox; the expected values stay on the host, which compares them by value and
  type with what came back (`True` is not `1`, and an object equal to everything is not a literal);
- the code runs in a forked child of the harness, which prefixes each result with a one-time nonce. The nonce
  comes from a file that the harness reads and deletes only after the fork, and the harness is not dumpable,
  so the code cannot learn it and text it prints is never taken for a result;
- every run gets a fresh workspace, so files an earlier run wrote cannot reach the hidden tests, and in a
  hidden-test run the code's standard output goes to /dev/null.

Settings (`workflow.options`): `show_example_result` (default true): whether the Reviewer sees what running
the example printed. Turning it off shows what a team loses without the execution result.
"""

from __future__ import annotations

import ast
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mappa.config import GenerationConfig, SandboxConfig, WorkflowConfig
from mappa.errors import MappaError
from mappa.protocols import GenerationLike, ProgressFn, Runtime
from mappa.sandbox import new_workspace, remove_workspace
from mappa.sandbox.codeblocks import extract_code_blocks, format_observation
from mappa.types import Action, CoachContext, Episode, ExecResult, Message, Task
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

_TEAM = "a programming team of two agents: Coder, then Reviewer"

CODER = AgentSpec(
    name="coder",
    title="Coder",
    role=(
        f"You are the Coder, the first agent of {_TEAM}. Write the requested Python function in one ```python "
        "block. It will run, followed by the example call, and the Reviewer will see your code and the output. "
        "Keep it short: your reply is cut off after {budget} tokens."
    ),
    max_turns=1,
    tools=("python",),
    sees="the task and the visible example",
)

REVIEWER = AgentSpec(
    name="reviewer",
    title="Reviewer",
    role=(
        f"You are the Reviewer, the last agent of {_TEAM}. You see the task, the Coder's code and what running "
        "the example printed. If the code is correct, reply APPROVE. Otherwise reply with the corrected function "
        "in one ```python block. The team succeeds only if the final code passes hidden tests. Keep it short: "
        "your reply is cut off after {budget} tokens."
    ),
    max_turns=1,
    tools=("python",),
    sees="the task, the example, the Coder's code and (by default) the example's output",
)

OPTIONS = {"show_example_result": True}
_APPROVE = re.compile(r"\bAPPROVE", re.IGNORECASE)
_TEST_LINE = "assert CALL == VALUE, e.g. assert add(2, 3) == 5"

NONCE_FILE = ".nonce"  # written by the host into the run's fresh workspace; the harness reads and deletes it

# Runs in the sandbox. The solution is a string literal here, so nothing it contains (an unclosed quote, a
# trailing backslash) can change the harness's own code. The solution runs in a forked child that never holds
# the nonce: the parent reads and deletes the nonce file only after the fork, while the child waits, and the
# parent is not dumpable, so the child cannot read its memory either. The child sends one line per call through
# a pipe; the parent prefixes each with the nonce. _QUIET (hidden runs): the child's fd 1 goes to /dev/null.
_HARNESS = """
import os, sys, traceback


def _child(go, results):
    os.read(go, 1)
    if _QUIET:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    out = os.fdopen(results, "w")
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(_SOLUTION, "<solution>", "exec"), ns)
    except SystemExit:
        pass
    for i, call in enumerate(_CALLS):
        try:
            line = "ok " + repr(eval(call, ns))
        except Exception as e:
            line = "error " + type(e).__name__ + ": " + str(e)
        out.write(str(i) + " " + line.replace("\\n", " ")[:2000] + "\\n")
        out.flush()


go_r, go_w = os.pipe()
res_r, res_w = os.pipe()
pid = os.fork()
if pid == 0:
    status = 0
    try:
        os.close(go_w)
        os.close(res_r)
        _child(go_r, res_w)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
os.close(go_r)
os.close(res_w)
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no reading this process's memory
except Exception:
    pass
with open(_NONCE_FILE) as f:
    nonce = f.read().strip()
os.remove(_NONCE_FILE)
os.write(go_w, b"x")
os.close(go_w)
with os.fdopen(res_r, "rb") as f:
    lines = f.read(1 << 20).decode("utf-8", "replace").splitlines()
for line in lines:
    sys.stdout.write(nonce + " " + line + "\\n")
sys.stdout.flush()
_, wait_status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(wait_status)
sys.exit(code if code >= 0 else 1)
"""


@dataclass(frozen=True)
class Check:
    """One unit test: a call that runs in the sandbox and the value it must return, which stays on the host."""

    call: str  # "add(2, 3)"
    expected: Any  # 5

    @property
    def text(self) -> str:
        return f"assert {self.call} == {self.expected!r}"

    @property
    def shown(self) -> str:
        """How an agent is shown the visible example."""
        return f"Example: {self.call} returns {self.expected!r}"


@dataclass(frozen=True)
class Outcome:
    """What one check gave: `status` is pass, fail (a wrong value), error (the call raised) or missing."""

    status: str
    got: str = ""  # the value's repr, or the exception

    def as_dict(self) -> dict[str, str]:
        return {"status": self.status, "got": self.got}


def parse_checks(text: str, where: str) -> list[Check]:
    """The checks of `text`, one `assert CALL == VALUE` a line (VALUE a Python literal); MappaError otherwise."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise MappaError(f"{where}: line {e.lineno}: not Python ({_TEST_LINE})") from None
    checks = []
    for node in tree.body:
        test = node.test if isinstance(node, ast.Assert) else None
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            raise MappaError(f"{where}: line {node.lineno}: expected {_TEST_LINE}")
        try:
            expected = ast.literal_eval(test.comparators[0])
        except ValueError:
            raise MappaError(f"{where}: line {node.lineno}: the expected value must be a literal") from None
        checks.append(Check(ast.unparse(test.left), expected))
    if not checks:
        raise MappaError(f"{where}: no tests ({_TEST_LINE})")
    return checks


def harness(code: str, checks: Sequence[Check], quiet: bool) -> str:
    """The snippet that runs `code`, then each check's call, printing `<nonce> <index> ok <repr>` (or `error
    <exception>`) per call; the nonce comes from the workspace's NONCE_FILE, never from this text."""
    calls = [c.call for c in checks]
    head = f"_SOLUTION = {code!r}\n_CALLS = {calls!r}\n_QUIET = {quiet!r}\n_NONCE_FILE = {NONCE_FILE!r}\n"
    return head + _HARNESS


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (so `True` does not pass for `1`, nor `(1,)` for `[1]`)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def _harness_line(line: str, nonce: str) -> tuple[int, str] | None:
    """(check index, `ok <repr>` or `error <exception>`) of a line the harness printed, else None."""
    parts = line.split(" ", 2)
    if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None


def read_outcomes(result: ExecResult, checks: Sequence[Check], nonce: str) -> list[Outcome]:
    """Each check's outcome from the harness's lines. A check with several lines (forged) fails."""
    lines: dict[int, list[str]] = {}
    for line in result.stdout.splitlines():
        found = _harness_line(line, nonce)
        if found is not None:
            lines.setdefault(found[0], []).append(found[1])
    out = []
    for i, check in enumerate(checks):
        seen = lines.get(i, [])
        if len(seen) != 1:
            out.append(Outcome("missing" if not seen else "fail", "" if not seen else "several results"))
            continue
        kind, _, got = seen[0].partition(" ")
        if kind != "ok":
            out.append(Outcome("error", got))
            continue
        try:  # the text is the code's to choose: anything that is not a plain literal fails
            value = ast.literal_eval(got)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            out.append(Outcome("fail", got))
            continue
        out.append(Outcome("pass" if same(value, check.expected) else "fail", got))
    return out


def passed(result: ExecResult, outcomes: Sequence[Outcome]) -> bool | None:
    """All checks passed in a run that exited cleanly; None when the sandbox itself failed (no verdict)."""
    if result.infra_error is not None:
        return None
    return result.ok and all(o.status == "pass" for o in outcomes)


def readable(result: ExecResult, checks: Sequence[Check], nonce: str) -> ExecResult:
    """`result` with the harness's lines shown as a REPL would (`>>> add(1, 2)` then `3`), the nonce gone."""
    kept = []
    for line in result.stdout.splitlines():
        found = _harness_line(line, nonce)
        if found is None or found[0] >= len(checks):
            kept.append(line)
        else:
            kept.append(f">>> {checks[found[0]].call}\n{found[1].partition(' ')[2]}")
    return result.model_copy(update={"stdout": "\n".join(kept) + ("\n" if kept else "")})


def solution(text: str) -> str | None:
    """The code of a reply: its ```python blocks joined in order; None without any."""
    blocks = extract_code_blocks(text)
    return "\n\n".join(blocks) if blocks else None


def verdict(text: str) -> str:
    """The Reviewer's decision: rewrite (it wrote code), approve, or unclear."""
    if solution(text) is not None:
        return "rewrite"
    return "approve" if _APPROVE.search(text) else "unclear"


@dataclass(frozen=True)
class Spec:
    """A task's parsed tests: the visible example and the hidden checks."""

    example: Check
    hidden: tuple[Check, ...]


def task_spec(task: Task) -> Spec:
    example = task.meta.get("example")
    if not isinstance(example, str):
        raise MappaError(f"task {task.id}: meta.example must be one test line ({_TEST_LINE})")
    (check,) = parse_checks(example, f"task {task.id}: meta.example")[:1]
    return Spec(check, tuple(parse_checks(task.answer, f"task {task.id}: answer")))


@dataclass(frozen=True)
class Job:
    """One snippet to run: `code` against `checks`; `quiet` (hidden tests): what the code prints is dropped."""

    code: str
    checks: Sequence[Check]
    quiet: bool


@dataclass(frozen=True)
class Ran:
    """A job's result as the agents may see it (nonce lines shown as a REPL would) and its checks' outcomes."""

    result: ExecResult
    outcomes: list[Outcome]

    def summary(self) -> dict[str, Any]:
        return {"passed": sum(o.status == "pass" for o in self.outcomes), "total": len(self.outcomes)}


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


def example_evidence(check: Check, ran: Ran | None) -> dict[str, Any]:
    """What the coach is told of a visible example run (the agents see the same in the observation)."""
    outcome = ran.outcomes[0] if ran is not None else Outcome("missing")
    return {"call": check.call, "expected": repr(check.expected), **outcome.as_dict()}


def tests_evidence(checks: Sequence[Check], ran: Ran | None) -> dict[str, Any]:
    """What the coach of the final agent is told of a hidden-test run (never shown to an agent)."""
    if ran is None:
        return {"passed": 0, "total": len(checks), "ok": False, "first_failure": "no code"}
    failures = [f"{c.text} -> {o.status} {o.got}".rstrip() for c, o in zip(checks, ran.outcomes, strict=True)]
    first = next((f for f, o in zip(failures, ran.outcomes, strict=True) if o.status != "pass"), "")
    if not first and not ran.result.ok:
        first = format_observation(ran.result, 300)
    return {**ran.summary(), "ok": passed(ran.result, ran.outcomes), "first_failure": first}


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
            max_context_tokens=g.max_context_tokens, seed=batch.stage_seed(), batch_size=g.batch_size,
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
