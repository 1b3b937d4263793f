"""`mappa train CONFIG [--set k=v]` or `mappa train --resume RUN_DIR [--set k=v]`: the command and its console.

During the run: what is under way (in a terminal a transient bar of the actions played; in a log that is not a
terminal, a line per phase and a few progress lines within it, `mappa.progress`), the self-test's lines, an
evaluation table at the start, every `train.eval_every` steps and the end, and one line per step (train accuracy,
each agent's mean coach score, loss / KL, optimizer steps, clip fraction, seconds), and after it one line per
agent that trained on no action in that step, with why (actions cut off at the token cap, unscored, ...), and one
per agent whose trained actions all scored alike (nothing to learn from: not updated). At the end, the held-out accuracy before
and after with 95% intervals that count tasks (several samples of one task are one unit), and the gain with a 95%
interval over the tasks, paired (`mappa.metrics.accuracy_gain`), so a gain can be told from noise. The first line names the sandbox's confinement, the next the run directory. A run that moved no
agent's weights (no action kept, or every step's kept actions scored alike) ends with a warning line and exit code 3. Ctrl-C ends with the step that is saved and
the exact command that continues the run (exit code 130).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, TaskID

from mappa.api import train
from mappa.cli.evaluate import COLUMNS, print_eval
from mappa.config import Config
from mappa.errors import MappaError
from mappa.metrics import Gain
from mappa.progress import ProgressLines
from mappa.training.checkpoint import latest_checkpoint
from mappa.training.rewards import no_training_reason
from mappa.training.tracking import StepResult, is_run_dir, run_config
from mappa.training.trainer import Event, TrainResult
from mappa.training.update import UpdateStats

NOTHING_TRAINED = 3  # the exit code of a run that moved no agent's weights (docs/training.md)
SCORES_LABEL = "mean coach score (0-10)"  # over the step table's agent columns


def _mean(result: StepResult, field: Callable[[UpdateStats], float]) -> float:
    """The mean of an update's `field` over the groups that trained; NaN when none did."""
    values = [field(g.update) for g in result.groups.values() if g.update is not None]
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


class Printer:
    """Turns the run's events into console lines."""

    def __init__(self, console: Console, cfg: Config) -> None:
        from mappa.workflows import build_workflow

        self.console = console
        self.agents = build_workflow(cfg).agents
        self.max_new_tokens = cfg.generation.max_new_tokens
        self.header_shown = False
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        self.run_dir: Path | None = None  # once the run has named it
        self.lines = ProgressLines(self.line, unit="actions")  # progress where no bar can be drawn

    def line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def show(self, label: str) -> None:
        """What is under way: a transient bar in a terminal (nothing stays on screen); in a log that is not a
        terminal (CI, nohup), a line, after which the phase's progress comes as lines."""
        self.stop_bar()
        if not self.console.is_terminal:
            self.line(label)
            self.lines.start(label)
            return
        self.bar = Progress(*COLUMNS, console=self.console, transient=True)
        self.bar.start()
        self.task = self.bar.add_task(label, total=None)

    def progress(self, done: int, total: int) -> None:
        """Actions played of the episodes under way."""
        if not self.console.is_terminal:
            self.lines(done, total)
            return
        if self.bar is None or self.task is None:
            self.show("playing episodes")
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=done, total=total)

    def stop_bar(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar, self.task = None, None

    def __call__(self, event: Event) -> None:
        if event.kind == "status":
            self.show(event.text)
            return
        self.stop_bar()
        if event.kind == "note":
            style = "bold red" if "WARNING" in event.text else None  # hidden answers reachable (allow_unconfined)
            self.console.print(
                event.text.replace("self-test ok:", "[green]self-test ok[/]"), style=style, highlight=False,
                soft_wrap=True,
            )  # fmt: skip
        elif event.kind == "run":
            self.run_dir = Path(event.text)
            self.console.print(f"run: {event.text}", markup=False, highlight=False, soft_wrap=True)
        elif event.kind == "eval":
            print_eval(self.console, f"eval {event.text} (step {event.step})", event.metrics, self.agents)
        elif event.kind == "step" and event.result is not None:
            self.step_line(event.result)
            self.untrained_lines(event.result)

    def step_line(self, r: StepResult) -> None:
        """The step's row of the table (its header first, once): train accuracy, each agent's mean coach score,
        the trained groups' mean loss / KL and clip fraction, their optimizer steps, seconds."""
        if not self.header_shown:
            names = " ".join(f"{a[:12]:>12}" for a in self.agents)
            over = f" {SCORES_LABEL} " if len(SCORES_LABEL) + 2 <= len(names) else SCORES_LABEL
            self.console.print(f"{'':11} {over:-^{len(names)}}", markup=False, highlight=False)
            self.console.print(f"{'step':>5} {'acc':>5} {names}  {'loss/kl':>13} {'opt':>3} {'clip':>5}    s")
            self.header_shown = True
        cells = " ".join(f"{r.episodes.get(f'train/{a}/score_mean', float('nan')):>12.2f}" for a in self.agents)
        loss, kl, clip = _mean(r, lambda u: u.loss), _mean(r, lambda u: u.kl), _mean(r, lambda u: u.clip_frac)
        loss_kl = f"{loss:+.3f}/{kl:.3f}" if math.isfinite(loss) else "-"  # no agent had an action to train on
        steps = sum(g.optimizer_steps for g in r.groups.values())
        self.console.print(
            f"{r.step:>5} {r.episodes['train/accuracy']:>5.0%} {cells}  {loss_kl:>13} {steps:>3} "
            f"{f'{clip:.1%}' if math.isfinite(clip) else '-':>5} {r.rollout_s + r.update_s:>4.0f}",
            highlight=False,
        )

    def untrained_lines(self, r: StepResult) -> None:
        """One line per agent (update group) that trained on no action this step, with the reasons counted: the
        step line's "-" and "opt 0" alone do not say that the settings, not the model, stopped the training."""
        for group, g in r.groups.items():
            if g.actions_trained:
                continue
            why = no_training_reason(g.dropped, self.max_new_tokens)
            self.console.print(
                f"step {r.step}: {group} trained on no action: {why}",
                style="yellow",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


def nothing_trained_line(result: TrainResult) -> str:
    """The end-of-run warning of a run whose steps moved no agent's weights (exit code 3)."""
    return (
        f"WARNING: {result.why_nothing_trained} in {result.step} step(s); the weights are the ones the run "
        "started from (the step lines above say why). Exit code 3."
    )


def gain_lines(gain: Gain, tasks: int, final_step: int) -> list[str]:
    """The end-of-run report of the held-out gain (format documented in docs/training.md)."""
    b_lo, b_hi = gain.before_ci
    a_lo, a_hi = gain.after_ci
    g_lo, g_hi = gain.gain_ci
    verdict = "beyond noise" if gain.significant else "within noise: the interval includes 0"
    changed = f"; {gain.improved} tasks improved, {gain.worsened} worsened" if gain.paired else ""
    how = gain.method
    return [
        f"held-out accuracy, {tasks} tasks ({gain.n_after} episodes): {gain.before:.1%} [{b_lo:.1%}, {b_hi:.1%}] "
        f"at step 0 -> {gain.after:.1%} [{a_lo:.1%}, {a_hi:.1%}] at step {final_step} (95%, over tasks)",
        f"gain {gain.gain * 100:+.1f} pp, 95% CI [{g_lo * 100:+.1f}, {g_hi * 100:+.1f}] pp ({how}{changed}): {verdict}",
    ]


def answered_line(change: Gain) -> str:
    """The held-out share of episodes that end with a final answer, right or wrong, before and after training: the
    format the final agent is asked for and a process coach rewards, which can move before accuracy does."""
    lo, hi = change.gain_ci
    how = change.method
    verdict = "beyond noise" if change.significant else "within noise"
    return (
        f"held-out episodes ending with a final answer (right or wrong): {change.before:.0%} -> {change.after:.0%}, "
        f"{change.gain * 100:+.1f} pp, 95% CI [{lo * 100:+.1f}, {hi * 100:+.1f}] pp ({how}): {verdict}"
    )


def _report(console: Console, result: TrainResult) -> None:
    if result.answered is not None and result.answered.n_after:
        console.print(answered_line(result.answered), highlight=False, soft_wrap=True)
    if result.gain is not None:
        tasks = int(result.final.get("eval/tasks", result.gain.n_after))
        for i, line in enumerate(gain_lines(result.gain, tasks, result.step)):
            console.print(f"[bold]{line}[/]" if i == 1 else line, highlight=False, soft_wrap=True)
    console.print(f"run: {result.run_dir}", highlight=False, soft_wrap=True)


def resume_command(run_dir: Path, overrides: Sequence[str], ray: str | None, resumed: bool = False) -> str:
    """The exact command that continues the run. A new run's config.yaml holds its --set overrides; a resume's
    reach config.yaml only once its checkpoint has loaded, so they are repeated (harmless after that); --ray is
    in no config."""
    args = ["mappa", "train", "--resume", str(run_dir)]
    if resumed:
        args += [a for o in overrides for a in ("--set", o)]
    if ray is not None:
        args += ["--ray", ray]
    return shlex.join(args)


def interrupted_line(run_dir: Path, command: str) -> str:
    """What Ctrl-C leaves: the step saved and how to go on, or that there is nothing to go on from."""
    if not is_run_dir(run_dir):  # stopped within its start, which `mappa.api.train` undid
        undone = "removed" if not run_dir.exists() else "emptied again"  # an empty directory given stays
        return f"interrupted before the run started: nothing is saved ({run_dir} {undone})"
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return f"interrupted before the first checkpoint: no step is saved; {command} starts the run over"
    step = int(ckpt.name.removeprefix("step-"))
    return f"interrupted: step {step} is saved ({ckpt}); continue with: {command}"


def train_command(cfg: Config | None, resume: str | None, overrides: list[str], ray: str | None = None) -> int:
    """`mappa train CONFIG [--set k=v]` or `mappa train --resume RUN_DIR [--set k=v]`; `--ray local|auto|ADDRESS`
    places the run's work on a Ray cluster (`mappa.distributed`).

    A thin layer over `mappa.train` (`mappa.api`): nothing is written before the arguments and the sandbox check
    out, a resume takes only a directory mappa made as a run (`mappa.training.tracking.require_run_dir`) and rewrites
    its config.yaml (with the --set overrides) only once its checkpoint has loaded and the self-test has passed."""
    place = None
    if ray is not None:  # a missing Ray is one line, before anything is written
        from mappa.distributed import placement

        place = placement(ray)
    if resume is not None:
        if cfg is not None:
            raise MappaError(
                "mappa train: give CONFIG or --resume RUN_DIR, not both (a resumed run keeps its own config.yaml; "
                "change it with --set)"
            )
        cfg = run_config(resume, "--resume", overrides)  # --set may extend it (e.g. train.steps=20)
    elif cfg is None:
        raise MappaError("mappa train: give a CONFIG file or --resume RUN_DIR")
    console = Console(stderr=True)
    printer = Printer(console, cfg)
    try:
        result = train(
            cfg, run_dir=resume, resume=resume is not None, emit=printer, progress=printer.progress, place=place
        )
    except KeyboardInterrupt:
        printer.stop_bar()
        if printer.run_dir is not None:
            command = resume_command(printer.run_dir, overrides, ray, resumed=resume is not None)
            console.print(interrupted_line(printer.run_dir, command), markup=False, highlight=False, soft_wrap=True)
        raise
    finally:
        printer.stop_bar()
    _report(console, result)
    if result.trained_nothing:  # a script that runs a config must notice a run that trained nothing
        console.print(nothing_trained_line(result), style="bold red", highlight=False, soft_wrap=True)
        return NOTHING_TRAINED
    return 0
