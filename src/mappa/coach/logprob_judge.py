"""The log-prob judge (`coach.judge: logprob`): the local coach's verdict read from one forward pass, never written.

The prompt is the generative judge's own (`mappa.coach.judge.prompt_or_worst`: the same template, fenced evidence
and budget, so both judges see the same evidence), and the coach's turn is made to begin with its verdict marker,
`PROCESS_SCORE:`. One forward pass over prompt and marker gives the next token's distribution, and from it the
score's, over the values 0..10:
- a value's tokens are what the coach's tokenizer makes of the verdict line `PROCESS_SCORE: <value>` after the
  tokens every value shares (`verdict_tokens`): " 7" for a tokenizer that writes the space with the number, " " then
  "7" for one that does not (Qwen2.5, SmolLM2);
- a tokenizer that splits digits writes 10 as "1" then "0": P(10) = P("1") P("0" | "1") and P(1) = P("1") (1 -
  P("0" | "1")), the second factor read one position further, with "1" appended to every row (the probe); the
  integer part only: a "7" that would go on to "7.5" counts as 7;
- renormalised over the eleven values; the probability they held before (`mass`) is recorded: a coach that would
  rather write something else there puts little on them.
The score is the expected value (`coach.expected_score: false`: the most likely value, what a greedy coach would
write first), with the distribution, both values and the mass in the judgment's raw reply (JSON). For the final
agent with a reference answer the verdict's second line is read the same way: `ANSWER_CORRECT:` after the most
likely score, from the same cache; `answer_correct` is whether "1" is likelier than "0".

So a judgment is never unparsable and costs no decoding: one prefill of the prompt, then a token or a few. Unlike
the generative judge it writes no analysis to think in, and it reads the model at its own distribution
(`coach.temperature` plays no part). What it is good for, as measured, is in docs/coach.md.

Judgments that arrive together are read together (`mappa.coach.local.Batcher`, up to `coach.concurrency` a batch):
one prefill in which the prompt opening every row shares (system prompt and rubric) runs once
(`mappa.policy.decoding.prefill`), in bfloat16 autocast on a CPU with native bfloat16 matmuls
(`mappa.policy.precision`). Cached like every judgment; the backend name `local-logprob` keeps its judgments apart from
the generative ones.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mappa.coach.judge import REQUEST_FAILED, RequestFailed, cut_note, prompt_or_worst
from mappa.coach.local import Batcher, LocalCoach, as_messages
from mappa.coach.prompts import Template
from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.policy import decoding
from mappa.policy.policy import Policy
from mappa.policy.precision import autocast, autocast_dtype, cpu_has_native_bf16
from mappa.types import CoachContext, CoachScore

VALUES = range(11)
MARKER = "PROCESS_SCORE: "
ANSWER_MARKER = "\nANSWER_CORRECT: "
SPARE = 16  # cache columns reserved after the prompt: the probe and the answer marker's tokens


@dataclass(frozen=True)
class VerdictTokens:
    """How the coach's tokenizer writes a verdict (`verdict_tokens`)."""

    stem: tuple[int, ...]  # the marker's tokens that every value's line starts with
    firsts: tuple[int, ...]  # (11,) the first token of each value 0..10
    probe: int | None  # the first token of the values written in two tokens; None: every value in one
    seconds: tuple[int | None, ...]  # (11,) the second token of each value written in two, else None
    answer_prefix: tuple[tuple[int, ...], ...]  # (11,) per value: its tokens, then the answer marker's
    answer_ids: tuple[int, int]  # the first token of the answer 0 and of the answer 1


def _common(rows: Sequence[Sequence[int]]) -> int:
    n = min(len(r) for r in rows)
    return next((i for i in range(n) if len({r[i] for r in rows}) > 1), n)


def verdict_tokens(tokenizer: object) -> VerdictTokens:
    """The verdict's tokens as `tokenizer` writes the lines themselves. Readable: every value 0..10 in one token or
    two, those in two all starting with one token (the probe: "1" of "1" "0", or a space written apart); MappaError
    otherwise."""

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    lines = [encode(f"{MARKER}{v}") for v in VALUES]
    n = _common(lines)
    written = [line[n:] for line in lines]
    probes = {w[0] for w in written if len(w) == 2}
    singles = [w[0] for w in written if len(w) == 1]
    ok = all(len(w) in (1, 2) for w in written) and len(probes) <= 1 and len(set(singles)) == len(singles)
    answer_prefix, answers = [], set()
    for v in VALUES:
        pair = [encode(f"{MARKER}{v}{ANSWER_MARKER}{a}") for a in (0, 1)]
        k = _common(pair)
        ok = ok and pair[0][: len(lines[v])] == lines[v] and k < min(len(p) for p in pair)
        answers.add((pair[0][k:][:1], pair[1][k:][:1]))
        answer_prefix.append(pair[0][n:k])
    if not ok or len(answers) != 1:
        shown = [tokenizer.convert_ids_to_tokens(list(w)) for w in written]  # type: ignore[attr-defined]
        raise MappaError(
            f"coach.judge: logprob reads scores written in one token or two after {MARKER!r}, those in two starting "
            f"alike; this tokenizer writes 0..10 as {shown}: use coach.judge: generate"
        )
    ((no,), (yes,)) = answers.pop()
    seconds = tuple(w[1] if len(w) == 2 else None for w in written)
    probe = probes.pop() if probes else None
    return VerdictTokens(lines[0][:n], tuple(w[0] for w in written), probe, seconds, tuple(answer_prefix), (no, yes))


def value_distribution(
    first: torch.Tensor, after_probe: torch.Tensor | None, tokens: VerdictTokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """From (B, V) log-probs of the token after the marker (and of the token after the probe, when some values take
    two), the (B, 11) distribution over the values 0..10 and (B,) the probability they held. A value written in one
    token that is also the probe (1, when 10 is "1" "0") keeps what the probe does not go on to another value with.
    In log space throughout: a coach that puts almost nothing on the values still gets a distribution."""
    logp = first[:, list(tokens.firsts)].double()
    if tokens.probe is not None:
        assert after_probe is not None
        two = [v for v in VALUES if tokens.seconds[v] is not None]
        second = after_probe[:, [tokens.seconds[v] for v in two]].double()  # (B, values in two tokens)
        for v in VALUES:
            if v in two:
                logp[:, v] += second[:, two.index(v)]
            elif tokens.firsts[v] == tokens.probe:  # "1" then anything but "0": the value 1
                logp[:, v] += torch.log1p(-second.exp().sum(-1).clamp(max=1.0))
    total = torch.logsumexp(logp, -1)
    return (logp - total[:, None]).exp().float(), total.exp().float()


@dataclass(frozen=True)
class Reading:
    """One verdict read from the coach's distribution."""

    probs: tuple[float, ...]  # (11,) P(score = v), v = 0..10, renormalised over the values
    mass: float  # the probability the values held before renormalising
    answer: float | None = None  # P(ANSWER_CORRECT: 1) against 0; None: not asked (not the final agent)

    @property
    def expected(self) -> float:
        return sum(v * p for v, p in zip(VALUES, self.probs, strict=True))

    @property
    def argmax(self) -> int:
        return max(VALUES, key=lambda v: self.probs[v])


def _step(module: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, cache: object):
    """One forward of new tokens (B, n) after the cache; returns the model's output (logits of the last only)."""
    return module(
        input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache, use_cache=True,
        logits_to_keep=1,
    )  # fmt: skip


def _answers(
    module: torch.nn.Module, prefilled: tuple, rows: list[int], values: list[int], tokens: VerdictTokens, pad_id: int
) -> list[float]:
    """P(ANSWER_CORRECT: 1) of `rows` after their `values`, continuing the batch's cache: each row's value and the
    answer marker, left-padded in one forward. The probe "1" already in the cache stays where the value begins with
    it (1, and 10 written "1" "0") and is masked out elsewhere, its position given to the next token."""
    cache, attn, pos = prefilled
    idx = torch.tensor(rows, device=attn.device)
    if len(rows) < attn.shape[0]:
        cache.batch_select_indices(idx)
    attn, pos = attn[idx].clone(), pos[idx].clone()
    own = []
    for r, v in enumerate(values):
        tail = tokens.answer_prefix[v]
        if tokens.probe is not None:
            if tail[0] == tokens.probe:
                tail = tail[1:]
            else:
                attn[r, -1], pos[r] = 0, pos[r] - 1
        own.append(tail)
    width = max(len(t) for t in own)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=attn.device)
    mask = torch.zeros_like(ids)
    for r, tail in enumerate(own):
        ids[r, width - len(tail) :] = torch.tensor(tail, dtype=torch.long)
        mask[r, width - len(tail) :] = 1
    positions = pos[:, None] + (mask.cumsum(-1) - 1).clamp(min=0)
    out = _step(module, ids, torch.cat([attn, mask], 1), positions, cache)
    no, yes = torch.log_softmax(out.logits[:, -1].float(), -1)[:, list(tokens.answer_ids)].unbind(-1)
    return torch.sigmoid(yes - no).tolist()  # P(1) / (P(0) + P(1))


@torch.no_grad()
def read_verdicts(
    module: torch.nn.Module,
    prompts: list[list[int]],
    finals: list[bool],
    tokens: VerdictTokens,
    pad_id: int,
    values: list[int] | None = None,
) -> list[Reading]:
    """The verdict of each prompt (chat-templated, the coach's turn opened and `tokens.stem` appended): the score's
    distribution, and for the `finals` the answer's, read after each one's most likely score (`values`: after these,
    one per final row, instead). One prefill of all rows, one step for the probe, one for the answers."""
    cache, logits, attn, pos = decoding.prefill(module, prompts, pad_id, spare=SPARE)
    first = torch.log_softmax(logits, -1)
    after_probe = None
    if tokens.probe is not None:
        attn = torch.cat([attn, attn.new_ones(len(prompts), 1)], 1)
        probe = torch.full((len(prompts), 1), tokens.probe, dtype=torch.long, device=attn.device)
        out = _step(module, probe, attn, pos[:, None], cache)
        cache, after_probe, pos = out.past_key_values, torch.log_softmax(out.logits[:, -1].float(), -1), pos + 1
    probs, mass = value_distribution(first, after_probe, tokens)
    answers: list[float | None] = [None] * len(prompts)
    rows = [i for i, final in enumerate(finals) if final]
    if rows:
        read = values if values is not None else [int(probs[i].argmax()) for i in rows]
        for i, p in zip(rows, _answers(module, (cache, attn, pos), rows, read, tokens, pad_id), strict=True):
            answers[i] = p
    return [
        Reading(tuple(probs[i].tolist()), float(mass[i]), answers[i]) for i in range(len(prompts))
    ]  # fmt: skip


def _rationale(r: Reading) -> str:
    text = (
        f"log-prob judge: expected score {r.expected:.2f}, most likely {r.argmax} (p {r.probs[r.argmax]:.2f}); "
        f"the scores held {r.mass:.0%} of the next token's probability"
    )
    return text if r.answer is None else f"{text}; P(ANSWER_CORRECT: 1) {r.answer:.2f}"


def _raw(r: Reading) -> str:
    """The reading as the judgment's raw reply: what a report or a bench reads back."""
    fields = {"judge": "logprob", "p": [round(p, 4) for p in r.probs], "mass": r.mass, "expected": r.expected,
              "argmax": r.argmax, "p_answer_correct": r.answer}  # fmt: skip
    return json.dumps(fields)


class LogprobCoach(LocalCoach):
    """The local coach's model and prompt, its verdict read rather than written (the module docstring)."""

    name = "local-logprob"

    def __init__(self, cfg: CoachConfig, template: Template, policy: Policy | None = None) -> None:
        # Its own model in bfloat16 where the CPU multiplies it natively: no decoding here, where bfloat16 would be
        # slower, and a forward ran 1.3x as fast as under autocast (0.5B, 8 prompts of ~1,300 tokens), at half the
        # memory; the policy's base, shared, under autocast (none for a model narrower than precision.MIN_HIDDEN).
        super().__init__(cfg, template, policy, torch.bfloat16 if cfg.model and cpu_has_native_bf16() else None)
        self.tokens = verdict_tokens(self.policy.tokenizer)
        with self.policy.active(None) as module:
            self.dtype = autocast_dtype("auto", module)
        # (prompt ids, whether the answer is read too) -> its reading
        self._readings: Batcher[tuple[list[int], bool], Reading] = Batcher(self._read)
        self.batches = self._readings.sizes  # judgments per forward, in order

    def _read(self, requests: list[tuple[list[int], bool]]) -> list[Reading]:
        out: list[Reading] = []
        size = self.cfg.concurrency
        with self.policy.active(None) as module, autocast(self.dtype):  # the frozen base: adapters disabled
            for start in range(0, len(requests), size):
                part = requests[start : start + size]
                prompts, finals = [p for p, _ in part], [f for _, f in part]
                out += read_verdicts(module, prompts, finals, self.tokens, self.policy.pad_id)
        return out

    async def score(self, ctx: CoachContext) -> CoachScore:
        t0 = time.perf_counter()
        prepared = prompt_or_worst(ctx, self.template, self.fit, backend=self.name, model=self.model)
        if isinstance(prepared, CoachScore):
            return prepared
        messages, cut = prepared
        prompt = self.policy.chat_ids(as_messages(messages)) + list(self.tokens.stem)
        final = ctx.is_final and ctx.ground_truth is not None
        self.counters.calls += 1
        common = dict(prompt_tokens=len(prompt), backend=self.name, model=self.model, truncated_inputs=cut.messages)
        try:
            r = await self._readings((prompt, final))
        except RequestFailed as e:
            self.counters.failures += 1
            return CoachScore(score=None, error=f"{REQUEST_FAILED}: {e}", latency_s=time.perf_counter() - t0, **common)
        self.counters.replies += 1
        return CoachScore(
            score=r.expected if self.cfg.expected_score else float(r.argmax),
            rationale=cut_note(cut) + _rationale(r),
            raw_reply=_raw(r),
            answer_correct=None if r.answer is None else r.answer > 0.5,
            latency_s=time.perf_counter() - t0,
            **common,
        )
