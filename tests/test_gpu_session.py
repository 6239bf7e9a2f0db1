"""bench/gpu_session.sh, the lent GPU machine's one prepared call: on a CPU host its `run`
rehearses every step at a tiny size, so these tests prove the install, the step machinery,
the per-step outputs and the time budget before a device minute is spent on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `run` is the real session (minutes)"),
    pytest.mark.timeout(300),
]


def session(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run the script with this interpreter first on PATH (its `python3`), results in tmp_path/out."""
    full = dict(
        os.environ,
        OUT=str(tmp_path / "out"),
        GPU_SESSION_SITE=str(tmp_path / "site"),
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        **env,
    )
    full.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=280)


def test_without_a_verb_it_prints_the_usage():
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: bench/gpu_session.sh fetch|run" in proc.stderr


def test_cpu_rehearsal_runs_the_steps_and_leaves_each_result(tmp_path):
    proc = session(tmp_path, "run", GPU_SESSION_STEPS="env,moe_large,moe_compile,moe_fp32,acceptance")
    out = tmp_path / "out"
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    assert "no CUDA: rehearsal on the CPU at a tiny size" in log
    for step in ("env", "moe_large", "moe_compile", "moe_fp32", "acceptance"):
        assert f"== {step}: exit 0" in log, log
    block, eager, compiled, capped, capped_compiled = map(
        json.loads, (out / "moe_layer_compile_bf16.json").read_text().strip().splitlines()
    )
    assert block["compile"] == "reduce-overhead" and block["dtype"] == "bf16"
    assert (eager["config"]["compile_moe"], compiled["config"]["compile_moe"]) == (False, True)
    assert compiled["config"]["moe"]["experts"] == 4 and compiled["tokens_per_s"] > 0
    assert (capped["config"]["compile_moe"], capped_compiled["config"]["compile_moe"]) == (False, True)
    assert capped_compiled["config"]["moe"]["capacity_factor"] == 1.25 and capped_compiled["tokens_per_s"] > 0
    large = json.loads((out / "moe_layer_large_bf16.json").read_text().strip().splitlines()[-1])
    assert (large["config"]["hidden"], large["config"]["ffn"], large["dtype"]) == (64, 128, "bf16")
    assert large["host_ops"]["total"] > 0 and large["peer"]["host_ops"]["total"] > 0
    assert "moe_bf16" not in log and "== bench" not in log  # not asked for
    assert f"torch {torch.__version__}" in (out / "env.txt").read_text()
    assert "meshtron 0.1.0" in (out / "env.txt").read_text()
    moe = json.loads((out / "moe_layer_fp32.json").read_text().strip().splitlines()[-1])
    assert moe["bench"] == "moe_layer" and moe["config"]["tokens"] == 128 and moe["dtype"] == "fp32"
    assert moe["peer"]["system"].startswith("transformers") and moe["ratio_tokens_per_s_vs_peer"] > 0
    acceptance = json.loads((out / "acceptance.json").read_text().strip().splitlines()[-1])
    assert acceptance["bench"] == "gpu_acceptance" and "no CUDA GPU" in acceptance["skipped"]
    assert (tmp_path / "site" / "meshtron" / "__init__.py").exists()  # installed where it was told


def test_a_step_without_enough_budget_left_is_skipped_and_says_so(tmp_path):
    proc = session(tmp_path, "run", GPU_SESSION_STEPS="env,moe_fp32", GPU_SESSION_BUDGET="10")
    log = (tmp_path / "out" / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    assert "== env: skipped" in log and "== moe_fp32: skipped" in log and "of the budget left" in log
    assert not (tmp_path / "out" / "moe_layer_fp32.json").exists()


def test_a_failing_step_makes_the_run_fail_and_is_named(tmp_path):
    """A step that exits non-zero (here the MoE bench refusing a bad --tokens via its own
    argument check, reached by an environment override) fails `run`; the others still run."""
    proc = session(tmp_path, "run", GPU_SESSION_STEPS="moe_fp32,acceptance", GPU_SESSION_MOE_ARGS="--tokens 0")
    log = (tmp_path / "out" / "log.txt").read_text()
    assert proc.returncode == 1, proc.stdout + log
    assert "== acceptance: exit 0" in log and "failed: moe_fp32" in log
