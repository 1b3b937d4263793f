"""The expected score against the sampled one: variance of rewards and of whitened advantages, per agent.

    .venv/bin/python bench/bench_expected_score.py [--episodes FILE.jsonl] [--record 8] [--draws 4]

`coach.expected_score` replaces the number the coach wrote (the sampled score) by the probability-weighted mean of
the score token's alternatives. This bench measures what that does to the rewards and to the advantages they become,
on coach replies with token log-probs:

- Episodes: recorded demo rollouts (`--episodes`, or `--record N` runs `mappa rollout configs/demo.yaml`: three
  SmolLM2-135M agents on arithmetic word problems).
- Coach: the `local` backend's own model, the embedded SmolLM2-135M-Instruct, on the exact prompt the coach sends
  (`mappa.coach.prompts.fit_prompt` within the local coach's budget, its chat template). The prompt is prefilled once
  per action; every draw then writes a short analysis (`--analysis-tokens`, end of turn masked, so every analysis
  has that length) followed by the verdict line, whose marker `PROCESS_SCORE: ` is written for it (a 135M model
  seldom writes it unasked; the coach's follow-up asks for exactly this line). The score token is drawn at the
  coach's temperature (a "1" may continue with "0": one more token); the sampled score is what
  `mappa.coach.parse.parse_score` reads, the expected score what `mappa.coach.parse.expected_score` computes from the
  same tokens (falling back to the sampled one, as the coach does).
- Draw 0 is greedy (temperature 0, the paper presets' coach): one reward per action, so the only variance is across
  the batch. Draws 1..K sample at `--temperature`: their spread within one action is the coach's noise.
- Advantages: `mappa.training.rl.reinforce_pp_advantages` per agent and draw, over all of the agent's actions, with the
KL term
  zero (at the first step the policy is its reference), tokens = the action's recorded response length.

Printed per agent, with 95% bootstrap intervals over episodes (resampled whole, whitening redone in each resample):
the batch variance of rewards at temperature 0 (sampled vs expected, ratio); the noise (mean within-action variance
over the K draws) of rewards and of whitened advantages at the sampling temperature (ratio expected / sampled). The
noise of a whitened advantage is the share of its variance that is the coach's draw rather than the action.
Caveat: a 135M coach is not Gemini; the numbers show the mechanism on real replies, not its size with a strong coach.
Runtime on the 2-core CPU under a load of ~8 (other jobs): ~1 min to record 8 episodes, 9 min to judge their 30
actions with 1 + 4 draws each (16-token analyses).

Measured (8 episodes, 30 actions, seed 0; expected / sampled, 95% interval over episodes):
| agent | batch variance of rewards, T=0 | reward noise, T=1 | noise share of whitened advantages, T=1 |
|---|---|---|---|
| problem_solver | 0.01 [0.00, 0.01] | 0.01 [0.01, 0.02] | 0.92 [0.63, 1.32] (sampled 1.08, expected 1.00) |
| code_executor | 0.02 [0.01, 0.65] | 0.03 [0.01, 0.04] | 0.93 [0.45, 1.09] (sampled 1.11, expected 1.04) |
| verifier | - (every greedy verdict the same) | 0.02 [0.01, 0.02] | 0.97 [0.28, 2.03] (sampled 1.03, expected 0.99) |
The expected score shrinks the rewards toward the middle of the coach's distribution, their spread across actions as
much as their noise; whitening per agent undoes the shrinking, and what the trainer gets is as noisy either way.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mappa.coach.local import LocalCoach
from mappa.coach.parse import TokenLogprob, expected_score, parse_score
from mappa.coach.prompts import draw_fence, fit_prompt, readable_context, template_for
from mappa.coach.replay import episode_contexts
from mappa.config import CoachConfig, load_config
from mappa.training.rl import reinforce_pp_advantages
from mappa.types import Episode, Message, read_jsonl
from mappa.workflows import build_workflow

ROOT = Path(__file__).resolve().parents[1]
MARKER = "\nPROCESS_SCORE: "
TOP = 20  # alternatives kept per position, as the coach asks an endpoint for


@dataclass(frozen=True)
class Judged:
    """One action's verdicts: draw 0 greedy, then K draws at the temperature (NaN: no score in that draw)."""

    episode: int
    agent: str
    tokens: int  # the action's response length: its weight in the whitening
    sampled: np.ndarray  # (1 + K,) the number the verdict line reads
    expected: np.ndarray  # (1 + K,) the probability-weighted score of the same tokens


def record(n: int, out: Path) -> None:
    mappa = Path(sys.executable).parent / "mappa"
    cmd = [str(mappa), "rollout", str(ROOT / "configs" / "demo.yaml"), "--episodes", str(n), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT)


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Row 0 greedy, the other rows drawn at `temperature`: (R, V) logits -> (R,) token ids."""
    drawn = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)
    drawn[0] = logits[0].argmax()
    return drawn


@torch.inference_mode()
def verdicts(coach: LocalCoach, prompt: list[int], args: argparse.Namespace, gen: torch.Generator) -> list[list]:
    """Per draw, the reply's tokens as the coach would read them: analysis, marker, score token(s)."""
    model, tok = coach.policy.model, coach.policy.tokenizer
    rows = 1 + args.draws
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(rows)
    logits = out.logits[:, -1].float().expand(rows, -1).clone()
    banned = torch.tensor(sorted(set(tok.all_special_ids) | set(coach.policy.eos_ids)))
    replies: list[list[TokenLogprob]] = [[] for _ in range(rows)]
    for _ in range(args.analysis_tokens):  # the analysis: its log-probs play no part in the score
        logits[:, banned] = -torch.inf
        ids = _pick(logits, args.temperature, gen)
        for r in range(rows):
            replies[r].append(TokenLogprob(coach.token_text(int(ids[r])), 0.0))
        logits = model(input_ids=ids[:, None], past_key_values=cache, use_cache=True).logits[:, -1].float()
    marker = tok.encode(MARKER, add_special_tokens=False)
    for r in range(rows):
        replies[r].extend(TokenLogprob(coach.token_text(i), 0.0) for i in marker)
    ids = torch.tensor([marker] * rows)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].float()
    for step in range(2):  # the score token, then what follows a "1" (a "0" makes it 10)
        logp = torch.log_softmax(logits, -1)
        top = logp.topk(TOP, -1)
        ids = _pick(logits, args.temperature, gen)
        for r in range(rows):
            if step == 1 and replies[r][-1].token.strip() != "1":
                continue
            alts = tuple(
                (coach.token_text(int(i)), float(v)) for i, v in zip(top.indices[r], top.values[r], strict=True)
            )
            replies[r].append(TokenLogprob(coach.token_text(int(ids[r])), float(logp[r, ids[r]]), alts))
        if step == 0:
            logits = model(input_ids=ids[:, None], past_key_values=cache, use_cache=True).logits[:, -1].float()
    return replies


def judge_all(episodes: list[Episode], args: argparse.Namespace) -> list[Judged]:
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    coach_cfg = CoachConfig(backend="local", model="smollm2-135m-instruct", cache=False)
    coach = LocalCoach(coach_cfg, template_for("", "mathchat"))
    workflow = build_workflow(cfg)  # the demo's MathChat, as it recorded the episodes
    gen = torch.Generator().manual_seed(args.seed)
    out: list[Judged] = []
    t0 = time.perf_counter()
    for e, ep in enumerate(episodes):
        for action, ctx in zip(ep.actions, episode_contexts(ep, workflow), strict=True):
            ctx = readable_context(ctx)
            fence = draw_fence(ctx, coach.fit.specials)
            messages, _ = fit_prompt(ctx, coach.template, coach.fit.budget, coach.fit.count, fence)
            prompt = coach.policy.chat_ids(tuple(Message(role=m["role"], content=m["content"]) for m in messages))
            s, x = [], []
            for reply in verdicts(coach, prompt, args, gen):
                score = parse_score("".join(t.token for t in reply))
                value = expected_score(reply) if score is not None else None
                s.append(np.nan if score is None else score)
                x.append(np.nan if score is None else (score if value is None else value))
            out.append(Judged(e, action.agent, max(1, len(action.response_ids)), np.array(s), np.array(x)))
        print(f"  episode {e + 1}/{len(episodes)}: {len(out)} actions, {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def advantages(values: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(N, D) rewards of one agent's N actions in D draws -> (N, D) whitened advantages, one batch per draw."""
    n, width = len(tokens), int(tokens.max())
    mask = torch.arange(width)[None, :] < torch.tensor(tokens)[:, None]
    zeros = torch.zeros(n, width, dtype=torch.float64)
    cols = []
    for d in range(values.shape[1]):
        adv = reinforce_pp_advantages(torch.tensor(values[:, d]), zeros, zeros, mask, kl_coef=0.0)
        cols.append(adv[:, 0].numpy())  # every token of an action carries the same advantage (gamma 1, no KL)
    return np.stack(cols, 1)


def agent_stats(rows: list[Judged]) -> dict[str, float]:
    """The statistics of one agent's actions (one batch)."""
    out: dict[str, float] = {}
    greedy = [r for r in rows if not np.isnan(r.sampled[0])]
    if len(greedy) > 1:
        out["batch_var_sampled"] = float(np.var([r.sampled[0] for r in greedy]))
        out["batch_var_expected"] = float(np.var([r.expected[0] for r in greedy]))
    full = [r for r in rows if not np.isnan(r.sampled[1:]).any()]
    if len(full) > 1:
        w = np.array([r.tokens for r in full], dtype=float)
        for kind in ("sampled", "expected"):
            v = np.stack([getattr(r, kind)[1:] for r in full])
            out[f"noise_{kind}"] = float(np.var(v, 1, ddof=1).mean())
            a = advantages(v, np.array([r.tokens for r in full]))
            out[f"adv_noise_{kind}"] = float((np.var(a, 1, ddof=1) * w).sum() / w.sum())
    return out


def ratio(stats: dict[str, float], num: str, den: str) -> float:
    return stats[num] / stats[den] if stats.get(den) else float("nan")


def report(judged: list[Judged], boot: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    episodes = sorted({j.episode for j in judged})
    by_episode = {e: [j for j in judged if j.episode == e] for e in episodes}
    agents = sorted({j.agent for j in judged})
    keys = [
        ("batch variance of rewards, temperature 0", "batch_var_expected", "batch_var_sampled"),
        ("noise variance of rewards (within an action)", "noise_expected", "noise_sampled"),
        ("noise variance of whitened advantages", "adv_noise_expected", "adv_noise_sampled"),
    ]
    for agent in agents:
        point = agent_stats([j for j in judged if j.agent == agent])
        samples: list[dict[str, float]] = []
        for _ in range(boot):
            pick = rng.choice(episodes, len(episodes))
            samples.append(agent_stats([j for e in pick for j in by_episode[e] if j.agent == agent]))
        rows = [j for j in judged if j.agent == agent]
        full = sum(not np.isnan(j.sampled[1:]).any() for j in rows)
        greedy = sum(not np.isnan(j.sampled[0]) for j in rows)
        print(f"\n{agent}: {len(rows)} actions ({greedy} scored greedy, {full} scored in every draw)")
        for label, num, den in keys:
            if den not in point:
                print(f"  {label}: too few scored actions")
                continue
            if not point[den]:
                print(
                    f"  {label}: sampled {point[den]:.3f}, expected {point[num]:.3f} (no ratio: every sampled equal)"
                )
                continue
            rs = np.array([ratio(s, num, den) for s in samples])
            lo, hi = np.nanpercentile(rs, [2.5, 97.5]) if np.isfinite(rs).any() else (np.nan, np.nan)
            print(
                f"  {label}: sampled {point[den]:.3f}, expected {point[num]:.3f}; "
                f"expected / sampled {ratio(point, num, den):.2f} [95% CI {lo:.2f}, {hi:.2f}]"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=Path, help="recorded episodes (JSONL); default: record --record of them")
    ap.add_argument("--record", type=int, default=8, help="demo episodes to record when --episodes is not given")
    ap.add_argument("--draws", type=int, default=4, help="verdicts drawn per action at --temperature")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--analysis-tokens", type=int, default=16)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    # One thread: on a 2-core machine busy with anything else, two torch threads spin-wait on each other (a decode
    # step measured 7 s with two, 0.3 s with one, under a load of 8).
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.episodes
        if path is None:
            path = Path(tmp) / "episodes.jsonl"
            t0 = time.perf_counter()
            record(args.record, path)
            print(f"recorded {args.record} demo episodes in {time.perf_counter() - t0:.0f} s")
        episodes = read_jsonl(path, Episode)
    t0 = time.perf_counter()
    judged = judge_all(episodes, args)
    print(f"judged {len(judged)} actions x {1 + args.draws} verdicts in {time.perf_counter() - t0:.0f} s")
    report(judged, args.bootstrap, args.seed)


if __name__ == "__main__":
    main()
