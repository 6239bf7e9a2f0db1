"""Pipeline parallelism (gpipe, 1f1b, interleaved) alone and combined with tp, sp, dp and MoE
ep equals the single-process run; live activations stay within each schedule's bound."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.pipeline_cases"))
def test_pipeline_parallel_equals_serial(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
