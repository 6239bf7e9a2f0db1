"""Calibration of the layout planner's step-time model (`planning.step_time`) on this CPU.

Measures what the `cpu` preset's constants stand for (one thread's best fp32 matmul rate, a
tensor copy's memory bandwidth), then runs bench/throughput.py (the real training step, under
`torchrun --standalone`, OMP_NUM_THREADS=1) for layouts at world 4 (4 processes on the 2
shared cores) on its reference shape (GPT-2 style, 4 layers, hidden 256, 4 heads, seq 128,
global batch 8, vocab 8192, fp32, AdamW) and prints ONE JSON object: per layout the measured
and the modelled tokens/s, the relative error and the ranks in both orders; over all layouts
run, the mean and largest absolute error and Spearman's rank correlation (`spearman_all`);
over the DEFAULT_LAYOUTS among them, whether the two orders agree (`order_agrees`) and the
smallest gap between neighbouring measured medians (`default_layouts_min_gap`).

    python bench/plan_calibration.py [--steps 6] [--rounds 3] [--layouts all | tp1_dp4,pp4,...]
    python bench/plan_calibration.py --remodel calib.json   # a previous run's rounds, current model

Each layout runs --rounds times, interleaved, and its median is compared. The host is shared:
the JSON records the other CPUs' load bench/throughput.py saw in every round, and one
layout's rounds spread by several percent even on the quiet host. Layouts whose medians lie
within that noise (~5%) are ties: their measured order means nothing, so the four
DEFAULT_LAYOUTS are ones whose measured throughputs lie clearly further apart (>= ~8%), all
of them layouts a user could pick at world 4. About 3 minutes for the four, 10 for all; not
part of the test suite.
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
# per-rank batch), except the pipelines (microbatches of 1 or 2: m = 4 at pp=2, 8 at pp=4) and
# tp1_dp4_mb1; *_full recompute every layer (trainer.recompute=full)
LAYOUTS = {
    "tp1_dp4": (Layout(tp=1, dp=4, micro_batch_size=2), ["--tp", "1"]),
    "tp2_dp2": (Layout(tp=2, dp=2, sp=False, micro_batch_size=4), ["--tp", "2"]),
    "tp4": (Layout(tp=4, dp=1, micro_batch_size=8), ["--tp", "4"]),
    "pp2_dp2": (Layout(pp=2, dp=2, micro_batch_size=1), ["--pp", "2", "--micro-batch", "1"]),
    "pp4": (Layout(pp=4, dp=1, micro_batch_size=1), ["--pp", "4", "--micro-batch", "1"]),
    "tp2_pp2": (Layout(tp=2, pp=2, dp=1, micro_batch_size=2), ["--tp", "2", "--pp", "2", "--micro-batch", "2"]),
    "tp2_sp_dp2": (Layout(tp=2, dp=2, sp=True, micro_batch_size=4), ["--tp", "2", "--sp"]),
    "tp4_sp": (Layout(tp=4, dp=1, sp=True, micro_batch_size=8), ["--tp", "4", "--sp"]),
    "tp1_dp4_mb1": (Layout(tp=1, dp=4, micro_batch_size=1), ["--tp", "1", "--micro-batch", "1"]),
    "tp1_dp4_full": (Layout(tp=1, dp=4, recompute="full", micro_batch_size=2), ["--tp", "1", "--recompute", "full"]),
    "pp4_full": (
        Layout(pp=4, dp=1, recompute="full", micro_batch_size=1),
        ["--pp", "4", "--micro-batch", "1", "--recompute", "full"],
    ),
    "tp4_sp_full": (
        Layout(tp=4, dp=1, sp=True, recompute="full", micro_batch_size=8),
        ["--tp", "4", "--sp", "--recompute", "full"],
    ),
    "cp4_ring": (Layout(cp=4, dp=1, cp_comm="ring", micro_batch_size=8), ["--cp", "4", "--cp-comm", "ring"]),
    "cp4_a2a": (Layout(cp=4, dp=1, cp_comm="a2a", micro_batch_size=8), ["--cp", "4", "--cp-comm", "a2a"]),
}
DEFAULT_LAYOUTS = ("tp1_dp4", "pp4", "pp4_full", "tp4_sp_full")


def model() -> GPTConfig:
    """bench/throughput.py's default (DESIGN.md reference) shape."""
    return GPTConfig(arch="gpt2", num_layers=4, hidden_size=256, num_heads=4, vocab_size=8192, seq_len=128, dropout=0.0)


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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        str(ROOT / "bench" / "throughput.py"),
        "--batch",
        str(BATCH),
        "--steps",
        str(steps),
        "--warmup",
        "2",
        *args_list,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def ranks(values: dict[str, float]) -> dict[str, int]:
    """1 = fastest."""
    order = sorted(values, key=lambda k: -values[k])
    return {k: order.index(k) + 1 for k in values}


def spearman(a: dict[str, float], b: dict[str, float]) -> float | None:
    """Spearman rank correlation of two {layout: tokens/s}: Pearson's r of the ranks, tied
    values sharing their average rank (the model can price two layouts alike); None for fewer
    than 2 layouts or a constant side."""

    def avg_ranks(values: dict[str, float]) -> list[float]:
        vals = list(values.values())
        return [sum(w < v for w in vals) + (sum(w == v for w in vals) + 1) / 2 for v in (values[k] for k in a)]

    x, y = avg_ranks(a), avg_ranks(b)
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((u - mx) * (v - my) for u, v in zip(x, y))
    sxx, syy = sum((u - mx) ** 2 for u in x), sum((v - my) ** 2 for v in y)
    return None if n < 2 or sxx == 0 or syy == 0 else sxy / (sxx * syy) ** 0.5


def summary(names: list[str], rounds: dict[str, list[dict]], host: dict[str, list], constants: dict) -> dict:
    """The JSON object: per layout the measured median (of `rounds`' tokens/s) beside the `cpu`
    preset's modelled tokens/s, ranks, errors, Spearman over all `names`, and whether the order
    of the DEFAULT_LAYOUTS among them agrees."""
    cfg = model()
    cluster = cluster_preset("cpu", WORLD, WORLD)
    measured, modelled, detail = {}, {}, {}
    for name in names:
        layout = LAYOUTS[name][0]
        mem = layout_memory(cfg, layout, global_batch_size=BATCH, device="cpu")
        t = step_time(cfg, layout, cluster, global_batch_size=BATCH, grad_elements=mem["grad_elements"])
        rates = rounds[name]
        measured[name], modelled[name] = statistics.median(rates), t.tokens_per_s
        detail[name] = {
            "overrides": layout.overrides(),
            "measured_tokens_per_s": measured[name],
            "measured_rounds": rates,
            "modelled_tokens_per_s": t.tokens_per_s,
            "relative_error": t.tokens_per_s / measured[name] - 1,
            "modelled_step_s": t.total,
            "modelled_terms": {k: v for k, v in t.as_dict().items() if k != "terms"},
            "host_other_busy_cpus": host[name],
        }
    rm, rp = ranks(measured), ranks(modelled)
    for name in names:
        detail[name].update(measured_rank=rm[name], modelled_rank=rp[name])
    errors = [abs(d["relative_error"]) for d in detail.values()]
    four = [n for n in names if n in DEFAULT_LAYOUTS]
    gaps = sorted((measured[n] for n in four), reverse=True)
    return {
        "bench": "plan_calibration",
        "world": WORLD,
        "global_batch": BATCH,
        "shape": "gpt2 L4 h256 a4 s128 V8192 fp32",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu_preset": CPU_CALIBRATION,
        "measured_constants": constants,
        "layouts": detail,
        "default_layouts": four,
        "order_agrees": (sorted(four, key=lambda k: -measured[k]) == sorted(four, key=lambda k: -modelled[k]))
        if four
        else None,
        "default_layouts_min_gap": min((a / b - 1 for a, b in zip(gaps, gaps[1:])), default=None),
        "spearman_all": spearman(measured, modelled),
        "mean_abs_relative_error": sum(errors) / len(errors),
        "max_abs_relative_error": max(errors),
        "torch": torch.__version__,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds over the layouts; the median tokens/s of each is compared",
    )
    p.add_argument(
        "--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma-separated, or all: {', '.join(LAYOUTS)}"
    )
    p.add_argument(
        "--remodel",
        metavar="JSON",
        help="measure nothing: compare the rounds a previous run of this script wrote with the "
        "current model (after a change of the cpu preset)",
    )
    args = p.parse_args(argv)
    if args.remodel:
        old = json.loads(Path(args.remodel).read_text())
        names = [n for n in old["layouts"] if n in LAYOUTS]
        rounds = {n: old["layouts"][n]["measured_rounds"] for n in names}
        host = {n: old["layouts"][n]["host_other_busy_cpus"] for n in names}
        out = summary(names, rounds, host, old["measured_constants"])
        out.update(date=old["date"], remodelled=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        print(json.dumps(out, indent=1))
        return
    names = list(LAYOUTS) if args.layouts == "all" else args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
    torch.set_num_threads(1)
    constants = {"flops_per_core": measure_cpu_peak_flops(torch.float32), "mem_bw_one_thread": memory_bandwidth()}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):  # interleaved, so a burst of load on the shared host hits every layout
        for name in names:
            runs[name].append(measure(LAYOUTS[name][1], args.steps))
            print(
                f"round {r + 1} {name}: {runs[name][-1]['tokens_per_s']:.0f} tokens/s "
                f"(others busy {runs[name][-1]['host']['other_busy_cpus']})",
                file=sys.stderr,
                flush=True,
            )
    rounds = {n: [r["tokens_per_s"] for r in runs[n]] for n in names}
    host = {n: [r["host"]["other_busy_cpus"] for r in runs[n]] for n in names}
    print(json.dumps(summary(names, rounds, host, constants), indent=1))


if __name__ == "__main__":
    main()
