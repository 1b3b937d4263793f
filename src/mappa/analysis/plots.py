"""Figures for the report, drawn with matplotlib and returned as inline SVG text.

Text stays text (`svg.fonttype: none`: small files, the page's font); every element id of a figure gets the
figure's own prefix, so that many figures inline in one page never share an id.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from typing import Any

from mappa.analysis.curves import Curve

WIDTH, HEIGHT = 7.2, 2.8  # inches; 518 x 202 pt, drawn at the page's width
_ID_RE = re.compile(r'id="([^"]+)"')
_METADATA_RE = re.compile(r"<metadata>.*?</metadata>", re.DOTALL)  # RDF namespaces and links, no drawing


class Plots:
    """Makes SVG figures; one instance per report (it numbers the figures), used as `with Plots() as plots:`."""

    def __init__(self) -> None:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        self.plt = plt
        self.count = 0
        self.style = {
            "svg.fonttype": "none",
            "svg.hashsalt": "mappa",  # the same figure gives the same text
            "font.size": 8.5,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "legend.frameon": False,
            "legend.fontsize": 7.5,
        }

    def __enter__(self) -> Plots:
        """The report's style holds while the figures are made and drawn (legends and labels come after
        `figure()`), and matplotlib's settings are restored afterwards."""
        self._rc = self.plt.rc_context(self.style)
        self._rc.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._rc.__exit__(*exc)

    def figure(self, ncols: int = 1, height: float = HEIGHT, sharey: bool = False) -> tuple[Any, Any]:
        fig, axes = self.plt.subplots(1, ncols, figsize=(WIDTH, height), sharey=sharey, squeeze=False)
        return fig, list(axes[0])

    def svg(self, fig: Any) -> str:
        """The figure as SVG text (no XML prolog), ids made unique to this figure; the figure is closed."""
        self.count += 1
        buf = io.StringIO()
        legend_rows = sum(math.ceil(len(lg.get_texts()) / LEGEND_COLS) for lg in fig.legends)
        fig.tight_layout(
            rect=(0, (LEGEND_ROW_IN * legend_rows + 0.05 * bool(legend_rows)) / fig.get_figheight(), 1, 1)
        )
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        self.plt.close(fig)
        text = buf.getvalue()
        text = _METADATA_RE.sub("", text[text.index("<svg") :])
        prefix = f"f{self.count}-"
        ids = set(_ID_RE.findall(text))
        text = _ID_RE.sub(lambda m: f'id="{prefix}{m.group(1)}"', text)
        for i in ids:
            text = text.replace(f"#{i})", f"#{prefix}{i})").replace(f'href="#{i}"', f'href="#{prefix}{i}"')
        return text


def step_axis(ax: Any) -> None:
    """Training steps are whole numbers."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")


PANEL_LEGEND_MAX = 4  # more curves than this: one legend under the figure (`shared_legend`), none per panel
LEGEND_ROW_IN = 0.2  # inches per row of a shared legend
LEGEND_COLS = 5


def legend(ax: Any) -> None:
    """Above the lines, in headroom added for it: with several curves filling the axes, matplotlib's "best"
    spot still covers one of them. More than `PANEL_LEGEND_MAX` curves get none here (`shared_legend`)."""
    n = len(ax.get_legend_handles_labels()[1])
    if n > PANEL_LEGEND_MAX:
        return
    rows = math.ceil(n / 2)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + (hi - lo) * (0.16 * rows + 0.04))
    ax.legend(loc="upper center", ncols=2, columnspacing=1.0, handlelength=1.5)


def shared_legend(fig: Any, ax: Any) -> None:
    """One legend under all the figure's panels, from `ax`'s curves (the panels show the same names); the
    figure grows by its rows and `Plots.svg` keeps them clear of the panels."""
    handles, labels = ax.get_legend_handles_labels()
    if not labels:
        return
    rows = math.ceil(len(labels) / LEGEND_COLS)
    fig.set_figheight(fig.get_figheight() + LEGEND_ROW_IN * rows)
    fig.legend(handles, labels, loc="lower center", ncols=min(len(labels), LEGEND_COLS), bbox_to_anchor=(0.5, 0.0))


def draw_stacked(ax: Any, data: dict[int, dict[str, int]], names: Sequence[str], title: str) -> None:
    """Bars per step, stacked by name; headroom above for the legend."""
    steps = sorted(data)
    bottom = [0.0] * len(steps)
    for name in names:
        h = [float(data[s].get(name, 0)) for s in steps]
        ax.bar(steps, h, bottom=bottom, label=name, width=0.6)
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    ax.set_ylim(0, max(bottom, default=1) * (1.2 + 0.12 * len(names)))
    ax.set_title(title, fontsize=9)
    step_axis(ax)
    ax.legend(loc="upper left", ncols=2)


def curve_xy(curve: Curve) -> tuple[list[int], list[float], list[float], list[float]]:
    """steps, values, lower and upper interval ends (NaN intervals drawn as the value)."""
    xs = sorted(curve)
    ys = [curve[x][0] for x in xs]
    lo = [curve[x][1][0] if math.isfinite(curve[x][1][0]) else curve[x][0] for x in xs]
    hi = [curve[x][1][1] if math.isfinite(curve[x][1][1]) else curve[x][0] for x in xs]
    return xs, ys, lo, hi


def draw_curves(ax: Any, curves: dict[str, Curve], title: str, ylabel: str, percent: bool = False) -> None:
    """One line per curve with its 95% interval as error bars (few points) or a band (many)."""
    for label, curve in curves.items():
        xs, ys, lo, hi = curve_xy(curve)
        if not xs:
            continue
        k = 100.0 if percent else 1.0
        # max(0, .): an interval end may sit a rounding error inside its value (Wilson at k = n)
        err = [[max(0.0, k * (y - a)) for y, a in zip(ys, lo, strict=True)],
               [max(0.0, k * (b - y)) for y, b in zip(ys, hi, strict=True)]]  # fmt: skip
        ax.errorbar(xs, [k * y for y in ys], yerr=err, marker="o", markersize=3.5, capsize=3, lw=1.4, label=label)
    ax.set_title(title, fontsize=9)
    step_axis(ax)
    ax.set_ylabel(ylabel)
    if sum(1 for c in curves.values() if c) > 1:  # one curve: the title names it
        legend(ax)


def draw_series(ax: Any, series: dict[str, dict[int, float]], title: str, percent: bool = False) -> None:
    """Plain lines (step -> value), one per name."""
    k = 100.0 if percent else 1.0
    for label, s in series.items():
        xs = sorted(s)
        ax.plot(xs, [k * s[x] for x in xs], marker="o", markersize=3, lw=1.3, label=label)
    ax.set_title(title, fontsize=9)
    step_axis(ax)
    if percent:
        ax.set_ylim(-3, 103)  # rates on their whole scale: 0% reads as 0%, not as a flat line mid-axis
    if len(series) > 1:
        legend(ax)


def draw_boxes(ax: Any, groups: dict[int, Sequence[float]], title: str) -> None:
    """Distributions per step (boxplots), 0-10."""
    steps = sorted(s for s, v in groups.items() if v)
    # manage_ticks=False: boxplot's own fixed labels would go out of step with the integer step locator below
    ax.boxplot([list(groups[s]) for s in steps], positions=steps, widths=0.6, showfliers=True, manage_ticks=False)
    if steps:
        ax.set_xlim(steps[0] - 0.6, steps[-1] + 0.6)
    ax.set_ylim(-0.5, 10.5)
    ax.set_title(title, fontsize=9)
    step_axis(ax)


def draw_gaps(ax: Any, labels: Sequence[str], gaps: Sequence[tuple[float, tuple[float, float]]], flagged: Sequence[bool],
              threshold: float) -> None:  # fmt: skip
    """Horizontal bars: each stratum's gap with its interval, the alarm threshold dashed, flagged ones red."""
    ys = list(range(len(labels)))
    for y, (g, (lo, hi)), bad in zip(ys, gaps, flagged, strict=True):
        color = "#c0392b" if bad else "#2c7fb8"
        ax.plot([g], [y], "o", color=color)
        if math.isfinite(lo) and math.isfinite(hi):
            ax.plot([lo, hi], [y, y], "-", color=color, lw=2)
    for x in (-threshold, threshold):
        ax.axvline(x, ls="--", color="#888", lw=1)
    ax.axvline(0, color="#333", lw=0.8)
    ax.set_yticks(ys, labels)
    ax.invert_yaxis()
    ax.set_xlabel("gap vs the other strata beyond the outcome prediction (points, CI)")
