"""Smoke tests of the MoE benchmarks: bench/moe_layer.py (one MoE block, forward+backward,
with its profiled breakdown) and bench/throughput.py with MoE options, at tiny sizes, run as
`python bench/...` subprocesses the way a user runs them; each prints one JSON object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, timeout: float = 60) -> dict:
    """The JSON object `python bench/<script> args...` printed (its last stdout line)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_moe_layer_bench_reports_speed_and_breakdown():
    out = run_bench("moe_layer.py", "--tokens", "64", "--hidden", "32", "--ffn", "64", "--experts", "4",
                    "--top-k", "2", "--shared-experts", "1", "--threads", "1", "--warmup", "1", "--iters", "1")
    for key in ("config", "layout", "threads", "tokens_per_s", "ms", "breakdown", "host"):
        assert key in out, key
    assert out["tokens_per_s"] > 0
    assert set(out["ms"]) == {"median", "min", "max"} and out["ms"]["median"] > 0
    assert out["config"]["experts"] == 4 and out["config"]["shared_experts"] == 1
    regions = out["breakdown"]["regions"]
    assert {"router", "dispatch", "expert_gemm", "expert_activation", "combine", "shared_experts",
            "other"} == set(regions)
    assert regions["expert_gemm"]["forward_ms"] > 0 and regions["expert_gemm"]["backward_ms"] > 0
    assert regions["shared_experts"]["forward_ms"] > 0
    assert "peer" not in out


def test_throughput_bench_runs_a_moe_model():
    out = run_bench("throughput.py", "--arch", "llama", "--layers", "1", "--hidden", "32", "--heads", "2",
                    "--vocab", "128", "--seq", "8", "--batch", "2", "--experts", "4", "--top-k", "2",
                    "--moe-ffn", "32", "--shared-experts", "1", "--warmup", "0", "--steps", "1", "--threads", "1")
    assert out["tokens_per_s"] > 0
    assert out["config"]["moe"] == {"experts": 4, "top_k": 2, "moe_ffn": 32, "shared_experts": 1,
                                    "moe_every": 1, "activation": "swiglu"}
    assert out["layout"]["ep"] == 1 and out["layout"]["pp"] == 1 and out["reference"] is None


def test_throughput_bench_rejects_expert_options_without_experts():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--ep", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--experts" in proc.stderr
