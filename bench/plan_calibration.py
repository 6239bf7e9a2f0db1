"""Calibration of the layout planner's step-time model (`planning.step_time`) on this CPU.

Measures what the `cpu` preset's constants stand for (one thread's best fp32 matmul rate, a
tensor copy's memory bandwidth), then runs bench/throughput.py (the real training step, under
`torchrun --standalone`, OMP_NUM_THREADS=1) for four layouts at world 4 on its reference shape
(GPT-2 style, 4 layers, hidden 256, 4 heads, seq 128, global batch 8, vocab 8192, fp32,
AdamW) and prints ONE JSON object: per layout the measured and the modelled tokens/s, the
relative error, the ranks in both orders and whether the orders agree.

    python bench/plan_calibration.py [--steps 6] [--rounds 3] [--layouts tp1_dp4,tp2_dp2,tp4,pp2_dp2]

Each layout runs --rounds times, interleaved, and its median is compared. Takes about ten
minutes on 2 cores; not part of the test suite. The host is shared: the JSON records the other
CPUs' load bench/throughput.py saw in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from meshtron.models.config import GPTConfig  # noqa: E402
from meshtron.planning.peak import measure_cpu_peak_flops  # noqa: E402
from meshtron.planning.search import layout_memory  # noqa: E402
from meshtron.planning.step_time import CPU_CALIBRATION, Layout, cluster_preset, step_time  # noqa: E402

WORLD = 4
BATCH = 8
# name: (Layout, bench/throughput.py arguments); micro batch as the bench defaults (the whole
# per-rank batch), except the pipeline, which gets 4 microbatches of 1 (m = 4, bubble 1/5)
LAYOUTS = {
    "tp1_dp4": (Layout(tp=1, dp=4, micro_batch_size=2), ["--tp", "1"]),
    "tp2_dp2": (Layout(tp=2, dp=2, sp=False, micro_batch_size=4), ["--tp", "2"]),
    "tp4": (Layout(tp=4, dp=1, micro_batch_size=8), ["--tp", "4"]),
    "pp2_dp2": (Layout(pp=2, dp=2, micro_batch_size=1), ["--pp", "2", "--micro-batch", "1"]),
}


def model() -> GPTConfig:
    """bench/throughput.py's default (DESIGN.md reference) shape."""
    return GPTConfig(arch="gpt2", num_layers=4, hidden_size=256, num_heads=4, vocab_size=8192, seq_len=128,
                     dropout=0.0)


def memory_bandwidth(mib: int = 64, seconds: float = 0.5) -> float:
    """Best bytes/s of copying a `mib` MiB fp32 tensor on this process's threads (read + write)."""
    a = torch.randn(mib * 2**18)
    b = torch.empty_like(a)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while best == float("inf") or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best


def measure(args_list: list[str], steps: int) -> dict:
    """One bench/throughput.py run at world 4 (torchrun, one thread per process); its JSON."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(ROOT / "bench" / "throughput.py"), "--batch", str(BATCH), "--steps", str(steps), "--warmup", "2",
           *args_list]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def ranks(values: dict[str, float]) -> dict[str, int]:
    """1 = fastest."""
    order = sorted(values, key=lambda k: -values[k])
    return {k: order.index(k) + 1 for k in values}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds over the layouts; the median tokens/s of each is compared")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args(argv)
    names = args.layouts.split(",")
    torch.set_num_threads(1)
    constants = {"flops_per_core": measure_cpu_peak_flops(torch.float32), "mem_bw_one_thread": memory_bandwidth()}
    cfg = model()
    cluster = cluster_preset("cpu", WORLD, WORLD)
    measured, modelled, detail = {}, {}, {}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):  # interleaved, so a burst of load on the shared host hits every layout
        for name in names:
            runs[name].append(measure(LAYOUTS[name][1], args.steps))
    for name in names:
        layout = LAYOUTS[name][0]
        mem = layout_memory(cfg, layout, global_batch_size=BATCH, device="cpu")
        t = step_time(cfg, layout, cluster, global_batch_size=BATCH, grad_elements=mem["grad_elements"])
        rates = [r["tokens_per_s"] for r in runs[name]]
        measured[name], modelled[name] = statistics.median(rates), t.tokens_per_s
        detail[name] = {"overrides": layout.overrides(), "measured_tokens_per_s": measured[name],
                        "measured_rounds": rates, "modelled_tokens_per_s": t.tokens_per_s,
                        "relative_error": t.tokens_per_s / measured[name] - 1, "modelled_step_s": t.total,
                        "modelled_terms": {k: v for k, v in t.as_dict().items() if k != "terms"},
                        "host_other_busy_cpus": [r["host"]["other_busy_cpus"] for r in runs[name]]}
    rm, rp = ranks(measured), ranks(modelled)
    for name in names:
        detail[name].update(measured_rank=rm[name], modelled_rank=rp[name])
    errors = [abs(d["relative_error"]) for d in detail.values()]
    print(json.dumps({
        "bench": "plan_calibration", "world": WORLD, "global_batch": BATCH, "shape": "gpt2 L4 h256 a4 s128 V8192 fp32",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_preset": CPU_CALIBRATION,
        "measured_constants": constants, "layouts": detail,
        "order_agrees": [k for k in sorted(names, key=rm.get)] == [k for k in sorted(names, key=rp.get)],
        "mean_abs_relative_error": sum(errors) / len(errors), "max_abs_relative_error": max(errors),
        "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
