"""Serving engines side by side: mappa's ChatEngine vs transformers' continuous batching, on bench_coach's workload.

    .venv/bin/python bench/bench_engines.py [--model tiny-random] [--actions 64] [--max-tokens 64] [--rounds 2]

The same recorded MathChat actions as `bench_coach.py` are judged by the `openai` coach at concurrency 8
through `mappa serve`'s app (in-process, on loopback), once with each engine behind the app, `--rounds`
times in alternation (the best round of each counts, so a burst of load on a shared machine does not
decide the comparison):
  - mappa: `mappa.policy.chat_engine.ChatEngine` (the engine `mappa serve` runs);
  - transformers: the `ContinuousBatchingManager` behind `model.generate_batch` / `transformers serve
    --continuous-batching` (paged KV cache, requests join between steps), behind the same `chat` interface.
Both decode greedily (coach temperature 0) with the same token cap and return per-token logprobs, so
they do the same work. transformers' manager returns no top-k logprobs, so the expected score is off
for both (`--expected-score` also times mappa's side with top-20 logprobs, for reference).
Prints judgments/s of each and the ratio transformers / mappa.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
from typing import Any

import torch
from bench_coach import recorded_contexts, timed
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from mappa.config import CoachConfig
from mappa.policy.chat_engine import ChatEngine, ChatRequest, load_policy
from mappa.policy.models import load_base_model
from mappa.policy.policy import Generation, Policy
from mappa.serving.server import create_app, start_server
from mappa.types import CoachContext


def mappa_engine(policy: Policy, top_logprobs: bool) -> ChatEngine:
    engine = ChatEngine(policy, max_batch=8)
    engine.top_logprobs_ok = top_logprobs  # whether the coach asks for top-20 logprobs
    return engine


class TransformersEngine:
    """`ChatEngine`'s interface (`chat`, `token_text`, `stats`, `aclose`) over transformers' continuous batching."""

    def __init__(self, model: Any, policy: Policy, max_batch: int) -> None:
        self.policy = policy
        eos = list(policy.eos_ids)
        config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=policy.pad_id, max_new_tokens=64)
        cb = ContinuousBatchingConfig(return_logprobs=True, max_requests_per_batch=max_batch)
        self.manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        self.manager.start()
        self._ids = itertools.count()
        self.requests = 0
        self.top_logprobs_ok = False

    def token_text(self, token_id: int) -> str:
        return self.policy.tokenizer.decode([token_id])

    def stats(self) -> dict[str, float]:
        return {"requests": self.requests}

    async def chat(self, request: ChatRequest) -> Generation:
        if request.temperature != 0 or request.top_logprobs:
            raise ValueError("this comparison runs greedy decoding without top-k logprobs")
        if request.agent is not None:
            raise ValueError("transformers' manager serves the base model only (no per-agent adapters)")
        prompt = self.policy.chat_ids(request.messages)
        future: asyncio.Future = asyncio.get_running_loop().create_future()

        def deliver(out: Any) -> None:
            if out.is_finished() and not future.done():
                future.set_result(out)

        rid = f"r{next(self._ids)}"
        self.manager.register_result_handler(rid, deliver)
        self.manager.add_request(prompt, request_id=rid, max_new_tokens=request.max_tokens)
        out = await future
        if out.error:
            raise RuntimeError(out.error)
        self.requests += 1
        tokens = list(out.generated_tokens)
        return Generation(
            prompt_ids=tuple(prompt),
            response_ids=tuple(tokens),
            logprobs=tuple(out.logprobs),
            text=self.policy.tokenizer.decode(tokens, skip_special_tokens=True),
            truncated=not tokens or tokens[-1] not in self.policy.eos_ids,
        )

    async def aclose(self) -> None:
        self.manager.stop(block=True)


def judged(policy: Policy, name: str, contexts: list[CoachContext], max_tokens: int, engine: Any) -> float:
    """Seconds for the `openai` coach to judge `contexts` through the serve app with `engine` behind it."""
    server = start_server(create_app(policy, name, (), engine=engine))
    try:
        cfg = CoachConfig(
            backend="openai",
            model=name,
            base_url=server.url,
            api_key_env="MAPPA_BENCH_UNSET_KEY",
            max_tokens=max_tokens,
            timeout_s=600,
            concurrency=8,
            cache=False,
            expected_score=engine.top_logprobs_ok,
        )
        timed(cfg, contexts[:8])  # warm-up: allocator, kernels, the paged cache's first blocks
        return timed(cfg, contexts)[0]
    finally:
        server.stop()
        asyncio.run(engine.aclose())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random", help="tiny-random or smollm2-135m-instruct")
    ap.add_argument("--actions", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--expected-score", action="store_true", help="also time mappa with top-20 logprobs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    contexts = recorded_contexts(args.actions)
    policy = load_policy(args.model)
    model, _ = load_base_model(args.model)  # transformers' side: the plain model (no LoRA layers to bypass)
    times: dict[str, list[float]] = {"mappa": [], "transformers": []}
    for _ in range(args.rounds):
        times["mappa"].append(judged(policy, args.model, contexts, args.max_tokens, mappa_engine(policy, False)))
        theirs = TransformersEngine(model, policy, max_batch=8)
        times["transformers"].append(judged(policy, args.model, contexts, args.max_tokens, theirs))
    n = len(contexts)
    print(f"model {args.model}, {n} actions, max_tokens {args.max_tokens}, concurrency 8, {os.cpu_count()} cores, "
          f"torch threads {torch.get_num_threads()}, rounds {args.rounds}")  # fmt: skip
    for name, ts in times.items():
        print(f"{name:13s}: best {min(ts):7.2f} s = {n / min(ts):6.2f} judgments/s  (rounds: {', '.join(f'{t:.2f}' for t in ts)} s)")  # fmt: skip
    if args.expected_score:
        t = judged(policy, args.model, contexts, args.max_tokens, mappa_engine(policy, True))
        print(f"mappa, top-20 logprobs: {t:7.2f} s = {n / t:6.2f} judgments/s (transformers' manager has no top-k)")
    print(f"transformers / mappa judgments/s: {min(times['mappa']) / min(times['transformers']):.2f}x "
          "(>= 0.8 would let transformers' engine replace mappa's)")  # fmt: skip


if __name__ == "__main__":
    main()
