"""configs/train.yaml is generated from the typed schema (issue 35, "one source per default and
per description"): the committed file is what `python -m meshtron.configs.generate` writes, it
composes to exactly the dataclass defaults, and every key carries a one-line help."""

from __future__ import annotations

import dataclasses
import difflib

import pytest
from omegaconf import OmegaConf

from meshtron.configs import generate
from meshtron.schema import help_of
from meshtron.training.cli import compose_run
from meshtron.training.config import SECTIONS, RunConfig, config_key

REGENERATE = "python -m meshtron.configs.generate"


def _fields():
    return [(section, f) for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)]


def test_committed_train_yaml_is_what_the_generator_writes():
    committed, generated = generate.TRAIN_YAML.read_text(), generate.train_yaml()
    diff = "\n".join(
        list(
            difflib.unified_diff(committed.splitlines(), generated.splitlines(), "committed", "generated", lineterm="")
        )[:12]
    )
    assert committed == generated, f"configs/train.yaml is stale: run `{REGENERATE}`\n{diff}"


def test_train_yaml_composes_to_the_dataclass_defaults():
    assert compose_run([]) == RunConfig()
    tree = OmegaConf.to_container(OmegaConf.load(generate.TRAIN_YAML))
    listed = {f"{s}.{k}" for s in SECTIONS for k in tree[s]}
    assert listed == {f"{s}.{config_key(f)}" for s, f in _fields() if f.metadata.get("in_train_yaml", True)}


def test_the_run_trains_the_model_train_yaml_always_trained():
    """The four keys where train.yaml and the dataclasses disagreed before: the run's values."""
    run = compose_run([])
    assert (run.model.num_layers, run.model.hidden_size, run.model.seq_len, run.trainer.eval_every) == (4, 128, 128, 50)


@pytest.mark.parametrize("section,field", _fields(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_key_has_a_one_line_help(section, field):
    text = help_of(field)
    assert isinstance(text, str) and text.strip() and "\n" not in text, f"{section}.{config_key(field)}"


def test_commented_out_keys_are_added_with_plus_as_before():
    run = compose_run(["+model.norm=rmsnorm", "+trainer.loss_scale_window=10"])
    assert run.model.norm == "rmsnorm" and run.trainer.loss_scale_window == 10
    assert "  # norm: null" in generate.train_yaml()


def test_check_flag_names_the_command(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "train.yaml"
    stale.write_text(generate.train_yaml().replace("max_steps: 200", "max_steps: 300"))
    monkeypatch.setattr(generate, "TRAIN_YAML", stale)
    assert generate.main(["--check"]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert "max_steps: 300" in stale.read_text()  # --check writes nothing
    assert generate.main([]) == 0 and stale.read_text() == generate.train_yaml()
    assert generate.main(["--check"]) == 0


@pytest.mark.parametrize("value", [None, True, 0.003, 1e-8, 300.0, 16_000_000, "1f1b", "on", [0.9, 0.95]])
def test_yaml_values_round_trip(value):
    loaded = OmegaConf.to_container(OmegaConf.create(f"k: {generate.yaml_value(value)}"))["k"]
    assert loaded == value and type(loaded) is type(value)
