"""`mappa eval CONFIG [--checkpoint DIR] [--out DIR]`: evaluate the base model or a trained checkpoint.

Also the console table of an evaluation (`print_eval`), shared with `mappa train`: per agent tool use,
response length, truncation; per task source and pooled, the accuracy with its Wilson 95% interval; on tabular
tasks DSBench's gap and reference fraction, and the paper's fair figures beside them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mappa.cli.confinement import print_confinement
from mappa.config import Config
from mappa.errors import MappaError
from mappa.metrics import PAPER_FIGURES, sources, wilson_interval
from mappa.progress import ProgressLines
from mappa.protocols import ProgressFn
from mappa.training.evaluate import eval_tasks, evaluate, policy_dir, write_eval
from mappa.training.tracking import run_dir_problem

COLUMNS = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


@contextmanager
def action_bar(console: Console, label: str) -> Iterator[ProgressFn]:
    """A transient bar of actions played, as a `(done, total)` progress callback; in a log that is not a terminal,
    a few lines (`mappa.progress`)."""
    if not console.is_terminal:
        lines = ProgressLines(
            lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True), unit="actions"
        )
        lines.start(label)
        yield lines
        return
    with Progress(*COLUMNS, console=console, transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def pct_ci(metrics: dict[str, float], key: str) -> str:
    """`20.3% [12.3, 31.7]`: the accuracy under `key` with its 95% interval in percent: the one counting tasks
    (`mappa.training.evaluate.accuracy_intervals`) where the metrics hold it, else Wilson over the episodes."""
    p, n = metrics[f"{key}/accuracy"], metrics[f"{key}/episodes"]
    if f"{key}/accuracy_ci_low" not in metrics:
        return share_ci(p, n)
    lo, hi = metrics[f"{key}/accuracy_ci_low"], metrics[f"{key}/accuracy_ci_high"]
    return f"{p:.1%} [{lo * 100:.1f}, {hi * 100:.1f}]"


def share_ci(p: float, n: float) -> str:
    """`20.3% [12.3, 31.7]`: a share of `n` episodes with its Wilson 95% interval in percent."""
    lo, hi = wilson_interval(round(p * n), int(n))
    return f"{p:.1%} [{lo * 100:.1f}, {hi * 100:.1f}]"


def accuracy_table(metrics: dict[str, float], prefix: str = "eval") -> Table:
    """Accuracy per task source and pooled; intervals count tasks (several samples of a task are one unit)."""
    table = Table(title_justify="left")
    for col in ("source", "episodes", "accuracy [95% CI]"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for source in sources(metrics, prefix):
        key = f"{prefix}/{source}"
        table.add_row(source, f"{metrics[f'{key}/episodes']:.0f}", pct_ci(metrics, key))
    n = metrics[f"{prefix}/episodes"]
    table.add_row("[bold]all[/]", f"{n:.0f}", f"[bold]{pct_ci(metrics, prefix)}[/]")
    return table


def tabular_table(metrics: dict[str, float], prefix: str = "eval") -> Table | None:
    """Tabular tasks' submissions per data type (`mappa.metrics`): the success share (better than every trivial
    prediction) and the valid share with their intervals, DSBench's gap and the fraction of the reference; None
    when the evaluation had no tabular task. Episodes recorded before the success rule show no success column."""
    head = f"{prefix}/tabular"
    if f"{head}/episodes" not in metrics:
        return None
    table = Table(title_justify="left")
    paper = any(k.startswith(f"{head}/paper/") for k in metrics)  # the paper's fair figures, when episodes had them
    success = f"{head}/success_rate" in metrics
    for col in ("data type", "episodes", *(("success [95% CI]",) if success else ()), "valid [95% CI]", "gap",
                "of reference", *(("accuracy", "F1", "RMSE % range", "RMSE % IQR") if paper else ())):  # fmt: skip
        table.add_column(col, justify="left" if col == "data type" else "right")
    types = sorted({k[len(head) + 1 :].split("/")[0] for k in metrics if k.startswith(head + "/")} - {"valid_rate",
                   "success_rate", "gap", "reference_fraction", "episodes", "paper"})  # fmt: skip
    for name, key in [*((t, f"{head}/{t}") for t in types), ("[bold]all[/]", head)]:
        n = metrics[f"{key}/episodes"]
        figures = [_paper_cell(metrics.get(f"{key}/paper/{k}"), k) for k in PAPER_FIGURES] if paper else []
        successes = [share_ci(metrics[f"{key}/success_rate"], n)] if success else []
        table.add_row(name, f"{n:.0f}", *successes, share_ci(metrics[f"{key}/valid_rate"], n),
                      f"{metrics[f'{key}/gap']:.3f}", f"{metrics[f'{key}/reference_fraction']:.2f}",
                      *figures)  # fmt: skip
    return table


def _paper_cell(value: float | None, key: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if key in ("accuracy", "f1") else f"{value:.1f}%"


def print_eval(
    console: Console,
    title: str,
    metrics: dict[str, float],
    agents: Sequence[str],
) -> None:
    table = Table(title=title, title_justify="left")
    for col in ("agent", "tool use", "resp. tokens", "truncated", "actions/ep"):
        table.add_column(col, justify="right" if col != "agent" else "left")
    for a in agents:
        table.add_row(
            a,
            f"{metrics[f'eval/{a}/tool_use_rate']:.0%}",
            f"{metrics[f'eval/{a}/response_tokens']:.0f}",
            f"{metrics[f'eval/{a}/truncation_rate']:.0%}",
            f"{metrics[f'eval/{a}/actions_per_episode']:.2f}",
        )
    console.print(table)
    console.print(accuracy_table(metrics))
    if (tabular := tabular_table(metrics)) is not None:
        console.print(tabular)
    console.print(
        f"rule-based check; answered {metrics['eval/answered_rate']:.0%}; {metrics['eval/seconds']:.0f} s",
        highlight=False,
    )


def default_out(weights: Path | None) -> Path:
    """Where `mappa eval` writes without --out: runs/eval for the base model; for a checkpoint (`weights`: its
    policy/), the eval/ of the run that holds it, which must be a run mappa made (`run_dir_problem`): a
    checkpoint copied elsewhere needs --out, so no folder around it is written into."""
    if weights is None:
        return Path("runs/eval")
    run_dir = (weights.parent if weights.name == "policy" else weights).parent.parent  # RUN/checkpoints/step-N
    problem = run_dir_problem(run_dir)
    if problem is not None:
        raise MappaError(f"--checkpoint {weights}: its run {run_dir}: {problem}; give --out DIR for the results")
    return run_dir / "eval"


def checkpoint_step(weights: Path | None) -> int | None:
    """The training step of the weights evaluated: 0 for the base model, else the checkpoint's (its state.json, else
    its `step-N` name), so that a standalone evaluation's summary row sits on the run's step axis. None: weights
    that are no checkpoint of a run (exported adapters, say)."""
    if weights is None:
        return 0
    ckpt = weights.parent if weights.name == "policy" else weights
    try:
        return int(json.loads((ckpt / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        number = ckpt.name.removeprefix("step-")
        return int(number) if number != ckpt.name and number.isdigit() else None


def eval_command(cfg: Config, checkpoint: str | None, out: str | None) -> int:
    """`mappa eval`: evaluate the base model (no --checkpoint) or a trained checkpoint; writes JSONL, and a summary
    row with the step the weights were trained to."""
    console = Console(stderr=True)
    weights = policy_dir(Path(checkpoint)) if checkpoint is not None else None  # a typo fails before loading
    out_dir = Path(out) if out else default_out(weights)
    print_confinement(console, cfg)
    from mappa.rollout import build_kit
    from mappa.workflows import build_workflow

    workflow = build_workflow(cfg)
    agents = workflow.agents
    tasks = eval_tasks(cfg)
    tag = "base" if weights is None else weights.name if weights.name != "policy" else weights.parent.name
    with console.status(f"loading {cfg.model.name if weights is None else weights}"):
        kit = build_kit(cfg, agents, weights=weights, coach=False)  # no coach: accuracy is the rule-based check
    with kit, action_bar(console, "evaluating") as progress:
        metrics, episodes = evaluate(cfg, workflow, kit.generator, kit.sandbox, tasks, progress=progress)
    step = checkpoint_step(weights)
    write_eval(out_dir, tag, metrics if step is None else {"step": step, **metrics}, episodes)
    print_eval(console, f"eval {tag}: {len(tasks)} tasks x {cfg.eval.samples}", metrics, agents)
    console.print(f"wrote {out_dir / (tag + '.jsonl')}")
    return 0
