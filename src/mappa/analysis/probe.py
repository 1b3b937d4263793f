"""Specialisation and forgetting per checkpoint: `probe_run(RUN_DIR)` writes RUN_DIR/probe.jsonl.

One row per checkpoint x weights x probe (x role), `{"step", "checkpoint", "agent", "probe", "role", "value", "n"}`:

    kl_base         mean per-token KL(agent || base) on the agent's own role prompts     role: the agent's   n: tokens
    general_nll     mean NLL per token of a fixed general-English text set                role: null          n: tokens
    role_nll        mean NLL per token of a role's reference replies, under these weights role: whose prompts n: tokens
    gsm8k_accuracy  GSM8K test questions answered alone, greedy, rule-checked (opt-in)    role: null          n: questions

The base model's rows (adapters off / the untouched base) have agent "base", checkpoint "base" and step 0. Every
agent starts there (LoRA B matrices start at zero, full copies start equal), so the base rows are each agent's
step-0 point.

The probe sets, fixed for a run:
  - role prompts: each agent's first `prompts_per_role` distinct prompts of the start-of-training evaluation
    (eval/start.jsonl: the workflow's own prompt builders on the held-out tasks, played with the base weights),
    with the replies the base gave there as the role's reference continuations for `role_nll`;
  - general text: `probe_texts.jsonl` beside this module, short general-English passages written for this
    probe (no third-party text), scored on every token after the first;
  - GSM8K: the first N questions of `gsm8k_test` from the configured math data directory.

The `kl_base` estimator: continuations are sampled from the agent itself (temperature 1, no nucleus, the run's
seed and token cap), and at every sampled position the KL between the agent's and the base's next-token
distributions is computed exactly over the full vocabulary; the value is the sum over positions divided by the
number of tokens. Sampling from the agent makes the sum an unbiased estimate of the sequence-level KL(agent ||
base) of the agent's replies (the exact inner sum removes the variance of a sampled log-ratio), so it is the
divergence of what the agent actually says, not of what the base would have said. For the base itself it is 0
by definition (written, not computed; its n counts the role's reference reply tokens).

Reading them: an agent that specialised has a `kl_base` above 0 and a `role_nll` that moved most on its own role;
one that forgot has a `general_nll` (and the other roles' `role_nll`) well above the base's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mappa.config import Config
from mappa.errors import MappaError
from mappa.protocols import ProgressFn
from mappa.training.tracking import run_config
from mappa.types import Action, Episode, Message, Task

PROBE_FILE = "probe.jsonl"
SETTINGS_FILE = "probe_settings.json"  # the probe set's size, beside the rows it was used for
PROBES = ("kl_base", "general_nll", "role_nll", "gsm8k_accuracy")
BASE = "base"  # the agent and checkpoint name of the base model's rows
if TYPE_CHECKING:
    import torch

GSM8K_ASK = "Solve it step by step. End with one line: The answer is <number>."


@dataclass(frozen=True)
class ProbeRow:
    """One measurement of one set of weights at one checkpoint."""

    step: int  # the checkpoint's training step (0: the base)
    checkpoint: str  # "step-000004", or "base"
    agent: str  # whose weights, or "base"
    probe: str  # one of PROBES
    role: str | None  # whose role prompts (kl_base, role_nll); None for the role-free probes
    value: float
    n: int  # tokens (NLL, KL) or questions (accuracy) the value is over


@dataclass(frozen=True)
class ProbeSets:
    """What every set of weights is measured on (fixed for a run)."""

    roles: dict[str, list[Action]]  # agent -> its role prompts with the base's reference replies
    general: list[list[int]]  # (N, L) token ids of the general passages
    gsm8k: list[Task]


@dataclass(frozen=True)
class ProbeSummary:
    path: Path
    probed: list[str]  # checkpoints measured by this call ("base" included)
    skipped: list[str]  # already in probe.jsonl
    rows: list[ProbeRow]  # every row of the file after this call


# ---------------------------------------------------------------------------------------------------- the run
def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the run's complete checkpoints, in step order; half-written ones are left out."""
    found = []
    for d in (run_dir / "checkpoints").glob("step-*"):
        if d.is_dir() and (d / "state.json").is_file() and (d / "policy").is_dir():
            try:
                found.append((int(d.name.removeprefix("step-")), d))
            except ValueError:
                continue
    return sorted(found)


def general_texts() -> list[str]:
    """The fixed general-English passages (package data)."""
    lines = resources.files("mappa.analysis").joinpath("probe_texts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line)["text"] for line in lines.splitlines() if line.strip()]


def role_prompts(run_dir: Path, agents: Sequence[str], per_role: int) -> dict[str, list[Action]]:
    """Each agent's first `per_role` distinct prompts of eval/start.jsonl, with the base's replies there."""
    path = run_dir / "eval" / "start.jsonl"
    if not path.is_file():
        raise MappaError(f"{path}: not found (the role probes are the start-of-training evaluation's prompts)")
    roles: dict[str, list[Action]] = {a: [] for a in agents}
    seen: set[tuple[int, ...]] = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            episode = Episode.model_validate_json(line)
        except ValueError:  # a torn line
            continue
        for action in episode.actions:
            mine = roles.get(action.agent)
            if mine is None or len(mine) >= per_role or not action.response_ids or action.prompt_ids in seen:
                continue
            seen.add(action.prompt_ids)
            mine.append(action)
    return roles


def probe_sets(
    run_dir: Path, cfg: Config, agents: Sequence[str], tokenizer: Any, per_role: int, gsm8k: int
) -> ProbeSets:
    general = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in general_texts()]
    questions: list[Task] = []
    if gsm8k:
        from mappa.tasks import load_source

        questions = load_source("gsm8k_test", cfg.tasks, "eval", cfg.seed)[:gsm8k]
    return ProbeSets(role_prompts(run_dir, agents, per_role), [ids for ids in general if len(ids) > 1], questions)


# ---------------------------------------------------------------------------------------------------- measures
def mean_nll(
    policy: Any, agent: str | None, prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]]
) -> tuple[float, int]:
    """Mean negative log-likelihood per reply token under `agent`'s weights (None: the base), and the token count."""
    logp, mask = policy.sequence_logprobs(agent, prompts, replies)
    n = int(mask.sum())
    return (float(-(logp * mask).sum()) / n if n else float("nan")), n


def vocab_logprobs(
    module: torch.nn.Module, prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, V) log-probabilities over the whole vocabulary at each reply position, for replies laid out as the
    training forward lays them out (`mappa.policy.decoding.response_layout`), and the (B, T) mask of real reply
    tokens."""
    import torch

    from mappa.policy.decoding import response_layout

    device = next(module.parameters()).device
    ids, attn, positions, mask = response_layout(prompts, replies, pad_id, device)
    T = mask.shape[1]
    logits = module(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=T + 1).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1), mask  # position t predicts token t+1


def kl_to_base(
    policy: Any, agent: str, prompts: Sequence[Sequence[Message]], max_new_tokens: int, seed: int, batch: int = 8
) -> tuple[float, int]:
    """Mean per-token KL(agent || base) on replies sampled from `agent` (the estimator in the module docstring).

    The replies are scored `batch` at a time, similar lengths together: one forward per batch with the agent's
    weights and one with the base's, not two per reply."""
    import torch

    from mappa.policy.decoding import length_batches

    gens = policy.generate(
        agent, prompts, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, max_context_tokens=None, seed=seed
    )
    gens = [g for g in gens if g.response_ids]
    total, n = 0.0, 0
    for rows in length_batches([len(g.prompt_ids) + len(g.response_ids) for g in gens], batch):
        chunk = [gens[i] for i in rows]
        prompt_ids, reply_ids = [g.prompt_ids for g in chunk], [g.response_ids for g in chunk]
        with torch.no_grad():
            with policy.active(agent) as module:
                own, mask = vocab_logprobs(module, prompt_ids, reply_ids, policy.pad_id)
            with policy.active(None) as module:
                base, _ = vocab_logprobs(module, prompt_ids, reply_ids, policy.pad_id)
        per_position = (own.exp() * (own - base)).sum(-1)
        total += float(per_position[mask].sum())
        n += int(mask.sum())
    return (total / n if n else float("nan")), n


def gsm8k_accuracy(policy: Any, agent: str | None, tasks: Sequence[Task], max_new_tokens: int) -> tuple[float, int]:
    """Share of GSM8K questions these weights answer right alone (greedy, rule-based check)."""
    from mappa.tasks import check_answer

    convs = [[Message(role="user", content=f"{t.problem}\n\n{GSM8K_ASK}")] for t in tasks]
    gens = policy.generate(
        agent, convs, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, max_context_tokens=None, seed=0
    )
    right = sum(check_answer(g.text, t.answer, t.problem) for g, t in zip(gens, tasks, strict=True))
    return right / len(tasks), len(tasks)


# ---------------------------------------------------------------------------------------------------- one checkpoint
def _units(sets: ProbeSets, agents: int, base: bool) -> int:
    """Progress units: per set of weights a KL per own role (the base: every role), the general text, one NLL
    per role and GSM8K."""
    per_weights = 1 + len(sets.roles) + bool(sets.gsm8k)
    return agents * (1 + per_weights) + (len(sets.roles) + per_weights if base else 0)


def probe_weights(
    policy: Any, agent: str | None, sets: ProbeSets, cfg: Config, where: tuple[int, str],
    gsm8k_tokens: int = 256, tick: Callable[[], None] | None = None,
) -> list[ProbeRow]:  # fmt: skip
    """Every probe on one set of weights (`agent`; None: the base) at checkpoint `where` = (step, name)."""
    step, checkpoint = where
    name = agent or BASE
    tick = tick or (lambda: None)
    out: list[ProbeRow] = []

    def add(probe: str, role: str | None, measured: tuple[float, int]) -> None:
        value, n = measured
        if n:  # nothing to measure (e.g. a role that never acted) leaves no row rather than a NaN
            out.append(ProbeRow(step, checkpoint, name, probe, role, value, n))
        tick()

    if agent is None:  # the base's KL to itself is 0 by definition; n: its reference reply tokens on each role
        for role, actions in sets.roles.items():
            add("kl_base", role, (0.0, sum(len(a.response_ids) for a in actions)))
    else:
        convs = [list(a.messages) for a in sets.roles[agent]]
        add("kl_base", agent, kl_to_base(policy, agent, convs, cfg.generation.max_new_tokens, cfg.seed))
    add(
        "general_nll",
        None,
        mean_nll(policy, agent, [ids[:1] for ids in sets.general], [ids[1:] for ids in sets.general]),
    )
    for role, actions in sets.roles.items():
        add(
            "role_nll",
            role,
            mean_nll(policy, agent, [a.prompt_ids for a in actions], [a.response_ids for a in actions]),
        )
    if sets.gsm8k:
        add("gsm8k_accuracy", None, gsm8k_accuracy(policy, agent, sets.gsm8k, gsm8k_tokens))
    return out


# ---------------------------------------------------------------------------------------------------- the file
def read_probes(run_dir: str | Path) -> list[ProbeRow]:
    """The rows of RUN_DIR/probe.jsonl (none when absent; a torn or foreign line is skipped)."""
    path = Path(run_dir) / PROBE_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(ProbeRow(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return rows


def _write(path: Path, rows: list[ProbeRow]) -> None:
    """Replace the file whole (rows in step order): a kill leaves the previous file, never half a checkpoint."""
    rows = sorted(rows, key=lambda r: r.step)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def _check_settings(run_dir: Path, settings: dict[str, int], rows: list[ProbeRow], force: bool) -> bool:
    """Rows measured on another probe set are not comparable: refuse to mix them, or with `force` say that the
    old rows must go (returns True then). Records the settings in use."""
    path = run_dir / SETTINGS_FILE
    try:
        before = json.loads(path.read_text(encoding="utf-8")) if rows and path.is_file() else settings
    except json.JSONDecodeError:
        before = settings
    if before != settings and not force:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in before.items())
        raise MappaError(f"{run_dir / PROBE_FILE} was measured with {flags}: give the same, or --force to start over")
    path.write_text(json.dumps(settings) + "\n", encoding="utf-8")
    return before != settings


def probe_run(
    run_dir: str | Path, *, force: bool = False, prompts_per_role: int = 16, gsm8k: int = 0, gsm8k_tokens: int = 256,
    progress: ProgressFn | None = None,
) -> ProbeSummary:  # fmt: skip
    """Probe the base and every complete checkpoint of a run not yet in probe.jsonl (all of them with `force`).

    The file is rewritten after each checkpoint, so a killed probe keeps what it finished and the next call
    goes on from there. `progress(done, total)` counts measurements (one KL, NLL or accuracy each).
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)  # before anything is written into it
    found = checkpoints(run_dir)
    if not found:
        raise MappaError(f"{run_dir}: no checkpoints to probe (no complete checkpoints/step-*/)")
    if prompts_per_role < 1 or gsm8k < 0:
        raise MappaError(f"probe: --prompts must be >= 1 and --gsm8k >= 0 (got {prompts_per_role}, {gsm8k})")
    path = run_dir / PROBE_FILE
    rows = read_probes(run_dir)
    if _check_settings(
        run_dir, {"prompts": prompts_per_role, "gsm8k": gsm8k, "gsm8k_tokens": gsm8k_tokens}, rows, force
    ):
        rows = []  # measured on another probe set: not comparable with what comes now
    done = {r.checkpoint for r in rows}
    todo = [(step, d) for step, d in found if force or d.name not in done]
    with_base = force or BASE not in done
    skipped = ([] if with_base else [BASE]) + [d.name for _, d in found if not force and d.name in done]
    if not todo and not with_base:
        return ProbeSummary(path, [], skipped, rows)

    from mappa.policy.policy import Policy

    first = (todo or found[-1:])[0][1]
    policy = Policy.from_checkpoint(first / "policy", device=cfg.model.device)
    sets = probe_sets(run_dir, cfg, policy.agents, policy.tokenizer, prompts_per_role, gsm8k)
    total, count = _units(sets, len(policy.agents) * len(todo), with_base), [0]

    def tick() -> None:
        count[0] += 1
        if progress is not None:
            progress(count[0], total)

    probed = []
    if with_base:
        rows = [r for r in rows if r.checkpoint != BASE] + probe_weights(
            policy, None, sets, cfg, (0, BASE), gsm8k_tokens, tick
        )
        _write(path, rows)
        probed.append(BASE)
    for step, d in todo:
        if d != first:
            policy.load_weights(d / "policy")
        new = [
            r for a in policy.agents for r in probe_weights(policy, a, sets, cfg, (step, d.name), gsm8k_tokens, tick)
        ]
        rows = [r for r in rows if r.checkpoint != d.name] + new
        _write(path, rows)
        probed.append(d.name)
    return ProbeSummary(path, probed, skipped, sorted(rows, key=lambda r: r.step))
