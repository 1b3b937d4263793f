"""`mappa trace RUN_DIR [--episode ID] [--step N]`: one episode, agent by agent, with coach scores.

For each action: what the agent was given (a summary of its input), what it wrote, what its code
printed, and the coach's score and rationale. For a failed episode the lowest-scored action is
named at the end: the coach's blame trail (method.md section 6).
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from mappa.trace import load_episodes, lowest_scored, pick_episode
from mappa.types import Action, Episode


def _clip(text: str, n: int) -> str:
    text = text.strip()
    return text if len(text) <= n else text[: n // 2] + f"\n  [... {len(text) - n} chars ...]\n" + text[-n // 2 :]


def print_action(i: int, a: Action, console: Console) -> None:
    console.rule(f"[{i}] {escape(a.agent)} turn {a.turn}", style="dim")
    last_input = a.messages[-1].content if a.messages else ""
    console.print(
        f"[bold]input[/] {len(a.messages)} messages, {len(a.prompt_ids)} tokens; last:\n"
        f"  {escape(_clip(last_input, 400))}"
    )
    cut = " [yellow](truncated at the token cap)[/]" if a.truncated else ""
    console.print(f"[bold]output[/] {len(a.response_ids)} tokens{cut}\n{escape(_clip(a.text, 1500))}")
    r = a.exec_result
    if r is None:
        console.print("[bold]tool[/] no code ran")
    else:
        status = "ok" if r.ok else "timed out" if r.timed_out else r.infra_error or f"exit {r.exit_code}"
        console.print(f"[bold]tool[/] {escape(status)} in {r.duration_s:.2f} s")
        if r.stdout.strip():
            console.print(f"  stdout: {escape(_clip(r.stdout, 600))}")
        if r.stderr.strip():
            console.print(f"  stderr: {escape(_clip(r.stderr, 600))}")
    c = a.coach
    if c is None:
        console.print("[bold]coach[/] not scored")
        return
    score = "unscored" if c.score is None else f"{c.score:g}/10"
    console.print(f"[bold]coach[/] {score}" + (f" ({escape(c.error)})" if c.error else ""))
    if c.rationale.strip():
        console.print(f"  {escape(_clip(c.rationale, 800))}")


def print_episode(episode: Episode, console: Console) -> None:
    outcome = {True: "[green]correct[/]", False: "[red]wrong[/]", None: "unchecked"}[episode.correct]
    step = episode.meta.get("step")
    console.rule(f"episode {escape(episode.id)}" + (f" (step {step})" if step is not None else ""))
    console.print(f"[bold]task[/] {escape(_clip(episode.task.problem, 600))}")
    console.print(
        f"[bold]gold[/] {escape(episode.task.answer)}   [bold]final answer[/] {escape(str(episode.final_answer))}"
        f"   {outcome}"
    )
    for i, a in enumerate(episode.actions):
        print_action(i, a, console)
    if episode.correct is not False:
        return
    worst = lowest_scored(episode)
    console.rule("blame", style="red")
    if worst is None or worst.coach is None:
        console.print("no scored action: the coach gave no judgment to trace the failure with")
    else:
        console.print(
            f"lowest-scored action: [bold]{escape(worst.agent)}[/] turn {worst.turn} "
            f"({worst.coach.score:g}/10): {escape(_clip(worst.coach.rationale, 400))}"
        )


def trace_command(run_dir: str, episode: str | None = None, step: int | None = None) -> int:
    """`mappa trace`: print one episode of a run (default: the latest failed one)."""
    episodes = load_episodes(run_dir, step)
    print_episode(pick_episode(episodes, episode), Console(highlight=False))
    return 0
