"""What the agents and the coach did, per agent and per step, from the run's files.

From the episodes (per agent): actions per episode, tool-use rate, response tokens, truncation rate, unscored
rate, code error and timeout rates. From metrics.jsonl: actions dropped from training by reason
(`agent/<group>/dropped_<why>`), the steps in which an agent trained on no action and why, and the coach's
accounting (`coach/*`, logged as running totals and turned into per-step amounts here).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from mappa.analysis.runs import score_of, step_of
from mappa.training.rewards import alike_groups, no_training_reason, untrained_groups
from mappa.types import Action, Episode

Series = dict[int, float]  # step -> value
AGENT_SERIES = (
    "actions_per_episode", "tool_use_rate", "response_tokens", "truncation_rate", "unscored_rate",
    "code_error_rate", "timeout_rate",
)  # fmt: skip
COACH_TOTALS = (
    "judgments",
    "calls",
    "retries",
    "failures",
    "unscored",
    "prompt_tokens",
    "completion_tokens",
    "cost_usd",
)


def _share(k: float, n: int) -> float:
    return k / n if n else 0.0


def _agent_step(actions: list[Action], episodes: int) -> dict[str, float]:
    ran = [a.exec_result for a in actions if a.exec_result is not None]
    return {
        "actions_per_episode": _share(len(actions), episodes),
        "tool_use_rate": _share(len(ran), len(actions)),
        "response_tokens": _share(sum(len(a.response_ids) for a in actions), len(actions)),
        "truncation_rate": _share(sum(a.truncated for a in actions), len(actions)),
        "unscored_rate": _share(sum(score_of(a) is None for a in actions), len(actions)),
        "code_error_rate": _share(sum(not r.ok and not r.timed_out for r in ran), len(ran)),
        "timeout_rate": _share(sum(r.timed_out for r in ran), len(ran)),
    }


def agent_behaviour(episodes: Sequence[Episode], agents: Sequence[str]) -> dict[str, dict[str, Series]]:
    """agent -> series name (AGENT_SERIES) -> step -> value."""
    by_step: dict[int, list[Episode]] = defaultdict(list)
    for e in episodes:
        by_step[step_of(e)].append(e)
    out: dict[str, dict[str, Series]] = {a: {k: {} for k in AGENT_SERIES} for a in agents}
    for step, eps in sorted(by_step.items()):
        for agent in agents:
            mine = [a for e in eps for a in e.actions if a.agent == agent]
            for k, v in _agent_step(mine, len(eps)).items():
                out[agent][k][step] = v
    return out


def training_rows(metrics: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a training step logged (not the eval or gain rows), the last one per step (after a resume)."""
    rows = {int(r["step"]): r for r in metrics if "step" in r and "time/rollout_s" in r}
    return [rows[s] for s in sorted(rows)]


def dropped(metrics: Sequence[dict[str, Any]]) -> dict[str, Series]:
    """`<group>/<reason>` -> step -> actions left out of the update for that reason."""
    out: dict[str, Series] = defaultdict(dict)
    for r in training_rows(metrics):
        for k, v in r.items():
            if k.startswith("agent/") and "/dropped_" in k:
                group, why = k.split("/")[1], k.rsplit("dropped_", 1)[1]
                out[f"{group}/{why}"][int(r["step"])] = float(v)
    return dict(out)


def _step_ranges(steps: Sequence[int]) -> str:
    """[1, 2, 3, 5] -> "steps 1-3, 5"."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"step{'s' if len(steps) > 1 else ''} {text}"


def untrained_lines(metrics: Sequence[dict[str, Any]], max_new_tokens: int | None = None) -> list[str]:
    """One line per agent (update group) whose weights did not move in some step, e.g. "verifier trained on no
    action at steps 1-2: 6 of 6 cut off at generation.max_new_tokens=128 (train.drop_truncated)", the counts
    summed over those steps, or "verifier not updated at step 2: the coach scored its kept actions alike (no
    spread)": the learning curves of such a step show weights that never moved."""
    steps: dict[str, list[int]] = defaultdict(list)
    alike: dict[str, list[int]] = defaultdict(list)
    drops: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in training_rows(metrics):
        for group, dropped in untrained_groups(r).items():
            steps[group].append(int(r["step"]))
            for why, n in dropped.items():
                drops[group][why] += n
        for group in alike_groups(r):
            alike[group].append(int(r["step"]))
    return [
        f"{g} trained on no action at {_step_ranges(s)}: {no_training_reason(drops[g], max_new_tokens)}"
        for g, s in steps.items()
    ] + [
        f"{g} not updated at {_step_ranges(s)}: the coach scored its kept actions alike (no spread)"
        for g, s in alike.items()
    ]


def coach_per_step(metrics: Sequence[dict[str, Any]]) -> dict[str, Series]:
    """coach total (COACH_TOTALS) -> step -> amount in that step. The coach logs running totals since it was
    built; a total that drops means a resumed run started counting again."""
    out: dict[str, Series] = {k: {} for k in COACH_TOTALS}
    last: dict[str, float] = {}
    for r in training_rows(metrics):
        for k in COACH_TOTALS:
            v = r.get(f"coach/{k}")
            if v is None:
                continue
            prev = last.get(k, 0.0)
            out[k][int(r["step"])] = float(v) - prev if v >= prev else float(v)
            last[k] = float(v)
    return {k: v for k, v in out.items() if v}


def metric_series(metrics: Sequence[dict[str, Any]], key: str) -> Series:
    """step -> value of one logged metric over the training steps."""
    return {int(r["step"]): float(r[key]) for r in training_rows(metrics) if key in r}
