"""Evaluation with a rule-based answer check, apart from training; results go to JSONL files.

Held-out tasks, `eval.samples` episodes per task at the eval temperature, no coach: accuracy is
`Episode.correct` (the rule-based check), never the coach's verdict. Per agent: tool-use rate (share
of its actions that ran code), mean response length in tokens, truncation rate.

`mappa eval CONFIG [--checkpoint DIR] [--out DIR]` runs the same function standalone on the base
model or a trained checkpoint (a `checkpoints/step-N` directory or its `policy/` subdirectory).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mappa.config import Config
from mappa.errors import MappaError
from mappa.types import Episode, Task, write_jsonl


def build_workflow(cfg: Config) -> Any:
    """The configured workflow object (its `agents` tuple names the team)."""
    from mappa import workflows

    return workflows.build_workflow(cfg.workflow)


def eval_tasks(cfg: Config) -> list[Task]:
    from mappa.tasks import load_tasks

    tasks = load_tasks(cfg.tasks.eval, cfg.tasks, "eval", cfg.seed)
    if cfg.eval.max_tasks is not None:
        tasks = tasks[: cfg.eval.max_tasks]
    if not tasks:
        raise MappaError(f"tasks.eval: no evaluation tasks from {cfg.tasks.eval}")
    return tasks


def summarize(episodes: Sequence[Episode], agents: Sequence[str]) -> dict[str, float]:
    """Namespaced eval metrics of a list of episodes (accuracy, per-agent tool use, length, truncation)."""
    n = max(len(episodes), 1)
    out: dict[str, float] = {
        "eval/accuracy": sum(bool(e.correct) for e in episodes) / n,
        "eval/answered_rate": sum(e.final_answer is not None for e in episodes) / n,
        "eval/episodes": float(len(episodes)),
    }
    for agent in agents:
        actions = [a for e in episodes for a in e.actions if a.agent == agent]
        k = max(len(actions), 1)
        out[f"eval/{agent}/tool_use_rate"] = sum(a.exec_result is not None for a in actions) / k
        out[f"eval/{agent}/response_tokens"] = sum(len(a.response_ids) for a in actions) / k
        out[f"eval/{agent}/truncation_rate"] = sum(a.truncated for a in actions) / k
        out[f"eval/{agent}/actions_per_episode"] = len(actions) / n
    return out


def evaluate(
    cfg: Config, workflow: Any, policy: Any, sandbox: Any, tasks: Sequence[Task], *, progress: bool = True
) -> tuple[dict[str, float], list[Episode]]:
    """Run `cfg.eval.samples` episodes per task at the eval temperature; no coach, rule-based accuracy."""
    from mappa.rollout import run_episodes

    gen = cfg.generation.model_copy(update={"temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p})
    batch = [t for t in tasks for _ in range(cfg.eval.samples)]
    start = time.perf_counter()
    episodes = run_episodes(workflow, policy, batch, sandbox=sandbox, gen=gen, scorer=None, progress=progress)
    metrics = summarize(episodes, workflow.agents)
    metrics["eval/seconds"] = time.perf_counter() - start
    return metrics, episodes


def write_eval(out_dir: str | Path, tag: str, metrics: dict[str, float], episodes: Sequence[Episode]) -> None:
    """`out_dir/<tag>.jsonl` (episodes) and one line appended to `out_dir/summary.jsonl`."""
    out = Path(out_dir)
    write_jsonl(out / f"{tag}.jsonl", list(episodes))
    with (out / "summary.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps({"tag": tag, **metrics}) + "\n")


def print_eval(console: Console, title: str, metrics: dict[str, float], agents: Sequence[str]) -> None:
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
    console.print(
        f"[bold]accuracy {metrics['eval/accuracy']:.1%}[/] over {metrics['eval/episodes']:.0f} episodes "
        f"(rule-based check; answered {metrics['eval/answered_rate']:.0%}; {metrics['eval/seconds']:.0f} s)"
    )


def _policy_dir(checkpoint: Path) -> Path:
    for candidate in (checkpoint / "policy", checkpoint):
        if candidate.is_dir() and any(candidate.iterdir()):
            return candidate
    raise MappaError(f"--checkpoint {checkpoint}: not a checkpoint directory")


def eval_command(cfg: Config, checkpoint: str | None, out: str | None) -> int:
    """`mappa eval`: evaluate the base model (no --checkpoint) or a trained checkpoint; writes JSONL."""
    console = Console(stderr=True)
    policy_dir = None
    if checkpoint is not None:  # checked first: a typo should not wait for the model to load
        if not Path(checkpoint).is_dir():
            raise MappaError(f"--checkpoint {checkpoint}: directory not found")
        policy_dir = _policy_dir(Path(checkpoint))
    from mappa.policy import Policy
    from mappa.sandbox import Sandbox

    workflow = build_workflow(cfg)
    tasks = eval_tasks(cfg)
    if policy_dir is None:
        policy = Policy.from_config(cfg.model, workflow.agents, seed=cfg.seed)
        tag = "base"
    else:
        policy = Policy.from_checkpoint(policy_dir, device=cfg.model.device)
        tag = policy_dir.name if policy_dir.name != "policy" else policy_dir.parent.name
    out_dir = Path(out) if out else (Path(checkpoint).parent.parent / "eval" if checkpoint else Path("runs/eval"))
    sandbox = Sandbox(cfg.sandbox)
    try:
        metrics, episodes = evaluate(cfg, workflow, policy, sandbox, tasks)
    finally:
        sandbox.close()
    write_eval(out_dir, tag, metrics, episodes)
    print_eval(console, f"eval {tag}: {len(tasks)} tasks x {cfg.eval.samples}", metrics, workflow.agents)
    console.print(f"wrote {out_dir / (tag + '.jsonl')}")
    return 0
