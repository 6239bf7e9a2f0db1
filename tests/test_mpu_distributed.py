"""mpu building blocks across processes: mesh groups, autograd collectives, vocab-parallel
cross-entropy, RNG streams and bucketed data-parallel gradient reduction."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.mpu_cases"))
def test_mpu_case(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
