"""Coaches from outside the package: a coach class, a factory, or a plain reward function (docs/your-team.md).

`coach.backend: "my_pkg.rewards:score"` names one of three things, told apart by `mappa.plugins.coach_kind`:
a class (built as `cls(coach_cfg)`), a factory `f(cfg) -> coach`, or a reward function `f(ctx) -> float | None`
(sync or async). A reward function becomes a `FunctionCoach`. Whatever the form, every score it returns is
checked here: a number outside 0-10 (or not a number) stops the run with one line naming the plug-in, since a
silently clipped or dropped reward would train on a bug.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable
from typing import Any

from mappa.config import CoachConfig
from mappa.errors import MappaError
from mappa.plugins import check_coach, load_object, qualified_name
from mappa.protocols import CallCounters, Coach
from mappa.types import CoachContext, CoachScore


def _checked(value: object, who: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MappaError(f"coach {who}: returned {str(value)[:40]!r}; a score must be a number 0-10 or None")
    if not 0.0 <= float(value) <= 10.0:
        raise MappaError(f"coach {who}: returned {float(value):g}; scores must lie in 0-10 (None: unscored)")
    return float(value)


def _failed(who: str, e: Exception) -> MappaError:
    return MappaError(f"coach {who}: raised {type(e).__name__}: {' '.join(str(e).split())[:200]}")


class FunctionCoach:
    """A reward function `f(ctx) -> 0-10 | None` as a coach: rule-based process rewards without a coach class.

    Sync functions run in a worker thread, so a slow one (running tests, say) does not hold up the others; the
    runner's `coach.concurrency` bounds how many run at once. Not cached: a rule costs nothing to re-run."""

    version = "function"
    cacheable = False

    def __init__(self, fn: Callable[[CoachContext], Any], name: str) -> None:
        self.fn, self.name, self.model = fn, name, ""
        self.counters = CallCounters()

    async def score(self, ctx: CoachContext) -> CoachScore:
        t0 = time.perf_counter()
        self.counters.calls += 1
        try:
            if inspect.iscoroutinefunction(self.fn):
                value = await self.fn(ctx)
            else:
                value = await asyncio.to_thread(self.fn, ctx)
        except Exception as e:  # the user's code: one line naming it, not a traceback from inside the runner
            raise _failed(self.name, e) from None
        score = _checked(value, self.name)
        return CoachScore(
            score=score, error=None if score is not None else "the reward function returned None",
            latency_s=time.perf_counter() - t0, backend=self.name,
        )  # fmt: skip

    async def aclose(self) -> None:
        return None


class CheckedCoach:
    """A plug-in coach object whose every score is checked (0-10, or None for unscored)."""

    def __init__(self, inner: Coach, name: str) -> None:
        self.inner, self.label = inner, name
        self.name = str(getattr(inner, "name", name))
        self.model = str(getattr(inner, "model", ""))
        self.version = str(getattr(inner, "version", "plugin"))
        self.cacheable = bool(getattr(inner, "cacheable", False))
        self.counters = getattr(inner, "counters", None) or CallCounters()

    async def score(self, ctx: CoachContext) -> CoachScore:
        try:
            result = await self.inner.score(ctx)
        except MappaError:
            raise
        except Exception as e:
            raise _failed(self.label, e) from None
        if not isinstance(result, CoachScore):
            raise MappaError(f"coach {self.label}: score() returned {type(result).__name__}, not a CoachScore")
        _checked(result.score, self.label)
        return result

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()


def plugin_coach(obj: Any, cfg: CoachConfig) -> Coach:
    """The coach a plug-in object stands for (`obj`: what `coach.backend` names, or an object passed from Python:
    a coach instance, a class, a factory or a reward function)."""
    if callable(getattr(obj, "score", None)) and not inspect.isclass(obj):
        return CheckedCoach(obj, qualified_name(obj))  # an instance handed in from Python
    kind = check_coach(obj, "coach.backend")
    name = qualified_name(obj)
    if kind == "function":
        return FunctionCoach(obj, name)
    coach = obj(cfg)
    if not callable(getattr(coach, "score", None)):
        raise MappaError(f"coach.backend: {name}(cfg) returned {type(coach).__name__}, which has no score method")
    return CheckedCoach(coach, name)


def load_plugin_coach(cfg: CoachConfig) -> Coach:
    return plugin_coach(load_object(cfg.backend, "coach.backend"), cfg)
