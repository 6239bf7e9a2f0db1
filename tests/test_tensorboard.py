"""Tests for TensorBoardWriter / record_scalars in observability/metrics.py."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import torch

from meshtron.observability.metrics import TensorBoardWriter, record_scalars, require_tensorboard
from meshtron.training.config import ConfigError

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _moe(imbalances):
    return [
        {"layer": i, "tokens_per_expert": [3, 1], "imbalance": b, "dropped_fraction": 0.0}
        for i, b in enumerate(imbalances)
    ]


RECORDS = [
    {
        "step": 1,
        "loss": 5.5,
        "lr": 1e-3,
        "grad_norm": 2.0,
        "tokens_per_s": 1000.0,
        "mfu": 0.1,
        "peak_mem_bytes": [100, 200],
        "peak_mem_max_bytes": 200,
        "moe": _moe([1.5, 1.25]),
        "note": "x",
    },
    {
        "step": 10,
        "loss": torch.tensor(4.25),
        "lr": np.float32(5e-4),
        "grad_norm": 1.5,
        "tokens_per_s": 1100.0,
        "mfu": 0.11,
        "skipped_steps": 0,
        "val_loss": 4.5,
        "moe": _moe([1.125, 2.0]),
    },
]


def test_record_scalars_takes_numbers_and_moe_layers_only():
    scalars = record_scalars(RECORDS[0] | {"ok": True, "none": None})
    assert scalars == {
        "loss": 5.5,
        "lr": 1e-3,
        "grad_norm": 2.0,
        "tokens_per_s": 1000.0,
        "mfu": 0.1,
        "peak_mem_max_bytes": 200.0,
        "moe/layer0/imbalance": 1.5,
        "moe/layer1/imbalance": 1.25,
        "moe/layer0/dropped_fraction": 0.0,
        "moe/layer1/dropped_fraction": 0.0,
    }


def test_event_file_round_trip(tmp_path: pathlib.Path):
    with TensorBoardWriter(tmp_path, enabled=True) as writer:
        for record in RECORDS:
            writer.log(record)
    tb_dir = tmp_path / "tb"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    acc = event_accumulator.EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "peak_mem_max_bytes",
        "val_loss",
        "skipped_steps",
        "moe/layer0/imbalance",
        "moe/layer1/imbalance",
    } <= tags
    assert not tags & {"step", "note", "peak_mem_bytes", "moe"}

    def series(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert series("loss") == [(1, 5.5), (10, 4.25)]
    assert [s for s, _ in series("lr")] == [1, 10]
    assert [v for _, v in series("lr")] == pytest.approx([1e-3, 5e-4])
    assert series("val_loss") == [(10, 4.5)]
    assert series("moe/layer1/imbalance") == [(1, 1.25), (10, 2.0)]
    assert series("tokens_per_s") == [(1, 1000.0), (10, 1100.0)]


def test_disabled_writer_creates_nothing(tmp_path: pathlib.Path):
    writer = TensorBoardWriter(tmp_path / "run", enabled=False)
    writer.log(RECORDS[0])
    writer.close()
    writer.close()
    assert not (tmp_path / "run").exists()


def test_missing_tensorboard_names_the_install(tmp_path: pathlib.Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install tensorboard.*\[viz\]"):
        require_tensorboard()
    with pytest.raises(ConfigError, match="trainer.tensorboard"):
        TensorBoardWriter(tmp_path, enabled=True)
    TensorBoardWriter(tmp_path, enabled=False).log(RECORDS[0])  # disabled: never imports it
    assert not (tmp_path / "tb").exists()
