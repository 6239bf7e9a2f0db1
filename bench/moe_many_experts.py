"""Many small experts beside a few large ones (issue 40): one MoE layer's forward + backward at
8 experts top-2 (Mixtral-like) and at 64 / 128 / 256 experts top-8 (fine-grained, Qwen3-MoE /
DeepSeek-V3-like), the expert width scaled so that every case has the same active expert FLOPs
per token (8 x 1024 top-2 = 2048 = 8 x 256 top-8), the same tokens per step.

Per case (each built by bench/moe_layer.py `build_meshtron`: SwiGLU experts, softmax top-k
router, renormalised, dropless, aux loss in the backward):
  * per-token time: median over every timed iteration, the cases interleaved round by round
    (`--rounds`, `--iters` each) so that all see the same machine load;
  * host ops per layer: top-level aten ops one forward + backward dispatches (moe_layer.py
    `count_host_ops`: views and metadata reads left out; about one kernel launch each on a GPU);
  * nested ops: every aten op the profiler records, those inside other ops included: on the
    CPU torch's `_grouped_mm` loops over the groups in C++ (an `mm` per group and direction),
    which the host-op count does not see;
  * grouped-GEMM share: fraction of a profiled iteration in the expert GEMMs (moe_layer.py
    `breakdown`: host time on the CPU, kernel time on CUDA).

Writes ONE JSON list of records in bench/kernel_records.py's schema (name, metric, meshtron,
baseline, ratio, target, met, device, date, torch, triton, plus `value` = meshtron and the
case's shape): `meshtron` the case's figure, `baseline` the 8-expert case's, `ratio` the
8-expert figure over the case's for times (higher: the case is faster per token), the case's
over the 8-expert's for counts. No targets: informative figures (met null).

    OMP_NUM_THREADS=1 python bench/moe_many_experts.py --out bench/results/cpu/DATE-moe-many-experts.json
    python bench/moe_many_experts.py --device cuda --dtype bf16 --kernels auto --out-dir $OUT/results/gpu
    python bench/moe_many_experts.py --cpu-rehearsal --out-dir /tmp/out   # tiny sizes: proves the paths

Sizes: the CPU default is hidden 256, 2,048 tokens, fp32, one thread; `--device cuda` defaults
to hidden 2048, 8,192 tokens, bf16 (Qwen3-30B-A3B's experts: 128 of 768 top-8 beside 8 of 3072
top-2). `--out-dir` names the file `<UTC date>-<device>-moe-experts.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_records as kr  # noqa: E402
import moe_layer as ml  # noqa: E402
import torch  # noqa: E402

from meshtron.kernels import selfcheck  # noqa: E402
from meshtron.kernels.backend import CHECKED, resolve_backend  # noqa: E402
from meshtron.mpu.mesh import ParallelConfig, build_mesh  # noqa: E402

# (experts, top_k, ffn) per size; the first is the baseline every other case is compared with
SIZES = {
    "cpu": {"hidden": 256, "tokens": 2048, "cases": [(8, 2, 1024), (64, 8, 256), (128, 8, 256), (256, 8, 256)]},
    "cuda": {"hidden": 2048, "tokens": 8192, "cases": [(8, 2, 3072), (64, 8, 768), (128, 8, 768), (256, 8, 768)]},
    "rehearsal": {"hidden": 64, "tokens": 128, "cases": [(8, 2, 64), (64, 8, 16)]},
}


def case_name(experts: int, top_k: int, ffn: int) -> str:
    return f"{experts}x{ffn} top-{top_k}"


def targets(cases, hidden: int, tokens: int) -> list[kr.Target]:
    """Informative targets (no threshold) for `cases`, named with the shape."""
    shape = f"h{hidden} {tokens} tokens"
    out = []
    for c in cases:
        n = case_name(*c)
        out += [
            kr.Target(
                f"moe layer per token {n} {shape}", "time per token, forward + backward, vs 8 experts", "us", None
            ),
            kr.Target(f"moe host ops {n} {shape}", "top-level aten ops per layer, forward + backward", "ops", None),
            kr.Target(f"moe nested ops {n} {shape}", "every aten op incl. those inside ops, fwd + bwd", "ops", None),
            kr.Target(f"moe grouped GEMM share {n} {shape}", "fraction of the profiled iteration", "fraction", None),
        ]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=list(ml.DTYPES), help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--kernels", default="torch", choices=["auto", "torch", "triton"])
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on cpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="timed iterations per case and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the cases")
    p.add_argument("--cpu-rehearsal", action="store_true", help="tiny sizes, one iteration: the code paths only")
    p.add_argument("--out", type=Path, default=None, help="the results file")
    p.add_argument("--out-dir", type=Path, default=None, help="write DIR/<UTC date>-<device>-moe-experts.json")
    return p.parse_args(argv)


def nested_ops(step, device) -> int:
    """Every aten op of one profiled forward + backward, those nested in other ops included."""
    from torch.profiler import ProfilerActivity, profile

    ml.sync(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        ml.sync(device)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def main(argv=None) -> int:
    args = parse_args(argv)
    size = SIZES["rehearsal" if args.cpu_rehearsal else args.device]
    if args.cpu_rehearsal:
        args.device, args.warmup, args.iters, args.rounds = "cpu", 1, 1, 1
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    hidden, tokens = args.hidden or size["hidden"], args.tokens or size["tokens"]
    if args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backend = resolve_backend(args.kernels, device.type)
    mesh = build_mesh(ParallelConfig(), device_type=device.type)
    cases = size["cases"]
    steps, layers = {}, {}
    for c in cases:
        e, k, f = c
        margs = ml.parse_args(
            ["--tokens", str(tokens), "--hidden", str(hidden), "--experts", str(e), "--top-k", str(k)]
            + ["--ffn", str(f), "--dtype", dtype, "--kernels", args.kernels]
        )
        _, layers[c], steps[c] = ml.build_meshtron(margs, mesh, tokens, device, backend)
        for i in range(max(args.warmup, 1)):
            steps[c]()
            if i == 0 and backend == CHECKED:
                selfcheck.agree(device)
    times = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            times[c] += ml.time_iters(steps[c], args.iters, 1, device)
    figures = {}
    for c in cases:
        host = ml.host_ops(steps[c], device)
        nested = nested_ops(steps[c], device)
        brk, _ = ml.breakdown(steps[c], layers[c], device)
        figures[c] = {
            "us_per_token": statistics.median(times[c]) / tokens * 1e6,
            "ms": [round(t * 1e3, 3) for t in times[c]],
            "host_ops": host["total"],
            "nested_ops": nested,
            "gemm_share": brk["regions"]["expert_gemm"]["fraction"],
            "regions": {r: v["fraction"] for r, v in brk["regions"].items()},
            "grouped_mm_calls": host["by_op"].get("_grouped_mm", 0),
        }
    env = kr.current_env(rehearsal=args.cpu_rehearsal)  # a full-size CPU run measures: no rehearsal flag
    tgts = {t.name: t for t in targets(cases, hidden, tokens)}
    base = figures[cases[0]]
    records = []
    for c in cases:
        fig, n = figures[c], case_name(*c)
        shape = {
            "experts": c[0],
            "top_k": c[1],
            "ffn": c[2],
            "hidden": hidden,
            "tokens": tokens,
            "dtype": dtype,
            "kernels": backend,
            "threads": torch.get_num_threads(),
        }
        shp = f"h{hidden} {tokens} tokens"
        rows = [
            ("moe layer per token", round(fig["us_per_token"], 3), round(base["us_per_token"], 3), True),
            ("moe host ops", fig["host_ops"], base["host_ops"], False),
            ("moe nested ops", fig["nested_ops"], base["nested_ops"], False),
            ("moe grouped GEMM share", fig["gemm_share"], base["gemm_share"], False),
        ]
        for what, mine, theirs, time_like in rows:
            ratio = None
            if mine and theirs:
                ratio = round(theirs / mine if time_like else mine / theirs, 3)
            extra = {"shape": shape, "value": mine}
            if what == "moe layer per token":
                extra.update(
                    ms_per_iteration=fig["ms"],
                    method="cuda_sync_wall" if device.type == "cuda" else "cpu_wall",
                    regions=fig["regions"],
                )
            records.append(kr.record_of(tgts[f"{what} {n} {shp}"], mine, theirs, ratio, env=env, **extra))
    problems = kr.check(records, tgts, "bench/moe_many_experts.py targets")
    text = json.dumps(records, indent=1, ensure_ascii=False) + "\n"
    path = args.out
    if path is None and args.out_dir is not None:
        path = args.out_dir / f"{env['date']}-{kr.device_slug(env['device'])}-moe-experts.json"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(text if path is None else f"{path}: {len(records)} records", flush=True)
    for c in cases:  # a table on stderr
        fig = figures[c]
        print(
            f"{case_name(*c):>16}: {fig['us_per_token']:8.2f} us/token  host ops {fig['host_ops']:4d}  "
            f"nested ops {fig['nested_ops']:6d}  grouped GEMM share {fig['gemm_share']}",
            file=sys.stderr,
        )
    for line in problems:
        print(f"schema: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
