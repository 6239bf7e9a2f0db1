"""Context-parallel attention (ring and all-to-all) over cp=2 and cp=4 gloo groups equals full
attention in one process, values and gradients, with causal and document masks and GQA; the
ring skips the causally invisible blocks with equal work per rank (tests/distributed/cp_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.cp_cases"))
def test_context_parallel_attention_equals_full_attention(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
