"""Multi-token prediction across processes: tp=2 with and without sequence parallelism, dp=2
with packed documents, a MoE model at tp=2 SP, pp=2 (the depths on the last stage, tied and
untied embeddings) and cp=2 (ring and a2a, with and without packed documents; at world 4 with
tp=2 SP) equal the single-process model in loss, MTP losses, gradients and weights after 3
AdamW steps; a direct forward under cp without the step's cut depths is refused in one line
(tests/distributed/mtp_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.mtp_cases"))
def test_mtp_parallel_equals_serial(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
