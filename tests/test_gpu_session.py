"""bench/gpu_session.sh, the lent GPU machine's one prepared call: on a CPU host its `run`
rehearses every step at a tiny size, and its `kernels` every part of issue 36's kernel
measurements (Triton in its interpreter), so these tests prove the install, the step
machinery, the per-step outputs, the results file and the time budget before a device minute
is spent on them."""

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
    proc = session(
        tmp_path, "run", GPU_SESSION_STEPS="env,moe_large,moe_compile,moe_swiglu_ab,compile_blocks,moe_fp32,acceptance"
    )
    out = tmp_path / "out"
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    assert "no CUDA: rehearsal on the CPU at a tiny size" in log
    for step in ("env", "moe_large", "moe_compile", "moe_swiglu_ab", "compile_blocks", "moe_fp32", "acceptance"):
        assert f"== {step}: exit 0" in log, log
    ab = [json.loads(line) for line in (out / "moe_swiglu_ab.json").read_text().strip().splitlines()]
    assert [r["config"]["swiglu_min_elements"] for r in ab] == [1 << 26, 0, 1 << 26, 0]
    assert all(r["config"]["moe"]["experts"] == 4 and r["tokens_per_s"] > 0 for r in ab)
    (blocks,) = [json.loads(line) for line in (out / "compile_blocks.json").read_text().strip().splitlines()]
    assert blocks["config"]["compile"] == "default" and blocks["tokens_per_s"] > 0  # CUDA graphs: on CUDA only
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


def test_kernels_rehearsal_writes_one_record_per_target_of_issue_36(tmp_path):
    """`kernels` on the CPU: every part runs at tiny sizes with the Triton calls in the
    interpreter, and the merge leaves ONE results file, named as the repository keeps them,
    with one record per target (schema checked) and the figures of every kernel built today."""
    from bench.kernel_records import BY_NAME, NOT_BUILT, TARGETS, check

    proc = session(tmp_path, "kernels")
    out = tmp_path / "out"
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    assert "no CUDA: rehearsal on the CPU at tiny sizes" in log
    for part in ("gpt_1b_tp4", "8b", "e2e_llama", "e2e_gpt_1b", "e2e_fp8"):
        assert f"== {part}: exit 0" in log, log
    (path,) = (out / "results" / "gpu").glob("*-cpu-kernels.json")
    assert path.name.endswith("-cpu-kernels.json") and not (out / "parts").exists()
    assert f"torch {torch.__version__}" in (out / "env.txt").read_text()
    records = json.loads(path.read_text())
    assert check(records) == [] and [r["name"] for r in records] == [t.name for t in TARGETS]
    by = {r["name"]: r for r in records}
    assert all(r["rehearsal"] and r["device"] == "cpu" for r in records)
    # Built today: both sides ran, the Triton side in the interpreter, on the CPU's wall clock.
    for shape in ("gpt_1b_tp4", "8b"):
        for stem in ("linear+GeLU", "linear+SwiGLU", "cross-entropy vs F.cross_entropy",
                     "grouped GEMM Triton vs grouped_mm"):  # fmt: skip
            rec = by[f"{stem} {shape}"]
            assert rec["meshtron"] > 0 and rec["baseline"] > 0 and rec["ratio"] > 0, rec
            assert rec["method"] == {"meshtron": "cpu_wall", "baseline": "cpu_wall"} and rec["shape"], rec
            assert rec["host_us"]["meshtron"] > 0 and rec["wall_ms"]["baseline"] > 0, rec
        assert by[f"grouped GEMM grouped_mm vs dense {shape}"]["unit"] == "TFLOP/s"
        assert by[f"grouped GEMM grouped_mm vs dense {shape}"]["meshtron"] > 0
    for name in ("RMSNorm h2048 device", "LayerNorm h8192 device", "RMSNorm h2048 host"):
        assert by[name]["meshtron"] > 0 and by[name]["baseline"] > 0, by[name]
    assert by["linear+SwiGLU saved activations gpt_1b_tp4"]["baseline"] == pytest.approx(3, abs=0.05)
    assert by["fused LM head + loss time vs Liger"]["meshtron"] > 0
    assert by["cross-entropy vs F.cross_entropy 8b"]["baseline_system"].startswith("F.cross_entropy")
    # Being built by others: a figure once the API exists, else a record saying "not built".
    for name in (
        "gemm x·Wᵀ gpt_1b_tp4",
        "gemm dW 8b",
        "residual+RMSNorm h2048 device",
        "residual+LayerNorm h2048 wall",
    ):
        rec = by[name]
        assert (rec["meshtron"] or 0) > 0 or rec["note"].startswith(NOT_BUILT), rec
    assert by["FP8 GEMM vs bf16 8b"]["meshtron"] > 0 and by["FP8 GEMM vs bf16 8b"]["baseline"] > 0
    fp8_loss = by["FP8 training loss vs bf16, 200 steps"]  # the tiny run: a relative difference
    assert 0 <= fp8_loss["meshtron"] < 0.2 and set(fp8_loss["loss"]) == {"bf16", "fp8"}, fp8_loss
    fp8_experts = by["FP8 expert GEMM vs bf16 8b"]  # the CPU's path: the dequantized emulation
    assert fp8_experts["meshtron"] > 0 and fp8_experts["baseline"] > 0 and "emulated" in fp8_experts["meshtron_system"]
    recompute = by["linear+SwiGLU recompute mode vs torch + activation checkpointing gpt_1b_tp4"]
    assert recompute["meshtron"] > 0 and recompute["baseline_system"].startswith("torch.utils.checkpoint"), recompute
    for name in ("end to end llama 8L h1024 auto vs torch", "end to end gpt_1b 4L auto vs torch"):
        assert by[name]["meshtron"] > 0 and by[name]["baseline"] > 0 and by[name]["unit"] == "tokens/s"
    assert by["end to end gpt_1b 4L auto vs torch"]["order"] == ["auto", "torch"]
    assert BY_NAME["end to end gpt_1b 4L auto vs torch"].target == by["end to end gpt_1b 4L auto vs torch"]["target"]


def test_kernels_out_of_budget_still_writes_every_target_as_not_measured(tmp_path):
    proc = session(tmp_path, "kernels", GPU_SESSION_BUDGET="10")
    out = tmp_path / "out"
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    assert "== gpt_1b_tp4: skipped" in log and "== e2e_gpt_1b: skipped" in log and "== merge: 0 part files" in log
    (path,) = (out / "results" / "gpu").glob("*-kernels.json")
    records = json.loads(path.read_text())
    assert all(r["meshtron"] is None and r["met"] is not True for r in records)
    assert "did not run or did not finish" in records[0]["note"]


def test_checks_rehearsal_collects_the_cuda_tests_and_rehearses_the_attention_check(tmp_path):
    """`checks` on the CPU: the cuda-marked tests of the device-only paths are collected (each
    skips with its reason; none deselected away by a typo in CHECK_TESTS), and
    bench/attention_check.py writes its records."""
    proc = session(tmp_path, "checks")
    out = tmp_path / "out"
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    summary = (out / "pytest_cuda.txt").read_text().strip().splitlines()[-1]
    skipped = int(summary.split(" skipped")[0].split()[-1])
    assert skipped >= 16 and "failed" not in summary and "error" not in summary, summary
    records = json.loads((out / "attention_check.json").read_text())
    assert {r["name"].split()[0] for r in records} == {"varlen", "flex"} and all(r["rehearsal"] for r in records)
