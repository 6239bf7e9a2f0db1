"""Hugging Face folders read straight into tp, ep and pp x tp layouts: each rank reads exactly
its shards' bytes, in the folder's dtype, equal to the import path and to transformers'
logits (tests/distributed/hf_folder_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.hf_folder_cases"))
def test_hf_folder_loads_into_a_layout(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
