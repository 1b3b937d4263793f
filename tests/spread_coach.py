"""A coach plug-in for training runs on tiny random models. Their replies break every rubric rule alike, so the
rubric scores an agent's actions alike, and scores without spread train nothing
(`mappa.training.update.scores_differ`): a test of training would test a run whose weights never move. This one
spreads its scores over 0-10 by the reply's text, the same in every process, so a resumed run and an uninterrupted
one score alike."""

from __future__ import annotations

import zlib

from mappa.types import CoachContext


def score(ctx: CoachContext) -> float:
    return float(zlib.crc32(ctx.output.encode("utf-8")) % 11)
