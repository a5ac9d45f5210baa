"""draftsmith.train.config: defaults < YAML < command line, and errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
import yaml

from draftsmith.train.config import (
    config_diff,
    config_from_dict,
    config_help,
    config_to_dict,
    parse_config,
    save_config,
)


@dataclass
class ToyConfig:
    """A config with one field of every supported type."""

    steps: int = field(default=10, metadata={"help": "optimizer steps"})
    lr: float = 1e-3
    wandb: bool = False
    name: str = "run"
    layers: list[int] = field(default_factory=lambda: [1, 2])
    tags: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=lambda: [0.5])
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    resume_from: str | None = None
    max_length: int | None = 2048


def write_yaml(tmp_path, data) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return str(path)


def test_defaults_without_arguments():
    assert parse_config(ToyConfig, []) == ToyConfig()


def test_yaml_overrides_defaults_and_command_line_overrides_yaml(tmp_path):
    path = write_yaml(tmp_path, {"steps": 100, "lr": 0.5, "name": "from-yaml", "layers": [7, 8]})
    cfg = parse_config(ToyConfig, ["--config", path, "--steps", "5", "--layers=3,4,5"])
    assert cfg.steps == 5  # command line beats YAML
    assert cfg.layers == [3, 4, 5]
    assert cfg.lr == 0.5 and cfg.name == "from-yaml"  # YAML beats defaults
    assert cfg.wandb is False and cfg.divergence == "forward_kl"  # defaults stay
    # the order of --config and the overrides does not matter
    assert parse_config(ToyConfig, ["--steps", "5", "--config", path]).steps == 5


def test_every_type_parses_from_the_command_line():
    cfg = parse_config(ToyConfig, [
        "--steps", "7", "--lr=2e-4", "--wandb", "yes", "--name", "x", "--layers", "",
        "--tags", "a,b", "--weights", "1,0.25", "--divergence", "jsd", "--resume-from", "ckpt",
        "--max_length", "none",
    ])
    assert cfg == ToyConfig(steps=7, lr=2e-4, wandb=True, name="x", layers=[], tags=["a", "b"],
                            weights=[1.0, 0.25], divergence="jsd", resume_from="ckpt",
                            max_length=None)
    assert parse_config(ToyConfig, ["--wandb"]).wandb is True  # bare flag
    assert parse_config(ToyConfig, ["--wandb", "--steps", "3"]).wandb is True
    for text, value in [("false", False), ("0", False), ("no", False), ("TRUE", True), ("1", True)]:
        assert parse_config(ToyConfig, [f"--wandb={text}"]).wandb is value


def test_yaml_types(tmp_path):
    # PyYAML reads 1e-4 (no dot) as a string; a float field still takes it
    path = write_yaml(tmp_path, "lr: 1e-4\nresume_from: null\nweights: [1, 2.5]\nwandb: true\n")
    cfg = parse_config(ToyConfig, ["--config", path])
    assert cfg.lr == 1e-4 and cfg.resume_from is None and cfg.weights == [1.0, 2.5]
    assert cfg.wandb is True
    assert parse_config(ToyConfig, ["--config", write_yaml(tmp_path, "")]) == ToyConfig()


@pytest.mark.parametrize("argv, key, suggestion", [
    (["--stpes", "3"], "stpes", "steps"),
    (["--max_lenght=3"], "max_lenght", "max_length"),
    (["--resume_form", "x"], "resume_form", "resume_from"),
])
def test_mistyped_key_names_it_and_suggests_the_closest(argv, key, suggestion):
    pattern = f"unknown config key '{key}'.*did you mean '{suggestion}'"
    with pytest.raises(ValueError, match=pattern):
        parse_config(ToyConfig, argv)


def test_mistyped_key_in_yaml_names_the_file(tmp_path):
    path = write_yaml(tmp_path, {"stepz": 3})
    with pytest.raises(ValueError, match=r"unknown config key 'stepz' in .*config\.yaml.*'steps'"):
        parse_config(ToyConfig, ["--config", path])


@pytest.mark.parametrize("argv, pattern", [
    (["--steps", "ten"], r"'steps' \(from the command line\) expects int, got 'ten'"),
    (["--steps", "1.5"], r"'steps' .*expects int, got '1.5'"),
    (["--lr", "fast"], r"'lr' .*expects float, got 'fast'"),
    (["--wandb", "maybe"], r"'wandb' .*expects bool, got 'maybe'.*true/false"),
    (["--layers", "1,x"], r"'layers\[1\]' .*expects int, got 'x'"),
    (["--divergence", "kl"], r"'divergence' .*got 'kl'.*\['forward_kl', 'reverse_kl', 'jsd'\]"),
    (["--max_length", "big"], r"'max_length' .*expects int or none, got 'big'"),
])
def test_wrong_type_on_the_command_line(argv, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_config(ToyConfig, argv)


@pytest.mark.parametrize("data, pattern", [
    ({"steps": "ten"}, r"'steps' \(from .*config\.yaml\) expects int, got 'ten' \(str\)"),
    ({"steps": 1.5}, r"'steps' .*expects int, got 1.5 \(float\)"),
    ({"steps": True}, r"'steps' .*expects int, got True \(bool\)"),
    ({"layers": 3}, r"'layers' .*expects list of int.*got 3 \(int\)"),
    ({"name": 12}, r"'name' .*expects str, got 12 \(int\)"),
    ({"name": None}, r"'name' .*expects str, got None"),
    ({"divergence": "tv"}, r"'divergence' .*choose one of"),
])
def test_wrong_type_in_yaml(tmp_path, data, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_config(ToyConfig, ["--config", write_yaml(tmp_path, data)])


def test_malformed_command_lines():
    with pytest.raises(ValueError, match="--steps needs a value"):
        parse_config(ToyConfig, ["--steps"])
    with pytest.raises(ValueError, match="unexpected command-line argument 'steps'"):
        parse_config(ToyConfig, ["steps", "3"])
    with pytest.raises(ValueError, match="--config given twice"):
        parse_config(ToyConfig, ["--config", "a.yaml", "--config", "b.yaml"])


def test_missing_or_malformed_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        parse_config(ToyConfig, ["--config", str(missing)])
    with pytest.raises(ValueError, match="must hold a mapping"):
        parse_config(ToyConfig, ["--config", write_yaml(tmp_path, "- 1\n- 2\n")])
    with pytest.raises(ValueError, match="not valid YAML"):
        parse_config(ToyConfig, ["--config", write_yaml(tmp_path, "steps: [1, 2\n")])


def test_help_lists_every_key_with_default_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(ToyConfig, ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "A config with one field of every supported type." in out
    assert "--steps int  (default: 10)" in out and "optimizer steps" in out
    assert "--layers list of int (comma-separated)  (default: [1, 2])" in out
    assert "--divergence {forward_kl,reverse_kl,jsd}" in out
    assert "--max_length int or none  (default: 2048)" in out
    assert out == config_help(ToyConfig) + "\n"


def test_save_then_load_round_trips(tmp_path):
    cfg = ToyConfig(steps=3, lr=1e-5, layers=[4], tags=["a"], resume_from="x", max_length=None)
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert yaml.safe_load(path.read_text()) == config_to_dict(cfg)
    assert parse_config(ToyConfig, ["--config", str(path)]) == cfg
    assert config_from_dict(ToyConfig, yaml.safe_load(path.read_text())) == cfg


def test_config_diff_for_resume_checks(tmp_path):
    a = ToyConfig()
    b = ToyConfig(steps=20, lr=0.1, layers=[1, 2])
    assert config_diff(a, a) == []
    assert config_diff(a, b) == ["steps", "lr"]
    assert config_diff(a, b, ignore=("steps",)) == ["lr"]
    saved = yaml.safe_load(save_config(b, tmp_path / "c.yaml").read_text())
    assert config_diff(b, saved) == []
    del saved["tags"]
    saved["old_key"] = 1
    assert config_diff(b, saved) == ["tags", "old_key"]


def test_required_fields_and_unsupported_types():
    @dataclass
    class Required:
        target: str
        steps: int = 1

    with pytest.raises(ValueError, match=r"missing required config key\(s\) \['target'\]"):
        parse_config(Required, [])
    assert parse_config(Required, ["--target", "t"]).target == "t"

    @dataclass
    class Unsupported:
        pair: tuple[int, int] = (1, 2)

    with pytest.raises(TypeError, match="'pair'.*does not support"):
        parse_config(Unsupported, ["--pair", "1,2"])
