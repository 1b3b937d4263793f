"""Several runs side by side: final metrics with 95% intervals and the difference from the first run.

Per run: steps done, the first and the last held-out evaluation (Wilson intervals), the run's own gain between
them (paired by task when both hold the same episodes, `mappa.metrics.accuracy_gain`), the last step's train
success and mean coach score. Then each run's last evaluation minus the first run's, paired by task when the
two evaluated the same tasks the same number of times (same seed and task set), else unpaired.
`differs` names the config settings in which a run departs from the first one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mappa.analysis.curves import Point, accuracy_point, final_eval, score_curves, train_curve
from mappa.analysis.runs import RunData
from mappa.config import config_from_dict
from mappa.errors import MappaError
from mappa.metrics import Gain, accuracy_gain

IGNORED = {"run_dir", "name"}  # settings that differ between any two runs


@dataclass(frozen=True)
class RunSummary:
    name: str
    path: str
    steps: int  # training steps with episodes
    start: Point | None  # the first evaluation
    final: Point | None  # the last evaluation
    final_tag: str
    gain: Gain | None  # last evaluation minus first, when the run has two
    train: Point | None  # the last step's train success
    score: float | None  # the last step's mean coach score over all agents
    vs_first: Gain | None  # this run's last evaluation minus the first run's (None for the first run)
    differs: str  # config settings that differ from the first run


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """Every setting of a config.yaml, defaults filled in: a run written before a setting existed holds its
    default (as it ran), not a difference. A config this version cannot read is compared as written."""
    try:
        return _flatten(config_from_dict(config).model_dump(mode="json"))
    except MappaError:
        return _flatten(config)


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    """`key=value` for every setting of b that differs from a (run names and directories left out)."""
    fa, fb = _settings(a), _settings(b)
    keys = sorted(k for k in set(fa) | set(fb) if k not in IGNORED and fa.get(k) != fb.get(k))
    return ", ".join(f"{k}={fb.get(k)}" for k in keys)


def summarise(run: RunData, first: RunData | None) -> RunSummary:
    last = final_eval(run)
    ref = final_eval(first) if first is not None else None
    tags = list(run.evals)
    gain = accuracy_gain(run.evals[tags[0]], last[1]) if last is not None and len(tags) >= 2 else None
    train = train_curve(run.episodes)
    scores = score_curves([e for e in run.episodes if run.steps and e.meta.get("step") == run.steps[-1]])
    all_scores = [p[0] * p[2] for c in scores.values() for p in c.values()]
    n_scores = sum(p[2] for c in scores.values() for p in c.values())
    return RunSummary(
        name=run.name,
        path=str(run.path),
        steps=len(run.steps),
        start=accuracy_point(run.evals[tags[0]]) if tags else None,
        final=accuracy_point(last[1]) if last is not None else None,
        final_tag=last[0] if last is not None else "",
        gain=gain,
        train=train[max(train)] if train else None,
        score=sum(all_scores) / n_scores if n_scores else None,
        vs_first=accuracy_gain(ref[1], last[1]) if ref is not None and last is not None else None,
        differs=config_diff(first.config, run.config) if first is not None else "",
    )


def compare_runs(runs: Sequence[RunData]) -> list[RunSummary]:
    """One summary per run, the first run being the reference of every difference."""
    return [summarise(run, runs[0] if i else None) for i, run in enumerate(runs)]
