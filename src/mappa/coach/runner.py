"""`CoachRunner`: a coach backend run over many contexts (concurrency limit, judgment cache, accounting, score caps);
`COACHES`, the backends by name; `build_coach`, the configured backend in its runner.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from mappa.coach.cache import JudgmentCache, cache_key, context_hash
from mappa.coach.caps import apply_caps
from mappa.coach.judge import REQUEST_FAILED, superseded
from mappa.coach.plugin import load_plugin_coach, plugin_coach
from mappa.coach.prompts import Template, readable_context, template_for
from mappa.config import CoachConfig
from mappa.protocols import CallCounters, Coach, ProgressFn
from mappa.types import CoachContext, CoachScore

if TYPE_CHECKING:
    from mappa.policy.policy import Policy


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


T = TypeVar("T")


class CoachRunner:
    """Runs a coach over many contexts: concurrency limit, cache, accounting; sync and async entry points.

    The sync entry point runs the async work on a private event loop in a daemon thread, so it
    works the same from scripts, from the trainer, and from code that already runs an event loop.
    """

    def __init__(self, coach: Coach, cfg: CoachConfig, cache: JudgmentCache | None = None) -> None:
        self.coach = coach
        self.cfg = cfg
        self.cache = cache
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sem: asyncio.Semaphore | None = None
        self._inflight: dict[str, asyncio.Future[CoachScore]] = {}
        self.reset_stats()

    # -- accounting -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self._judgments = 0
        self._cache_hits = 0
        self._unscored = 0
        self._truncated = 0  # judgments whose prompt left out part of the agent's input
        self._latencies: list[float] = []
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._base = CallCounters(**vars(self.coach.counters))

    def stats(self) -> dict[str, float]:
        """Accounting since construction or the last `reset_stats()` (log it as `coach/<key>`)."""
        c, b = self.coach.counters, self._base
        replies = c.replies - b.replies
        cut = c.cut_replies - b.cut_replies
        cost = (
            self._prompt_tokens * self.cfg.price_prompt_per_m
            + self._completion_tokens * self.cfg.price_completion_per_m
        ) / 1e6
        return {
            "judgments": float(self._judgments),
            "calls": float(c.calls - b.calls),
            "cache_hits": float(self._cache_hits),
            "retries": float(c.retries - b.retries),
            "failures": float(c.failures - b.failures),
            "unscored": float(self._unscored),
            "unscored_rate": self._unscored / self._judgments if self._judgments else 0.0,
            "replies": float(replies),
            "cut_replies": float(cut),
            "cut_rate": cut / replies if replies else 0.0,
            "replies_without_logprobs": float(c.replies_without_logprobs - b.replies_without_logprobs),
            "truncated_contexts": float(self._truncated),
            "latency_p50_s": _percentile(self._latencies, 0.5),
            "latency_p95_s": _percentile(self._latencies, 0.95),
            "prompt_tokens": float(self._prompt_tokens),
            "completion_tokens": float(self._completion_tokens),
            "cost_usd": cost,
        }

    # -- scoring ----------------------------------------------------------------------------
    def _key(self, ctx: CoachContext) -> tuple[str, str]:
        # Keyed on the context, never on the prompt: the prompt's fence token is random per judgment
        # (mappa.coach.prompts), and the same context must find the same judgment in a replay.
        h = context_hash(ctx)
        # The variant keeps judgments made with different decoding settings apart.
        cfg = self.cfg
        variant = f"t={cfg.temperature:g};es={int(cfg.expected_score)};mt={cfg.max_tokens}"
        if cfg.thinking_budget is not None or cfg.reasoning_effort:  # unset: the keys judgments had before
            variant += f";think={cfg.thinking_budget};effort={cfg.reasoning_effort}"
        # A budget changes what the coach is shown: the backend's effective one (its default when unset).
        context = getattr(self.coach, "context_tokens", None) or cfg.max_context_tokens
        if context is not None:
            variant += f";ctx={context};tok={cfg.tokenizer}"
        return cache_key(self.coach.name, self.coach.model, f"{self.coach.version};{variant}", h), h

    def _count(self, result: CoachScore) -> None:
        self._judgments += 1
        self._unscored += result.score is None
        self._truncated += result.truncated_inputs > 0

    def _count_hit(self, hit: CoachScore) -> CoachScore:
        self._count(hit)
        self._cache_hits += 1
        return hit.model_copy(update={"cached": True})

    async def score_one(self, ctx: CoachContext) -> CoachScore:
        """One judgment (from the cache when there) of the context made readable, within its score caps."""
        ctx = readable_context(ctx)
        return apply_caps(ctx, await self._score_cached(ctx))

    async def _score_cached(self, ctx: CoachContext) -> CoachScore:
        if self.cache is None:
            return await self._score_uncached(ctx, "", "")
        key, h = self._key(ctx)
        hit = self.cache.get(key)
        if hit is not None and not superseded(ctx, hit):
            return self._count_hit(hit)
        # The same context twice in flight (e.g. two samples with identical output): pay once.
        pending = self._inflight.get(key)
        if pending is not None:
            return self._count_hit(await asyncio.shield(pending))
        future: asyncio.Future[CoachScore] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            result = await self._score_uncached(ctx, key, h)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved here: waiters re-raise it, nobody else must
            raise
        else:
            future.set_result(result)
        finally:
            self._inflight.pop(key, None)
        return result

    async def _score_uncached(self, ctx: CoachContext, key: str, h: str) -> CoachScore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.cfg.concurrency)
        async with self._sem:
            result = await self.coach.score(ctx)
        self._count(result)
        self._latencies.append(result.latency_s)
        self._prompt_tokens += result.prompt_tokens
        self._completion_tokens += result.completion_tokens
        failed = result.error is not None and result.error.startswith(REQUEST_FAILED)
        if self.cache is not None and not failed:
            self.cache.put(
                key, result, backend=self.coach.name, model=self.coach.model, template_version=self.coach.version,
                ctx_hash=h,
            )  # fmt: skip
        return result

    async def score_many_async(
        self, contexts: Sequence[CoachContext], progress: ProgressFn | None = None
    ) -> list[CoachScore]:
        done = 0

        async def one(ctx: CoachContext) -> CoachScore:
            nonlocal done
            r = await self.score_one(ctx)
            done += 1
            if progress is not None:
                progress(done, len(contexts))
            return r

        return list(await asyncio.gather(*(one(c) for c in contexts)))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="mappa-coach", daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def score_many(self, contexts: Sequence[CoachContext], progress: ProgressFn | None = None) -> list[CoachScore]:
        """Score every context (in order); unscored ones come back with `score=None` and an error.

        `progress(done, total)` is called from the coach's thread after each judgment.
        """
        if not contexts:
            return []
        return self._run(self.score_many_async(contexts, progress))

    def __call__(self, contexts: Sequence[CoachContext]) -> list[CoachScore]:
        """A runner is itself the `scorer` callable that `run_episodes` takes."""
        return self.score_many(contexts)

    def close(self) -> None:
        if self._loop is not None:
            loop = self._loop
            # Judgments still in flight (a run interrupted mid-step) are cancelled and awaited first: a task left
            # pending in a closed loop is reported on stderr after the run's last line.
            asyncio.run_coroutine_threadsafe(_cancel_others(), loop).result()
            asyncio.run_coroutine_threadsafe(self.coach.aclose(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            loop.close()
            self._loop = None
            self._sem = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def __enter__(self) -> CoachRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_others() -> None:
    """Cancel every other task of the running loop and wait until they have ended."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def _rubric(cfg: CoachConfig, template: Template, policy: Policy | None) -> Coach:
    from mappa.coach.rubric import rubric_coach

    return rubric_coach()


def _outcome(cfg: CoachConfig, template: Template, policy: Policy | None) -> Coach:
    from mappa.coach.outcome import outcome_coach

    return outcome_coach()


def _openai(cfg: CoachConfig, template: Template, policy: Policy | None) -> Coach:
    from mappa.coach.openai_backend import OpenAICoach

    return OpenAICoach(cfg, template)


def _local(cfg: CoachConfig, template: Template, policy: Policy | None) -> Coach:
    if cfg.judge == "logprob":
        from mappa.coach.logprob_judge import LogprobCoach

        return LogprobCoach(cfg, template, policy)
    from mappa.coach.local import LocalCoach

    return LocalCoach(cfg, template, policy)


# Backend name -> factory(cfg, template, policy); the names are `CoachConfig.backend`'s (a test checks both agree).
# Imports are lazy: the rubric coach needs no torch or openai.
COACHES: dict[str, Callable[[CoachConfig, Template, Policy | None], Coach]] = {
    "rubric": _rubric,
    "outcome": _outcome,
    "openai": _openai,
    "local": _local,
}


def build_coach(cfg: CoachConfig, workflow: str, policy: Policy | None = None, plugin: Any = None) -> CoachRunner:
    """The configured coach for `workflow`, wrapped in a runner (cache and accounting included).

    `policy` lets the `local` backend reuse an already loaded model (its base weights, adapters
    disabled) when `coach.model` is empty. `plugin`: a coach handed in from Python (an instance, class, factory
    or reward function, `mappa.coach.plugin`), used instead of `cfg.backend`; a `cfg.backend` that is an import
    path is loaded the same way.
    """
    if plugin is not None:
        coach = plugin_coach(plugin, cfg)
    elif cfg.is_plugin:
        coach = load_plugin_coach(cfg)
    else:
        coach = COACHES[cfg.backend](cfg, template_for(cfg.template, workflow), policy)
    cache = JudgmentCache(cfg.cache_path or None) if cfg.cache and coach.cacheable else None
    return CoachRunner(coach, cfg, cache)
