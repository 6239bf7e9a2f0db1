"""Each meshtron kernel beside its torch baseline: device, host and wall time, as issue 36's records.

    python bench/kernel_speed.py --device cuda                       # both shapes, bf16: JSON list on stdout
    python bench/kernel_speed.py --device cuda --shapes 8b --out r.json   # one shape; records written after each case
    python bench/kernel_speed.py --device cuda --e2e llama_8l_h1024  # bench/throughput.py, kernels auto vs torch
    python bench/kernel_speed.py                                     # no GPU: a rehearsal at tiny sizes

The records (one per target of issue 36, schema and target list: bench/kernel_records.py)
come out as ONE JSON list on stdout, a table on stderr. `bench/gpu_session.sh kernels` runs the
parts on a lent GPU and merges them into `bench/results/gpu/<UTC date>-<device>-kernels.json`.

For each kernel the meshtron side and the baseline run in the same process on the same inputs,
alternating (`--rounds`, the order flipped each round), forward + backward unless the target
is one GEMM, each measured three ways:

* device time: after `--warmup` eager calls (autotuning done), one call is captured in a CUDA
  graph and `N` replays are timed between CUDA events (N: about 20 ms of replays), so the
  figure holds the kernels and the gaps between them but no host work (`method`
  "cuda_graph"). Where capture fails (a host sync inside the call, say) the kernels' summed
  time from torch.profiler over a few calls (`method` "profiler": busy time, gaps excluded).
  On the CPU there is no device: the wall time stands in (`method` "cpu_wall").
* host time per call: the host's time to issue one call without synchronising, averaged over
  a burst of `HOST_BURST` calls (a few hundred launches at most: the launch queue never fills,
  so the host never waits for the device), median over bursts; also forward alone, so the
  backward's share is the difference (the norms' target is per call and direction).
* wall time: synchronised before and after each call, median of `--wall-iters`.

Shapes (`--shapes`): gpt_1b at tp=4 (4,096 tokens; h 2048; ffn 5632/4; vocab 50688/4; experts
8 x 1,024 rows, h 2048, f 2816) and an 8B-class shape (8,192 tokens, h 4096, ffn 14336, vocab
128256/4; experts 8 x 2,048 rows, h 4096, f 14336; the fused LM head + loss at 16k tokens).
`--size tiny` keeps the record names and shrinks every dimension: the CPU rehearsal, under
TRITON_INTERPRET=1 (set here when the device is the CPU), which runs every code path once
(the Triton calls included) and measures nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after the installed meshtron: `bench.kernel_records` only

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

from bench.kernel_records import (  # noqa: E402
    BY_NAME,
    NOT_BUILT,
    TARGETS,
    current_env,
    make_record,
    missing_record,
    not_built_records,
)

EPS = 1e-5
HOST_BURST = 4  # calls per host-time burst: <= ~30 launches a call here, far below the launch queue
GRAPH_MS = 20.0  # replays per device-time sample: about this much device time

FULL = {
    "gpt_1b_tp4": dict(
        tokens=4096, hidden=2048, ffn=5632 // 4, vocab=50688 // 4, experts=8, rows=1024, moe_h=2048, moe_f=2816
    ),
    "8b": dict(
        tokens=8192,
        hidden=4096,
        ffn=14336,
        vocab=128256 // 4,
        experts=8,
        rows=2048,
        moe_h=4096,
        moe_f=14336,
        wide_h=8192,
        lce_tokens=16384,
    ),
}
# The rehearsal: the same cases at sizes the Triton interpreter runs in seconds (odd ffn and vocab).
TINY = {
    "gpt_1b_tp4": dict(tokens=48, hidden=64, ffn=40, vocab=72, experts=4, rows=16, moe_h=64, moe_f=32),
    "8b": dict(
        tokens=32, hidden=32, ffn=56, vocab=88, experts=2, rows=24, moe_h=32, moe_f=48, wide_h=128, lce_tokens=64
    ),
}
# bench/throughput.py shapes of the end-to-end targets (bf16, one GPU), and tiny stand-ins.
E2E = {
    "llama_8l_h1024": (
        "end to end llama 8L h1024 auto vs torch",
        "--arch llama --layers 8 --hidden 1024 --heads 16 --kv-heads 8 --ffn 2816 --vocab 32000 --seq 1024 --batch 8",
        "--arch llama --layers 1 --hidden 32 --heads 2 --vocab 128 --seq 8 --batch 2",
    ),
    "gpt_1b_4l": (  # configs/model/gpt_1b.yaml at 4 layers, 4 x 2048 tokens a step
        "end to end gpt_1b 4L auto vs torch",
        "--arch llama --layers 4 --hidden 2048 --heads 16 --kv-heads 8 --ffn 5632 --vocab 50257 --seq 2048 --batch 4 "
        "--experts 8 --top-k 2 --moe-ffn 2816 --moe-every 2 --untied-embeddings",
        "--arch llama --layers 2 --hidden 32 --heads 2 --kv-heads 1 --vocab 128 --seq 8 --batch 2 --experts 4 "
        "--top-k 2 --moe-ffn 32 --moe-every 2 --untied-embeddings",
    ),
}
# The FP8 loss target: one memorisation run (8 batches cycled) per precision, bf16 then fp8.
FP8_LOSS = (
    "FP8 training loss vs bf16, 200 steps",
    "--arch llama --layers 4 --hidden 1024 --heads 16 --kv-heads 8 --ffn 2816 --vocab 32000 --seq 512 --batch 8 "
    "--distinct-batches 8 --warmup 0 --steps 200 --kernels torch",
    "--arch llama --layers 1 --hidden 32 --heads 2 --vocab 128 --seq 16 --batch 2 --distinct-batches 2 --warmup 0 "
    "--steps 4 --kernels torch",
)


# --------------------------------------------------------------------------- measuring


@dataclass
class Plan:
    warmup: int = 3
    rounds: int = 3
    wall_iters: int = 5
    host_bursts: int = 3
    host_burst: int = HOST_BURST
    profile_calls: int = 3


@dataclass
class Side:
    label: str  # "meshtron", "baseline", or a third path (the grouped GEMM's dense rate)
    system: str  # what runs, in words
    step: Callable[[], object]  # one call: forward + backward (or one GEMM)
    fwd: Callable[[], object] | None = None  # forward alone, for the host time per direction


@dataclass
class Figures:
    device_ms: float | None = None
    method: str | None = None
    host_us: float | None = None
    host_fwd_us: float | None = None
    wall_ms: float | None = None
    error: str | None = None
    capture_error: str | None = None
    samples: dict = field(default_factory=lambda: {"device": [], "host": [], "fwd": [], "wall": []})

    @property
    def host_bwd_us(self) -> float | None:
        if self.host_us is None or self.host_fwd_us is None:
            return None
        return max(self.host_us - self.host_fwd_us, 0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quiet_sync(device: torch.device) -> None:
    try:
        sync(device)
    except Exception:  # noqa: BLE001 - after a failed capture; the next use reports any real error
        pass


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def host_us(fn: Callable, device: torch.device, bursts: int, burst: int = HOST_BURST) -> float:
    """Median over `bursts` of the host time per call of `burst` calls issued back to back
    without synchronising (synchronised before each burst, so the queue starts empty)."""
    vals = []
    for _ in range(bursts):
        sync(device)
        start = time.perf_counter()
        for _ in range(burst):
            fn()
        vals.append((time.perf_counter() - start) / burst * 1e6)
        sync(device)
    return statistics.median(vals)


def wall_ms(fn: Callable, device: torch.device, iters: int) -> float:
    """Median of `iters` calls, each synchronised before and after."""
    vals = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        vals.append((time.perf_counter() - start) * 1e3)
    return statistics.median(vals)


def _replay_ms(graph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def capture(step: Callable, device: torch.device):
    """(graph, replays per sample) of one call of `step`, warmed up on a side stream first as
    torch's CUDA-graph notes ask (the caller's eager warm-up already finished any autotuning)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    once = _replay_ms(graph, 1)
    return graph, max(3, min(1000, math.ceil(GRAPH_MS / max(once, 1e-3))))


def kernel_ms_of_events(events) -> float | None:
    """Summed duration in ms of the device work (kernels, copies, memsets) among profiler
    events, region annotations excluded; None when there is none."""
    total_us = sum(
        e.time_range.end - e.time_range.start
        for e in events
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
    )
    return total_us / 1e3 if total_us > 0 else None


def profiler_ms(step: Callable, device: torch.device, calls: int) -> float | None:
    """Device time per call from torch.profiler: the kernels' summed time over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        sync(device)
    total = kernel_ms_of_events(prof.events())
    return None if total is None else total / calls


def measure(
    sides: list[Side], device: torch.device, plan: Plan, capture_fn: Callable = capture, profile_fn=profiler_ms
) -> dict[str, Figures]:
    """Device, host and wall time of every side, alternating the sides round by round."""
    figs = {s.label: Figures() for s in sides}
    live = []
    for s in sides:  # eager warm-up: compiles and autotunes every Triton kernel before capture
        try:
            for _ in range(max(plan.warmup, 1)):
                s.step()
            sync(device)
            live.append(s)
        except Exception as err:  # noqa: BLE001 - recorded, the other sides go on
            figs[s.label].error = _short(err)
            _quiet_sync(device)
    graphs = {}
    if device.type == "cuda":
        for s in live:
            try:
                graphs[s.label] = capture_fn(s.step, device)
            except Exception as err:  # noqa: BLE001 - falls back to the profiler
                figs[s.label].capture_error = _short(err)
                _quiet_sync(device)
                gc.collect()
    for r in range(plan.rounds):
        for s in live if r % 2 == 0 else live[::-1]:
            f = figs[s.label]
            if f.error:
                continue
            try:
                if s.label in graphs:
                    f.samples["device"].append(_replay_ms(*graphs[s.label]))
                    f.method = "cuda_graph"
                elif device.type == "cuda":
                    ms = profile_fn(s.step, device, plan.profile_calls)
                    if ms is not None:
                        f.samples["device"].append(ms)
                        f.method = "profiler"
                f.samples["host"].append(host_us(s.step, device, plan.host_bursts, plan.host_burst))
                if s.fwd is not None:
                    f.samples["fwd"].append(host_us(s.fwd, device, plan.host_bursts, plan.host_burst))
                f.samples["wall"].append(wall_ms(s.step, device, plan.wall_iters))
            except Exception as err:  # noqa: BLE001
                f.error = _short(err)
                _quiet_sync(device)
    graphs.clear()  # their memory pools go with them
    for f in figs.values():
        med = {k: statistics.median(v) if v else None for k, v in f.samples.items()}
        f.host_us, f.host_fwd_us, f.wall_ms = med["host"], med["fwd"], med["wall"]
        if med["device"] is not None:
            f.device_ms = med["device"]
        elif device.type == "cpu" and f.wall_ms is not None:
            f.device_ms, f.method = f.wall_ms, "cpu_wall"
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figs


def peak_bytes(step: Callable, device: torch.device) -> int | None:
    """Peak memory one call allocates above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def saved_bytes(op: Callable, inputs: list) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of `op`, not counting
    the storages of `inputs` (what a custom Function stores on ctx outside
    save_for_backward is not seen)."""
    inputs_ptrs = {t.untyped_storage().data_ptr() for t in inputs if torch.is_tensor(t)}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    leaves = [t.detach().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = op(*leaves)
    del out
    return sum(seen.values())


def fwd_bwd(op: Callable, inputs: list, seed: int = 0) -> tuple[Callable, Callable]:
    """(step, fwd): step runs `op` on fresh leaves of `inputs` (floating tensors require grad)
    and backward through every output with fixed random upstream gradients (made at the first
    call, so never inside a capture); fwd runs the forward alone."""
    state: dict = {}

    def leaves():
        return [t.detach().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]

    def outputs():
        out = op(*leaves())
        return out if isinstance(out, tuple) else (out,)

    def step():
        outs = outputs()
        if "grads" not in state:
            g = torch.Generator(device=outs[0].device).manual_seed(seed)
            state["grads"] = [
                torch.randn(o.shape, dtype=o.dtype, device=o.device, generator=g) if o.dim() else torch.ones_like(o)
                for o in outs
            ]
        torch.autograd.backward(outs, state["grads"])

    return step, outputs


# --------------------------------------------------------------------------- cases


@dataclass
class Ctx:
    device: torch.device
    dtype: torch.dtype
    plan: Plan
    env: dict
    shape_name: str
    dims: dict

    def randn(self, *shape, scale=1.0, seed=0, dtype=None):
        g = torch.Generator(device=self.device).manual_seed(seed)
        return (torch.randn(*shape, generator=g, device=self.device) * scale).to(dtype or self.dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _module(name: str):
    """meshtron.kernels.<name>, or the reason it is missing (being built by someone else)."""
    import importlib

    try:
        return importlib.import_module(f"meshtron.kernels.{name}"), None
    except ImportError as err:
        return None, f"{NOT_BUILT}: meshtron.kernels.{name} does not import ({_short(err)})"


def _api(module: str, attr: str):
    mod, why = _module(module)
    if mod is None:
        return None, why
    fn = getattr(mod, attr, None)
    return (fn, None) if fn is not None else (None, f"{NOT_BUILT}: meshtron.kernels.{module}.{attr} does not exist")


def _round(x, digits=4):
    return None if x is None else float(f"{x:.{digits}g}")


def time_record(
    ctx: Ctx,
    name: str,
    figs: dict[str, Figures],
    systems: dict[str, str],
    *,
    which: str = "device_ms",
    shape: dict,
    flops: float | None = None,
    note: str | None = None,
    mesh: str = "meshtron",
    base: str = "baseline",
) -> dict:
    """A record comparing two sides' `which` time (ratio = baseline / meshtron), every figure
    of both sides beside it."""
    m, b = figs.get(mesh), figs.get(base)
    mv = getattr(m, which) if m else None
    bv = getattr(b, which) if b else None
    ratio = bv / mv if mv and bv else None
    notes = [note] if note else []
    for label, f in ((mesh, m), (base, b)):
        if f and f.error:
            notes.append(f"{label} raised: {f.error}")
        if f and f.capture_error:
            notes.append(f"{label} not capturable in a CUDA graph ({f.capture_error}): profiler kernel time")
        if f and not f.error and f.device_ms is None and f.wall_ms is not None:
            notes.append(f"{label}: no device time (the profiler recorded no kernels)")

    def both(get):  # per side, keyed "meshtron" / "baseline" whatever the sides' labels
        return {"meshtron": get(m) if m else None, "baseline": get(b) if b else None}

    extra = {
        "shape": shape,
        "dtype": ctx.dtype_name,
        "meshtron_system": systems.get(mesh),
        "baseline_system": systems.get(base),
        "method": both(lambda f: f.method),
        "device_ms": both(lambda f: _round(f.device_ms)),
        "device_ms_rounds": both(lambda f: [_round(v) for v in f.samples["device"]]),
        "host_us": both(lambda f: _round(f.host_us)),
        "host_fwd_us": both(lambda f: _round(f.host_fwd_us)),
        "host_bwd_us": both(lambda f: _round(f.host_bwd_us)),
        "wall_ms": both(lambda f: _round(f.wall_ms)),
    }
    if flops:
        extra["tflops"] = both(lambda f: _round(flops / f.device_ms / 1e9) if f.device_ms else None)
    return make_record(name, _round(mv), _round(bv), _round(ratio), env=ctx.env, note="; ".join(notes) or None, **extra)


def host_record(ctx: Ctx, name: str, figs: dict[str, Figures], systems: dict, shape: dict) -> dict:
    """The host-time target: the larger of the forward's and the backward's host time per call."""

    def per_direction(f: Figures | None):
        if f is None or f.host_fwd_us is None or f.host_bwd_us is None:
            return None
        return max(f.host_fwd_us, f.host_bwd_us)

    m, b = per_direction(figs.get("meshtron")), per_direction(figs.get("baseline"))
    rec = time_record(ctx, name, figs, systems, shape=shape)
    rec.update(meshtron=_round(m), baseline=_round(b), ratio=_round(b / m) if m and b else None)
    rec["met"] = make_record(name, rec["meshtron"], rec["baseline"], rec["ratio"], env=ctx.env)["met"]
    return rec


def _sides(spec: dict[str, tuple[str, Callable, list]]) -> tuple[list[Side], dict[str, str]]:
    sides, systems = [], {}
    for label, (system, op, inputs) in spec.items():
        step, fwd = fwd_bwd(op, inputs)
        sides.append(Side(label, system, step, fwd))
        systems[label] = system
    return sides, systems


def gemm_cases(ctx: Ctx) -> list[dict]:
    """x·Wᵀ, dX = dY·W and dW = dYᵀ·x of the MLP's first GEMM, forward only, on the same
    strided views for both sides: meshtron.kernels.gemm.matmul(backend="triton") vs torch.mm."""
    d, s = ctx.dims, ctx.shape_name
    m, k, n = d["tokens"], d["hidden"], d["ffn"]
    x, w, dy = ctx.randn(m, k, seed=1), ctx.randn(n, k, scale=0.02, seed=2), ctx.randn(m, n, seed=3)
    matmul, why = _api("gemm", "matmul")
    cases = {
        f"gemm x·Wᵀ {s}": (x, w.t(), f"[{m},{k}] @ Wᵀ ([{n},{k}] transposed)"),
        f"gemm dX {s}": (dy, w, f"[{m},{n}] @ [{n},{k}]"),
        f"gemm dW {s}": (dy.t(), x, f"dYᵀ ([{m},{n}] transposed) @ [{m},{k}]"),
    }
    out = []
    for name, (a, b, what) in cases.items():
        shape = {"M": a.shape[0], "K": a.shape[1], "N": b.shape[1], "product": what}
        flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        sides = [Side("baseline", "torch.mm", lambda a=a, b=b: torch.mm(a, b))]
        if matmul is not None:
            sides.append(
                Side("meshtron", 'gemm.matmul(backend="triton")', lambda a=a, b=b: matmul(a, b, backend="triton"))
            )
        figs = measure(sides, ctx.device, ctx.plan)
        systems = {sd.label: sd.system for sd in sides}
        out.append(time_record(ctx, name, figs, systems, shape=shape, flops=flops, note=why))
    return out


def fp8_cases(ctx: Ctx) -> list[dict]:
    """x·Wᵀ at the 8B-class MLP shape with both operands quantized to e4m3 per row (mpu/fp8.py,
    the quantization counted) against the bf16 GEMM, forward only."""
    d, s = ctx.dims, ctx.shape_name
    m, k, n = d["tokens"], d["hidden"], d["ffn"]
    x, w = ctx.randn(m, k, seed=1).bfloat16(), (ctx.randn(n, k, seed=2) * 0.02).bfloat16()
    name = f"FP8 GEMM vs bf16 {s}"
    shape = {"M": m, "K": k, "N": n, "product": f"[{m},{k}] @ Wᵀ ([{n},{k}])"}
    from meshtron.mpu.fp8 import fp8_matmul_nt, fp8_supported

    ok, why = fp8_supported(ctx.device)
    sides = [Side("baseline", "torch.mm bf16", lambda: torch.mm(x, w.t()))]
    if ok:
        system = "mpu.fp8.fp8_matmul_nt (e4m3, row scales)"
        sides.append(Side("meshtron", system, lambda: fp8_matmul_nt(x, w, torch.bfloat16, False)))
    figs = measure(sides, ctx.device, ctx.plan)
    systems = {sd.label: sd.system for sd in sides}
    return [time_record(ctx, name, figs, systems, shape=shape, flops=2.0 * m * k * n, note=why or None)]


def fp8_grouped_cases(ctx: Ctx) -> list[dict]:
    """The experts' grouped GEMM y[rows of g] = x[rows of g]·W_g at the 8B-class expert shape
    in FP8 (moe/fp8_experts.py: rows quantized to e4m3 per row, each expert's weight per output
    column, the quantization counted; on the path kernels.backend=auto takes there: torch's
    _scaled_grouped_mm on sm_90) against the bf16 grouped GEMM (moe/experts.py grouped_matmul:
    F.grouped_mm), forward only, as the dense FP8 record."""
    from meshtron.kernels.backend import CHECKED
    from meshtron.moe.experts import grouped_matmul
    from meshtron.moe.fp8_experts import fp8_grouped_path, group_ends, grouped_fp8_product
    from meshtron.mpu.fp8 import fp8_supported

    d, s = ctx.dims, ctx.shape_name
    e, rows, h, f = d["experts"], d["rows"], d["moe_h"], d["moe_f"]
    x, w = ctx.randn(e * rows, h, seed=1).bfloat16(), (ctx.randn(e, h, f, seed=2) * 0.02).bfloat16()
    sizes = torch.full((e,), rows, device=ctx.device, dtype=torch.int64)
    offsets = group_ends(sizes)
    shape = {"experts": e, "rows_per_expert": rows, "hidden": h, "ffn": f, "product": f"[{e}x{rows},{h}] @ W_g"}
    ok, why = fp8_supported(ctx.device)
    base = 'moe.experts.grouped_matmul(backend="torch") bf16 (F.grouped_mm)'
    sides = [Side("baseline", base, lambda: grouped_matmul(x, w, sizes, backend="torch", offsets=offsets))]
    if ok:
        path = fp8_grouped_path(ctx.device, CHECKED)
        system = f"moe.fp8_experts.grouped_fp8_product ({path}; e4m3, row / per-expert column scales)"
        sides.append(Side("meshtron", system, lambda: grouped_fp8_product(x, w, sizes, offsets, path)))
    figs = measure(sides, ctx.device, ctx.plan)
    systems = {sd.label: sd.system for sd in sides}
    flops = 2.0 * e * rows * h * f
    return [time_record(ctx, f"FP8 expert GEMM vs bf16 {s}", figs, systems, shape=shape, flops=flops, note=why or None)]


def linear_act_cases(ctx: Ctx) -> list[dict]:
    """linear+GeLU (tanh, with bias) and linear+SwiGLU (no biases) forward + backward vs torch eager;
    at gpt_1b_tp4 also the activations each side saves for backward."""
    from meshtron.kernels import linear_act

    d, s = ctx.dims, ctx.shape_name
    m, k, n = d["tokens"], d["hidden"], d["ffn"]
    x = ctx.randn(m, k, seed=1)
    w, b = ctx.randn(n, k, scale=0.02, seed=2), ctx.randn(n, scale=0.02, seed=3)
    wg, wu = ctx.randn(n, k, scale=0.02, seed=4), ctx.randn(n, k, scale=0.02, seed=5)
    shape = {"tokens": m, "in": k, "out": n}
    gelu = {
        "meshtron": (
            'linear_act.linear_gelu(approximate="tanh", backend="triton")',
            lambda x, w, b: linear_act.linear_gelu(x, w, b, approximate="tanh", backend="triton"),
            [x, w, b],
        ),
        "baseline": (
            'F.gelu(F.linear(x, w, b), approximate="tanh")',
            lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
            [x, w, b],
        ),
    }
    swiglu = {
        "meshtron": (
            'linear_act.linear_swiglu(backend="triton")',
            lambda x, wg, wu: linear_act.linear_swiglu(x, wg, None, wu, None, backend="triton"),
            [x, wg, wu],
        ),
        "baseline": (
            "F.silu(F.linear(x, wg)) * F.linear(x, wu)",
            lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu),
            [x, wg, wu],
        ),
    }
    recompute = {  # the opt-in memory mode: nothing but x kept, the pre-activations recomputed
        "meshtron": (
            'linear_act.linear_swiglu(backend="triton", recompute=True)',
            lambda x, wg, wu: linear_act.linear_swiglu(x, wg, None, wu, None, backend="triton", recompute=True),
            [x, wg, wu],
        ),
        "baseline": (
            "torch.utils.checkpoint of F.silu(F.linear(x, wg)) * F.linear(x, wu)",
            lambda x, wg, wu: torch.utils.checkpoint.checkpoint(
                lambda a, g, u: F.silu(F.linear(a, g)) * F.linear(a, u), x, wg, wu, use_reentrant=False
            ),
            [x, wg, wu],
        ),
    }
    out = []
    name = f"linear+SwiGLU recompute mode vs torch + activation checkpointing {s}"
    if name in BY_NAME:
        sides, systems = _sides(recompute)
        figs = measure(sides, ctx.device, ctx.plan)
        out.append(time_record(ctx, name, figs, systems, shape=shape, flops=8.0 * m * k * n * 2))
    for label, spec, gemms in (("GeLU", gelu, 1), ("SwiGLU", swiglu, 2)):
        sides, systems = _sides(spec)
        figs = measure(sides, ctx.device, ctx.plan)
        out.append(time_record(ctx, f"linear+{label} {s}", figs, systems, shape=shape, flops=6.0 * m * k * n * gemms))
        name = f"linear+{label} saved activations {s}"
        if name in BY_NAME:
            unit = m * n * ctx.dtype.itemsize
            saved = {}
            for side, (_, op, inputs) in spec.items():
                try:
                    saved[side] = saved_bytes(op, inputs)
                except Exception as err:  # noqa: BLE001
                    saved[side] = _short(err)
            mv, bv = (saved[k] / unit if isinstance(saved[k], int) else None for k in ("meshtron", "baseline"))
            note = "; ".join(f"{k} raised: {v}" for k, v in saved.items() if isinstance(v, str)) or None
            out.append(
                make_record(
                    name,
                    _round(mv),
                    _round(bv),
                    _round(bv / mv) if mv and bv else None,
                    env=ctx.env,
                    note=note,
                    shape=shape,
                    dtype=ctx.dtype_name,
                    saved_bytes=saved,
                    meshtron_system=spec["meshtron"][0],
                    baseline_system=spec["baseline"][0],
                )
            )
    return out


def norm_cases(ctx: Ctx) -> list[dict]:
    """Fused residual add + RMSNorm / LayerNorm vs eager `s = x + delta; F.*_norm(s)` (both outputs
    get an upstream gradient), and the plain norms vs F.rms_norm / F.layer_norm."""
    from meshtron.kernels import norms

    tokens = ctx.dims["tokens"]
    out = []
    if ctx.shape_name == "gpt_1b_tp4":
        h = ctx.dims["hidden"]
        x, delta = ctx.randn(tokens, h, seed=1), ctx.randn(tokens, h, seed=2)
        w, b = ctx.randn(h, scale=0.1, seed=3) + 1, ctx.randn(h, scale=0.1, seed=4)
        shape = {"tokens": tokens, "hidden": h}
        res_rms, why_rms = _api("norms", "residual_rms_norm")
        res_ln, why_ln = _api("norms", "residual_layer_norm")

        def eager_rms(x, d, w):
            s = x + d
            return s, F.rms_norm(s, (h,), w, EPS)

        def eager_ln(x, d, w, b):
            s = x + d
            return s, F.layer_norm(s, (h,), w, b, EPS)

        residual = {
            "RMSNorm": (
                res_rms,
                why_rms,
                lambda fn: (
                    'norms.residual_rms_norm(backend="triton")',
                    lambda x, d, w: fn(x, d, w, EPS, backend="triton"),
                    [x, delta, w],
                ),
                ("s = x + delta; F.rms_norm(s)", eager_rms, [x, delta, w]),
            ),
            "LayerNorm": (
                res_ln,
                why_ln,
                lambda fn: (
                    'norms.residual_layer_norm(backend="triton")',
                    lambda x, d, w, b: fn(x, d, w, b, EPS, backend="triton"),
                    [x, delta, w, b],
                ),
                ("s = x + delta; F.layer_norm(s)", eager_ln, [x, delta, w, b]),
            ),
        }
        for label, (fn, why, mesh_spec, base_spec) in residual.items():
            spec = {"baseline": base_spec}
            if fn is not None:
                spec["meshtron"] = mesh_spec(fn)
            sides, systems = _sides(spec)
            figs = measure(sides, ctx.device, ctx.plan)
            for what in ("device", "wall"):
                out.append(
                    time_record(
                        ctx, f"residual+{label} h2048 {what}", figs, systems, which=f"{what}_ms", shape=shape, note=why
                    )
                )
            rec = host_record(ctx, f"residual+{label} h2048 host", figs, systems, shape)
            if why:
                rec["note"] = why
            out.append(rec)
        plain = {"h2048": (h, ("device", "host"))}
    else:
        plain = {"h8192": (ctx.dims["wide_h"], ("device",))}
    for tag, (h, kinds) in plain.items():
        x = ctx.randn(tokens, h, seed=5)
        w, b = ctx.randn(h, scale=0.1, seed=6) + 1, ctx.randn(h, scale=0.1, seed=7)
        shape = {"tokens": tokens, "hidden": h}
        specs = {
            "RMSNorm": {
                "meshtron": (
                    'norms.rms_norm(backend="triton")',
                    lambda x, w: norms.rms_norm(x, w, EPS, backend="triton"),
                    [x, w],
                ),
                "baseline": ("F.rms_norm", lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS), [x, w]),
            },
            "LayerNorm": {
                "meshtron": (
                    'norms.layer_norm(backend="triton")',
                    lambda x, w, b: norms.layer_norm(x, w, b, EPS, backend="triton"),
                    [x, w, b],
                ),
                "baseline": ("F.layer_norm", lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS), [x, w, b]),
            },
        }
        for label, spec in specs.items():
            sides, systems = _sides(spec)
            figs = measure(sides, ctx.device, ctx.plan)
            if "device" in kinds:
                out.append(time_record(ctx, f"{label} {tag} device", figs, systems, shape=shape))
            if "host" in kinds:
                out.append(host_record(ctx, f"{label} {tag} host", figs, systems, shape))
    return out


def cross_entropy_cases(ctx: Ctx) -> list[dict]:
    """meshtron's fused cross-entropy (Triton, gradient written into the logits, summed) vs
    F.cross_entropy(logits, reduction="sum") in the logits' dtype; extra memory per token; at
    gpt_1b_tp4 also meshtron's torch path (mpu-style chunks) vs the same baseline."""
    from meshtron.kernels import cross_entropy

    d, s = ctx.dims, ctx.shape_name
    tokens, vocab = d["tokens"], d["vocab"]
    logits = ctx.randn(tokens, vocab, scale=2.0, seed=1)
    g = torch.Generator(device=ctx.device).manual_seed(2)
    target = torch.randint(0, vocab, (tokens,), device=ctx.device, generator=g)
    shape = {"tokens": tokens, "vocab": vocab}
    base = (
        f"F.cross_entropy(logits [{ctx.dtype_name}], target, reduction='sum'): torch's log_softmax + nll_loss in "
        "the logits' dtype",
        lambda lg: F.cross_entropy(lg, target, reduction="sum"),
        [logits],
    )
    spec = {
        "meshtron": (
            'cross_entropy.fused_cross_entropy(backend="triton").sum(): fp32 math, gradient in place of the logits',
            lambda lg: cross_entropy.fused_cross_entropy(lg, target, backend="triton").sum(),
            [logits],
        ),
        "baseline": base,
    }
    sides, systems = _sides(spec)
    figs = measure(sides, ctx.device, ctx.plan)
    note = "the in-place backward overwrites the shared logits with gradients after the first call (timing unaffected)"
    out = [time_record(ctx, f"cross-entropy vs F.cross_entropy {s}", figs, systems, shape=shape, note=note)]
    mem, mem_notes = {}, []
    for side in sides:
        try:
            mem[side.label] = peak_bytes(side.step, ctx.device)
        except Exception as err:  # noqa: BLE001
            mem[side.label] = None
            mem_notes.append(f"{side.label} raised: {_short(err)}")
    if ctx.device.type != "cuda":
        mem_notes.append("no figure on the CPU: torch.cuda.max_memory_allocated only")
    mv, bv = (mem.get(k) / tokens if mem.get(k) is not None else None for k in ("meshtron", "baseline"))
    out.append(
        make_record(
            f"cross-entropy extra memory {s}",
            _round(mv),
            _round(bv),
            _round(bv / mv) if mv and bv else None,
            env=ctx.env,
            note="; ".join(mem_notes) or None,
            shape=shape,
            dtype=ctx.dtype_name,
            peak_bytes=mem,
            meshtron_system=systems["meshtron"],
            baseline_system=systems["baseline"],
        )
    )
    name = f"cross-entropy torch path vs F.cross_entropy {s}"
    if name in BY_NAME:
        spec = {
            "meshtron": (
                'cross_entropy.fused_cross_entropy(backend="torch").sum() (mpu-style row chunks)',
                lambda lg: cross_entropy.fused_cross_entropy(lg, target, backend="torch").sum(),
                [logits],
            ),
            "baseline": base,
        }
        sides, systems = _sides(spec)
        out.append(time_record(ctx, name, measure(sides, ctx.device, ctx.plan), systems, shape=shape))
    return out


def grouped_cases(ctx: Ctx) -> list[dict]:
    """The experts' grouped GEMM forward + backward: torch's grouped_mm (moe/experts.py
    grouped_matmul, the path kernels.backend=auto takes in bf16) as a fraction of the dense
    GEMM rate of the same FLOPs, and the Triton grouped GEMM against it."""
    from meshtron.kernels import grouped_gemm
    from meshtron.moe.experts import _grouped_mm_applies, grouped_matmul

    d, s = ctx.dims, ctx.shape_name
    e, rows, h, f = d["experts"], d["rows"], d["moe_h"], d["moe_f"]
    x, w = ctx.randn(e * rows, h, seed=1), ctx.randn(e, h, f, scale=0.02, seed=2)
    dense_w = ctx.randn(h, f, scale=0.02, seed=3)
    sizes = torch.full((e,), rows, device=ctx.device, dtype=torch.int64)
    native = _grouped_mm_applies(ctx.device.type, ctx.dtype, h, f)
    grouped_system = 'moe.experts.grouped_matmul(backend="torch"): ' + (
        "F.grouped_mm" if native else "padded bmm (F.grouped_mm does not take these operands)"
    )
    spec = {
        "grouped_mm": (grouped_system, lambda x, w: grouped_matmul(x, w, sizes, backend="torch"), [x, w]),
        "triton": (
            'grouped_gemm.grouped_gemm(backend="triton")',
            lambda x, w: grouped_gemm.grouped_gemm(x, w, sizes, backend="triton"),
            [x, w],
        ),
        "dense": ("x @ W, one dense GEMM of the same FLOPs (torch.matmul)", lambda x, w: x @ w, [x, dense_w]),
    }
    sides, systems = _sides(spec)
    figs = measure(sides, ctx.device, ctx.plan)
    flops = 6.0 * e * rows * h * f
    shape = {"experts": e, "rows_per_expert": rows, "hidden": h, "ffn": f}
    rate = {k: (flops / v.device_ms / 1e9 if v.device_ms else None) for k, v in figs.items()}
    frac = time_record(
        ctx,
        f"grouped GEMM grouped_mm vs dense {s}",
        figs,
        systems,
        shape=shape,
        flops=flops,
        mesh="grouped_mm",
        base="dense",
    )
    gm, dn = rate["grouped_mm"], rate["dense"]
    frac.update(meshtron=_round(gm), baseline=_round(dn), ratio=_round(gm / dn) if gm and dn else None)
    frac["met"] = make_record(frac["name"], frac["meshtron"], frac["baseline"], frac["ratio"], env=ctx.env)["met"]
    tri = time_record(
        ctx,
        f"grouped GEMM Triton vs grouped_mm {s}",
        figs,
        systems,
        shape=shape,
        flops=flops,
        mesh="triton",
        base="grouped_mm",
    )
    return [frac, tri]


def lce_cases(ctx: Ctx) -> list[dict]:
    """The fused LM head + summed loss at 16k tokens, vocab 128256/4, h 4096: time and peak
    memory beside Liger-Kernel's LigerFusedLinearCrossEntropyLoss(reduction="sum") when it
    imports, else beside torch's unfused F.cross_entropy(F.linear(x, w)) (then no target is
    judged)."""
    from meshtron.kernels.linear_cross_entropy import linear_cross_entropy_sum

    d = ctx.dims
    tokens, h, vocab = d["lce_tokens"], d["hidden"], d["vocab"]
    x, w = ctx.randn(tokens, h, seed=1), ctx.randn(vocab, h, scale=0.02, seed=2)
    g = torch.Generator(device=ctx.device).manual_seed(3)
    target = torch.randint(0, vocab, (tokens,), device=ctx.device, generator=g)
    shape = {"tokens": tokens, "hidden": h, "vocab": vocab}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        base = ("liger_kernel LigerFusedLinearCrossEntropyLoss(reduction='sum')", lambda x, w: liger(w, x, target))
        note = None
    except Exception as err:  # noqa: BLE001 - ImportError, or its own import-time failure
        base = (
            "F.cross_entropy(F.linear(x, w), reduction='sum') (torch, unfused)",
            lambda x, w: F.cross_entropy(F.linear(x, w), target, reduction="sum"),
        )
        note = f"Liger-Kernel does not import here ({_short(err)}): baseline is torch unfused, no target judged"
    spec = {
        "meshtron": (
            'linear_cross_entropy.linear_cross_entropy_sum(backend="triton")',
            lambda x, w: linear_cross_entropy_sum(x, w, target, backend="triton"),
            [x, w],
        ),
        "baseline": (base[0], base[1], [x, w]),
    }
    sides, systems = _sides(spec)
    figs = measure(sides, ctx.device, ctx.plan)
    timing = time_record(ctx, "fused LM head + loss time vs Liger", figs, systems, shape=shape, note=note)
    mem = {}
    for side in sides:
        try:
            mem[side.label] = peak_bytes(side.step, ctx.device)
        except Exception as err:  # noqa: BLE001
            mem[side.label] = None
            note = (note + "; " if note else "") + f"{side.label} raised: {_short(err)}"
    mv, bv = mem.get("meshtron"), mem.get("baseline")
    memory = make_record(
        "fused LM head + loss peak memory vs Liger",
        mv,
        bv,
        _round(bv / mv) if mv and bv else None,
        env=ctx.env,
        note=note if ctx.device.type == "cuda" else "no figure on the CPU: torch.cuda.max_memory_allocated only",
        shape=shape,
        dtype=ctx.dtype_name,
        meshtron_system=systems["meshtron"],
        baseline_system=systems["baseline"],
    )
    if note and "no target judged" in note:  # beside torch, not Liger: the figures stay, no ratio, not met
        for rec in (timing, memory):
            rec["ratio_vs_torch"], rec["ratio"] = rec["ratio"], None
            rec["met"] = make_record(rec["name"], rec["meshtron"], None, None, env=ctx.env)["met"]
            rec["note"] = note
    return [timing, memory]


CASES = {
    "gpt_1b_tp4": (norm_cases, cross_entropy_cases, linear_act_cases, gemm_cases, grouped_cases),
    "8b": (
        norm_cases,
        cross_entropy_cases,
        lce_cases,
        linear_act_cases,
        gemm_cases,
        fp8_cases,
        fp8_grouped_cases,
        grouped_cases,
    ),
}


def run_shape(ctx: Ctx, emit: Callable[[list[dict]], None], only: str | None = None) -> None:
    """Every case of one shape; `emit` gets each case's records as they come (a case that raises
    gives its targets a record saying so)."""
    for case in CASES[ctx.shape_name]:
        names = [t.name for t in TARGETS if t.part == ctx.shape_name and _case_of(t.name) == case.__name__]
        if only and not any(only in n for n in names):
            continue
        start = time.perf_counter()
        try:
            records = case(ctx)
        except Exception as err:  # noqa: BLE001 - the other cases go on
            traceback.print_exc(file=sys.stderr)
            records = [missing_record(n, ctx.env, f"{case.__name__} raised: {_short(err)}") for n in names]
        if only:
            records = [r for r in records if only in r["name"]]
        print(f"{ctx.shape_name} {case.__name__}: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
        emit(records)


def _case_of(name: str) -> str:
    for prefix, case in (
        ("gemm ", "gemm_cases"),
        ("linear+", "linear_act_cases"),
        ("cross-entropy", "cross_entropy_cases"),
        ("grouped GEMM", "grouped_cases"),
        ("fused LM head", "lce_cases"),
        ("FP8 GEMM", "fp8_cases"),
        ("FP8 expert GEMM", "fp8_grouped_cases"),
    ):
        if name.startswith(prefix):
            return case
    return "norm_cases"


# --------------------------------------------------------------------------- end to end


def e2e_records(model: str, device: torch.device, tiny: bool, env: dict, timeout: float) -> list[dict]:
    """bench/throughput.py twice, kernels torch and auto (llama torch first, gpt_1b auto first):
    training tokens/s in bf16, ratio auto / torch."""
    name, full, small = E2E[model]
    args = (small if tiny else full).split()
    args += ["--device", device.type, "--precision", "bf16"]
    args += ["--warmup", "1", "--steps", "1"] if tiny else ["--warmup", "3", "--steps", "10"]
    order = ("torch", "auto") if model == "llama_8l_h1024" else ("auto", "torch")
    got, notes = {}, []
    deadline = time.monotonic() + timeout
    for i, kernels in enumerate(order):
        cmd = [sys.executable, str(ROOT / "bench" / "throughput.py"), *args, "--kernels", kernels]
        left = deadline - time.monotonic()  # the first run half of it, the second what is left
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(left / (2 - i), 1))
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-400:]}")
            got[kernels] = json.loads(proc.stdout.strip().splitlines()[-1])
        except Exception as err:  # noqa: BLE001
            notes.append(f"--kernels {kernels}: {_short(err)}")
    auto, base = got.get("auto"), got.get("torch")
    mv = auto["tokens_per_s"] if auto else None
    bv = base["tokens_per_s"] if base else None
    extra = {
        "command": "python bench/throughput.py " + " ".join(args) + " --kernels torch|auto",
        "order": list(order),
        "kernels": {k: r["config"]["kernels"] for k, r in got.items()},
        "kernel_verdicts": {k: r["config"].get("kernel_verdicts") for k, r in got.items()},
        "step_time_s": {k: r["step_time_s"] for k, r in got.items()},
        "mfu": {k: _round(r.get("mfu")) for k, r in got.items()},
        "memory": {k: r.get("memory") for k, r in got.items()},
    }
    return [
        make_record(
            name,
            _round(mv, 6),
            _round(bv, 6),
            _round(mv / bv) if mv and bv else None,
            env=env,
            note="; ".join(notes) or None,
            **extra,
        )
    ]


def fp8_loss_records(device: torch.device, tiny: bool, env: dict, timeout: float) -> list[dict]:
    """bench/throughput.py with trainer.precision bf16, then fp8, on the same cycled batches:
    the relative difference of the last 20 steps' mean loss (target: at most 1%)."""
    name, full, small = FP8_LOSS
    args = (small if tiny else full).split() + ["--device", device.type]
    got, notes = {}, []
    deadline = time.monotonic() + timeout
    for i, precision in enumerate(("bf16", "fp8")):
        cmd = [sys.executable, str(ROOT / "bench" / "throughput.py"), *args, "--precision", precision]
        left = deadline - time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(left / (2 - i), 1))
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-400:]}")
            got[precision] = json.loads(proc.stdout.strip().splitlines()[-1])
        except Exception as err:  # noqa: BLE001
            notes.append(f"--precision {precision}: {_short(err)}")
    bf16, fp8 = (got[p]["loss"]["mean_last_20"] if p in got else None for p in ("bf16", "fp8"))
    diff = abs(fp8 - bf16) / bf16 if fp8 is not None and bf16 else None
    extra = {
        "command": "python bench/throughput.py " + " ".join(args) + " --precision bf16|fp8",
        "loss": {p: r["loss"] for p, r in got.items()},
        "tokens_per_s": {p: _round(r["tokens_per_s"], 6) for p, r in got.items()},
    }
    return [make_record(name, _round(diff), None, None, env=env, note="; ".join(notes) or None, **extra)]


# --------------------------------------------------------------------------- main


def _table(records: list[dict]) -> str:
    lines = [f"{'name':58} {'meshtron':>11} {'baseline':>11} {'ratio':>7} {'target':>7}  met   method"]
    for r in records:
        method = r.get("method")
        if isinstance(method, dict):
            method = "/".join(str(v) for v in method.values())
        cells = [
            f"{r['name'][:58]:58}",
            *(f"{r[k]:>11.4g}" if isinstance(r[k], (int, float)) else f"{'-':>11}" for k in ("meshtron", "baseline")),
            *(f"{r[k]:>7.3g}" if isinstance(r[k], (int, float)) else f"{'-':>7}" for k in ("ratio", "target")),
            f" {str(r['met']):5}",
            str(method or r.get("note", ""))[:60],
        ]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--shapes", default="gpt_1b_tp4,8b", help="comma list of gpt_1b_tp4, 8b")
    p.add_argument("--size", default="auto", choices=["auto", "full", "tiny"], help="auto: full on CUDA, tiny on CPU")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="auto: bf16 (GPU), fp32 (CPU)"
    )
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds per case (default 3 GPU, 1 CPU)")
    p.add_argument(
        "--e2e", choices=sorted([*E2E, "fp8_loss"]), default=None, help="instead of the kernels: one end-to-end target"
    )
    p.add_argument("--e2e-timeout", type=float, default=300.0, help="seconds for both throughput.py runs")
    p.add_argument("--not-built", action="store_true", help="also write the records of targets not built yet")
    p.add_argument("--only", default=None, help="keep only the records whose name contains this")
    p.add_argument("--out", type=Path, default=None, help="also write the records here, after each case")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in CASES]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(CASES)}")
    args.shapes = shapes
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels only (set before meshtron.kernels imports)
        torch.cuda.set_device(device)
    elif os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        print("CPU: the Triton side runs in Triton's interpreter (TRITON_INTERPRET=1)", file=sys.stderr)
    tiny = args.size == "tiny" or (args.size == "auto" and not cuda)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    dtype = dtypes[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if cuda else torch.float32)
    env = current_env(rehearsal=tiny or not cuda)
    plan = Plan() if cuda else Plan(warmup=1, rounds=1, wall_iters=1, host_bursts=1, host_burst=1, profile_calls=1)
    if args.rounds:
        plan.rounds = args.rounds
    records: list[dict] = []

    def emit(new: list[dict]) -> None:
        records.extend(new)
        if args.out:  # whole or not at all: a timeout's kill never leaves half a file
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
            os.replace(tmp, args.out)

    if args.e2e == "fp8_loss":
        emit(fp8_loss_records(device, tiny, env, args.e2e_timeout))
    elif args.e2e:
        emit(e2e_records(args.e2e, device, tiny, env, args.e2e_timeout))
    else:
        if args.not_built:
            emit(not_built_records(env))
        for shape in args.shapes:
            dims = (TINY if tiny else FULL)[shape]
            ctx = Ctx(device, dtype, plan, env, shape, dims)
            run_shape(ctx, emit, args.only)
    print(_table(records), file=sys.stderr)
    print(json.dumps(records, ensure_ascii=False), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
