"""meshtron/rules.py: each run rule once, and the planner and the typed config raise its message."""

from __future__ import annotations

import pytest

from meshtron.models.config import GPTConfig
from meshtron.mpu.mesh import ParallelConfig
from meshtron.planning.plan import plan_rank
from meshtron.rules import (
    batch_checks,
    compute_precision_check,
    first_failure,
    microbatches,
    pick_precision,
    precision_check,
)
from meshtron.training.config import ConfigError, RunConfig
from meshtron.training.precision import Precision


@pytest.mark.parametrize(
    "args, message",
    [
        ((8, 2, 2), None),
        ((8, None, 2), None),
        ((0, 2, 2), "trainer.global_batch_size=0 must be a positive integer"),
        ((8, 0, 2), "trainer.micro_batch_size=0 must be a positive integer"),
        ((6, None, 4), "trainer.global_batch_size=6 is not divisible by dp=4; use a multiple of 4"),
        (
            (12, 4, 2),
            "trainer.global_batch_size=12 is not divisible by trainer.micro_batch_size=4 * dp=2 = 8; use a "
            "global batch that is a multiple of 8 (e.g. 8 or 16)",
        ),
    ],
)
def test_batch_rules(args, message):
    found = first_failure(batch_checks(*args))
    assert found == message if message is None else found.startswith(message)


def test_interleaved_needs_a_multiple_of_pp_microbatches():
    assert first_failure(batch_checks(8, 2, 1, pp=2, schedule="interleaved")) is None  # 4 microbatches
    assert "divisible by pp=3" in first_failure(batch_checks(8, 2, 1, pp=3, schedule="interleaved"))
    assert first_failure(batch_checks(8, 2, 1, pp=3, schedule="1f1b")) is None


def test_microbatches():
    assert microbatches(16, 2, 4) == (2, 2)
    assert microbatches(16, None, 4) == (4, 1)


def test_precision_rule_is_the_one_message_everywhere():
    ok, message = precision_check("fp4")
    assert not ok and message == "trainer.precision='fp4' is unknown; use one of auto, fp32, bf16, fp16, fp8"
    with pytest.raises(ConfigError) as from_config:
        RunConfig.from_dict({"trainer": {"precision": "fp4"}})
    assert str(from_config.value) == message
    # what computes (Precision, the planner) takes resolved precisions only
    ok, computed = compute_precision_check("fp4")
    assert not ok and computed == "trainer.precision='fp4' is unknown; use one of fp32, bf16, fp16, fp8"
    with pytest.raises(ValueError) as from_precision:
        Precision("fp4")
    with pytest.raises(ValueError) as from_plan:
        plan_rank(GPTConfig(), ParallelConfig(), 1, 0, micro_batch_size=1, global_batch_size=1, precision="fp4")
    assert str(from_precision.value) == str(from_plan.value) == computed
    with pytest.raises(ValueError, match="auto is resolved per device first"):
        Precision("auto")


@pytest.mark.parametrize(
    "setting, device, bf16, picked",
    [
        ("auto", "cuda", True, "bf16"),
        ("auto", "cuda", False, "fp32"),
        ("auto", "cpu", True, "fp32"),
        ("fp32", "cuda", True, "fp32"),
        ("fp16", "cpu", False, "fp16"),
    ],
)
def test_auto_precision_is_bf16_on_cuda_with_bf16_else_fp32(setting, device, bf16, picked):
    name, why = pick_precision(setting, device, bf16)
    assert name == picked
    assert why.startswith(f"trainer.precision={setting}") and (setting != "auto" or f"picked {picked}" in why)
    run, why_run = RunConfig.from_dict({"trainer": {"precision": setting}}).with_precision_for(device, bf16)
    assert run.trainer.precision == picked and why_run == why


def test_auto_is_the_default_and_rechecked_once_resolved():
    run = RunConfig.from_dict({"optim": {"param_dtype": "bf16"}})
    assert run.trainer.precision == "auto"  # bf16 weights pass with auto: a GPU would pick bf16
    assert run.with_precision_for("cuda", True)[0].trainer.precision == "bf16"
    with pytest.raises(ConfigError) as err:
        run.with_precision_for("cpu", False)
    assert str(err.value) == (
        "optim.param_dtype=bf16 needs trainer.precision=bf16 (got 'fp32') "
        "(trainer.precision=auto picked fp32: cpu has no fast 16-bit matmul)"
    )
