"""`python -m tests.distributed WORLD [MODULE] [CONTAINS]`: runs the chosen cases in one world,
prints a verdict per case, exits 0 when all passed and 2 (one line) when nothing matches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tests.distributed", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_runs_the_matching_cases_of_one_world():
    done = _run("2", "mpu_cases", "rng_streams")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK   tests.distributed.mpu_cases:rng_streams" in done.stdout
    assert "1/1 passed" in done.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (("2", "mpu_cases", "no_such_case"), "no case of world 2 matches"),
        (("2", "nothing_cases"), "No module named 'tests.distributed.nothing_cases'"),
    ],
)
def test_nothing_to_run_is_one_line_and_exit_2(args, message):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_every_case_module_is_asserted_by_a_pytest_test():
    """Every case module the registry runs in its worlds has a pytest test asserting its
    verdicts (`params(module)`): a module run but never asserted fails silently, as
    cp_model_cases did until 2026-11-27."""
    from tests.distributed.registry import CASE_MODULES

    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    unasserted = [m for m in CASE_MODULES if f'params("{m}")' not in sources]
    assert not unasserted, f"no tests/test_*.py asserts the cases of {unasserted}"
