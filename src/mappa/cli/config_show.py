"""`mappa config show`: the resolved config as YAML with every field's help as a comment, and its JSON schema.

The YAML reads back into the same Config (`mappa train` takes it as a preset). The schema is pydantic's for
`mappa.config.Config`; editors that speak the YAML language server validate and complete a preset against it
when the preset's first line is `# yaml-language-server: $schema=PATH` (the repository ships it as
docs/config.schema.json).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from mappa.config import Config, load_config
from mappa.errors import MappaError

WIDTH = 119
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"  # the dialect pydantic writes


def config_schema() -> dict[str, Any]:
    """The JSON schema of a config file: pydantic's, with the dialect named so that editors pick it up."""
    return {"$schema": JSON_SCHEMA_DIALECT, **Config.model_json_schema()}


def schema_text() -> str:
    """The schema as the file docs/config.schema.json holds it (a test keeps the two equal)."""
    return json.dumps(config_schema(), indent=2, ensure_ascii=False) + "\n"


def _comment(text: str, indent: int) -> list[str]:
    pad = " " * indent
    return [f"{pad}# {line}" for line in textwrap.wrap(text, WIDTH - indent - 2, break_on_hyphens=False)]


def _value_line(name: str, value: Any, indent: int) -> str:
    # Flow style keeps each field on one line under its comment (a list, a plug-in's options); its quoting is the
    # strictest YAML has, so the text is also right after `key: `. The width is unlimited: no folded lines.
    flow = yaml.safe_dump([value], default_flow_style=True, width=1 << 30, allow_unicode=True).strip()
    return " " * indent + f"{name}: {flow[1:-1]}"


def _section_lines(model: BaseModel, data: dict[str, Any], indent: int) -> list[str]:
    """YAML lines of one section: each field's description above it, the default noted where it differs."""
    defaults = type(model)().model_dump(mode="json")
    lines: list[str] = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            doc = field.description or (type(value).__doc__ or "").strip().split("\n\n")[0]
            if indent == 0 and lines:
                lines.append("")
            lines += _comment(" ".join(doc.split()), indent) if doc else []
            lines.append(" " * indent + f"{name}:")
            lines += _section_lines(value, data[name], indent + 2)
            continue
        help_text = field.description or ""
        if data[name] != defaults[name]:
            default = json.dumps(defaults[name], ensure_ascii=False)
            help_text = f"{help_text} (default: {default})".strip()
        lines += _comment(help_text, indent)
        lines.append(_value_line(name, data[name], indent))
    return lines


def commented_yaml(cfg: Config, schema_ref: str | None = None) -> str:
    """`cfg` as YAML that `load_config` reads back into an equal Config, each field's help above it."""
    head = [f"# yaml-language-server: $schema={schema_ref}"] if schema_ref else []
    return "\n".join(head + _section_lines(cfg, cfg.model_dump(mode="json"), 0)) + "\n"


def write_schema(path: str | Path) -> Path:
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(schema_text(), encoding="utf-8")
    except OSError as e:
        raise MappaError(f"--schema {out}: cannot write ({e.strerror or e})") from None
    return out


def config_show_command(config: str | None, overrides: list[str], schema: str | None = None) -> int:
    """Print the resolved config (preset or defaults, then `--set` overrides); write the schema when asked."""
    cfg = load_config(config, overrides)
    schema_ref = None
    if schema is not None:
        written = write_schema(schema)
        schema_ref = str(written.resolve())
        # stderr, so that stdout stays a preset that can be redirected to a file
        print(f"wrote the config's JSON schema to {written}", file=sys.stderr)
    sys.stdout.write(commented_yaml(cfg, schema_ref))
    return 0
