"""Fine-grained MoE GPTs (64 experts of width 8, top-8; issue 40) under ep/etp over tp x dp
(x sp) and pp, dropless and with capacity, every aux-loss scope, DeepSeek-V3 routing (sigmoid,
group-limited, scaled, aux-free bias), Qwen2-MoE's gated shared expert and the dense-layer
patterns, equal the single-process run (tests/distributed/moe_fine_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.moe_fine_cases"))
def test_moe_fine_parallel_equals_serial(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
