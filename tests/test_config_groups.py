"""Config groups (issue 17): the parallel=, optim= and data= presets compose with Hydra's
compose API onto train.yaml, change exactly the keys they name, build a valid RunConfig and
pass the layout checks at the world size they are meant for; `+model=NAME` keeps working;
group selections Hydra would refuse in many lines are refused in one (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from meshtron.training import run_checks
from meshtron.training.cli import config_groups, default_list_groups, group_selection_error
from meshtron.training.config import RunConfig, unknown_override
from meshtron.training.run_checks import check_run_config

ROOT = Path(__file__).resolve().parents[1]


def composed(*overrides: str) -> dict:
    with initialize_config_module(config_module="meshtron.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def changed(tree: dict, base: dict) -> dict:
    """{"section.key": value} where `tree` differs from `base`."""
    return {f"{s}.{k}": v for s, section in tree.items() for k, v in section.items() if base[s].get(k) != v}


# preset -> (exactly the keys it changes, the world size it is meant for, extra overrides)
PRESETS = {
    "parallel=tp2": ({"parallel.tp": 2}, 2, []),
    "parallel=tp2_sp": ({"parallel.tp": 2, "parallel.sp": True}, 2, []),
    "parallel=tp4_ep8": ({"parallel.tp": 4, "parallel.ep": 8}, 8, ["+model=gpt_1b"]),
    "parallel=tp2_pp2_vpp2": (
        {
            "parallel.tp": 2,
            "parallel.pp": 2,
            "parallel.vpp": 2,
            "parallel.sp": True,
            "parallel.schedule": "interleaved",
            "trainer.micro_batch_size": 2,
        },
        8,
        [],
    ),
    "parallel=dp_zero2": ({"optim.zero": 2}, 2, []),
    "optim=adamw": ({}, 1, []),
    "optim=adamw_zero1": ({"optim.zero": 1}, 2, []),
    "data=stdlib": ({}, 1, []),
    "data=prepared": ({"data.prepared": "data/prepared"}, 1, []),
}


def test_every_preset_file_is_covered():
    groups = config_groups([])
    files = {f"{g}={o}" for g in ("parallel", "optim", "data") for o in groups[g]}
    assert files == set(PRESETS)
    assert default_list_groups() == {"parallel", "optim", "data"}  # model stays out: `+model=`


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_changes_exactly_its_keys_and_passes_the_layout_checks(preset, monkeypatch):
    # the presets target GPU nodes: this checks their layouts, not whether this machine's memory holds them
    monkeypatch.setattr(run_checks, "device_memory_bytes", lambda *a: (1 << 60, "the test assumes"))
    expected, world, extra = PRESETS[preset]
    base, tree = composed(*extra), composed(*extra, preset)
    assert changed(tree, base) == expected
    run = RunConfig.from_dict(tree)  # unknown keys in a preset would raise ConfigError here
    par, _, n_micro = check_run_config(run, world)
    assert par.tp * par.pp * par.dp == world
    if preset == "parallel=tp2_pp2_vpp2":
        assert n_micro % par.pp == 0 and par.dp == 2


def test_later_groups_win_and_command_line_keys_win_over_presets():
    tree = composed("parallel=dp_zero2", "optim=adamw_zero1", "parallel.tp=2", "optim.lr=1e-3")
    # defaults list order: parallel, optim, data; key overrides come last
    assert tree["optim"]["zero"] == 1 and tree["parallel"]["tp"] == 2 and tree["optim"]["lr"] == 1e-3


def test_plus_model_still_composes_unchanged():
    tree = composed("+model=gpt_1b", "parallel=tp4_ep8", "optim=adamw_zero1")
    assert tree["model"]["num_layers"] == 16 and tree["model"]["num_experts"] == 8
    assert tree["model"]["hidden_size"] == 2048 and tree["parallel"]["ep"] == 8


@pytest.mark.parametrize(
    "argv,message",
    [
        (["+parallel=tp2"], "parallel is in the defaults list: select a preset without `+`, e.g. parallel=tp2"),
        (["model=gpt_1b"], "model is not in the defaults list: add it with `+`, e.g. +model=gpt_1b"),
        (
            ["parallel=tp3"],
            "unknown parallel option 'tp3'; did you mean parallel=tp2? known: dp_zero2, tp2, "
            "tp2_pp2_vpp2, tp2_sp, tp4_ep8",
        ),
        (["-m", "optim=adamw,adamw_zero3"], "unknown optim option 'adamw_zero3'; did you mean optim=adamw_zero1?"),
        (["parallel=tp2", "optim=adamw_zero1", "data=stdlib", "+model=gpt_1b"], None),
        (["-m", "parallel=tp2,tp2_sp", "parallel.tp=1"], None),
    ],
)
def test_group_selection_errors(argv, message):
    error = group_selection_error(argv)
    assert (error is None) if message is None else (error is not None and error.startswith(message)), error


def test_config_dir_adds_its_own_group_options(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "imported.yaml").write_text("# @package model\nnum_layers: 2\n")
    assert group_selection_error(["--config-dir", str(tmp_path), "+model=imported"]) is None
    assert group_selection_error([f"--config-dir={tmp_path}", "+model=imported"]) is None
    assert "unknown model option 'imported'" in group_selection_error(["+model=imported"])


def test_unknown_key_check_still_sees_keys_next_to_group_selections():
    assert unknown_override(["parallel=tp2", "optim=adamw_zero1"]) is None
    assert unknown_override(["parallel=tp2", "parallel.tpp=2"]) == "unknown key parallel.tpp; did you mean parallel.tp?"


@pytest.mark.timeout(60)
def test_bad_group_selection_is_one_line_exit_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "train.py", "parallel=tp3", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "meshtron: configuration error: unknown parallel option 'tp3'; did you mean parallel=tp2? "
        "known: dp_zero2, tp2, tp2_pp2_vpp2, tp2_sp, tp4_ep8"
    ]
