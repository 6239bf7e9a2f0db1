"""Training throughput of meshtron's real training step for one shape and layout.

Builds and steps the run through the Engine the training loop uses (training/engine.py: the
model built sharded on the mesh, the gradient reducer, AdamW, the pipeline executor at pp > 1)
on random token batches from a fixed seed, times each step and prints ONE JSON object on
stdout (global rank 0 only).

    python bench/throughput.py                                   # reference shape, 1 process
    torchrun --standalone --nproc_per_node=2 bench/throughput.py --tp 2
    python bench/throughput.py --experts 8 --top-k 2 --moe-ffn 512 --arch llama   # MoE MLPs
    torchrun --standalone --nproc_per_node=2 bench/throughput.py --experts 8 --ep 2
    torchrun --standalone --nproc_per_node=2 bench/throughput.py --pp 2 --micro-batch 2

Defaults are the DESIGN.md reference shape (GPT-2 style, 4 layers, hidden 256, 4 heads,
seq 128, global batch 8, vocab 8192, fp32, AdamW). On CPU each step ends with `.item()` of
the loss (the wall time per step needs a host sync); on CUDA with a device synchronize.

`--profile` runs one more step under torch.profiler after the timed steps and prints the
top operators (and a coarse per-phase breakdown) to stderr on rank 0; stdout stays JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshtron.kernels import backend as kernel_backend_module  # noqa: E402
from meshtron.kernels import selfcheck  # noqa: E402
from meshtron.kernels.backend import CHECKED, resolve_backend  # noqa: E402
from meshtron.models.config import ExecutionConfig, GPTConfig  # noqa: E402
from meshtron.mpu.mesh import ParallelConfig, build_mesh  # noqa: E402
from meshtron.observability.memory import peak_memory_bytes  # noqa: E402
from meshtron.planning.flops import model_flops_per_token  # noqa: E402
from meshtron.planning.peak import peak_flops  # noqa: E402
from meshtron.rules import PRECISIONS, compile_checks, compile_moe_checks, cuda_graph_checks, first_failure  # noqa: E402
from meshtron.training.config import OptimConfig  # noqa: E402
from meshtron.training.engine import Engine, EngineConfig  # noqa: E402
from meshtron.training.host_malloc import keep_freed_host_memory  # noqa: E402
from meshtron.training.precision import Precision  # noqa: E402
from meshtron.training.step import StepResult  # noqa: E402

SEED = 1234
DATA_SEED = 4321
LR = 3e-4
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 1.0

# DESIGN.md "Performance principles": measured side by side on the 2-core CPU, fp32, AdamW,
# tokens/s per step, 1 process x 2 threads (tp=1) vs 2 processes x 1 thread (tp=2).
REFERENCE_SHAPE = dict(arch="gpt2", layers=4, hidden=256, heads=4, kv_heads=4, ffn=1024, vocab=8192, seq=128, batch=8)
REFERENCE = {
    "source": "DESIGN.md, Performance principles (2-core CPU, fp32, AdamW; 1 process x 2 threads "
    "vs 2 processes x 1 thread)",
    "tokens_per_s": {
        "megatron_core_0.19_tp1": 2600,
        "megatron_core_0.19_tp2": 2100,
        "hf_gpt2": 2500,
        "dtensor_tp2": 1300,
    },
    "megatron_core_tp1_mfu": 0.88,
    "cpu_peak_flops": 98e9,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--ffn", type=int, default=None, help="default: 4 * hidden")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch size (sequences per step)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per microbatch on one dp rank (default: batch // dp, one microbatch)",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs tp > 1 to matter)")
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (parallel.pp; runs pipeline_train_step with --schedule)"
    )
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule at --pp > 1 (parallel.schedule)")
    p.add_argument("--experts", type=int, default=0, help="model.num_experts (0 = dense MLPs)")
    p.add_argument("--top-k", type=int, default=2, help="model.top_k (with --experts)")
    p.add_argument("--moe-ffn", type=int, default=None, help="model.moe_ffn_hidden_size (default: the dense --ffn)")
    p.add_argument("--shared-experts", type=int, default=0, help="model.shared_experts (with --experts)")
    p.add_argument("--moe-every", type=int, default=1, help="model.moe_every: every N-th layer's MLP is MoE")
    p.add_argument("--untied-embeddings", action="store_true", help="model.tie_embeddings=false (gpt_1b, llama)")
    p.add_argument(
        "--capacity-factor", type=float, default=None, help="model.capacity_factor (with --experts; default dropless)"
    )
    p.add_argument("--cp", type=int, default=1, help="context parallelism (parallel.cp)")
    p.add_argument("--cp-comm", default="ring", choices=["ring", "a2a"], help="parallel.cp_comm")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (parallel.ep)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor parallelism (parallel.etp)")
    p.add_argument(
        "--recompute",
        default="none",
        choices=["none", "selective", "full"],
        help="activation recomputation (trainer.recompute)",
    )
    p.add_argument(
        "--unfused-lm-loss",
        action="store_true",
        help="trainer.fused_lm_loss=false: whole logits, then the cross-entropy",
    )
    p.add_argument(
        "--compile-moe",
        action="store_true",
        help="trainer.compile_moe=true: each MoE layer under torch.compile (one graph, or its "
        "router and experts where collectives or host syncs cut it; bf16: meshtron/rules.py "
        "compile_moe_checks)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="trainer.compile=true: every transformer block under torch.compile (meshtron/rules.py compile_checks)",
    )
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "max-autotune-no-cudagraphs", "reduce-overhead"],
        help="trainer.compile_mode with --compile (reduce-overhead: CUDA graphs where the step has no host sync)",
    )
    p.add_argument(
        "--swiglu-min-elements",
        type=int,
        default=None,
        help="A/B: kernels.backend=auto runs the experts' fused SwiGLU from this many elements "
        "(kernels/backend.py AUTO_TRITON_MIN_ELEMENTS; default: its own 2^26)",
    )
    p.add_argument(
        "--moe-dispatch-chunks",
        type=int,
        default=1,
        help="trainer.moe_dispatch_chunks: each MoE layer's tokens dispatched in this many chunks "
        "(at ep/etp > 1), one chunk's experts overlapping another's all-to-alls",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: torch's current count; under torchrun "
        "on CPU without OMP_NUM_THREADS: max(1, cores // local processes))",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--kernels",
        default="torch",
        choices=["auto", "torch", "triton"],
        help="kernels.backend: torch (default), triton (strict) or auto (self-checked Triton on CUDA)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=list(PRECISIONS),
        help="compute precision as trainer.precision (autocast; fp32 main weights; fp8: FP8 dense GEMMs)",
    )
    p.add_argument(
        "--distinct-batches",
        type=int,
        default=None,
        help="cycle through this many random batches (a memorisation run whose loss falls; default all distinct)",
    )
    p.add_argument(
        "--profile", action="store_true", help="profile one extra step with torch.profiler; table to stderr on rank 0"
    )
    args = p.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        p.error(f"--warmup={args.warmup} must be >= 0 and --steps={args.steps} >= 1")
    if not args.experts and (
        args.ep > 1
        or args.etp > 1
        or args.shared_experts
        or args.moe_ffn is not None
        or args.capacity_factor is not None
    ):
        p.error(
            f"--ep={args.ep} / --etp={args.etp} / --shared-experts / --moe-ffn / --capacity-factor need --experts > 0 "
            f"(a dense model has no experts to split)"
        )
    if args.moe_dispatch_chunks < 1:
        p.error(f"--moe-dispatch-chunks={args.moe_dispatch_chunks} must be >= 1")
    return args


def fail(msg: str) -> None:
    print(f"bench/throughput.py: {msg}", file=sys.stderr)
    sys.exit(2)


def choose_threads(args: argparse.Namespace, device: torch.device) -> int:
    if args.threads is not None:
        if args.threads < 1:
            fail(f"--threads={args.threads} must be >= 1")
        return args.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type == "cpu" and local > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // local)
    return torch.get_num_threads()


def pick_device(name: str, on_error=None) -> torch.device:
    """The device of `--device` auto|cpu|cuda: cuda:LOCAL_RANK for cuda (auto: when available),
    else cpu; cuda without CUDA goes to `on_error` (default: this script's exit 2)."""
    if name == "cuda" and not torch.cuda.is_available():
        (on_error or fail)(
            f"--device=cuda but torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); use --device cpu or auto"
        )
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_process_group(device: torch.device) -> None:
    """Join torchrun's default process group: NCCL with this rank's GPU on CUDA, gloo on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        dist.init_process_group(backend="gloo")


def global_batches(cfg: GPTConfig, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` random global batches (inputs, targets) [batch, seq], identical on every rank."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def rank_microbatches(
    inputs: torch.Tensor, targets: torch.Tensor, dp_rank: int, dp: int, micro: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's contiguous slice of the global batch, cut into microbatches of `micro`."""
    per_rank = inputs.shape[0] // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    x, y = inputs[rows].to(device), targets[rows].to(device)
    return [(x[i : i + micro], y[i : i + micro]) for i in range(0, per_rank, micro)]


def _host_cpu_seconds() -> tuple[float, float] | None:
    """(busy, steal) CPU-seconds of the whole host so far, from /proc/stat; None elsewhere.
    Steal is time the hypervisor gave our virtual CPUs to someone else."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in (fields + ["0"] * 8)[:8])
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz


def host_load(host_start, host_end, own_seconds: float, wall: float) -> tuple[float | None, float | None]:
    """(other_busy_cpus, steal_cpus) over `wall` seconds from two `_host_cpu_seconds` readings:
    CPUs kept busy by other processes (`own_seconds`, our CPU time, subtracted) and CPUs the
    hypervisor stole; (None, None) where /proc/stat is missing."""
    if host_start is None or host_end is None:
        return None, None
    return max(0.0, (host_end[0] - host_start[0] - own_seconds) / wall), (host_end[1] - host_start[1]) / wall


def _own_cpu_seconds() -> float:
    """CPU-seconds this process (all its threads) has used so far."""
    t = os.times()
    return t.user + t.system


def sync_step(out: StepResult, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return float(out.loss.item())


def profile_step(step, micro, device, rank: int) -> None:
    """One train_step under torch.profiler; rank 0 prints op table and a phase breakdown to stderr."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        with record_function("bench::train_step"):
            sync_step(step(micro), device)
    if rank != 0:
        return
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30), file=sys.stderr)
    # Phase breakdown from profiler events: autograd engine (backward), optimizer, forward.
    events = prof.key_averages()
    wanted = [
        "bench::train_step",
        "Optimizer.step#AdamW.step",
        "autograd::engine::evaluate_function",
        "_VocabParallelCrossEntropyBackward",
        "_VocabParallelCrossEntropy",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        "_ColumnParallelLinear",
        "_RowParallelLinear",
        "aten::addmm",
        "aten::mm",
        "aten::linear",
        "gloo:",
        "c10d::",
        "shm::",
    ]
    rows = {e.key: e for e in events}
    print("phase/op cpu totals (ms):", file=sys.stderr)
    for key in wanted:
        for name, e in rows.items():
            if name.startswith(key):
                print(
                    f"  {name:70s} total {e.cpu_time_total / 1e3:8.2f}  self {e.self_cpu_time_total / 1e3:8.2f}"
                    f"  calls {e.count}",
                    file=sys.stderr,
                )


def build_run(args: argparse.Namespace, device: torch.device, world: int):
    """The timed run through the Engine: (engine, kernel backend, precision, micro batch, rows
    per dp rank); a bad shape or layout fails with one line (exit 2)."""
    try:
        backend = resolve_backend(args.kernels, device.type)
        cfg = GPTConfig(
            arch=args.arch,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            ffn_hidden_size=args.ffn,
            vocab_size=args.vocab,
            seq_len=args.seq,
            dropout=0.0,
            num_experts=args.experts,
            top_k=args.top_k,
            moe_ffn_hidden_size=args.moe_ffn,
            shared_experts=args.shared_experts,
            capacity_factor=args.capacity_factor,
            moe_every=args.moe_every,
            tie_embeddings=not args.untied_embeddings,
        )
        mesh = build_mesh(
            ParallelConfig(
                tp=args.tp,
                sp=args.sp,
                pp=args.pp,
                ep=args.ep,
                etp=args.etp,
                schedule=args.schedule,
                cp=args.cp,
                cp_comm=args.cp_comm,
            ),
            cfg,
            device_type=device.type,
        )
    except (ValueError, RuntimeError) as exc:  # ParallelConfigError is a ValueError
        fail(str(exc))
    precision = Precision(args.precision, device.type)
    dp = mesh.dp_size
    if args.batch % dp:
        fail(
            f"--batch={args.batch} is not divisible by dp={dp} "
            f"(world {world} / (tp={args.tp} * cp={args.cp} * pp={args.pp}))"
        )
    per_rank = args.batch // dp
    micro = per_rank if args.micro_batch is None else args.micro_batch
    if micro < 1 or per_rank % micro:
        fail(f"--micro-batch={micro} must divide the per-dp-rank batch {per_rank} (batch {args.batch} / dp {dp})")

    failure = first_failure(
        compile_moe_checks(
            args.compile_moe,
            num_experts=cfg.num_experts,
            hidden_size=cfg.hidden_size,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            precision=args.precision,
            kernel_backend=args.kernels,
            recompute=args.recompute,
            zero=0,
        )
    )
    if failure:
        fail(f"--compile-moe: {failure}")
    failure = first_failure(
        compile_checks(
            args.compile,
            compile_mode=args.compile_mode,
            compile_moe=args.compile_moe,
            precision=args.precision,
            kernel_backend=args.kernels,
            zero=0,
            dropout=0.0,
        )
        + (
            cuda_graph_checks(
                args.compile_mode,
                device_type=device.type,
                num_experts=cfg.num_experts,
                ep=args.ep,
                etp=args.etp,
                capacity_factor=cfg.capacity_factor,
                precision=args.precision,
                pp=args.pp,
            )
            if args.compile
            else []
        )
    )
    if failure:
        fail(f"--compile: {failure}")
    if args.swiglu_min_elements is not None:  # an A/B of the fused SwiGLU's size threshold
        kernel_backend_module.AUTO_TRITON_MIN_ELEMENTS["swiglu"] = args.swiglu_min_elements
    execution = ExecutionConfig(
        recompute=args.recompute,
        kernel_backend=backend,
        fused_lm_loss=not args.unfused_lm_loss,
        compile_moe=args.compile_moe,
        compile=args.compile,
        compile_mode=args.compile_mode,
        moe_dispatch_chunks=args.moe_dispatch_chunks,
    )
    engine = Engine.build(
        EngineConfig(
            model=cfg,
            micro_batch_size=micro,
            seed=SEED,
            execution=execution,
            optim=OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY),
            max_grad_norm=MAX_GRAD_NORM,
        ),
        mesh,
        device,
        precision=precision,
    )
    return engine, backend, precision, micro, per_rank


def time_steps(step, batches: list, args: argparse.Namespace, world: int, device: torch.device, backend: str):
    """Run the warm-up and timed steps (every rank starts each together); returns the timed
    steps' wall times (the slowest rank's), their losses, and the host's other load
    (other_busy_cpus, steal_cpus)."""
    host_start = _host_cpu_seconds()
    own_start = _own_cpu_seconds()
    wall_start = time.perf_counter()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if world > 1:
            dist.barrier()  # every rank starts the step together; the barrier is outside the timing
        t0 = time.perf_counter()
        out = step(batches[i])
        loss = sync_step(out, device)
        if i == 0 and backend == CHECKED:
            selfcheck.agree(device)  # as the training loop does after its first step
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
            losses.append(loss)
    wall = time.perf_counter() - wall_start
    own = torch.tensor([_own_cpu_seconds() - own_start], dtype=torch.float64)
    if world > 1:
        own = own.to(device)
        dist.all_reduce(own)
    host_end = _host_cpu_seconds()
    # > ~0.1 busy or stolen CPUs means the timings are pessimistic.
    other_busy, steal = host_load(host_start, host_end, float(own.sum()), wall)
    if world > 1:
        # A step lasts as long as its slowest rank.
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
    return times, losses, other_busy, steal


def main(argv=None) -> None:
    args = parse_args(argv)
    kept_freed_memory = keep_freed_host_memory()  # as train.py does (MESHTRON_SYSTEM_MALLOC=1: off)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(args.device)
    threads = choose_threads(args, device)
    torch.set_num_threads(threads)

    if world > 1:
        init_process_group(device)
    rank = dist.get_rank() if world > 1 else 0

    engine, backend, precision, micro, per_rank = build_run(args, device, world)
    cfg, mesh, dp = engine.config.model, engine.mesh, engine.mesh.dp_size

    def step(micro_batches):
        return engine.step(micro_batches, LR)

    total = args.warmup + args.steps + (1 if args.profile else 0)
    distinct = min(total, args.distinct_batches or total)  # fewer: the run cycles them (memorisation)
    made = [
        rank_microbatches(x, y, mesh.dp_rank, dp, micro, device) for x, y in global_batches(cfg, args.batch, distinct)
    ]
    batches = [made[i % distinct] for i in range(total)]

    times, losses, other_busy, steal = time_steps(step, batches, args, world, device, backend)

    if args.profile:
        profile_step(step, batches[-1], device, rank)

    # Peak as the training loop computes it: this process's peak (CPU: measured matmul on its
    # threads, every rank measuring at once as they do at the start of a run; CUDA: datasheet)
    # times the world size.
    if world > 1:
        dist.barrier()
    peak_dtype = precision.dtype if precision.dtype is not None and device.type == "cuda" else torch.float32
    per_proc, source = peak_flops(device, peak_dtype)
    total_peak = per_proc * world
    peak_source = source if world == 1 else f"{world} x rank 0's {source} ({per_proc / 1e9:.1f} GFLOP/s each)"

    tokens_per_step = args.batch * cfg.seq_len
    step_med = statistics.median(times)
    tokens_per_s = tokens_per_step / step_med
    fpt = model_flops_per_token(cfg)
    achieved = fpt * tokens_per_s

    shape = dict(
        arch=cfg.arch,
        layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        ffn=cfg.ffn_hidden_size,
        vocab=cfg.vocab_size,
        seq=cfg.seq_len,
        batch=args.batch,
    )
    moe = None
    if cfg.num_experts:
        moe = dict(
            experts=cfg.num_experts,
            top_k=cfg.top_k,
            moe_ffn=cfg.moe_ffn_hidden_size,
            shared_experts=cfg.shared_experts,
            moe_every=cfg.moe_every,
            activation=cfg.activation,
            capacity_factor=cfg.capacity_factor,
        )
    reference = None
    if shape == REFERENCE_SHAPE and moe is None and args.pp == 1:
        reference = dict(REFERENCE)
        same = "megatron_core_0.19_tp1" if args.tp == 1 else ("megatron_core_0.19_tp2" if args.tp == 2 else None)
        if same is not None and device.type == "cpu" and not args.sp:
            reference["same_layout"] = same
            reference["ratio_to_same_layout"] = round(tokens_per_s / REFERENCE["tokens_per_s"][same], 3)

    result = {
        "bench": "throughput",
        "config": {
            **shape,
            "moe": moe,
            "micro_batch": micro,
            "dtype": args.precision,
            "optimizer": "AdamW",
            "recompute": args.recompute,
            "compile_moe": args.compile_moe,
            "compile": args.compile_mode if args.compile else None,
            "swiglu_min_elements": kernel_backend_module.AUTO_TRITON_MIN_ELEMENTS["swiglu"],
            "moe_dispatch_chunks": args.moe_dispatch_chunks,
            "kernels": backend,
            "kernel_verdicts": {k: selfcheck.verdict(k) for k in selfcheck.KERNELS if selfcheck.verdict(k) is not None},
            "tie_embeddings": cfg.tie_embeddings,
            "padded_vocab": cfg.padded_vocab_size(args.tp),
        },
        "layout": {
            "world": world,
            "tp": args.tp,
            "dp": dp,
            "sp": bool(args.sp),
            "pp": mesh.pp_size,
            "schedule": args.schedule if mesh.pp_size > 1 else None,
            "ep": mesh.par.ep,
            "etp": mesh.par.etp,
            "edp": mesh.par.edp,
            "microbatches_per_rank": per_rank // micro,
            "threads_per_process": threads,
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # Other work on the host skews CPU timings: other_busy_cpus is the average number of
        # CPUs other processes kept busy during the timed steps, steal_cpus the average number
        # taken by the hypervisor (both from /proc/stat; null elsewhere).
        "host": {
            "cpus": os.cpu_count(),
            "other_busy_cpus": None if other_busy is None else round(other_busy, 3),
            "steal_cpus": None if steal is None else round(steal, 3),
            "malloc": "keep_freed" if kept_freed_memory else "system",
        },
        "steps": {"warmup": args.warmup, "timed": args.steps},
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "step_time_s": {"median": step_med, "min": min(times), "max": max(times)},
        "step_times_s": [round(t, 6) for t in times],  # every timed step, in order
        "flops_per_token": fpt,
        "achieved_flops": achieved,
        "peak_flops": total_peak,
        "peak_flops_per_process": per_proc,
        "peak_source": peak_source,
        "mfu": achieved / total_peak,
        "loss": {"first": losses[0], "last": losses[-1], "mean_last_20": statistics.fmean(losses[-20:])},
        # Rank 0's peak: CUDA max_memory_allocated, CPU the process's peak resident set.
        "memory": {
            "peak_bytes": peak_memory_bytes(device),
            "measure": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS",
        },
        "reference": reference,
        "torch": torch.__version__,
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
    engine.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
