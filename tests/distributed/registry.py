"""All multi-process cases, grouped by world size; each world starts once for all of them."""

from __future__ import annotations

import functools
import importlib

from tests.distributed.harness import run_world

CASE_MODULES = (
    "tests.distributed.dense_cases",
    "tests.distributed.mpu_cases",
    "tests.distributed.moe_cases",
    "tests.distributed.moe_fine_cases",
    "tests.distributed.moe_dispatch_cases",
    "tests.distributed.pipeline_cases",
    "tests.distributed.zero_cases",
    "tests.distributed.zero3_cases",
    "tests.distributed.checkpoint_cases",
    "tests.distributed.hf_cases",
    "tests.distributed.hf_folder_cases",
    "tests.distributed.offload_cases",
    "tests.distributed.cp_cases",
    "tests.distributed.cp_model_cases",
    "tests.distributed.resident_cases",
    "tests.distributed.local_sgd_cases",
    "tests.distributed.ps_cases",
    "tests.distributed.mla_cases",
    "tests.distributed.mtp_cases",
)
WORLD_SIZES = (2, 4, 8)
WORLD_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_S = 30.0


def cases_for_world(world_size: int, module: str | None = None) -> list[str]:
    """ "module:function" names of the cases that run in a world of `world_size` processes."""
    names = []
    for mod in CASE_MODULES if module is None else (module,):
        names += [f"{mod}:{c}" for c in importlib.import_module(mod).cases_for_world(world_size)]
    return names


@functools.cache
def world_results(world_size: int) -> dict:
    """Run every case of this world size once (cached for the pytest session)."""
    return run_world(
        world_size, cases_for_world(world_size), timeout=WORLD_TIMEOUT_S, collective_timeout=COLLECTIVE_TIMEOUT_S
    )


def assert_case_passed(world_size: int, case: str) -> None:
    result = world_results(world_size)[case]
    details = "\n".join(f"--- rank {r} ---\n{e}" for r, e in result["errors"].items())
    assert result["ok"], f"{case} in a world of {world_size}:\n{details}"


def params(module: str) -> list[tuple[int, str]]:
    """pytest parameters (world_size, case) for one case module."""
    return [(w, c) for w in WORLD_SIZES for c in cases_for_world(w, module)]
