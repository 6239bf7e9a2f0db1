"""Dense GPT: every tp x dp x sp layout up to 8 processes equals the single-process run."""

from __future__ import annotations

import functools

import pytest

from tests.distributed.dense_cases import cases_for_world
from tests.distributed.harness import run_world

WORLDS = (2, 4, 8)
MODULE = "tests.distributed.dense_cases"


@functools.cache
def world_results(world_size: int) -> dict:
    return run_world(world_size, MODULE, cases_for_world(world_size), timeout=900)


@pytest.mark.distributed
@pytest.mark.timeout(960)
@pytest.mark.parametrize("world_size,case", [(w, c) for w in WORLDS for c in cases_for_world(w)])
def test_parallel_equals_serial(world_size: int, case: str) -> None:
    result = world_results(world_size)[case]
    details = "\n".join(f"--- rank {r} ---\n{e}" for r, e in result["errors"].items())
    assert result["ok"], f"{case} in a world of {world_size}:\n{details}"
