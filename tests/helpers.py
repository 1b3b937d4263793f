"""What several test modules share, in one place (a test module never imports another): stand-ins (a scripted
policy through a real tokenizer, a real policy with one method overridden, a coach context with every field filled,
a fault-injecting coach server), tiny real models and configs, scripted teams, and run files to read back.

Each stand-in behaves like the real thing on the surface a test reaches, so a test that uses one still exercises
the real workflow, sandbox or coach."""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from mappa.config import (
    AnalysisConfig,
    Config,
    GenerationConfig,
    SandboxConfig,
    WorkflowConfig,
    dump_config,
    load_config,
)
from mappa.metrics import episode_metrics
from mappa.policy.models import chat_prompt_ids, tiny_model_and_tokenizer, tiny_tokenizer
from mappa.policy.policy import Generation, Policy
from mappa.sandbox import Sandbox
from mappa.tasks.dsbench.reference import reference_snippets
from mappa.tasks.tabular import score_submission
from mappa.training.checkpoint import latest_checkpoint
from mappa.training.trainer import update_settings
from mappa.training.update import update_group
from mappa.types import Action, CoachContext, CoachScore, Episode, ExecResult, Message, Task, write_jsonl
from mappa.workflows import DsPipeline

Reply = Callable[[str | None, Sequence[Message]], str]  # (agent, conversation) -> the agent's reply


class ScriptedPolicy:
    """Same `chat_ids`/`generate` surface as mappa.policy.policy.Policy; replies come from a script, not a model.

    Like the real policy, a reply longer than `max_new_tokens` is cut there and marked truncated, and a prompt
    longer than `max_context_tokens` fails: the workflow under test must fit its prompts itself."""

    def __init__(self, reply: Reply) -> None:
        self.tokenizer = tiny_tokenizer()
        self.reply = reply
        self.calls: list[tuple[str | None, int]] = []  # (agent, conversations) per generate call
        self.seeds: list[int | Sequence[int] | None] = []  # the sampling seed(s) of each generate call

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, {})

    def generate(
        self,
        agent: str | None,
        conversations: Sequence[Sequence[Message]],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        max_context_tokens: int | None = None,
        top_logprobs: int = 0,
        seed: int | Sequence[int] | None = None,
        batch_size: int | None = None,
    ) -> list[Generation]:
        self.calls.append((agent, len(conversations)))
        self.seeds.append(seed)
        out = []
        for conv in conversations:
            prompt = self.chat_ids(conv)
            assert max_context_tokens is None or len(prompt) <= max_context_tokens  # the engine must fit prompts
            ids = self.tokenizer(self.reply(agent, conv), add_special_tokens=False)["input_ids"]
            truncated = len(ids) > max_new_tokens
            ids = ids[:max_new_tokens] if truncated else [*ids, self.tokenizer.eos_token_id]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Generation(tuple(prompt), tuple(ids), tuple(-0.5 for _ in ids), text, truncated))
        return out


class Miswired:
    """A real Policy behind one wiring bug, as a policy implementation could have it: everything is the real
    policy's except the method a subclass overrides."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def __getattr__(self, name: str):  # noqa: ANN204 - the real policy's attribute
        return getattr(self.inner, name)


def coach_context(**kw: object) -> CoachContext:
    """The Code Executor's context after a tool call that printed the answer of 2 + 3; `kw` replaces fields."""
    base: dict[str, object] = dict(
        task="What is 2 + 3?",
        workflow="mathchat",
        agent="code_executor",
        role="You are the Code Executor. Write a ```python code block that computes the answer.",
        is_final=False,
        messages=(Message(role="system", content="role"), Message(role="user", content="Problem: 2 + 3")),
        output="```python\nprint(2 + 3)\n```",
        exec_result=ExecResult(ok=True, exit_code=0, stdout="5\n"),
        observation="5",
    )
    return CoachContext(**{**base, **kw})


def play_scripted(workflow, tasks, policy, sandbox, scorer=None, *, gen=None, seed=0, **kw):  # type: ignore[no-untyped-def]
    """`mappa.workflows.play` of `workflow` with a scripted (or any batched) policy behind `PolicyGenerator`, at `gen`'s
    sampling settings (default: GenerationConfig's)."""
    from mappa.config import GenerationConfig
    from mappa.generation import PolicyGenerator
    from mappa.protocols import Runtime
    from mappa.workflows import play

    rt = Runtime(PolicyGenerator(policy), sandbox, scorer)
    return play(workflow, tasks, rt, sampling=(gen or GenerationConfig()).sampling(), seed=seed, **kw)


# ---------------------------------------------------------------------------------------- scripted workflow episodes
class RecordingSandbox(Sandbox):
    """The real sandbox, counting how many batches of snippets it was handed."""

    def __init__(self, cfg: SandboxConfig) -> None:
        super().__init__(cfg)
        self.batches: list[int] = []

    def run_many(self, items):  # type: ignore[no-untyped-def]
        self.batches.append(len(items))
        return super().run_many(items)


GEN = GenerationConfig(max_new_tokens=200, max_context_tokens=1024, batch_size=8)


def task(answer: str = "42", problem: str = "What is 6 * 7?", tid: str = "t") -> Task:
    return Task(id=tid, problem=problem, answer=answer, source="test")


def py(code: str) -> str:
    return f"Let me compute.\n```python\n{code}\n```"


def script(
    solver: str = "I think it is 42.", coder: Sequence[str] = ("Done.",), verifier: str = "\\boxed{42}"
) -> Reply:
    """Fixed replies per agent; the Code Executor's reply depends on its turn (its count of user turns)."""

    def reply(agent: str | None, conv: Sequence[Message]) -> str:
        if agent == "problem_solver":
            return solver
        if agent == "code_executor":
            turn = sum(m.role == "user" for m in conv) - 1
            return coder[min(turn, len(coder) - 1)]
        return verifier

    return reply


class ScriptedScorer:
    def __init__(self) -> None:
        self.calls: list[list[CoachContext]] = []

    def __call__(self, contexts: Sequence[CoachContext]) -> list[CoachScore]:
        self.calls.append(list(contexts))
        return [CoachScore(score=len(self.calls), rationale=f"note-{c.agent}-{len(self.calls)}") for c in contexts]


def free_port() -> int:
    """A TCP port free on the loopback now (a test server's or a process group's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------- tiny policies and configs for the update
def update_policy(agent_weights: str = "lora"):
    from mappa.policy.models import tiny_model_and_tokenizer
    from mappa.policy.policy import Policy

    model, tok = tiny_model_and_tokenizer(seed=0)
    return Policy.from_model(model, tok, AGENTS, agent_weights=agent_weights, lora_r=4, lora_alpha=8, seed=0)


def sampled_actions(policy, agent: str, n: int, seed: int) -> list[Action]:
    convs = [[Message(role="user", content=f"What is {i} + {i}?")] for i in range(n)]
    gens = policy.generate(agent, convs, max_new_tokens=6, temperature=1.0, seed=seed)
    return [Action.sampled(agent, 0, c, g) for c, g in zip(convs, gens, strict=True)]


def train_cfg(**train: object) -> Config:
    return Config().model_copy(update={"train": Config().train.model_copy(update=train)})


SPREAD_COACH = f"{Path(__file__).with_name('spread_coach.py')}:score"  # tiny models' replies score alike on the rubric


def tiny_cfg(tmp_path: Path, *overrides: str) -> Config:
    return load_config(
        None,
        [
            "model.name=tiny-random",
            "model.lora_r=4",
            "model.lora_alpha=8",
            "generation.max_new_tokens=12",
            "generation.max_context_tokens=1024",
            "sandbox.pool=false",
            "sandbox.timeout_s=5",
            f"coach.backend={SPREAD_COACH}",
            "coach.cache=false",
            "tasks.arithmetic_train_size=16",
            "tasks.arithmetic_eval_size=2",
            "train.steps=2",
            "train.prompts_per_step=2",
            "train.samples_per_prompt=1",
            "train.drop_truncated=false",
            "train.lr=1e-2",
            "logging.report_to=[tensorboard]",
            f"run_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


# -------------------------------------------------------------------------------------- a tiny policy, conversations
AGENTS = ("solver", "coder", "verifier")


def make_policy(agent_weights: str = "lora", seed: int = 0, eos_scale: float = 1.0, **kw) -> Policy:
    model, tokenizer = tiny_model_and_tokenizer(seed)
    if eos_scale != 1.0:
        # A larger EOS embedding row makes EOS a likely next token at some positions, so sequences of
        # one batch finish at different steps (tied embeddings: the LM head row scales too).
        with torch.no_grad():
            model.model.embed_tokens.weight[tokenizer.eos_token_id] *= eos_scale
    return Policy.from_model(model, tokenizer, AGENTS, agent_weights=agent_weights, **kw)


def convs(n: int) -> list[list[Message]]:
    """Conversations of different lengths (exercises left padding)."""
    out = []
    for i in range(n):
        msgs = [Message(role="user", content="What is 17 * 23? " * (1 + i % 4) + str(i))]
        if i % 2:
            msgs.insert(0, Message(role="system", content="You are the Code Executor."))
        out.append(msgs)
    return out


def perturb(policy: Policy, agent: str, scale: float = 0.5, seed: int = 1) -> None:
    """Give one agent non-zero LoRA B matrices (standard init has B = 0, so every agent starts as the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters(agent):
            p.add_(torch.randn(p.shape, generator=g) * scale)


# ---------------------------------------------------------------------------------- one update step at a temperature
def solver_actions(policy, n: int, temperature: float) -> list[Action]:  # noqa: ANN001
    chats = [[Message(role="user", content=f"What is {i} + {i}?")] for i in range(n)]
    gens = policy.generate("solver", chats, max_new_tokens=6, temperature=temperature, seed=7)
    return [Action.sampled("solver", 0, c, g) for c, g in zip(chats, gens, strict=True)]


def first_update_step(
    actions: list[Action], temperature: float, recompute: bool, policy=None, exact: bool = True
) -> dict[str, float]:  # noqa: ANN001
    """One optimizer step at learning rate 0 (no weight change) with `generation.temperature` set, on `policy`
    (default: a fresh one with the solver perturbed as `solver_actions`' callers do); `exact`: what the generator said of
    its log-probs (`samples_exactly`)."""
    cfg = Config()
    cfg = cfg.model_copy(
        update={
            "generation": cfg.generation.model_copy(update={"temperature": temperature}),
            "train": cfg.train.model_copy(
                update={"mini_batch_size": len(actions), "recompute_old_logprobs": recompute}
            ),
        }
    )
    if policy is None:
        policy = make_policy()
        perturb(policy, "solver", scale=0.3, seed=3)  # the agent is not the reference: the KL term is live
    opt = torch.optim.SGD(policy.trainable_parameters("solver"), lr=0.0)
    steps: list[dict[str, float]] = []
    update_group(
        policy, opt, actions, [10.0, 0.0, 5.0, 3.0, 8.0, 1.0], update_settings(cfg, exact), on_step=steps.append
    )
    return steps[0]


class RawLogprobs(Miswired):
    """Reports the raw logits' log-probs (temperature 1) whatever temperature it samples at."""

    def generate(self, agent: str | None, conversations, **kw) -> Sequence[Generation]:  # noqa: ANN001
        gens = self.inner.generate(agent, conversations, **kw)
        out = []
        for g in gens:
            lp, _ = self.inner.forward_logprobs(agent, [g.prompt_ids], [g.response_ids])
            out.append(dataclasses.replace(g, logprobs=tuple(lp[0, : len(g.response_ids)].tolist())))
        return out


# --------------------------------------------------------------------------------- training runs, killed and resumed
TINY = [
    "model.name=tiny-random",
    "model.lora_r=4",
    "model.lora_alpha=8",
    "generation.max_new_tokens=10",
    "sandbox.pool=false",
    f"coach.backend={SPREAD_COACH}",
    "coach.cache=false",
    "tasks.arithmetic_train_size=32",
    "tasks.arithmetic_eval_size=2",
    "train.prompts_per_step=2",
    "train.samples_per_prompt=1",
    "train.mini_batch_size=1",  # several optimizer steps per agent and step: the schedule and shuffle resume too
    "train.drop_truncated=false",
    "train.lr=1e-2",
    "logging.report_to=[]",
]


class ToyPolicy:
    """The two methods of Policy that checkpointing uses, over one tensor."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.zeros(3))

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        torch.save(self.w.detach(), directory / "w.pt")

    def load_weights(self, directory: Path) -> None:
        with torch.no_grad():
            self.w.copy_(torch.load(directory / "w.pt"))


def interruptible() -> None:
    """`preexec_fn` of a process a test will Ctrl-C: SIGINT back to its default, so Python turns it into
    KeyboardInterrupt even when the test suite itself was started in the background, where SIGINT is ignored and
    every child inherits that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_at_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout: float = 240) -> None:
    """SIGKILL `proc` as soon as checkpoint `step` is complete (the next step is then under way); fails with the
    log's tail if it exits first, or after `timeout` seconds. The caller reaps it (and whatever it started)."""

    def reached() -> bool:
        ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
        return ckpt is not None and ckpt.name == f"step-{step:06d}"

    wait_for(reached, proc, log, f"checkpoint {step}", timeout)
    proc.send_signal(signal.SIGKILL)


def wait_for(condition, proc: subprocess.Popen, log: Path, what: str, timeout: float = 240) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what}: not in time"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------- run files for the analysis
MATHCHAT_AGENTS = ("problem_solver", "code_executor", "verifier")


def act(agent: str, score: float | None, turn: int = 0, result: ExecResult | None = None, verdict=None) -> Action:
    return Action(
        agent=agent, turn=turn, messages=(Message(role="user", content="q"),), text=f"{agent} says 7",
        prompt_ids=(1, 2), response_ids=(3, 4, 5), exec_result=result,
        coach=CoachScore(score=score, rationale=f"{agent} judged {score}", answer_correct=verdict),
    )  # fmt: skip


TH = AnalysisConfig()  # the analysis' default thresholds


def clamp(x: float) -> float:
    return max(0.0, min(10.0, x))


def synthetic(seed: int = 0, steps: int = 6, per_step: int = 30, bias: float = 0.0, drift: float = 0.0,
              coder_rise: float = 0.0, accuracy_rise: float = 0.0) -> list[Episode]:  # fmt: skip
    """Episodes whose truth is known: the verifier's score follows the outcome (8 right, 2 wrong) plus noise,
    plus `bias` on source "b" (and `drift` * step/steps on it); the coder's score rises by `coder_rise` per step;
    accuracy is 0.4 (+ `accuracy_rise` per step)."""
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        for i in range(per_step):
            source = "abc"[i % 3]
            correct = rng.random() < 0.4 + accuracy_rise * step
            extra = (bias + drift * step / steps) if source == "b" else 0.0
            verifier = clamp((8.0 if correct else 2.0) + rng.gauss(0, 1) + extra)
            coder = clamp(3.0 + coder_rise * step + rng.gauss(0, 1))
            solver = clamp(5.0 + rng.gauss(0, 1))
            out.append(make_episode(i, step, correct, (solver, coder, verifier), source, level=1 + i % 2))
    return out


def make_episode(i: int, step: int, correct: bool, scores: tuple[float, float, float], source: str = "a",
                 level: int = 1, result: ExecResult | None = None, answer: str | None = "7") -> Episode:  # fmt: skip
    task = Task(id=f"{source}-{i}", problem="p", answer="7", source=source, meta={"level": level})
    actions = (
        act(MATHCHAT_AGENTS[0], scores[0]),
        act(MATHCHAT_AGENTS[1], scores[1], result=result or ExecResult(ok=True, exit_code=0, stdout="7")),
        act(MATHCHAT_AGENTS[2], scores[2]),
    )
    return Episode(
        id=f"e{step}-{i}", workflow="mathchat", task=task, actions=actions, final_answer=answer, correct=correct,
        meta={"step": step},
    )  # fmt: skip


def write_run(path: Path, episodes: list[Episode], *, evals: bool = True, probes: bool = True, **cfg_update) -> Path:
    """A run directory in the trainer's formats (config.yaml, episodes/metrics JSONL, eval/, probe.jsonl)."""
    path.mkdir(parents=True)
    (path / "run.json").write_text('{"mappa_run": 1}')  # marked, as mappa marks each run it makes
    cfg = Config(name=path.name, **cfg_update)
    (path / "config.yaml").write_text(dump_config(cfg))
    write_jsonl(path / "episodes.jsonl", episodes)
    steps = sorted({e.meta["step"] for e in episodes})
    with (path / "metrics.jsonl").open("w") as f:
        for s in steps:
            m = episode_metrics([e for e in episodes if e.meta["step"] == s], MATHCHAT_AGENTS, "train")
            m.update(
                {"time/rollout_s": 1.0, "time/update_s": 2.0, "coach/judgments": 90.0 * s, "coach/calls": 90.0 * s}
            )
            m.update({f"agent/{a}/dropped_truncated": float(s % 2) for a in MATHCHAT_AGENTS})
            f.write(json.dumps({"step": s, **{k: v for k, v in m.items() if v == v}}) + "\n")
    if evals:
        for tag, step in (("start", 0), ("final", steps[-1])):
            eps = [e.model_copy(update={"meta": {}}) for e in episodes if e.meta["step"] == steps[-1 if step else 0]]
            write_jsonl(path / "eval" / f"{tag}.jsonl", eps)
            with (path / "eval" / "summary.jsonl").open("a") as f:
                f.write(json.dumps({"tag": tag, "step": step, "eval/accuracy": 0.4}) + "\n")
    if probes:
        rows = [
            {
                "step": 0,
                "checkpoint": "base",
                "agent": "base",
                "probe": "general_nll",
                "role": None,
                "value": 3.0,
                "n": 8,
            }
        ]
        for s in (2, 4):
            for i, a in enumerate(MATHCHAT_AGENTS):
                rows += [
                    {
                        "step": s,
                        "checkpoint": f"step-{s:06d}",
                        "agent": a,
                        "probe": "kl_base",
                        "role": None,
                        "value": 0.01 * s * (i + 1),
                        "n": 8,
                    },
                    {
                        "step": s,
                        "checkpoint": f"step-{s:06d}",
                        "agent": a,
                        "probe": "general_nll",
                        "role": None,
                        "value": 3.0 + 0.01 * s,
                        "n": 8,
                    },
                ]
                rows += [
                    {"step": s, "checkpoint": f"step-{s:06d}", "agent": a, "probe": "role_nll", "role": r, "value": 2.0 - 0.1 * (a == r), "n": 8}
                    for r in MATHCHAT_AGENTS
                ]  # fmt: skip
        rows += [
            {"step": 0, "checkpoint": "base", "agent": "base", "probe": "role_nll", "role": r, "value": 2.0, "n": 8}
            for r in MATHCHAT_AGENTS
        ]
        (path / "probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------- the command line as a subprocess
ROOT = Path(__file__).resolve().parents[1]


def assert_updated_where_scores_differ(rows: list[dict], agents: Sequence[str], some: bool = True) -> None:
    """Per logged step and agent: an optimizer step exactly when the agent's trained actions scored differently
    (scores without spread teach nothing and leave the weights alone); with `some`, some agent updated at all."""
    for row in rows:
        for a in agents:
            spread = row.get(f"agent/{a}/reward_std", 0.0) > 0
            assert (row.get(f"agent/{a}/optimizer_steps", 0) > 0) == spread, (row["step"], a)
    assert not some or any(row.get(f"agent/{a}/optimizer_steps", 0) > 0 for row in rows for a in agents)


def mappa(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mappa.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr  # no traceback
    assert lines[0].startswith("mappa: error: ")
    return lines[0]


# ------------------------------------------------------------------------------ a coach server that fails on purpose
def reply(
    text: str, logprobs: list[dict] | None = None, prompt_tokens: int = 100, completion_tokens: int = 20
) -> dict:
    return {"kind": "reply", "text": text, "logprobs": logprobs, "usage": (prompt_tokens, completion_tokens)}


OK = reply("ANALYSIS: the code ran and printed the answer.\nPROCESS_SCORE: 7")


def thinking_reply(step: dict, body: dict) -> dict:
    # The cap counts thinking and the written reply together, as OpenAI's max_completion_tokens and Gemini's
    # max_tokens do; what is left after thinking is the reply's room, and a reply over it is cut.
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    words = step["text"].split(" ")
    room = max(0, cap - step["thinking"])
    cut = room < len(words)
    text = " ".join(words[:room])
    return {
        **reply(text, completion_tokens=min(cap, step["thinking"] + len(words))),
        "finish": "length" if cut else "stop",
    }


class FaultServer:
    def __init__(self, plan: dict[str, list[dict]]) -> None:
        self.plan = plan
        self.attempts: dict[str, int] = defaultdict(int)
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = json.dumps(body["messages"])
                case = text.split("CASE=")[1].split(" ")[0].split("\\")[0] if "CASE=" in text else "default"
                with server.lock:
                    server.requests.append(body)
                    n = server.attempts[case]
                    server.attempts[case] += 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                steps = server.plan.get(case) or server.plan.get("default", [OK])
                step = steps[min(n, len(steps) - 1)]
                try:
                    self.respond(step, body)
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def respond(self, step: dict, body: dict) -> None:
                kind = step["kind"]
                if kind == "status":
                    err = {"error": {"message": step.get("message", "boom"), "type": "x", "code": None}}
                    self._send(step["status"], json.dumps(err).encode(), step.get("headers"))
                elif kind == "hang":
                    time.sleep(step["seconds"])
                    self._send(200, json.dumps(completion(OK, body)).encode())
                elif kind == "garbage":
                    self._send(200, b"<html>502 bad gateway</html>{{{")
                elif kind == "delay":
                    time.sleep(step["seconds"])
                    self._send(200, json.dumps(completion(OK, body)).encode())
                elif kind == "no_logprobs" and body.get("logprobs"):
                    err = {"error": {"message": "logprobs are not supported", "type": "invalid_request_error"}}
                    self._send(400, json.dumps(err).encode())
                elif kind == "think":
                    self._send(200, json.dumps(completion(thinking_reply(step, body), body)).encode())
                else:
                    self._send(200, json.dumps(completion(step if kind == "reply" else OK, body)).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(step: dict, body: dict) -> dict:
    p, c = step["usage"]
    message = {"role": "assistant", "content": step["text"]}
    choice = {"index": 0, "message": message, "finish_reason": step.get("finish", "stop")}
    if step.get("logprobs") is not None and body.get("logprobs"):
        choice["logprobs"] = {"content": step["logprobs"], "refusal": None}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": body["model"],
        "choices": [choice],
        "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
    }


def status(code: int, headers: dict[str, str] | None = None, message: str = "boom") -> dict:
    return {"kind": "status", "status": code, "headers": headers, "message": message}


# --------------------------------------------------------------------- the data-science pipeline on a tiny benchmark
def _table(kind: str, n: int, rng: np.random.Generator) -> pd.DataFrame:
    x1, x2 = rng.normal(size=n).round(3), rng.uniform(0, 10, size=n).round(2)
    plan = rng.choice(["basic", "plus", "pro"], size=n)
    effect = pd.Series(plan).map({"basic": -1.0, "plus": 0.0, "pro": 1.5}).to_numpy()
    if kind == "classification":
        p = 1 / (1 + np.exp(-(2 * x1 + effect)))
        y = (rng.uniform(size=n) < p).astype(int)
    else:
        y = (50 + 12 * x1 + 3 * x2 + 10 * effect + rng.normal(scale=4, size=n)).round(2)
    return pd.DataFrame({"tenure": x1, "usage": x2, "plan": plan, "target": y})


def _write_task(root: Path, task_id: str, kind: str, metric: str, seed: int) -> dict:
    """One task as the builder writes it: train/test/sample/description in tasks/<id>, answers apart."""
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

    frame = _table(kind, 240, np.random.default_rng(seed))
    frame.insert(0, "id", range(1, len(frame) + 1))
    train, test = frame.iloc[:170], frame.iloc[170:]
    task_dir, answer_dir = root / "tasks" / task_id, root / "answers" / task_id
    task_dir.mkdir(parents=True)
    answer_dir.mkdir(parents=True)
    train.to_csv(task_dir / "train.csv", index=False)
    test.drop(columns=["target"]).to_csv(task_dir / "test.csv", index=False)
    test[["id", "target"]].to_csv(answer_dir / "test_answer.csv", index=False)
    trivial = round(float(train["target"].mean()), 6)
    pd.DataFrame({"id": test["id"], "target": trivial}).to_csv(task_dir / "sample_submission.csv", index=False)
    what = "the probability that target is 1" if metric == "roc_auc" else "target"
    (task_dir / "description.txt").write_text(
        f"# {task_id}\nPredict `target` for each row of test.csv. Columns: id, tenure, usage, plan (text), target.\n"
        f"Metric: {metric}. Submission: a CSV with columns id,target where target is {what}.\n",
        encoding="utf-8",
    )
    model = HistGradientBoostingClassifier if kind == "classification" else HistGradientBoostingRegressor
    features = pd.get_dummies(frame.drop(columns=["id", "target"]), dtype=float)
    fitted = model(random_state=0).fit(features.iloc[:170], train["target"])
    row = {"id": task_id, "split": "", "data_type": kind, "metric": metric, "target": "target", "id_column": "id"}
    row.update(source="test:generated", baseline_score=0.0, reference_score=0.0, title=task_id)
    row.update(n_train=len(train), n_test=len(test), n_features=3)
    task = Task(id=task_id, problem="", answer="", source="dsbench", meta={**row, "task_dir": str(task_dir),
                "answer_path": str(answer_dir / "test_answer.csv")})  # fmt: skip
    row["baseline_score"] = score_submission(task, task_dir / "sample_submission.csv").score
    pred = (
        fitted.predict_proba(features.iloc[170:])[:, 1] if metric == "roc_auc" else fitted.predict(features.iloc[170:])
    )
    reference = task_dir.parent.parent / f"{task_id}-reference.csv"
    pd.DataFrame({"id": test["id"], "target": pred}).to_csv(reference, index=False)
    row["reference_score"] = score_submission(task, reference).score
    reference.unlink()
    return row


def fenced(code: str, note: str = "") -> str:
    return f"{note}\n```python\n{code}\n```"


def team(tasks: Sequence[Task], script: Callable[[Task, str, int], str]) -> Reply:
    """A reply per (task, agent, turn): the task is recognised by its description in the first user turn."""

    def reply(agent: str | None, conv: Sequence[Message]) -> str:
        first = next(m for m in conv if m.role == "user")  # after the system prompt, or alone (the paper's)
        task = next(t for t in tasks if t.problem.strip() in first.content)
        return script(task, str(agent), sum(m.role == "user" for m in conv) - 1)

    return reply


def reference_team(task: Task, agent: str, turn: int) -> str:
    note = "<think>secret plan: try everything</think>I prepared the data." if agent == "data_engineer" else ""
    return fenced(reference_snippets(task)[agent], note) if turn == 0 else "Done."


DS_GEN = GenerationConfig(max_new_tokens=2048, max_context_tokens=8192, batch_size=8)


def play(tasks, script, sandbox, *, turns: int = 2, keep: bool = False, scorer=None, **settings) -> list[Episode]:  # type: ignore[no-untyped-def]
    """`settings`: further `WorkflowConfig` fields (prompts, ds_stop_when_done, ds_caps, show_coach_feedback)."""
    cfg = WorkflowConfig(name="ds_pipeline", ds_max_turns=turns, **settings)
    wf = DsPipeline(cfg, SandboxConfig(keep_workspaces=keep))
    return play_scripted(
        wf, tasks, ScriptedPolicy(team(tasks, script)), sandbox, scorer, gen=DS_GEN, keep_workspaces=keep
    )


FORGETFUL_ENGINEER = """\
import pickle
import pandas as pd
train = pd.read_csv("train.csv")
y_train = train.pop("target")
X_train = pd.get_dummies(train.drop(columns=["id"]), dtype=float)
for name, obj in [("X_train", X_train), ("y_train", y_train)]:
    with open(name + ".pkl", "wb") as f:
        pickle.dump(obj, f)
print("X_train", X_train.shape)
"""


def write_bench(root: Path) -> Path:
    """A tiny benchmark directory in the mini-DSBench's layout under `root`: two train tasks and one eval task."""
    rows = [
        {**_write_task(root, "toy_churn", "classification", "roc_auc", 1), "split": "train"},
        {**_write_task(root, "toy_prices", "regression", "rmse", 2), "split": "train"},
        {**_write_task(root, "toy_churn_eval", "classification", "roc_auc", 3), "split": "eval"},
    ]
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


# ----------------------------------------------------------------------------- a tiny model with a thinking template
# A chat template that reads `enable_thinking`, as Qwen3's does: off, the prompt ends with an empty think block.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def save_tiny(directory: Path, seed: int = 0) -> Path:
    """A tiny random model with `THINK_TEMPLATE`, saved as an HF directory."""
    model, tokenizer = tiny_model_and_tokenizer(seed=seed)
    tokenizer.chat_template = THINK_TEMPLATE
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
