"""MoE GPTs: ep x etp expert layouts folded over tp x dp (x sp) dense layouts, top-1/top-2,
softmax/sigmoid routers, dropless and capacity modes, equal the single-process run."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.moe_cases"))
def test_moe_parallel_equals_serial(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
