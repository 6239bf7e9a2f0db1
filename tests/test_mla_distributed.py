"""Multi-head latent attention across processes: tp=2 with and without sequence parallelism
(selective and full recompute, a plain q with 2 microbatches) and dp=2 equal the
single-process model in logits, loss, gradients and weights after 3 AdamW steps
(tests/distributed/mla_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.mla_cases"))
def test_mla_parallel_equals_serial(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
