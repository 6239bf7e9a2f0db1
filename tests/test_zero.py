"""ZeRO-1 (optimizer state sharded over the replicas) equals replicated AdamW: dense dp,
tp x dp with SP and MoE experts over edp, with 1/replicas of the optimizer state."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.zero_cases"))
def test_zero1_equals_replicated_adamw(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
