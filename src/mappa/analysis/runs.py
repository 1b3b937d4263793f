"""A run directory read back from its files, robustly: a killed run, a missing file or a torn line is a note,
never a crash; a directory that mappa did not make as a run is one MappaError line (`require_run_dir`).

    run = load_run("runs/demo-20261201-134907")
    run.episodes      training rollouts (episodes.jsonl, each with meta["step"])
    run.metrics       rows of metrics.jsonl
    run.evals         eval tag -> its episodes (eval/<tag>.jsonl), in step order: start, step-..., final
    run.probes        rows of probe.jsonl (`mappa probe`), when present
    run.notes         what was missing or skipped, one line each

Strata of a task (`stratum(task, dim)`): its source, its data type (`Task.meta["data_type"]`) and its difficulty
(`Task.meta["difficulty"]`, else `meta["level"]`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mappa.config import AnalysisConfig, config_from_dict
from mappa.errors import MappaError
from mappa.training.tracking import require_run_dir
from mappa.types import Action, Episode, Task

STRATA = ("source", "data_type", "difficulty")
PROBES = ("kl_base", "general_nll", "role_nll", "gsm8k_accuracy")


@dataclass
class RunData:
    """Everything a report reads from one run directory."""

    path: Path
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml as written (empty when missing)
    episodes: list[Episode] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: dict[str, list[Episode]] = field(default_factory=dict)
    eval_steps: dict[str, int] = field(default_factory=dict)  # eval tag -> the step it was taken at
    probes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def agents(self) -> list[str]:
        """Agents in order of play (first seen in the episodes; else from per-agent metric names)."""
        seen: dict[str, None] = {}
        for e in [*self.episodes, *(e for eps in self.evals.values() for e in eps)]:
            for a in e.actions:
                seen.setdefault(a.agent)
        if not seen:
            for row in self.metrics:
                for k in row:
                    if k.startswith("agent/") and k.count("/") == 2:
                        seen.setdefault(k.split("/")[1])
        return list(seen)

    @property
    def steps(self) -> list[int]:
        """Training steps with episodes, in order."""
        return sorted({int(e.meta.get("step", 0)) for e in self.episodes})

    @property
    def code_agents(self) -> set[str]:
        """Agents that ran code at least once in this run (the ones that can fail with 'no code')."""
        eps = [*self.episodes, *(e for v in self.evals.values() for e in v)]
        return {a.agent for e in eps for a in e.actions if a.exec_result is not None}

    def thresholds(self, overrides: Sequence[str] = ()) -> AnalysisConfig:
        """The `analysis:` section of the run's config (defaults when it has none), with `a.b=c` overrides."""
        from mappa.config import parse_override

        section = dict(self.config.get("analysis") or {})
        for text in overrides:
            key, value = parse_override(text)
            if not key.startswith("analysis."):
                raise MappaError(f"--set {text}: only analysis.* settings apply to a report")
            section[key.removeprefix("analysis.")] = value
        return config_from_dict({"analysis": section}, f"{self.path}/config.yaml analysis").analysis


def final_agent(episode: Episode) -> str | None:
    return episode.actions[-1].agent if episode.actions else None


def stratum(task: Task, dim: str) -> str | None:
    """The task's stratum along `dim` (one of STRATA), None when the task does not say."""
    if dim == "source":
        return task.source
    value = task.meta.get("data_type") if dim == "data_type" else task.meta.get("difficulty", task.meta.get("level"))
    return None if value is None else str(value)


def step_of(episode: Episode) -> int:
    return int(episode.meta.get("step", 0))


def score_of(action: Action) -> float | None:
    return action.coach.score if action.coach is not None else None


def scored_actions(episodes: Sequence[Episode]) -> Iterator[tuple[Episode, Action, float]]:
    """(episode, action, score) for every action the coach scored."""
    for e in episodes:
        for a in e.actions:
            s = score_of(a)
            if s is not None and math.isfinite(s):
                yield e, a, s


# ---------------------------------------------------------------------------------------------------- reading
def _json_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Non-empty lines of a JSONL file with their line numbers (the callers skip torn ones and say so)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, start=1):
        if line.strip():
            yield i, line


def _read_episodes(path: Path, notes: list[str]) -> list[Episode]:
    out, bad = [], []
    for i, line in _json_lines(path):
        try:
            out.append(Episode.model_validate_json(line))
        except ValidationError:
            bad.append(i)
    if bad:
        notes.append(f"{path.name}: skipped {len(bad)} unreadable line(s) (first: line {bad[0]}; a killed write?)")
    return out


def _read_rows(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    out, bad = [], 0
    for _, line in _json_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            out.append(row)
        else:
            bad += 1
    if bad:
        notes.append(f"{path.name}: skipped {bad} unreadable line(s)")
    return out


def _valid_probe(row: dict[str, Any]) -> bool:
    try:
        return (
            isinstance(row["step"], int)
            and isinstance(row["agent"], str)
            and row["probe"] in PROBES
            and math.isfinite(float(row["value"]))
        )
    except (KeyError, TypeError, ValueError):
        return False


def _read_evals(run: RunData) -> None:
    eval_dir = run.path / "eval"
    if not eval_dir.is_dir():
        run.notes.append("no eval/ directory: no held-out evaluation yet")
        return
    summary = eval_dir / "summary.jsonl"
    rows = _read_rows(summary, run.notes) if summary.is_file() else []
    steps = {str(r["tag"]): int(r.get("step", 0)) for r in rows if "tag" in r}
    tags = [p.stem for p in eval_dir.glob("*.jsonl") if p.stem != "summary"]
    order = {"start": -1, "final": 10**9}
    for tag in sorted(tags, key=lambda t: (steps.get(t, order.get(t, 0)), order.get(t, 0), t)):
        episodes = _read_episodes(eval_dir / f"{tag}.jsonl", run.notes)
        if episodes:
            run.evals[tag] = episodes
            run.eval_steps[tag] = steps.get(tag, 0 if tag == "start" else max(steps.values(), default=0))
    if "final" not in run.evals:
        run.notes.append("no final evaluation (eval/final.jsonl): the run did not finish")


def load_run(path: str | Path) -> RunData:
    """Read a run directory; a missing or foreign directory is a one-line MappaError, a partial run is notes."""
    path = require_run_dir(path)
    run = RunData(path)
    cfg = path / "config.yaml"
    if cfg.is_file():
        try:
            loaded = yaml.safe_load(cfg.read_text(encoding="utf-8"))
            run.config = loaded if isinstance(loaded, dict) else {}
        except yaml.YAMLError:
            run.notes.append("config.yaml: unreadable YAML; default thresholds used")
    else:
        run.notes.append("no config.yaml")
    eps = path / "episodes.jsonl"
    if eps.is_file():
        run.episodes = _read_episodes(eps, run.notes)
    else:
        run.notes.append("no episodes.jsonl: no training step finished yet")
    if (path / "metrics.jsonl").is_file():
        run.metrics = _read_rows(path / "metrics.jsonl", run.notes)
    _read_evals(run)
    if (path / "probe.jsonl").is_file():
        rows = _read_rows(path / "probe.jsonl", run.notes)
        run.probes = [r for r in rows if _valid_probe(r)]
        if len(run.probes) < len(rows):
            run.notes.append(
                f"probe.jsonl: skipped {len(rows) - len(run.probes)} row(s) without step/agent/probe/value"
            )
    return run


def load_runs(paths: Sequence[str | Path]) -> list[RunData]:
    if not paths:
        raise MappaError("give at least one run directory")
    return [load_run(p) for p in paths]
