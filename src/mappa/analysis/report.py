"""`mappa report`: one self-contained HTML page per set of runs, rebuilt from the run directories' files.

Sections (docs/analysis.md says how to read each): the alarms at the top, led by the steps in which an agent
trained on no action; a comparison when there are several runs; then per run the learning curves, the coach's
scores per agent and stratum with the bias monitor, the coach against the rule-based check, the reward-hacking
alarm, blame, behaviour, and specialisation and forgetting (from `probe.jsonl`). Plots are inline SVG; the page
loads nothing from anywhere.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mappa.analysis import sections
from mappa.analysis.behaviour import untrained_lines
from mappa.analysis.bias import StratumBias, bias_monitor
from mappa.analysis.hacking import HackingCheck, hacking_checks
from mappa.analysis.runs import RunData
from mappa.config import AnalysisConfig

SECTIONS = ("learning-curves", "coach-scores", "coach-truth", "hacking", "blame", "behaviour", "specialisation")
CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 0; background: #fafafa; }
main { max-width: 1080px; margin: 0 auto; padding: 16px 24px 48px; background: #fff; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 18px; border-bottom: 2px solid #ddd; margin-top: 36px; }
h3 { font-size: 15px; margin: 26px 0 6px; } p.lead { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0 12px; font-size: 12.5px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: #f2f2f2; } td.l, th.l { text-align: left; }
figure.plot { margin: 8px 0; } figure.plot svg { width: 100%; height: auto; max-width: 1000px; display: block; }
.alarm { background: #fdecea; border-left: 4px solid #c0392b; padding: 6px 10px; margin: 6px 0; }
.warn { background: #fff6e0; border-left: 4px solid #d68910; padding: 6px 10px; margin: 6px 0; }
.ok { background: #eaf6ec; border-left: 4px solid #2e8b57; padding: 6px 10px; margin: 6px 0; }
.note { color: #666; font-size: 12.5px; } code { background: #f3f3f3; padding: 0 3px; }
div.ev { text-align: left; max-width: 520px; font-size: 12px; color: #444; }
"""


@dataclass
class Report:
    """The page as it is built: HTML parts, what each run shows, and the alarms found, which the CLI prints."""

    runs: list[RunData]
    thresholds: list[AnalysisConfig]
    parts: list[str] = field(default_factory=list)
    alarms: list[str] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)  # checks with too little data to judge, one line each
    untrained: list[str] = field(default_factory=list)  # per run and agent: the steps it trained on no action
    headlines: list[str] = field(default_factory=list)  # per run: the held-out gain and what it means
    figures: int = 0

    def html(self) -> str:
        title = "mappa report: " + ", ".join(r.name for r in self.runs)
        shows = "".join(f"<p>{html.escape(h)}</p>" for h in self.headlines) or (
            '<p class="note">No held-out evaluation to compare yet.</p>'
        )
        none = "No alarm: no coach bias, no reward hacking past the thresholds."
        if self.unjudged:  # "no alarm" from checks that could not judge is no all-clear
            none = "No alarm raised; some checks had too little data to judge (below)."
        alarms = "".join(f'<div class="alarm">{html.escape(a)}</div>' for a in self.alarms) or (
            f'<div class="ok">{none}</div>'
        )
        alarms += "".join(f'<p class="note">{html.escape(u)}</p>' for u in self.unjudged)
        # A warning, not an alarm: a step that trained nothing is a fact about the run (every curve below shows
        # unmoved weights there), not a judgement of the coach that could be a false alarm.
        alarms += "".join(f'<div class="warn">warning: {html.escape(u)}</div>' for u in self.untrained)
        head = (
            f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
            f"<body><main><h1>{html.escape(title)}</h1>"
            f'<p class="lead">Built from the run directories\' files; see docs/analysis.md for how to read each '
            f'section.</p><section id="summary" data-section="summary"><h2>What the run shows</h2>{shows}</section>'
            f'<section id="alarms" data-section="alarms"><h2>Alarms</h2>{alarms}</section>'
        )
        return head + "".join(self.parts) + "</main></body></html>"


def _run_alarms(run: RunData, biases: Sequence[StratumBias], checks: Sequence[HackingCheck]) -> list[str]:
    out = [
        f"{run.name}: coach bias on {b.agent}, {b.dimension}={b.stratum} (n={b.n}, {b.tasks} tasks): {b.alarm}"
        for b in biases
        if b.alarm
    ]
    out += [f"{run.name}: reward hacking? {c.agent}: {c.alarm}" for c in checks if c.alarm]
    return out


def _run_unjudged(run: RunData, biases: Sequence[StratumBias], checks: Sequence[HackingCheck]) -> list[str]:
    """One line per alarm kind that could not judge some of its cases, saying what it needs."""
    out = []
    unjudged = [c for c in checks if c.judged]
    if unjudged:
        names = ", ".join(c.agent for c in unjudged)
        out.append(f"{run.name}: reward hacking ({names}): {unjudged[0].judged}")
    thin = [b for b in biases if b.judged]
    if thin:
        out.append(f"{run.name}: coach bias, {len(thin)} of {len(biases)} strata: {thin[0].judged}")
    return out


def _run_sections(report: Report, run: RunData, th: AnalysisConfig, i: int, plots: sections.Plots) -> None:
    biases = bias_monitor(run.episodes, th)
    checks = hacking_checks(run.episodes, run.agents, th, list(run.evals.values()))
    report.alarms += _run_alarms(run, biases, checks)
    report.unjudged += _run_unjudged(run, biases, checks)
    cap = (run.config.get("generation") or {}).get("max_new_tokens")
    report.untrained += [f"{run.name}: {line}" for line in untrained_lines(run.metrics, cap)]
    headline = sections.headline(run)
    if headline:
        report.headlines.append(f"{run.name}: {headline}")
    suffix = f"-{i}" if len(report.runs) > 1 else ""
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in run.notes)
    report.parts.append(
        f'<h2 id="run{suffix}">Run {html.escape(run.name)}</h2><p class="note">{html.escape(str(run.path))}: '
        f"{len(run.steps)} training step(s), {len(run.episodes)} training episodes, evaluations: "
        f"{html.escape(', '.join(run.evals) or 'none')}; agents: {html.escape(', '.join(run.agents) or 'none')}</p>"
        + (f'<ul class="note">{notes}</ul>' if notes else "")
    )
    builders: dict[str, Callable[[], str]] = {
        "learning-curves": lambda: sections.learning_curves(run, plots),
        "coach-scores": lambda: sections.coach_scores(run, biases, th, plots),
        "coach-truth": lambda: sections.coach_truth(run, th, plots),
        "hacking": lambda: sections.hacking(checks, th, plots),
        "blame": lambda: sections.blame_section(run, plots),
        "behaviour": lambda: sections.behaviour(run, plots),
        "specialisation": lambda: sections.specialisation(run, plots),
    }
    for name in SECTIONS:
        body = builders[name]()
        report.parts.append(
            f'<section id="{name}{suffix}" data-section="{name}"><h3>{sections.TITLES[name]}</h3>{body}</section>'
        )


def build_report(
    runs: Sequence[RunData], thresholds: Sequence[AnalysisConfig], progress: Callable[[int, int], None] | None = None
) -> Report:
    """The report of `runs` (each with its alarm thresholds); `progress(done, total)` per run."""
    report = Report(list(runs), list(thresholds))
    with sections.Plots() as plots:
        if len(runs) > 1:
            report.parts.append(sections.comparison(runs, plots))
        for i, (run, th) in enumerate(zip(runs, thresholds, strict=True)):
            _run_sections(report, run, th, i, plots)
            if progress is not None:
                progress(i + 1, len(runs))
    report.figures = plots.count
    return report


def default_out(paths: Sequence[str | Path]) -> Path:
    """RUN_DIR/report.html for one run; report.html in the runs' common parent for several."""
    if len(paths) == 1:
        return Path(paths[0]) / "report.html"
    parents = {Path(p).resolve().parent for p in paths}
    return (parents.pop() if len(parents) == 1 else Path.cwd()) / "report.html"


def write_report(report: Report, out: Path) -> int:
    """Write the page atomically; returns its size in bytes."""
    text = report.html()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return len(text.encode())
