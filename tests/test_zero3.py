"""ZeRO-3 (optim.zero=3): parameters sharded and gathered per unit equal replicated AdamW
(dense dp, tp x dp with SP, MoE over edp, pipeline 1F1B and interleaved, full recompute,
bf16, CPU offload, evaluation, checkpoints between zero 0 and 3) with 1/replicas of the bytes
between steps; the planner accounts the shards and two gathered units."""

from __future__ import annotations

import pytest

from meshtron.errors import ConfigError
from meshtron.models.config import GPTConfig
from meshtron.mpu.mesh import ParallelConfig
from meshtron.planning.plan import plan_rank
from meshtron.training.config import RunConfig
from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params
from tests.test_train_cli import TORCHRUN, metrics, run


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.zero3_cases"))
def test_zero3_equals_replicated_adamw(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)


def test_zero3_is_a_config_choice() -> None:
    run = RunConfig.from_dict({"optim": {"zero": 3, "offload": True}, "parallel": {"tp": 2, "sp": True, "pp": 2}})
    assert run.optim.zero == 3
    with pytest.raises(ConfigError, match="optim.zero=4 must be one of 0, 1, 2, 3"):
        RunConfig.from_dict({"optim": {"zero": 4}})


def test_planner_zero3_shards_weights_and_gradient_buffers() -> None:
    """GPT-2 (tied), 2 layers, h=32, vocab 200 (padded 256), seq 16 at dp=4. Units in fp32
    elements: embedding 256*32 + 16*32 = 8704; a block 8192 matrix + 352 vector elements =
    8544; the head 64 (final norm) + the tied embedding 8704. The largest adjacent pair is the
    head with the last block; the weights between steps are a quarter of the 25,856 elements."""
    cfg = GPTConfig(
        arch="gpt2",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        vocab_size=200,
        seq_len=16,
        tie_embeddings=True,
    )
    plans = {
        zero: plan_rank(cfg, ParallelConfig(), 4, 0, zero=zero, micro_batch_size=1, global_batch_size=4)["memory"][
            "bytes"
        ]
        for zero in (2, 3)
    }
    z2, z3 = plans[2], plans[3]
    assert z3["weights"] == 4 * 25856 // 4 and z2["weights"] == 4 * 25856
    assert z3["weights_gathered"] == 4 * (64 + 8704 + 8544) and z2["weights_gathered"] == 0
    assert z3["grads"] == z2["grads"] and z3["optimizer"] == z2["optimizer"]
    # Gradient buffers in backward: a block in full, the last bucket of the block after it
    # (its 352 vector elements: norm1's weight, registered first, comes last) and the tied
    # embedding, allocated with the head and kept to the end (ZeRO-2: all 25,856).
    assert z3["grad_buffers_backward"] == 4 * (8544 + 352 + 8704) and z2["grad_buffers_backward"] == 4 * 25856
    assert z3["total"] == (
        z2["total"]
        - (z2["weights"] - z3["weights"])
        + z3["weights_gathered"]
        - (z2["grad_buffers_backward"] - z3["grad_buffers_backward"])
    )


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_zero3_logs_the_replicated_losses_and_resumes_at_zero0(tmp_path):
    """torchrun --nproc_per_node=2 train.py optim.zero=3 logs the losses of optim.zero=0, and
    its step-2 checkpoint resumed at optim.zero=0 logs the same steps 3 and 4."""
    common = [
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "trainer.progress=false",
        "model.num_layers=2",
        "trainer.eval_every=0",
    ]
    runs = {
        "zero0": ["optim.zero=0"],
        "zero3": ["optim.zero=3", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2"],
        "resumed": ["optim.zero=0", f"checkpoint.resume={tmp_path / 'ckpt' / 'step_00000002'}"],
    }
    logs = {}
    for name, extra in runs.items():
        out = run(
            [*TORCHRUN, "--nproc_per_node=2", "train.py", *common, *extra, f"hydra.run.dir={tmp_path / name}"],
            timeout=140,
            threads=1,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        logs[name] = {r["step"]: r["loss"] for r in metrics(tmp_path / name)}
    assert sorted(logs["zero3"]) == [1, 2, 3, 4] and sorted(logs["resumed"]) == [3, 4]
    for name in ("zero3", "resumed"):
        for step, loss in logs[name].items():
            assert abs(loss - logs["zero0"][step]) <= 1e-6 * logs["zero0"][step], (name, step, loss)


def test_freed_units_drop_their_cached_16bit_weight_copies() -> None:
    """ZeRO-3 frees a unit's full weights after use (`on_free` = `forget_weight_copies`): the
    step's 16-bit copy cache must not keep a copy of them; the next use casts afresh."""
    import torch

    from meshtron.kernels.operands import forget_weight_copies, weight_copy, weight_copy_scope

    w, other = torch.randn(4, 4), torch.randn(4, 4)
    with weight_copy_scope():
        first, kept = weight_copy(w, torch.bfloat16), weight_copy(other, torch.bfloat16)
        assert weight_copy(w, torch.bfloat16) is first  # cached within the step
        forget_weight_copies([w])
        again = weight_copy(w, torch.bfloat16)
        assert again is not first and torch.equal(again, first)
        assert weight_copy(other, torch.bfloat16) is kept
    forget_weight_copies([w])  # outside a scope: nothing cached, nothing to do
