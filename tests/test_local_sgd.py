"""Local SGD / DiLoCo (training/local_sgd.py, optim.local_steps / outer_optimizer / outer_lr /
outer_momentum): the multi-process proofs (tests/distributed/local_sgd_cases.py: H=1 equals
DP, H=4 replicas identical at syncs and divergent between, dp bytes fall 4x, the DiLoCo
outer step by hand), the configurations refused with one line, and the training loop's sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.config import ConfigError, RunConfig
from meshtron.training.local_sgd import LocalSGD, local_sgd_enabled
from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "world_size,case",
    [(w, c) for w, c in params("tests.distributed.local_sgd_cases") if not c.split(":")[1].startswith("hierarchical")],
)
def test_local_sgd_cases(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"optim": {"local_steps": 4, "zero": 1}},
            "optim.local_steps=4 needs optim.zero=0 (got 1): ZeRO shards the optimizer state over the data replicas "
            "that local SGD keeps apart",
        ),
        ({"optim": {"local_steps": 2, "offload": True}}, "optim.local_steps=2 does not support optim.offload=true"),
        (
            {"optim": {"local_steps": 2, "param_dtype": "bf16"}, "trainer": {"precision": "bf16"}},
            "optim.local_steps=2 needs optim.param_dtype=fp32",
        ),
        (
            {"optim": {"local_steps": 2}, "model": {"num_experts": 4}},
            "optim.local_steps=2 does not support MoE models yet",
        ),
        (
            {"optim": {"local_steps": 1, "outer_optimizer": "nesterov"}, "checkpoint": {"dir": "/tmp/x"}},
            "optim.local_steps=1 with optim.outer_optimizer=nesterov does not save its outer state",
        ),
        ({"optim": {"outer_optimizer": "adam"}}, "optim.outer_optimizer='adam' must be one of none, nesterov"),
        ({"optim": {"local_steps": 0}}, "optim.local_steps=0 must be an integer >= 1"),
        ({"optim": {"outer_momentum": 1.0}}, "optim.outer_momentum=1.0 must be"),
    ],
)
def test_unsupported_combinations_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_defaults_are_ordinary_data_parallelism():
    o = RunConfig.from_dict({}).optim
    assert (o.local_steps, o.outer_optimizer, o.outer_lr, o.outer_momentum) == (1, "none", 0.7, 0.9)
    assert not local_sgd_enabled(o.local_steps, o.outer_optimizer)
    assert local_sgd_enabled(2, "none") and local_sgd_enabled(1, "nesterov")


def test_sync_schedule_and_outer_state_in_one_process():
    """World of one: syncs after every H-th step and the final one; DiLoCo's outer step with one
    replica (average = local) follows the Nesterov formula from the kept global weights."""
    module = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, -1.0]]))
    local = LocalSGD(
        [module], single_process_mesh(), local_steps=3, outer_optimizer="nesterov", outer_lr=0.5, outer_momentum=0.5
    )
    assert [local.after_step(s) for s in (1, 2, 3, 4)] == [False, False, True, False]
    assert local.after_step(5, final=True) and local.syncs == 2 and local.bytes_sent == 0
    with torch.no_grad():
        module.weight.add_(torch.tensor([[1.0, 2.0]]))  # local steps moved the weights by +1, +2
    local.sync()
    # delta = global - local = (-1, -2); buf = delta; global -= 0.5 * (delta + 0.5 * buf) = +0.75 * (1, 2)
    assert torch.allclose(module.weight, torch.tensor([[1.75, 0.5]]))
    with pytest.raises(ValueError, match="outer_optimizer"):
        LocalSGD([module], single_process_mesh(), local_steps=2, outer_optimizer="adam")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_training_loop_syncs_every_h_steps(tmp_path):
    """torchrun, 2 data replicas, optim.local_steps=2 with DiLoCo: metrics count one sync per
    2 steps, and the run learns."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            "trainer.max_steps=6",
            "trainer.log_every=1",
            "trainer.progress=false",
            "model.num_layers=1",
            "model.seq_len=32",
            "trainer.global_batch_size=8",
            "trainer.eval_every=0",
            "optim.local_steps=2",
            "optim.outer_optimizer=nesterov",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["local_sgd_syncs"] for r in records] == [0, 1, 1, 2, 2, 3]
    assert records[-1]["loss"] < records[0]["loss"]
