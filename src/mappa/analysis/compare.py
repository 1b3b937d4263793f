"""Several runs side by side: final metrics with 95% intervals and the difference from the first run.

Per run: steps done, the first and the last held-out evaluation (Wilson intervals), the run's own gain between
them (`mappa.metrics.accuracy_gain`: intervals over tasks, paired by task when both hold the same tasks), the last
step's train success and mean coach score. Then each run's last evaluation minus the first run's, paired by task
when the two evaluated the same tasks (same seed and task set), else unpaired.
`differs` names the config settings in which a run departs from the first one; `coach` names where the run's
per-action scores came from (rules, outcome only, or which LLM), from its config.

Runs whose settings differ only in the seed are one *arm* (`compare_arms`). Each arm's final accuracy minus the
first arm's is given two ways: over seeds (one paired gain per seed, then a Student t interval on seeds - 1
degrees of freedom), which holds the variation between training seeds, and over tasks x seeds pooled (each
(seed, task) one unit, its samples together), which treats the tasks as independent and so leaves that variation
out. With one seed only
the second exists, and `ArmGain.one_seed` says so.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mappa.analysis.curves import Point, accuracy_point, final_eval, score_curves, train_curve
from mappa.analysis.runs import RunData
from mappa.analysis.stats import Estimate, t_interval, welch_interval
from mappa.config import config_from_dict
from mappa.errors import MappaError
from mappa.metrics import Gain, accuracy_gain, correct
from mappa.types import Episode

IGNORED = {"run_dir", "name"}  # settings that differ between any two runs
ONE_SEED_WARNING = (
    "one seed per arm: the interval is over tasks only and leaves out the variation between training seeds "
    "(often the largest source of noise in RL); train each arm on more seeds (seed=43, 44, ...) to include it"
)


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
    coach: str = ""  # where the run's per-action scores came from (`coach_label`)
    seed: int | None = None


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
        coach=coach_label(run.config),
        seed=run_seed(run),
    )


def compare_runs(runs: Sequence[RunData]) -> list[RunSummary]:
    """One summary per run, the first run being the reference of every difference."""
    return [summarise(run, runs[0] if i else None) for i, run in enumerate(runs)]


def coach_label(config: dict[str, Any]) -> str:
    """Where a run's per-action scores came from, in words: the rubric's rules are not an AI coach, and a figure
    from an LLM coach depends on which model judged."""
    s = _settings(config)
    backend, model = s.get("coach.backend", "rubric"), s.get("coach.model") or ""
    if backend == "rubric":
        return "rule-based process rewards (rubric coach)"
    if backend == "outcome":
        return "outcome-only rewards (10/0 on the final answer, no coach)"
    if backend == "openai":
        where = s.get("coach.base_url") or "api.openai.com"
        return f"LLM coach {model or '(no model named)'} (OpenAI-compatible endpoint {where})"
    if backend == "local":
        return f"LLM coach {model or 'the policy base model'} (in-process)"
    return f"coach {backend} {model}".strip()


def run_seed(run: RunData) -> int | None:
    seed = _settings(run.config).get("seed")
    return int(seed) if isinstance(seed, int) else None


@dataclass(frozen=True)
class Arm:
    """Runs whose settings differ only in the seed."""

    name: str
    coach: str
    runs: list[RunData] = field(default_factory=list)
    differs: str = ""  # settings that differ from the first arm

    def finals(self) -> dict[int, list[Episode]]:
        """Seed -> the last evaluation's episodes (several runs of one seed pooled; runs without a seed or an
        evaluation left out), task ids prefixed with the seed: each seed draws its own held-out tasks."""
        out: dict[int, list[Episode]] = {}
        for i, run in enumerate(self.runs):
            last = final_eval(run)
            if last is None:
                continue
            seed = run_seed(run)
            out.setdefault(seed if seed is not None else -1 - i, []).extend(keyed_by_seed(last[1], seed))
        return out


def per_seed_accuracy(finals: Mapping[int, Sequence[Episode]]) -> dict[int, float]:
    return {s: _accuracy(eps) for s, eps in sorted(finals.items())}


def keyed_by_seed(episodes: Sequence[Episode], seed: int | None) -> list[Episode]:
    """Episodes with the seed in their task id, so that pairs across arms are (seed, task)."""
    return [
        e.model_copy(update={"task": e.task.model_copy(update={"id": f"seed{seed}/{e.task.id}"})}) for e in episodes
    ]


def _arm_key(config: dict[str, Any]) -> str:
    s = {k: v for k, v in _settings(config).items() if k not in IGNORED and k != "seed"}
    return json.dumps(s, sort_keys=True, default=str)


def group_arms(runs: Sequence[RunData]) -> list[Arm]:
    """Runs grouped by every setting but the seed (and name, directory), in the order first seen. An arm is named
    after its first run, less a trailing seed (`process-seed42` -> `process`)."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(_arm_key(run.config), []).append(run)
    arms = []
    for members in groups.values():
        name = re.sub(r"[-_.]?seed[-_]?\d+$", "", members[0].name) or members[0].name
        diff = config_diff(runs[0].config, members[0].config)
        differs = ", ".join(x for x in diff.split(", ") if x and not x.startswith("seed="))
        arms.append(Arm(name, coach_label(members[0].config), list(members), differs))
    return arms


@dataclass(frozen=True)
class ArmGain:
    """An arm's final held-out accuracy minus the reference arm's: over seeds, and over tasks x seeds pooled."""

    seeds: tuple[int, ...]  # the seeds the over-seeds figure rests on
    paired: bool  # one gain per seed both arms ran; else the arms' per-seed accuracies compared unpaired (Welch)
    per_seed: tuple[float, ...]  # paired: the gain of each seed
    over_seeds: Estimate  # mean gain with a t interval over seeds (NaN interval with one seed)
    per_task: (
        Gain | None
    )  # pooled over (seed, task) units, paired when both arms hold the same: seed variation left out

    @property
    def one_seed(self) -> bool:
        """No interval over seeds: a single seed (or, unpaired, a single seed in one arm) has no spread."""
        return not math.isfinite(self.over_seeds[1][0])


def _accuracy(episodes: Sequence[Episode], hit: Callable[[Episode], bool] = correct) -> float:
    return sum(hit(e) for e in episodes) / len(episodes) if episodes else float("nan")


def seed_gain(
    reference: Mapping[int, Sequence[Episode]],
    other: Mapping[int, Sequence[Episode]],
    hit: Callable[[Episode], bool] = correct,
) -> ArmGain:
    """`other` minus `reference`, each a seed -> final-evaluation episodes map (task ids keyed by seed), in the
    share of episodes that are right (or `hit`, e.g. `mappa.metrics.answered`).

    Paired over the seeds both ran when there are two or more of them: the spread of the per-seed gains holds
    the seed-to-seed variation and the task sampling within each seed, so the t interval counts both. Else
    unpaired over each arm's own seeds (Welch)."""
    common = sorted(set(reference) & set(other))
    pooled_ref = [e for s in sorted(reference) for e in reference[s]]
    pooled_other = [e for s in sorted(other) for e in other[s]]
    per_task = accuracy_gain(pooled_ref, pooled_other, hit) if pooled_ref and pooled_other else None
    if len(common) >= 2 or (common and (len(reference) < 2 or len(other) < 2)):
        gains = tuple(_accuracy(other[s], hit) - _accuracy(reference[s], hit) for s in common)
        return ArmGain(tuple(common), True, gains, t_interval(gains), per_task)
    a = [_accuracy(reference[s], hit) for s in sorted(reference)]
    b = [_accuracy(other[s], hit) for s in sorted(other)]
    seeds = tuple(sorted(set(reference) | set(other)))
    return ArmGain(seeds, False, (), welch_interval(a, b), per_task)


def compare_arms(runs: Sequence[RunData]) -> list[tuple[Arm, ArmGain | None]]:
    """Each arm with its gain over the first arm (None for the first arm itself)."""
    arms = group_arms(runs)
    ref = arms[0].finals() if arms else {}
    out: list[tuple[Arm, ArmGain | None]] = [(arms[0], None)] if arms else []
    for arm in arms[1:]:
        finals = arm.finals()
        out.append((arm, seed_gain(ref, finals) if ref and finals else None))
    return out


def over_seeds_text(g: ArmGain) -> str:
    """The gain with its interval over seeds, and how many seeds it rests on."""
    m, (lo, hi) = g.over_seeds
    if g.one_seed:
        return f"{m * 100:+.1f} pp (one seed: no interval over seeds)"
    how = "t on per-seed paired gains" if g.paired else "Welch t on per-seed accuracies"
    return f"{m * 100:+.1f} pp, 95% CI [{lo * 100:+.1f}, {hi * 100:+.1f}] over {len(g.seeds)} seeds ({how})"


def per_task_text(g: ArmGain) -> str:
    """The gain with its interval over tasks x seeds pooled: every (seed, task) as if independent."""
    p = g.per_task
    if p is None:
        return "-"
    lo, hi = p.gain_ci
    how = f"{p.method}: {p.improved} better, {p.worsened} worse" if p.paired else p.method
    return (
        f"{p.gain * 100:+.1f} pp [{lo * 100:+.1f}, {hi * 100:+.1f}] over {p.tasks} tasks x seeds, "
        f"{p.n_after} episodes ({how}; seed variation left out)"
    )
