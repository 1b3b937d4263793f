"""Coaches from outside the package: a coach class, instance or factory, or a plain reward function.

`coach.backend: "my_pkg.rewards:score"` (or an object handed to `mappa.train`) is one of four things, told apart
by `mappa.plugins.coach_kind` from what it declares: a class (built as `cls(coach_cfg)`), an object with a
`score` method (used as it is), a factory `f(cfg: CoachConfig) -> coach`, or a reward function
`f(ctx) -> score` (sync or async), which becomes a `FunctionCoach`. Whatever the form, every score it returns is
checked here: a number outside 0-10 (or not a number) stops the run with one line naming the plug-in, since a
silently clipped or dropped reward would train on a bug. An exception raised in the plug-in's code stops the run
with one line naming the user's file and line (`mappa.plugins.user_code_error`).
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
from mappa.plugins import check_coach, load_object, qualified_name, user_code_error
from mappa.protocols import CallCounters, Coach
from mappa.types import CoachContext, CoachScore

MAX_WHY_CHARS = 4000  # a reward function's rationale is kept whole up to this (it may quote agent output)
_FACTORY_HINT = "; a factory declares its parameter as cfg: CoachConfig (docs/your-team.md)"


def _checked(value: object, who: str) -> float | None:
    if value is None:
        return None
    if callable(getattr(value, "score", None)):
        raise MappaError(
            f"coach {who}: returned a coach ({type(value).__name__}) where a reward function returns a score, "
            f"0-10 or None{_FACTORY_HINT}"
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MappaError(f"coach {who}: returned {str(value)[:40]!r}; a score must be a number 0-10 or None")
    if not 0.0 <= float(value) <= 10.0:
        raise MappaError(f"coach {who}: returned {float(value):g}; scores must lie in 0-10 (None: unscored)")
    return float(value)


def _score_and_why(value: object, who: str) -> tuple[float | None, str]:
    """A reward function's return value: a score, or `(score, why)` whose `why` blame and trace show."""
    if not isinstance(value, tuple | list):
        return _checked(value, who), ""
    if len(value) != 2 or not isinstance(value[1], str):
        what = f"a tuple of {len(value)} items" if len(value) != 2 else f"(score, {type(value[1]).__name__})"
        raise MappaError(f"coach {who}: returned {what}; return a score (0-10 or None) or (score, why) with why a str")
    return _checked(value[0], who), value[1][:MAX_WHY_CHARS]


def _failed(who: str, e: Exception, role: str) -> MappaError:
    """The one line for an exception in the plug-in: at its frame in the user's file, else by the plug-in's name."""
    located = user_code_error(e, role)
    if located is None:
        return MappaError(f"coach {who}: raised {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    if isinstance(e, AttributeError) and isinstance(e.obj, CoachContext) and e.name in CoachConfig.model_fields:
        # a factory taken for a reward function: it was called with the action's context, not the coach's settings
        return located.during("", f" (a reward function is called with one CoachContext{_FACTORY_HINT})")
    return located


class FunctionCoach:
    """A reward function `f(ctx) -> score` as a coach: rule-based process rewards without a coach class. The
    score is 0-10, or None for unscored; `(score, why)` also gives the rationale that blame and trace show.

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
        except MappaError:  # raised on purpose, with its own one line
            raise
        except Exception as e:  # the user's code: one line naming its file and line; the traceback stays on `e`
            raise _failed(self.name, e, "reward function") from e
        score, why = _score_and_why(value, self.name)
        unscored = "the reward function returned None" + (f": {' '.join(why.split())[:200]}" if why else "")
        return CoachScore(
            score=score, rationale=why, error=None if score is not None else unscored,
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
            raise _failed(self.label, e, "coach") from e
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
    a coach instance, a class, a factory or a reward function; `mappa.plugins.coach_kind`)."""
    kind = check_coach(obj, "coach.backend")
    name = qualified_name(obj)
    if kind == "instance":
        return CheckedCoach(obj, name)
    if kind == "function":
        return FunctionCoach(obj, name)
    try:
        coach = obj(cfg)
    except MappaError:
        raise
    except Exception as e:
        raise _failed(name, e, "coach") from e
    if not callable(getattr(coach, "score", None)):
        raise MappaError(f"coach.backend: {name}(cfg) returned {type(coach).__name__}, which has no score method")
    return CheckedCoach(coach, name)


def load_plugin_coach(cfg: CoachConfig) -> Coach:
    return plugin_coach(load_object(cfg.backend, "coach.backend"), cfg)
