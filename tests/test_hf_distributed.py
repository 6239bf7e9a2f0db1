"""Hugging Face interop across processes: a full HF state dict loads into tp, ep, pp, cp
(ring and a2a) and pp x tp layouts with HF's logits, and exports back bitwise on rank 0; the
new families (Mistral, Llama 3.1, Qwen2, Qwen3) train like transformers at tp, pp and cp; an
imported Mixtral trained at ep=2 follows transformers' objective and weights step by step
(tests/distributed/hf_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.hf_cases"))
def test_hf_interop_parallel(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)
