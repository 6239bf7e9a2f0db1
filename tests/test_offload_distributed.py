"""CPU offload of AdamW (optim.offload=true) equals the device optimizer bit for bit under
data parallelism, ZeRO-1/2, tp x dp with SP and MoE experts over edp, checkpoints included
(see tests/distributed/offload_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.offload_cases"))
def test_offload_equals_device_adamw(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
