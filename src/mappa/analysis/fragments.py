"""HTML building blocks of the report's sections: escaped text, numbers with intervals, tables, figures, notes."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence


def esc(x: object) -> str:
    return html.escape(str(x))


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def with_ci(value: float, ci: tuple[float, float], spec: str = ".2f", scale: float = 1.0) -> str:
    v = fmt(value * scale, spec)
    if not (math.isfinite(ci[0]) and math.isfinite(ci[1])):
        return v
    return f"{v} [{fmt(ci[0] * scale, spec)}, {fmt(ci[1] * scale, spec)}]"


def table(head: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, text: Sequence[int] = ()) -> str:
    """Cells are HTML already; the first `left` columns and the `text` columns align left (numbers right)."""
    lefts = {*range(left), *(i % len(head) for i in text)}
    th = "".join(f'<th class="{"l" if i in lefts else ""}">{h}</th>' for i, h in enumerate(head))
    body = "".join(
        "<tr>" + "".join(f'<td class="{"l" if i in lefts else ""}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def figure(svg: str, name: str, caption: str) -> str:
    return (
        f'<figure class="plot" data-plot="{esc(name)}">{svg}<figcaption class="note">{caption}</figcaption></figure>'
    )


def note(text: str) -> str:
    return f'<p class="note">{text}</p>'
