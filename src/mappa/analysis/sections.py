"""The report's sections as HTML fragments: tables, inline SVG figures and the notes that explain them.

The entry point of `report.py`: each section's title, and the function that writes it. The sections live by
topic: evaluation and comparison in `eval_sections.py`, the coach (scores, bias, coach vs truth, reward
hacking) in `coach_sections.py`, the agents (blame, behaviour, specialisation) in `agent_sections.py`; the HTML
building blocks they share in `fragments.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from mappa.analysis.agent_sections import behaviour, blame_section, specialisation
from mappa.analysis.coach_sections import coach_scores, coach_truth, hacking
from mappa.analysis.eval_sections import comparison_body, headline, learning_curves
from mappa.analysis.plots import Plots
from mappa.analysis.runs import RunData

__all__ = [
    "TITLES",
    "Plots",
    "behaviour",
    "blame_section",
    "coach_scores",
    "coach_truth",
    "comparison",
    "hacking",
    "headline",
    "learning_curves",
    "specialisation",
]

TITLES = {
    "learning-curves": "Learning curves",
    "coach-scores": "Coach scores per agent and stratum, and the bias monitor",
    "coach-truth": "Coach vs ground truth",
    "hacking": "Reward-hacking alarm",
    "blame": "Blame",
    "behaviour": "Behaviour",
    "specialisation": "Specialisation and forgetting",
    "comparison": "Comparison",
}


def comparison(runs: Sequence[RunData], plots: Plots) -> str:
    """The comparison of several runs as a whole section of the page, placed before the runs' own."""
    body = comparison_body(runs, plots)
    return f'<section id="comparison" data-section="comparison"><h2>{TITLES["comparison"]}</h2>{body}</section>'
