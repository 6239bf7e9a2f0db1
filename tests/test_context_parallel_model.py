"""Whole models under context parallelism (cp 2/4, ring and all-to-all, alone and with tp/SP,
pp, dp, ep, ZeRO-1/3, packed documents and recomputation) equal one process: logits of the cp
shard, loss, grad norm, aux terms, gradients, weights after 3 steps and the eval loss
(tests/distributed/cp_model_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.cp_model_cases"))
def test_context_parallel_model_equals_one_process(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
