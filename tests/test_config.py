import pytest

from mappa.config import Config, Section, dump_config, load_config, parse_override
from mappa.errors import MappaError


def test_defaults_have_help_lines():
    # every leaf field documents itself: the help line is part of the config's contract
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, Section):
                yield from walk(ann, prefix + name + ".")
            else:
                yield prefix + name, field.description

    missing = [k for k, d in walk(Config) if not d]
    assert missing == []


def test_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(None, ["train.steps=7", "train.lr=3e-5", "tasks.train=[gsm8k, amc]", "tasks.data_dir=null"])
    assert cfg.train.steps == 7
    assert cfg.train.lr == pytest.approx(3e-5)
    assert cfg.tasks.train == ["gsm8k", "amc"]
    assert cfg.tasks.data_dir is None
    assert parse_override("coach.model=gpt-4o-mini") == ("coach.model", "gpt-4o-mini")


def test_a_bare_off_means_the_mode_off(tmp_path):
    # YAML 1.1 reads `off` as false: the modes named "off" take it, in a file and through --set
    path = tmp_path / "c.yaml"
    path.write_text("generation:\n  sampling_copy: off\ntrain:\n  cpu_autocast: off\n")
    for cfg in (load_config(path), load_config(None, ["generation.sampling_copy=off", "train.cpu_autocast=off"])):
        assert (cfg.generation.sampling_copy, cfg.train.cpu_autocast) == ("off", "off")
    with pytest.raises(MappaError, match="train.cpu_autocast"):  # true is still no mode
        load_config(None, ["train.cpu_autocast=true"])


def test_unknown_key_names_key_and_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(MappaError, match=r"c.yaml: unknown key 'train.stepz'"):
        load_config(path)
    with pytest.raises(MappaError, match=r"unknown key 'nope'"):
        load_config(None, ["nope=1"])


def test_wrong_type_names_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: many\n")
    with pytest.raises(MappaError, match=r"c.yaml: train.steps: .*integer"):
        load_config(path)
    with pytest.raises(MappaError, match=r"coach.backend"):
        load_config(None, ["coach.backend=gemini-magic"])


def test_bad_yaml_and_missing_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: [unclosed\n")
    with pytest.raises(MappaError, match=r"c.yaml:\d+: invalid YAML"):
        load_config(path)
    with pytest.raises(MappaError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(MappaError, match="KEY=VALUE"):
        load_config(None, ["train.steps"])


def test_dump_round_trip(tmp_path):
    cfg = load_config(None, ["train.steps=3", "train.agent_lr={solver: 1.0e-5}"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
