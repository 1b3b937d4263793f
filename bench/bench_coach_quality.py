"""How well each offline coach tells right from wrong, on recorded episodes with ground truth.

    .venv/bin/python bench/bench_coach_quality.py --episodes A.jsonl [B.jsonl ...] [--generative 16]
        [--coaches rubric,logprob,generate] [--model qwen2.5-coder-0.5b-instruct] [--out judgments.jsonl]

The coaches, on the same recorded MathChat episodes (`mappa rollout configs/demo.yaml --out F.jsonl`; each episode
carries `correct`, the rule-based check of its final answer), their contexts rebuilt as the rollout built them
(`mappa.coach.replay.episode_contexts`):
- rubric: the offline rules (`mappa.coach.rubric`); it checks the final answer against the reference itself, so its
  final-agent AUC is the ceiling of a coach that knows the answer, not a judgment;
- logprob: the local coach, `coach.judge: logprob` (`mappa.coach.logprob_judge`), on `--model`: one forward per
  judgment, the expected score over 0..10;
- generate: the local coach, `coach.judge: generate`, on the same model: it writes an analysis and the verdict
  (parsed, one follow-up when missing), `coach.max_tokens` `--max-tokens`. Slow on a CPU, so it judges every action of
  a sample of `--generative` episodes only, half of them right where there are enough (seeded); the other coaches'
  figures on that sample are printed beside its own.
Printed per coach: the final agent's AUC (its score against `Episode.correct`; 0.5 = no better than chance), each
earlier agent's AUC (the mean score of its actions in the episode against the episode's outcome: does the coach's
view of an earlier action go with how the episode ended), with 95% percentile-bootstrap intervals over episodes
(resampled whole); for the log-prob judge also the AUC of its P(ANSWER_CORRECT: 1). Then the parse rate (judgments
with a score), judgments per second (uncached judgments over the wall time of their pass; a pass served wholly from
the cache says so) and, for the log-prob judge, the mean probability its values held. Judgments are cached
(`coach.cache`), so a second run with the same coaches and episodes costs nothing; `--out` writes one line per
judgment, from which the tables can be rebuilt.
Threads: `--threads` torch threads (default 2); on a 2-core machine busy with other jobs 1 can be faster for decoding.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mappa.coach import build_coach
from mappa.coach.replay import episode_contexts
from mappa.config import CoachConfig, load_config
from mappa.types import Episode, read_jsonl
from mappa.workflows import build_workflow

ROOT = Path(__file__).resolve().parents[1]
FINAL = "verifier"
EARLIER = ("problem_solver", "code_executor")


@dataclass(frozen=True)
class Judged:
    """One coach's judgment of one action of episode `episode` (an index into the episodes read)."""

    coach: str
    episode: int
    agent: str
    correct: bool  # the episode's outcome
    score: float | None
    p_answer: float | None = None  # the log-prob judge's P(ANSWER_CORRECT: 1), final agent only
    mass: float | None = None  # the log-prob judge's probability on the values 0..10


def coach_config(name: str, args: argparse.Namespace) -> CoachConfig:
    if name == "rubric":
        return CoachConfig(backend="rubric")
    judge = "logprob" if name == "logprob" else "generate"
    return CoachConfig(
        backend="local", judge=judge, model=args.model, max_tokens=args.max_tokens, concurrency=args.concurrency,
        cache=not args.no_cache,
    )  # fmt: skip


def balanced(indices: list[int], episodes: list[Episode], right: int, wrong: int, seed: int) -> list[int]:
    """Up to `right` right and `wrong` wrong episodes of `indices`, drawn with `seed`, in order."""
    rng = random.Random(seed)
    yes = [i for i in indices if episodes[i].correct]
    no = [i for i in indices if not episodes[i].correct]
    return sorted(rng.sample(yes, min(len(yes), right)) + rng.sample(no, min(len(no), wrong)))


def judge_all(name: str, episodes: list[Episode], picked: list[int], args: argparse.Namespace) -> tuple[list, dict]:
    """Every action of the `picked` episodes judged by coach `name`; (judgments, timing and accounting)."""
    workflow = build_workflow(load_config(ROOT / "configs" / "demo.yaml"))  # MathChat, as the demo records it
    owners, contexts = [], []
    for i in picked:
        for ctx in episode_contexts(episodes[i], workflow):
            owners.append(i)
            contexts.append(ctx)
    t0 = time.perf_counter()
    with build_coach(coach_config(name, args), "mathchat") as runner:
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        scores = runner.score_many(contexts, progress=_progress(name, len(contexts)))
        seconds = time.perf_counter() - t0
        stats = runner.stats()
    out = []
    for i, ctx, s in zip(owners, contexts, scores, strict=True):
        raw = json.loads(s.raw_reply) if s.raw_reply.startswith('{"judge": "logprob"') else {}
        out.append(Judged(name, i, ctx.agent, bool(episodes[i].correct), s.score, raw.get("p_answer_correct"),
                          raw.get("mass")))  # fmt: skip
    fresh = stats["judgments"] - stats["cache_hits"]
    return out, {"seconds": seconds, "load_s": load_s, "fresh": fresh, "judgments": stats["judgments"], **stats}


def _progress(name: str, total: int):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    step = max(1, total // 10)

    def show(done: int, _: int) -> None:
        if done % step == 0 or done == total:
            print(f"  {name}: {done}/{total} judged, {time.perf_counter() - t0:.0f} s", flush=True)

    return show


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(a right episode's score > a wrong one's), ties counting half (Mann-Whitney); NaN without both kinds."""
    pos, neg = scores[labels], scores[~labels]
    if not len(pos) or not len(neg):
        return float("nan")
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


def per_episode(judged: list[Judged], agent: str, field: str = "score") -> dict[int, float]:
    """Episode -> the mean of `agent`'s scored actions' `field` in it (episodes where none was scored left out)."""
    values: dict[int, list[float]] = {}
    for j in judged:
        value = getattr(j, field)
        if j.agent == agent and value is not None:
            values.setdefault(j.episode, []).append(value)
    return {e: float(np.mean(v)) for e, v in values.items()}


def auc_interval(values: dict[int, float], correct: dict[int, bool], boot: int, seed: int) -> tuple[float, ...]:
    """(AUC, low, high, right, wrong): the point estimate and a 95% percentile-bootstrap interval over episodes."""
    eps = np.array(sorted(values))
    if not len(eps):
        return (float("nan"),) * 3 + (0, 0)
    x, y = np.array([values[e] for e in eps]), np.array([correct[e] for e in eps])
    rng = np.random.default_rng(seed)
    draws = [auc(x[p], y[p]) for p in (rng.integers(0, len(eps), len(eps)) for _ in range(boot))]
    lo, hi = np.nanpercentile(draws, [2.5, 97.5]) if np.isfinite(draws).any() else (float("nan"),) * 2
    return auc(x, y), float(lo), float(hi), int(y.sum()), int((~y).sum())


def fmt(a: tuple[float, ...]) -> str:
    return "-" if np.isnan(a[0]) else f"{a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}]"


def table(judged: list[Judged], timing: dict[str, dict], on: list[int], label: str, args: argparse.Namespace) -> None:
    """One row per coach, over the episodes `on`."""
    keep = set(on)
    print(f"\n{label}")
    print(f"| coach | episodes (right / wrong) | final agent AUC | {' | '.join(f'{a} AUC' for a in EARLIER)} "
          "| parse rate | judgments/s |")  # fmt: skip
    print("|---|---|---|" + "---|" * len(EARLIER) + "---|---|")
    for name, t in timing.items():
        mine = [j for j in judged if j.coach == name and j.episode in keep]
        if not mine or not keep <= {j.episode for j in mine}:
            continue
        correct = {j.episode: j.correct for j in mine}
        final = auc_interval(per_episode(mine, FINAL), correct, args.bootstrap, args.seed)
        earlier = [fmt(auc_interval(per_episode(mine, a), correct, args.bootstrap, args.seed)) for a in EARLIER]
        parsed = sum(j.score is not None for j in mine) / len(mine)
        speed = f"{t['fresh'] / t['seconds']:.3g}" if t["fresh"] else "(cached)"
        print(f"| {name} | {final[3]} / {final[4]} | {fmt(final)} | {' | '.join(earlier)} | {parsed:.0%} | {speed} |")
        if name == "logprob":
            answer = auc_interval(per_episode(mine, FINAL, "p_answer"), correct, args.bootstrap, args.seed)
            mass = np.mean([j.mass for j in mine if j.mass is not None])
            print(f"| logprob: P(ANSWER_CORRECT: 1) | | {fmt(answer)} | | | mean mass on 0..10 {mass:.2f} | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=Path, nargs="+", required=True, help="recorded MathChat episodes (JSONL)")
    ap.add_argument("--coaches", default="rubric,logprob,generate")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="the local coaches' model")
    ap.add_argument("--wrong-per-right", type=int, default=2, help="wrong episodes drawn per right one (seeded)")
    ap.add_argument("--generative", type=int, default=16, help="episodes the generative judge judges (a sample)")
    ap.add_argument("--max-tokens", type=int, default=256, help="the generative judge's coach.max_tokens")
    ap.add_argument("--concurrency", type=int, default=8, help="coach.concurrency: judgments batched together")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cache", action="store_true", help="judge everything anew (coach.cache: false)")
    ap.add_argument("--out", type=Path, help="write every judgment here (JSONL)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    episodes = [e for path in args.episodes for e in read_jsonl(path, Episode)]
    right = sum(bool(e.correct) for e in episodes)
    print(f"read {len(episodes)} episodes ({right} right, {len(episodes) - right} wrong); coach model {args.model}")
    everything = balanced(list(range(len(episodes))), episodes, right, args.wrong_per_right * right, args.seed)
    half = args.generative // 2
    sample = balanced(everything, episodes, half, args.generative - min(half, right), args.seed)
    judged: list[Judged] = []
    timing: dict[str, dict] = {}
    for name in args.coaches.split(","):
        picked = sample if name == "generate" else everything
        rows, timing[name] = judge_all(name, episodes, picked, args)
        judged += rows
        t = timing[name]
        print(f"{name}: {t['judgments']:.0f} judgments ({t['fresh']:.0f} uncached) in {t['seconds']:.0f} s "
              f"(model load {t['load_s']:.0f} s), {t['unscored']:.0f} unscored, {t['calls']:.0f} calls")  # fmt: skip
    if args.out:
        args.out.write_text("".join(json.dumps(j.__dict__) + "\n" for j in judged))
    table(judged, timing, everything, f"{len(everything)} episodes: every right one, wrong ones drawn", args)
    if "generate" in timing:
        table(judged, timing, sample, f"The generative judge's sample of {len(sample)} episodes", args)


if __name__ == "__main__":
    main()
