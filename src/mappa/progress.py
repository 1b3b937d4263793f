"""Progress as lines of text, where no bar can be drawn: a CI log, `nohup`, a notebook, `mappa.train` from Python.

A terminal gets rich's transient bars (`mappa.cli`); anything else gets `ProgressLines`, a few lines per phase
(rollouts, an evaluation, scoring), so that a long step shows it is moving without a line per action.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ProgressLines:
    """`(done, total)` progress of one phase at a time, as lines `label: 13/100 actions (13%), 3 s`: one when another
    tenth is done (at most one every `min_gap_s`), one every `every_s` while anything moves, and one when the phase
    is done. The callers report whole actions, never tokens."""

    def __init__(
        self, write: Callable[[str], None], unit: str = "", every_s: float = 30.0, min_gap_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.write, self.unit, self.every_s, self.min_gap_s, self.clock = write, unit, every_s, min_gap_s, clock
        self.label, self.t0, self.last_t, self.started = "", 0.0, 0.0, False
        self.last_fraction, self.last_done, self.done = 0.0, 0, False

    def start(self, label: str) -> None:
        """A new phase: what follows counts from here."""
        self.label = label
        self.t0 = self.last_t = self.clock()
        self.started = True
        self.last_fraction, self.last_done, self.done = 0.0, 0, False

    def __call__(self, done: int, total: int) -> None:
        if not self.started:  # progress before any phase was named: it starts now
            self.start(self.label)
        now = self.clock()
        if total <= 0 or self.done:
            return
        fraction = min(done / total, 1.0)
        finished = done >= total
        tenth = fraction >= self.last_fraction + 0.1 and now - self.last_t >= self.min_gap_s
        stale = now - self.last_t >= self.every_s and done > self.last_done
        if not (finished or tenth or stale):
            return
        self.last_t, self.last_fraction, self.last_done, self.done = now, fraction, done, finished
        unit = f" {self.unit}" if self.unit else ""
        head = f"{self.label}: " if self.label else ""
        self.write(f"{head}{done}/{total}{unit} ({fraction:.0%}), {now - self.t0:.0f} s")
