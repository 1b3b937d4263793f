"""`mappa --version` and `mappa config show`, through the installed `mappa` command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import mappa
from mappa.cli.config_show import schema_text
from mappa.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
MAPPA = str(Path(sys.executable).parent / "mappa")
SHIPPED_SCHEMA = ROOT / "docs" / "config.schema.json"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([MAPPA, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_version_prints_the_package_version():
    proc = run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"mappa {mappa.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", mappa.__version__)


def test_show_prints_yaml_that_loads_back_into_the_same_config(tmp_path):
    overrides = ["train.steps=3", "coach.options={a: {b: [1, 'x, y']}}", 'name="x: #y"']
    proc = run("config", "show", "configs/demo.yaml", *sum((["--set", o] for o in overrides), []))
    assert proc.returncode == 0, proc.stderr
    shown = tmp_path / "shown.yaml"
    shown.write_text(proc.stdout, encoding="utf-8")
    assert load_config(shown) == load_config(ROOT / "configs" / "demo.yaml", overrides)
    assert load_config(shown).train.steps == 3


def test_show_puts_every_fields_help_above_it():
    lines = run("config", "show").stdout.splitlines()
    data = yaml.safe_load("\n".join(lines))
    assert set(data) == set(Config.model_fields)

    def check(model: type, indent: int, start: int) -> int:
        """Fields appear in order, each under its description; returns the line after the section."""
        for name, field in model.model_fields.items():
            at = next(i for i in range(start, len(lines)) if lines[i].startswith(" " * indent + f"{name}:"))
            start = at + 1
            if hasattr(field.annotation, "model_fields"):
                start = check(field.annotation, indent + 2, start)
                continue
            above = []
            for line in reversed(lines[:at]):
                if not line.startswith(" " * indent + "# "):
                    break
                above.insert(0, line.strip()[2:])
            assert " ".join(above) == " ".join(field.description.split()), f"{name}: {above}"
        return start

    check(Config, 0, 0)


def test_show_notes_the_default_of_an_overridden_field():
    out = run("config", "show", "--set", "train.lr=3e-5").stdout
    assert "# Learning rate (peak). (default: 1e-06)\n  lr: 3.0e-05\n" in out
    assert "# Learning rate (peak).\n" not in out


def test_bad_config_is_one_line_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n", encoding="utf-8")
    proc = run("config", "show", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"mappa: error: {bad}: unknown key 'train.stepz'\n"
    proc = run("config", "show", "--set", "train.steps=-1")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "train.steps" in proc.stderr


def test_schema_is_written_only_when_asked_and_validates_a_preset(tmp_path):
    assert run("config", "show", cwd=tmp_path).returncode == 0
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "sub" / "config.schema.json"
    proc = run("config", "show", "--schema", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and str(out) in proc.stderr
    assert proc.stdout.splitlines()[0] == f"# yaml-language-server: $schema={out}"
    schema = json.loads(out.read_text(encoding="utf-8"))
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["TrainConfig"]["properties"]["steps"]["description"]

    import jsonschema  # what an editor's YAML language server does with the file

    jsonschema.validate(yaml.safe_load(proc.stdout), schema)
    with pytest.raises(jsonschema.ValidationError, match="stepz"):
        jsonschema.validate({"train": {"stepz": 3}}, schema)


def test_schema_to_an_unwritable_path_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    proc = run("config", "show", "--schema", str(blocker / "x.json"))
    assert proc.returncode == 2 and proc.stderr.startswith("mappa: error: --schema") and "Traceback" not in proc.stderr


def test_the_shipped_schema_is_current():
    assert SHIPPED_SCHEMA.read_text(encoding="utf-8") == schema_text(), (
        "docs/config.schema.json is out of date with mappa.config: regenerate it with "
        "`.venv/bin/mappa config show --schema docs/config.schema.json > /dev/null`"
    )
