"""Dense GPT (both families): every tp x dp x sp layout up to 8 processes equals the
single-process run in logits, loss, gradients and weights after 3 AdamW steps."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.dense_cases"))
def test_parallel_equals_serial(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
