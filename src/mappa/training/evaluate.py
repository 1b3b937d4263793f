"""Evaluation with a rule-based answer check, apart from training; results go to JSONL files.

Held-out tasks, `eval.samples` episodes per task at the eval temperature, no coach: accuracy is
`Episode.correct` (the rule-based check), never the coach's verdict. Metrics are `mappa.metrics.
episode_metrics` under `eval/`: the pooled accuracy, the accuracy per task source (`eval/aime2025/accuracy`),
and per agent tool use, response length and truncation.

Every evaluation samples from the same seed (`cfg.seed` by default), so two evaluations of one run differ
by their weights, not by their luck of the draw; `eval_gain` compares two of them with 95% intervals.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mappa.config import Config
from mappa.errors import MappaError
from mappa.metrics import Gain, accuracy_gain, clustered_accuracy, correct, episode_metrics
from mappa.paths import atomic_write
from mappa.protocols import Generator, ProgressFn, Runtime, SandboxLike, Workflow
from mappa.types import Episode, Task, read_jsonl


def eval_tasks(cfg: Config) -> list[Task]:
    """The configured held-out tasks (at most `eval.max_tasks`); none is a one-line MappaError."""
    from mappa.tasks import load_tasks

    tasks = load_tasks(cfg.tasks.eval, cfg.tasks, "eval", cfg.seed)
    if cfg.eval.max_tasks is not None:
        tasks = tasks[: cfg.eval.max_tasks]
    if not tasks:
        raise MappaError(f"tasks.eval: no evaluation tasks from {cfg.tasks.eval}")
    return tasks


def evaluate(
    cfg: Config,
    workflow: Workflow,
    generator: Generator,
    sandbox: SandboxLike,
    tasks: Sequence[Task],
    *,
    seed: int | None = None,
    progress: ProgressFn | None = None,
) -> tuple[dict[str, float], list[Episode]]:
    """Run `cfg.eval.samples` episodes of `workflow` per task at the eval temperature; no coach, rule-based accuracy.

    `workflow` is the one the run trains (a team handed in from Python included). `seed` defaults to `cfg.seed`;
    `progress(actions done, total)` as the episodes play.
    """
    from mappa.workflows.runtime import play

    sampling = cfg.generation.sampling(cfg.eval.temperature, cfg.eval.top_p)
    batch = [t for t in tasks for _ in range(cfg.eval.samples)]
    start = time.perf_counter()
    seed = cfg.seed if seed is None else seed
    episodes = play(
        workflow, batch, Runtime(generator, sandbox), sampling=sampling, seed=seed, progress=progress,
        keep_workspaces=cfg.sandbox.keep_workspaces,
    )  # fmt: skip
    return eval_metrics(episodes, workflow.agents, len(tasks), time.perf_counter() - start), episodes


def eval_metrics(episodes: Sequence[Episode], agents: Sequence[str], tasks: int, seconds: float) -> dict[str, float]:
    """An evaluation's metrics: `episode_metrics` under `eval/`, the accuracy's intervals counting tasks, how many
    tasks and how long. The one place they are put together, in this process or pooled over Ray workers."""
    metrics = episode_metrics(episodes, agents, "eval")
    metrics.update(accuracy_intervals(episodes))
    metrics["eval/tasks"] = float(tasks)
    metrics["eval/seconds"] = seconds
    return metrics


def accuracy_intervals(episodes: Sequence[Episode]) -> dict[str, float]:
    """The accuracy's 95% interval pooled and per task source, counting tasks, not episodes (several samples of one
    task are not independent: `mappa.metrics.clustered_accuracy`): `eval/accuracy_ci_low|high`, and the same under
    `eval/<source>/`."""
    out: dict[str, float] = {}
    by_source: dict[str, list[Episode]] = {}
    for e in episodes:
        by_source.setdefault(e.task.source, []).append(e)
    for key, group in [("eval", list(episodes)), *((f"eval/{s}", g) for s, g in sorted(by_source.items()))]:
        if group:
            _, (lo, hi), _ = clustered_accuracy(group)
            out[f"{key}/accuracy_ci_low"], out[f"{key}/accuracy_ci_high"] = lo, hi
    return out


def write_eval(out_dir: str | Path, tag: str, metrics: dict[str, float], episodes: Sequence[Episode]) -> None:
    """`out_dir/<tag>.jsonl` (episodes) and one line appended to `out_dir/summary.jsonl`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Rewritten whole when an evaluation is repeated (after a resume): a kill mid-write leaves the old file.
    atomic_write(out / f"{tag}.jsonl", (e.model_dump_json() + "\n" for e in episodes))
    with (out / "summary.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps({"tag": tag, **metrics}) + "\n")


def eval_gain(
    eval_dir: str | Path, before: str = "start", after: str = "final", hit: Callable[[Episode], bool] = correct
) -> Gain | None:
    """Accuracy of evaluation `after` minus `before` (their episode files in `eval_dir`), or the share of another
    outcome (`hit`, e.g. `mappa.metrics.answered`); None if one is missing."""
    paths = [Path(eval_dir) / f"{tag}.jsonl" for tag in (before, after)]
    if not all(p.is_file() for p in paths):
        return None
    return accuracy_gain(read_jsonl(paths[0], Episode), read_jsonl(paths[1], Episode), hit)


def gain_metrics(gain: Gain) -> dict[str, float]:
    """The gain as metrics (logged at the final step)."""
    return {
        "eval/gain": gain.gain,
        "eval/gain_ci_low": gain.gain_ci[0],
        "eval/gain_ci_high": gain.gain_ci[1],
        "eval/gain_episodes": float(gain.n_after),
    }


def policy_dir(checkpoint: Path) -> Path:
    """The weights directory of a checkpoint (`checkpoints/step-N` or its `policy/`)."""
    if not checkpoint.is_dir():
        raise MappaError(f"--checkpoint {checkpoint}: directory not found")
    for candidate in (checkpoint / "policy", checkpoint):
        if candidate.is_dir() and any(candidate.iterdir()):
            return candidate
    raise MappaError(f"--checkpoint {checkpoint}: not a checkpoint directory")
