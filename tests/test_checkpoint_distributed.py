"""Checkpoints saved under one layout (tp x pp, ZeRO-1, ep) load under others: the loaded
weights equal a single-process load bit for bit and training continues like the
uninterrupted run (see tests/distributed/checkpoint_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.checkpoint_cases"))
def test_checkpoint_reshards(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
