"""The deduplicated, asynchronous MoE dispatcher equals the pair-per-row reference (values and
gradients, ep=2, ep=4, ep=2 x etp=2, ep=4 x etp=2, with capacity dropping), sends one row per
(token, destination), and overlaps the shared experts with its all-to-alls."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.moe_dispatch_cases"))
def test_moe_dispatch_parallel(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
