"""Smoke tests of the MoE benchmarks: bench/moe_layer.py (one MoE block, forward+backward,
with its profiled breakdown) and bench/throughput.py with MoE options, at tiny sizes, run as
`python bench/...` subprocesses the way a user runs them; each prints one JSON object."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench_module():
    """bench/moe_layer.py imported as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_moe_layer", ROOT / "bench" / "moe_layer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def run_bench(script: str, *args: str, timeout: float = 60) -> dict:
    """The JSON object `python bench/<script> args...` printed (its last stdout line)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_moe_layer_bench_reports_speed_and_breakdown():
    out = run_bench(
        "moe_layer.py",
        "--tokens",
        "64",
        "--hidden",
        "32",
        "--ffn",
        "64",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--shared-experts",
        "1",
        "--threads",
        "1",
        "--warmup",
        "1",
        "--iters",
        "1",
    )
    for key in ("config", "layout", "threads", "tokens_per_s", "ms", "breakdown", "host"):
        assert key in out, key
    assert out["tokens_per_s"] > 0
    assert set(out["ms"]) == {"median", "min", "max"} and out["ms"]["median"] > 0
    assert out["config"]["experts"] == 4 and out["config"]["shared_experts"] == 1
    regions = out["breakdown"]["regions"]
    assert {"router", "dispatch", "expert_gemm", "expert_activation", "combine", "shared_experts", "other"} == set(
        regions
    )
    assert regions["expert_gemm"]["forward_ms"] > 0 and regions["expert_gemm"]["backward_ms"] > 0
    assert regions["shared_experts"]["forward_ms"] > 0
    assert "peer" not in out


def test_throughput_bench_runs_a_moe_model():
    out = run_bench(
        "throughput.py",
        "--arch",
        "llama",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--vocab",
        "128",
        "--seq",
        "8",
        "--batch",
        "2",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--moe-ffn",
        "32",
        "--shared-experts",
        "1",
        "--capacity-factor",
        "1.5",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--threads",
        "1",
    )
    assert out["tokens_per_s"] > 0
    assert out["config"]["moe"] == {
        "experts": 4,
        "top_k": 2,
        "moe_ffn": 32,
        "shared_experts": 1,
        "moe_every": 1,
        "activation": "swiglu",
        "capacity_factor": 1.5,
    }
    assert out["layout"]["ep"] == 1 and out["layout"]["pp"] == 1 and out["reference"] is None


def test_throughput_bench_rejects_expert_options_without_experts():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "throughput.py"), "--ep", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--experts" in proc.stderr


def run_bench_fails(script: str, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`python bench/<script> args...` that must refuse: exit 2, one line on stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return proc


TINY = (
    "--tokens",
    "32",
    "--hidden",
    "32",
    "--ffn",
    "64",
    "--experts",
    "4",
    "--top-k",
    "2",
    "--threads",
    "1",
    "--warmup",
    "1",
    "--iters",
    "1",
)


def test_moe_layer_bench_bf16_with_the_peer_on_cpu():
    # bf16 for both blocks; auto kernels resolve to torch off CUDA.
    out = run_bench(
        "moe_layer.py", *TINY, "--device", "cpu", "--dtype", "bf16", "--kernels", "auto", "--peer", "--rounds", "1"
    )
    assert out["device"] == "cpu" and out["dtype"] == "bf16" and out["config"]["dtype"] == "bf16"
    assert out["kernels"] == "torch" and out["kernels_requested"] == "auto" and out["config"]["kernels"] == "torch"
    assert out["tokens_per_s"] > 0 and out["breakdown"]["time"] == "host"
    assert out["peer"]["dtype"] == "bf16" and out["peer"]["device"] == "cpu" and out["peer"]["tokens_per_s"] > 0
    assert out["ratio_tokens_per_s_vs_peer"] > 0


@pytest.mark.timeout(300)
def test_moe_layer_bench_compiles_both_blocks():
    """--compile: both blocks under torch.compile (meshtron's whole, fullgraph=True); the host
    dispatches a fraction of the eager block's ~90 operators; no region breakdown (its markers
    would break the graph)."""
    out = run_bench(
        "moe_layer.py",
        *TINY,
        "--device",
        "cpu",
        "--dtype",
        "bf16",
        "--peer",
        "--rounds",
        "1",
        "--compile",
        "default",
        timeout=300,
    )
    assert out["compile"] == "default" and out["breakdown"] is None
    assert 0 < out["host_ops"]["total"] < 40 and out["peer"]["host_ops"]["total"] > 0
    assert out["tokens_per_s"] > 0 and out["ratio_tokens_per_s_vs_peer"] > 0


def test_moe_layer_bench_compiles_only_bf16_single_process_blocks():
    proc = run_bench_fails("moe_layer.py", *TINY, "--device", "cpu", "--compile", "default")
    assert "--compile=default" in proc.stderr and "bf16" in proc.stderr


def test_throughput_bench_compiles_moe_layers_only_where_the_rules_allow():
    proc = run_bench_fails(
        "throughput.py",
        "--arch",
        "llama",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--vocab",
        "128",
        "--seq",
        "8",
        "--batch",
        "2",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--moe-ffn",
        "32",
        "--steps",
        "1",
        "--compile-moe",
    )
    assert "--compile-moe: trainer.compile_moe=true needs trainer.precision=bf16 (got fp32)" in proc.stderr


def test_moe_layer_bench_refuses_triton_on_cpu_without_the_interpreter():
    proc = run_bench_fails("moe_layer.py", *TINY, "--device", "cpu", "--kernels", "triton")
    assert "--kernels=triton" in proc.stderr and "TRITON_INTERPRET" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_moe_layer_bench_refuses_cuda_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has CUDA")
    proc = run_bench_fails("moe_layer.py", *TINY, "--device", "cuda")
    assert "--device=cuda" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_moe_layer_device_time_attribution():
    """The CUDA breakdown's attribution of kernel time (bench/moe_layer.py device_regions), on
    hand-made profiler events: forward kernels by innermost region, backward by autograd node."""
    from types import SimpleNamespace

    bench = _bench_module()

    def ev(name, parent=None, kernels=(), seq=-1, annotation=None):
        return SimpleNamespace(
            name=name,
            cpu_parent=parent,
            sequence_nr=seq,
            kernels=[SimpleNamespace(name=f"kernel{d}", duration=d) for d in kernels]
            + ([SimpleNamespace(name=name, duration=annotation)] if annotation else []),
        )

    it = ev("moe::iteration")
    router, experts = ev("moe::router", it), ev("moe::experts", it)
    # a Triton launch: no aten op of its own; the region's GPU-timeline span is no kernel
    gemm = ev("moe::expert_gemm", experts, kernels=[100], annotation=1000)
    events = [
        it,
        router,
        experts,
        gemm,
        ev("aten::linear", router, kernels=[10]),
        ev("aten::mul", experts, kernels=[5]),
        ev("aten::grouped_mm", ev("aten::_grouped_mm", gemm), kernels=[50]),
        ev("aten::index_add_", it, kernels=[3]),
        ev("aten::mm", ev("autograd::engine::evaluate_function: GroupedGemmFunctionBackward", seq=7), kernels=[200]),
        ev("aten::mul", ev("autograd::engine::evaluate_function: MulBackward0", seq=8), kernels=[7]),
        ev("aten::mm", ev("autograd::engine::evaluate_function: MmBackward0", seq=9), kernels=[11]),
        ev("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", seq=10, kernels=[2]),
        ev("aten::empty", experts),
    ]
    fwd, back = bench.device_regions(events, {8: "expert_gemm", 9: "router", 10: "expert_gemm"})
    assert dict(fwd) == {"router": 10, "expert_gemm": 150, "expert_activation": 5, "other": 3}
    assert dict(back) == {"expert_gemm": 200, "expert_activation": 7, "router": 11, "other": 2}


def test_gpu_acceptance_moe_layer_entry_reads_the_bench_report(monkeypatch):
    """bench/gpu_acceptance.py's moe_layer entries, fed by the same bench at a tiny shape on CPU
    (the command it builds asks for cuda: swapped for cpu here), and a failing run recorded."""
    from bench import gpu_acceptance

    real = gpu_acceptance._bench_json
    seen = []

    def on_cpu(args, timeout):
        seen.append(list(args))
        if "fp32" in args:
            raise RuntimeError("bench/moe_layer.py exited 2: no GPU")
        args = ["cpu" if a == "cuda" else a for a in args]
        return real([*args, *TINY], timeout)

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(gpu_acceptance, "_bench_json", on_cpu)
    out = gpu_acceptance.run_moe_layer(timeout=60)
    assert [a[:9] for a in seen] == [
        ["bench/moe_layer.py", "--device", "cuda", "--dtype", d, "--kernels", "auto", "--peer", "--rounds"]
        for d in ("bf16", "fp32")
    ]
    bf16 = out["bf16"]
    assert bf16["tokens_per_s"] > 0 and bf16["peer_tokens_per_s"] > 0 and bf16["ms"]["median"] > 0
    assert bf16["ratio_tokens_per_s_vs_peer"] > 0 and bf16["meets_target"] == (
        bf16["ratio_tokens_per_s_vs_peer"] >= 1.2
    )
    assert bf16["kernels"] == "torch" and bf16["config"]["dtype"] == "bf16" and bf16["breakdown_time"] == "host"
    assert set(bf16["breakdown_fractions"]) == {
        "router",
        "dispatch",
        "expert_gemm",
        "expert_activation",
        "combine",
        "shared_experts",
        "other",
    }
    assert "error" not in bf16 and "no GPU" in out["fp32"]["error"]


def test_host_ops_counts_dispatched_operators_not_views_or_inner_casts():
    """bench/moe_layer.py host_ops: top-level ops of a forward + backward, split at the first
    autograd node; views and metadata reads do not count, a conversion the code asks for does
    (once), a cast inside another op does not."""

    bench = _bench_module()
    cpu = torch.device("cpu")
    x = torch.randn(6, 4)

    def views_only():
        x.view(4, 6).t().reshape(-1)[2:].unsqueeze(0)

    def casts():
        x.double()  # asked for: one _to_copy
        torch.cumsum(x[:, 0].long(), 0, dtype=torch.int32)  # .long() counts; cumsum's inner cast does not

    assert bench.host_ops(views_only, cpu)["total"] == 0
    ops = bench.host_ops(casts, cpu)
    assert ops["by_op"] == {"_to_copy": 2, "cumsum": 1} and ops["kernel_launches"] is None

    w = torch.randn(4, 3, requires_grad=True)

    def step():
        (x @ w).square().sum().backward()

    ops = bench.host_ops(step, cpu)
    # mm, square, sum and backward()'s seed gradient (ones_like, before the engine starts); then the gradients
    assert ops["forward"] == 4 and ops["by_op"]["ones_like"] == 1 and ops["backward"] > 0
    assert ops["total"] == ops["forward"] + ops["backward"] == sum(ops["by_op"].values())
    assert ops["before_first_gemm"] is None  # no grouped GEMM in this step

    def grouped():
        y = x.square().exp()  # two ops, then the GEMM
        torch.bmm(y.view(2, 3, 4), w.detach().expand(2, 4, 3)).sum()

    assert bench.host_ops(grouped, cpu)["before_first_gemm"] == 2


def test_device_kernels_rank_kernels_by_summed_device_time():
    """bench/moe_layer.py `_device_kernels`: device events grouped by kernel name, summed over
    calls (profiler microseconds -> ms), largest first, cut to `top`; the total covers all;
    region annotations on the GPU timeline are left out."""
    from types import SimpleNamespace as NS

    bench = _bench_module()

    def kernel(name, start, end):
        return NS(name=name, device_type=NS(name="CUDA"), time_range=NS(start=start, end=end))

    events = [kernel("gemm", 0, 400), kernel("silu", 400, 450), kernel("gemm", 450, 1050), kernel("copy", 1050, 1350)]
    region = kernel("moe::experts", 0, 1350)  # a record_function region's span on the GPU timeline: not work
    got = bench._device_kernels(events, top=2)
    assert got == {
        "total_ms": 1.35,
        "kernels": 4,
        "top": [{"name": "gemm", "calls": 2, "ms": 1.0}, {"name": "copy", "calls": 1, "ms": 0.3}],
    }
    cpu_event = NS(name="aten::mm", device_type=NS(name="CPU"), time_range=NS(start=0, end=1), cpu_parent=None)
    assert bench.count_host_ops([cpu_event, region] + events, cuda=True)["device_kernels"]["kernels"] == 4


def test_device_idle_finds_the_gaps_between_busy_kernels():
    """bench/moe_layer.py `_device_idle`: from the first host op to the last kernel, the gaps
    of at least 10 us in the union of the (possibly overlapping) kernels, the host ops that
    started in each, forward or backward by the autograd engine's start."""
    from types import SimpleNamespace as NS

    bench = _bench_module()

    def event(name, start, end):
        return NS(name=name, time_range=NS(start=start, end=end))

    ops = [event("aten::mm", t, t + 2) for t in (0, 20, 30, 500, 520)]
    kernels = [
        event("gemm", 40, 300),
        event("silu", 100, 310),
        event("copy", 315, 400),  # 5 us: no gap
        event("mm_bwd", 600, 1000),
    ]
    got = bench._device_idle(kernels, ops, bwd_start=450)
    assert got == {
        "span_ms": 1.0,
        "idle_ms": 0.24,
        "before_first_kernel_ms": 0.04,
        "gaps": [
            {"at_ms": 0.0, "ms": 0.04, "phase": "forward", "next_kernel": "gemm", "host_ops_started": 3},
            {"at_ms": 0.4, "ms": 0.2, "phase": "backward", "next_kernel": "mm_bwd", "host_ops_started": 2},
        ],
    }
    assert bench._device_idle(kernels, ops, bwd_start=450, top=1)["gaps"][0]["ms"] == 0.2  # the longest
