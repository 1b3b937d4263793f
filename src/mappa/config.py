"""One typed config tree. YAML presets and `a.b=c` overrides load into the same classes.

Every field has a default and a description (its help line). Unknown keys and wrong types are
rejected with a message naming the key and the file: a typo must never silently fall back to a
default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from mappa.config_rollout import (
    BUILTIN_COACHES,
    BUILTIN_WORKFLOWS,
    PAPER_REWARD_SCALE,
    CoachConfig,
    GenerationConfig,
    ModelConfig,
    SandboxConfig,
    Section,
    TasksConfig,
    WorkflowConfig,
)
from mappa.config_training import AnalysisConfig, EvalConfig, LoggingConfig, RayConfig, TrainConfig
from mappa.errors import MappaError
from mappa.plugins import anchor

# The sections live in config_rollout and config_training; importers take every name from here.
__all__ = [
    "BUILTIN_COACHES",
    "BUILTIN_WORKFLOWS",
    "PAPER_REWARD_SCALE",
    "AnalysisConfig",
    "CoachConfig",
    "Config",
    "EvalConfig",
    "GenerationConfig",
    "LoggingConfig",
    "ModelConfig",
    "RayConfig",
    "SandboxConfig",
    "Section",
    "TasksConfig",
    "TrainConfig",
    "WorkflowConfig",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_override",
]


class Config(Section):
    seed: int = Field(42, description="One seed for data sampling, generation and init.")
    run_dir: str = Field("runs/{name}-{time}", description="Run directory; {name} and {time} are filled in.")
    name: str = Field("run", description="Run name.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    coach: CoachConfig = Field(default_factory=CoachConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    ray: RayConfig = Field(default_factory=RayConfig)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise MappaError(f"override {key!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", value parsed as YAML, so 3 is an int, [1,2] a list, null None)."""
    if "=" not in text:
        raise MappaError(f"override {text!r}: expected KEY=VALUE, e.g. train.steps=5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise MappaError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise MappaError(f"{source}: unknown key {loc!r}") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise MappaError(f"{source}: {loc}: {msg} (got {err.get('input')!r})") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML preset (or the defaults when `path` is None) and apply `a.b=c` overrides."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise MappaError(f"{p}: config file not found")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise MappaError(f"{p}{where}: invalid YAML") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise MappaError(f"{p}: top level must be a mapping of sections")
        data = _anchored(loaded, p.parent)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    if overrides:
        source += " (with --set overrides)"
    return config_from_dict(data, source)


def _anchored(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative plug-in files and `jsonl:` task files named in a config file resolve against its directory, so
    `mappa train examples/x/config.yaml` works from anywhere and the run directory records absolute paths."""

    def fix(section: str, key: str) -> None:
        node = data.get(section)
        if not isinstance(node, dict) or key not in node:
            return
        value = node[key]
        if isinstance(value, str):
            node[key] = _anchor_one(value, base)
        elif isinstance(value, list):
            node[key] = [_anchor_one(v, base) if isinstance(v, str) else v for v in value]

    for section, key in (("workflow", "name"), ("coach", "backend"), ("tasks", "train"), ("tasks", "eval")):
        fix(section, key)
    return data


def _anchor_one(value: str, base: Path) -> str:
    if value.startswith("jsonl:") and not Path(value[6:]).expanduser().is_absolute():
        return f"jsonl:{(base / value[6:]).resolve()}"
    if value.startswith("hf:"):  # a dataset directory beside the config file; else a hub id (or cwd-relative)
        name, sep, split = value[3:].partition(":")
        if name and not Path(name).expanduser().is_absolute() and (base / name).is_dir():
            return f"hf:{(base / name).resolve()}{sep}{split}"
    return anchor(value, base)


def dump_config(cfg: Config) -> str:
    """YAML text that `load_config` reads back into an equal Config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
