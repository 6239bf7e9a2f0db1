"""Speed of one meshtron MoE block (moe/layer.py `MoELayer`): forward + backward.

Builds `MoELayer` from a `GPTConfig` (SwiGLU experts like Mixtral, softmax top-k router with
renormalised weights, no shared experts, no capacity limit by default) at the issue-12 shape
(hidden 256, expert ffn 512, 8 experts, top-2, 1,024 tokens; fp32 on CPU by default) and times
forward + backward w.r.t. the input and every weight: warm-up, then `--iters` individually
timed iterations (median/min/max). The backward includes the router's aux-loss term, as a
training step does (`--aux-loss-coef`, default the model config's 0.01; 0 drops it).

`host_ops` (both blocks) counts the operators one forward + backward dispatches from the host
(top-level aten/c10d ops; views and metadata reads left out): about one kernel launch each on a
GPU, so at small shapes, where kernels take microseconds, it sets the GPU time (bench/README.md).

One more iteration runs under torch.profiler to say where the time goes: forward ops are
attributed to the region they ran in (router, dispatch, expert GEMMs, expert activation,
combine, shared experts, other), backward autograd nodes to the region of the forward op that
created them (matched by autograd sequence number). Profiled times carry the profiler's own
overhead; the fractions are what to read.

    OMP_NUM_THREADS=2 python bench/moe_layer.py                     # meshtron only
    OMP_NUM_THREADS=2 python bench/moe_layer.py --peer              # + transformers' Mixtral block, interleaved
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/moe_layer.py --ep 2

`--peer` builds transformers' `MixtralSparseMoeBlock` exactly as ../shared/peers/hf_mixtral_moe.py
does (same config, N(0, 0.02) weights, the experts implementation a MixtralForCausalLM picks on
this machine) and times it in the same process, alternating rounds with meshtron's block
(`--rounds`), so both sides see the same machine load. Single process only.

Under torchrun (`--ep`/`--etp`, world = ep * etp * edp; gloo on CPU, NCCL with one GPU per
rank, cuda:LOCAL_RANK, on CUDA) `--tokens` is the global token count, split evenly over the
ranks; an iteration lasts as long as the slowest rank.

`--compile MODE` runs both blocks under torch.compile (meshtron's with fullgraph=True: the dropless
block at ep = 1 has no graph break and no host sync; tests/test_moe_compile.py), single process
and bf16 only; `reduce-overhead` replays the compiled forward and backward as CUDA graphs on a
GPU, which takes the host's op dispatch out of the small-shape time. No region breakdown then
(its markers would break the graph); `host_ops` still counts what the host dispatches.

Device, dtype and kernels: `--device auto|cpu|cuda` (auto: CUDA when available), `--dtype
fp32|bf16` (parameters, input and upstream gradient of BOTH blocks in that dtype; meshtron's
router computes in fp32 whatever the dtype), `--kernels torch|triton|auto` for meshtron's
grouped GEMMs (kernels.backend as in bench/throughput.py: auto = self-checked Triton on CUDA,
torch on CPU; triton on CPU only under TRITON_INTERPRET=1). On CUDA every timed iteration
starts and ends with torch.cuda.synchronize(), and the breakdown attributes kernel (device)
time to the regions (see `breakdown.time`).

    python bench/moe_layer.py --device cuda --dtype bf16 --kernels auto --peer --rounds 3   # the GPU target

Prints ONE JSON object on stdout (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshtron.kernels import selfcheck  # noqa: E402
from meshtron.kernels.backend import CHECKED, resolve_backend  # noqa: E402
from meshtron.kernels.tf32 import dot_precision, torch_allows_tf32  # noqa: E402
from meshtron.models.config import GPTConfig  # noqa: E402
from meshtron.moe.experts import grouped_backend  # noqa: E402
from meshtron.moe.layer import MoELayer  # noqa: E402
from meshtron.mpu.init import initialize_parameters  # noqa: E402
from meshtron.mpu.mesh import ParallelConfig, build_mesh  # noqa: E402
from meshtron.training.host_malloc import keep_freed_host_memory  # noqa: E402

SEED = 1234
REGIONS = ("router", "dispatch", "expert_gemm", "expert_activation", "combine", "shared_experts", "other")
INSIDE = ("expert_gemm", "router", "dispatch", "combine", "experts", "shared_experts")  # record_function regions
PEER_SCRIPT = ROOT.parent / "shared" / "peers" / "hf_mixtral_moe.py"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per iteration (global under torchrun)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="expert ffn size (model.moe_ffn_hidden_size)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared-experts", type=int, default=0)
    p.add_argument("--activation", default="swiglu", choices=["swiglu", "gelu"])
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        default=None,
        help="router aux-loss coefficient (default: GPTConfig's); its term is in the backward",
    )
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (torchrun, gloo)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (torchrun, gloo)")
    p.add_argument(
        "--dispatch-chunks",
        type=int,
        default=1,
        help="trainer.moe_dispatch_chunks: tokens dispatched in this many chunks (at ep/etp > 1)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed iterations (per round with --peer)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds with --peer")
    p.add_argument(
        "--peer", action="store_true", help="also time transformers' MixtralSparseMoeBlock (grouped_mm) in the same run"
    )
    p.add_argument("--no-profile", action="store_true", help="skip the profiled breakdown iteration")
    p.add_argument(
        "--compile",
        default=None,
        choices=COMPILE_MODES,
        help="torch.compile both blocks with this mode (meshtron's with fullgraph=True; "
        "single process, bf16, dropless; reduce-overhead adds CUDA graphs on a GPU)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda when torch.cuda.is_available(), else cpu (both blocks run there)",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=list(DTYPES),
        help="dtype of the parameters, input and upstream gradient of both blocks",
    )
    p.add_argument(
        "--kernels",
        default="torch",
        choices=["auto", "torch", "triton"],
        help="meshtron's kernels.backend: torch (default), triton (strict) or auto (self-checked "
        "Triton on CUDA, torch on CPU)",
    )
    args = p.parse_args(argv)
    if args.tokens < 1 or args.iters < 1 or args.warmup < 0 or args.rounds < 1 or args.dispatch_chunks < 1:
        p.error("--tokens, --iters, --rounds and --dispatch-chunks must be >= 1 and --warmup >= 0")
    return args


def fail(msg: str) -> None:
    print(f"bench/moe_layer.py: {msg}", file=sys.stderr)
    sys.exit(2)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that the host clock brackets it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- meshtron's block


def build_meshtron(args, mesh, local_tokens: int, device: torch.device, backend: str):
    """meshtron's MoELayer on `device` in `args.dtype` with `backend` kernels, and its timed step."""
    kw = {} if args.aux_loss_coef is None else {"aux_loss_coef": args.aux_loss_coef}
    dtype = DTYPES[args.dtype]
    cfg = GPTConfig(
        arch="llama",
        num_layers=1,
        hidden_size=args.hidden,
        num_heads=1,
        activation=args.activation,
        num_experts=args.experts,
        top_k=args.top_k,
        moe_ffn_hidden_size=args.ffn,
        shared_experts=args.shared_experts,
        seq_len=local_tokens,
        **kw,
    )
    layer = MoELayer(cfg.moe(), mesh, device=device, dtype=dtype, backend=backend, dispatch_chunks=args.dispatch_chunks)
    initialize_parameters(layer, SEED, mesh)
    layer.train()
    gen = torch.Generator().manual_seed(SEED + 1 + _rank())
    x = torch.randn(local_tokens, 1, args.hidden, generator=gen).to(device, dtype).requires_grad_(True)  # [s, b, h]
    gy = torch.randn(x.shape, generator=gen).to(device, dtype)
    one = torch.ones((), device=device)
    forward = compiled(layer, args.compile, fullgraph=True)

    def step():
        if args.compile:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration for CUDA graph trees
        out = forward(x)
        aux = layer.last_router.aux_loss
        if aux.requires_grad:
            torch.autograd.backward([out, aux], [gy, one])
        else:
            out.backward(gy)
        x.grad = None
        for q in layer.parameters():
            q.grad = None
        return out.detach()

    return cfg, layer, step


def compiled(module: torch.nn.Module, mode: str | None, fullgraph: bool):
    """`module` itself, or its torch.compile with `mode` (fullgraph: fail on any graph break)."""
    return module if mode is None else torch.compile(module, mode=mode, fullgraph=fullgraph)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---------------------------------------------------------------- the peer (transformers' Mixtral block)


def build_peer(args, device: torch.device):
    """transformers' MixtralSparseMoeBlock as ../shared/peers/hf_mixtral_moe.py builds it, moved
    to `device` and `args.dtype` (parameters, input and upstream gradient)."""
    try:
        import transformers
    except ImportError as exc:
        fail(f"--peer needs transformers (the hf extra: pip install -e '.[hf]'): {exc}")
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral as mm

    tiny = mm.MixtralForCausalLM(
        MixtralConfig(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=128,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
    )
    impl = tiny.config._experts_implementation
    del tiny
    cfg = MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        router_jitter_noise=0.0,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=128,
    )
    cfg._experts_implementation = impl
    # Does grouped_mm run torch's native grouped_mm kernel on this device and dtype, or
    # transformers' python fallback loop? (as hf_mixtral_moe.py asks; a private helper)
    from transformers.integrations import moe as hf_moe

    can_use = getattr(hf_moe, "_can_use_grouped_mm", None)
    native = (
        None
        if can_use is None
        else bool(
            can_use(
                torch.zeros(4, args.hidden, device=device, dtype=DTYPES[args.dtype]),
                torch.zeros(args.experts, 2 * args.ffn, args.hidden, device=device, dtype=DTYPES[args.dtype]),
                torch.arange(1, args.experts + 1, dtype=torch.int32, device=device),
            )
        )
    )
    torch.manual_seed(0)
    block = mm.MixtralSparseMoeBlock(cfg)
    for prm in block.parameters():
        torch.nn.init.normal_(prm, std=0.02)
    dtype = DTYPES[args.dtype]
    block.to(device, dtype)
    block.train()
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(0))
    x = x.to(device, dtype).requires_grad_(True)
    gy = torch.randn_like(x)
    forward = compiled(block, args.compile, fullgraph=False)  # transformers' block may break the graph

    def step():
        if args.compile:
            torch.compiler.cudagraph_mark_step_begin()
        out = forward(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(gy)
        x.grad = None
        for q in block.parameters():
            q.grad = None
        return out.detach()

    info = {
        "system": f"transformers {transformers.__version__} {mm.MixtralSparseMoeBlock.__name__}",
        "experts_implementation": impl,
        "script": str(PEER_SCRIPT),
        "dtype": args.dtype,
        "device": str(device),
        "native_grouped_mm": native,
        "setup": "as hf_mixtral_moe.py: MixtralConfig(router_jitter_noise=0), N(0, 0.02) weights, "
        "forward + backward(gy) w.r.t. input and all weights",
    }
    return info, step


# ---------------------------------------------------------------- timing


def time_iters(step, n: int, world: int, device: torch.device) -> list[float]:
    """`n` timed iterations of `step`; on CUDA the clock is read after a device synchronize at
    both ends. With several ranks each iteration's time is the max over the default group."""
    times = []
    for _ in range(n):
        if world > 1:
            dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    if world > 1:
        t = torch.tensor(times, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
    return times


def summary(times: list[float], tokens: int) -> dict:
    med = statistics.median(times)
    return {
        "tokens_per_s": round(tokens / med, 1),
        "ms": {"median": round(med * 1e3, 3), "min": round(min(times) * 1e3, 3), "max": round(max(times) * 1e3, 3)},
        "timed_iters": len(times),
    }


# ---------------------------------------------------------------- where the time goes


def _wrap(region: str, fn):
    from torch.profiler import record_function

    def wrapped(*a, **kw):
        with record_function(f"moe::{region}"):
            return fn(*a, **kw)

    return wrapped


def instrument(layer: MoELayer) -> None:
    """Mark the layer's parts with record_function regions (instance attributes only; moe/ is untouched)."""
    layer.router.route = _wrap("router", layer.router.route)  # the expert choice
    layer.router.statistics = _wrap("router", layer.router.statistics)  # balancing statistics, after the experts
    layer.dispatcher.dispatch_chunks = _wrap("dispatch", layer.dispatcher.dispatch_chunks)  # plan rows, start sending
    layer.dispatcher.receive = _wrap("dispatch", layer.dispatcher.receive)  # wait, expand rows to pairs
    layer.dispatcher.combine = _wrap("combine", layer.dispatcher.combine)  # weighted row sums, start the return
    layer.dispatcher.finish = _wrap("combine", layer.dispatcher.finish)  # wait, sum each token's rows
    if layer.shared is not None:
        layer.shared.hidden = _wrap("shared_experts", layer.shared.hidden)
        layer.shared.output = _wrap("shared_experts", layer.shared.output)
    layer.experts.forward = _wrap("experts", layer.experts.forward)
    # Each grouped GEMM (torch or Triton: a Triton launch is no aten op, so its region must
    # come from the call site). GroupedExperts looks grouped_matmul up in its module at each
    # call; this rebinds it in this process only, after the timed iterations.
    from meshtron.moe import experts as experts_module

    experts_module.grouped_matmul = _wrap("expert_gemm", experts_module.grouped_matmul)


def _is_gemm(name: str) -> bool:
    """An expert GEMM op or autograd node: torch's grouped_mm, the padded bmm (CUDA fp32), the
    Triton GroupedGemmFunction."""
    return (
        "grouped_mm" in name
        or "GroupedMm" in name
        or "GroupedGemm" in name
        or "bmm" in name.lower()
        or name in ("aten::mm",)
    )


def _is_annotation(name: str) -> bool:
    """The GPU-timeline copy of a record_function region (Kineto's gpu_user_annotation): a span
    from the region's first kernel to its last, idle gaps included, not work."""
    return name.startswith(("moe::", "ProfilerStep"))


def _is_device_work(e) -> bool:
    """A kernel, copy or memset on the device (not a region annotation)."""
    return e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False) and not _is_annotation(e.name)


def device_regions(events, seq_region: dict) -> tuple[dict, dict]:
    """Kernel (device) time per region, forward and backward, in us: each CPU event's own
    kernels (`FunctionEvent.kernels`, filled from ProfilerActivity.CUDA) go to the innermost
    enclosing autograd node (backward: the region of the forward op that made it, by sequence
    number, split into GEMM / activation by the node's kind) or else the innermost moe:: region
    (forward; 'other' outside the regions)."""
    fwd, back = defaultdict(float), defaultdict(float)
    for e in events:
        own = sum(k.duration for k in getattr(e, "kernels", ()) or () if not _is_annotation(k.name))
        if not own:
            continue
        region, node, a = None, None, e
        while a is not None:
            if a.name.startswith("autograd::engine::evaluate_function"):
                node = a
                break
            if region is None and a.name.startswith("moe::") and a.name[5:] in INSIDE:
                region = a.name[5:]
            a = a.cpu_parent
        if node is not None:
            name = node.name.split(": ", 1)[-1]
            r = seq_region.get(node.sequence_nr, "other")
            if r in ("expert_gemm", "expert_activation") or "GroupedGemm" in name:
                r = "expert_gemm" if _is_gemm(name) else "expert_activation"
            if "AccumulateGrad" in name:
                r = "other"
            back[r] += own
        else:
            fwd["expert_activation" if region == "experts" else (region or "other")] += own
    return fwd, back


TIME_NOTE = {  # (on CUDA, kernel events recorded) -> what the region figures are
    (False, False): "Times: host (CPU) time of the ops; fractions of the profiled iteration.",
    (True, True): "Times: DEVICE time (ProfilerActivity.CUDA): each CUDA kernel or copy goes to the CPU event that "
    "launched it, hence to its innermost autograd node (backward, as above) or else its innermost "
    "region (forward; the grouped GEMM calls, torch or Triton, are a region of their own); "
    "fractions and unattributed_ms are relative to kernel_ms, the summed time of every kernel and "
    "copy in the iteration (profiled_iteration_ms is its host wall time, synchronized).",
    (True, False): "Times: HOST time (the profiler recorded no CUDA kernels, so device time could not be "
    "attributed); on CUDA host time is launch overhead, not where the GPU spends its time.",
}


def breakdown(step, layer: MoELayer, device: torch.device) -> tuple[dict, list]:
    """One profiled iteration; forward and backward time per region: host (CPU) time on CPU,
    kernel (device) time on CUDA, where the host only queues work. Also returns the profile's
    events (for `count_host_ops`)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    instrument(layer)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        with record_function("moe::iteration"):
            step()
            sync(device)  # the span ends when the device is done
    all_events = prof.events()
    events = [e for e in all_events if e.device_type.name == "CPU"]
    # On CUDA the whole is the summed time of every kernel and copy (streams overlapping would
    # count twice); without any recorded the breakdown says it is host time.
    kernel_total = sum(e.time_range.end - e.time_range.start for e in all_events if _is_device_work(e))
    device_time = cuda and kernel_total > 0
    spans = {}  # region -> list of (start, end)
    for e in events:
        if e.name.startswith("moe::"):
            spans.setdefault(e.name[5:], []).append((e.time_range.start, e.time_range.end))
    total = spans["iteration"][0][1] - spans["iteration"][0][0]

    def region_of(e) -> str:
        t = e.time_range.start
        for r in INSIDE:  # expert_gemm first: its spans lie inside the experts' spans
            for s, end in spans.get(r, []):
                if s <= t <= end:
                    if r == "experts":
                        return "expert_gemm" if _is_gemm(e.name) else "expert_activation"
                    return r
        return "other"

    # Forward: top-level aten / c10d ops (not nested in another op) before the autograd engine starts.
    bwd = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    bwd_ranges = [(e.time_range.start, e.time_range.end) for e in bwd]
    bwd_start = min((s for s, _ in bwd_ranges), default=float("inf"))

    def is_op(e) -> bool:
        return e.name.startswith(("aten::", "c10d::"))

    fwd_ops = [
        e
        for e in events
        if is_op(e) and e.cpu_parent is not None and not is_op(e.cpu_parent) and e.time_range.start < bwd_start
    ]
    fwd = defaultdict(float)
    seq_region = {}
    for e in fwd_ops:
        r = region_of(e)
        fwd[r] += e.cpu_time_total
    for e in events:  # every op that made an autograd node, nested or not
        if e.sequence_nr >= 0 and e.time_range.start < bwd_start and not e.name.startswith("autograd::"):
            seq_region.setdefault(e.sequence_nr, region_of(e))
    back = defaultdict(float)
    for e in bwd:
        node = e.name.split(": ", 1)[-1]
        r = seq_region.get(e.sequence_nr, "other")
        if r in ("expert_gemm", "expert_activation") or "GroupedGemm" in node:  # a node's region follows its kind
            r = "expert_gemm" if _is_gemm(node) else "expert_activation"
        if "AccumulateGrad" in node:
            r = "other"
        back[r] += e.cpu_time_total
    if device_time:  # the same regions, in kernel time
        fwd, back = device_regions(events, seq_region)
    fwd_total, bwd_total = sum(fwd.values()), sum(back.values())
    iteration = total
    if device_time:
        total = kernel_total
    regions = {}
    for r in REGIONS:
        f, b = fwd.get(r, 0.0) / 1e3, back.get(r, 0.0) / 1e3
        regions[r] = {
            "forward_ms": round(f, 3),
            "backward_ms": round(b, 3),
            "fraction": round((f + b) / (total / 1e3), 3) if total else None,
        }
    return {
        "method": "torch.profiler, one extra iteration (times include profiler overhead): forward = top-level "
        "aten/c10d ops inside record_function regions wrapped around router / dispatcher.dispatch / "
        "experts / dispatcher.combine / shared experts (router = routing + balancing statistics, "
        "dispatch = dispatcher.dispatch + receive, combine = dispatcher.combine + finish, including "
        "the weighted sum of the k choices; the rest of MoELayer.forward, i.e. capacity bookkeeping, "
        "is 'other' for the forward); backward = autograd nodes attributed by sequence number to the "
        "forward op that made them (AccumulateGrad: other). " + TIME_NOTE[(cuda, device_time)],
        "time": "device" if device_time else "host",
        "profiled_iteration_ms": round(iteration / 1e3, 3),
        "kernel_ms": round(kernel_total / 1e3, 3) if cuda else None,
        "forward_ms": round(fwd_total / 1e3, 3),
        "backward_ms": round(bwd_total / 1e3, 3),
        "unattributed_ms": round((total - fwd_total - bwd_total) / 1e3, 3),
        "regions": regions,
    }, all_events


# Ops that only make views or read metadata: no kernel of their own on a GPU.
METADATA_OPS = frozenset(
    {
        "alias",
        "as_strided",
        "chunk",
        "contiguous",
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "expand_as",
        "flatten",
        "is_nonzero",
        "is_same_size",
        "item",
        "lift_fresh",
        "movedim",
        "narrow",
        "new_empty",
        "new_empty_strided",
        "permute",
        "reshape",
        "_reshape_alias",
        "resolve_conj",
        "resolve_neg",
        "result_type",
        "select",
        "size",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "stride",
        "t",
        "to",
        "transpose",
        "unbind",
        "unflatten",
        "unsqueeze",
        "_unsafe_view",
        "view",
        "view_as",
        "_local_scalar_dense",
    }
)


def host_ops(step, device: torch.device) -> dict:
    """`count_host_ops` of one profiled forward + backward of `step`."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        sync(device)
    return count_host_ops(prof.events(), cuda)


def count_host_ops(events, cuda: bool, top: int = 25) -> dict:
    """Operators one forward + backward dispatched from the host, from its profile's
    `events` (CPU ones; device ones feed `device_kernels`): top-level aten / c10d ops (not
    nested in another op; a dtype conversion `to` counts as its `_to_copy`), views and
    metadata reads left out. On a GPU each is about one
    kernel launch; at small shapes, where a kernel takes a few microseconds, the block's time is
    then the host's dispatch time, so this count predicts the GPU ratio better than CPU timings
    do. On CUDA `kernel_launches` counts the runtime's kernel launches as well (Triton kernels
    included, which are no aten ops), `device_kernels` lists the `top` kernels by summed device
    time (name, calls, ms) with the total of all: where the GPU spends the iteration, and
    `device_idle` where it waits for the host instead (`_device_idle`)."""
    device_events = [e for e in events if _is_device_work(e)]
    events = [e for e in events if e.device_type.name == "CPU"]
    bwd_start = min(
        (e.time_range.start for e in events if e.name.startswith("autograd::engine::evaluate_function")),
        default=float("inf"),
    )

    def op_parent(e):
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "c10d::")):
            parent = parent.cpu_parent
        return parent

    def counted(e) -> bool:
        if not e.name.startswith(("aten::", "c10d::")):
            return False
        parent = op_parent(e)
        if parent is None:
            return e.name.split("::", 1)[1] not in METADATA_OPS
        # a conversion the code asked for: `_to_copy` under a top-level `to` (which itself is metadata)
        return e.name == "aten::_to_copy" and parent.name == "aten::to" and op_parent(parent) is None

    ops = [e for e in events if counted(e)]
    names = defaultdict(int)
    for e in ops:
        names[e.name.split("::", 1)[1]] += 1
    forward = sum(1 for e in ops if e.time_range.start < bwd_start)
    launches = (
        sum(1 for e in events if "LaunchKernel" in e.name) if cuda else None
    )  # cudaLaunchKernel(Ex), cuLaunchKernel
    gemm_starts = [e.time_range.start for e in ops if "grouped_mm" in e.name or "bmm" in e.name]
    first_gemm = min(gemm_starts) if gemm_starts else None
    return {
        "forward": forward,
        "backward": len(ops) - forward,
        "total": len(ops),
        "kernel_launches": launches,
        # ops the host issues before the first expert GEMM (torch's grouped_mm or the padded bmm;
        # None for the Triton kernel, no aten op): an iteration that starts on an idle GPU waits
        # for them before the first large kernel
        "before_first_gemm": None if first_gemm is None else sum(1 for e in ops if e.time_range.start < first_gemm),
        "by_op": dict(sorted(names.items(), key=lambda kv: (-kv[1], kv[0]))),
        "device_kernels": _device_kernels(device_events, top) if device_events else None,
        "device_idle": _device_idle(device_events, ops, bwd_start) if device_events and ops else None,
    }


def _device_kernels(device_events, top: int) -> dict:
    """Device time by kernel name (summed over calls), the `top` largest, and the total."""
    by_name = defaultdict(lambda: [0, 0.0])
    for e in device_events:
        entry = by_name[e.name]
        entry[0] += 1
        entry[1] += (e.time_range.end - e.time_range.start) / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {
        "total_ms": round(sum(ms for _, (_, ms) in ranked), 3),
        "kernels": len(device_events),
        "top": [{"name": name[:120], "calls": calls, "ms": round(ms, 3)} for name, (calls, ms) in ranked[:top]],
    }


def _device_idle(device_events, ops, bwd_start: float, min_gap_us: float = 10.0, top: int = 8) -> dict:
    """Where the device waits for the host in one iteration: from the first host op's start to
    the last kernel's end, the gaps of at least `min_gap_us` between the busy intervals (the
    union of the kernels). `idle_ms` sums them, `before_first_kernel_ms` is the first; `gaps`
    lists the `top` longest in time order: where (ms from the first op; forward or backward),
    how long, the kernel that ended the wait (its start gives the phase) and the host ops that
    started during the wait."""
    start = min(e.time_range.start for e in ops)
    kernels = sorted(device_events, key=lambda e: e.time_range.start)
    busy_until, gaps = start, []
    for k in kernels:
        if k.time_range.start - busy_until >= min_gap_us:
            gaps.append((busy_until, k.time_range.start, k.name))
        busy_until = max(busy_until, k.time_range.end)
    first = kernels[0].time_range.start - start

    def described(gap):
        begin, end, name = gap
        return {
            "at_ms": round((begin - start) / 1e3, 3),
            "ms": round((end - begin) / 1e3, 3),
            "phase": "forward" if end < bwd_start else "backward",
            "next_kernel": name[:80],
            "host_ops_started": sum(1 for e in ops if begin <= e.time_range.start < end),
        }

    longest = sorted(sorted(gaps, key=lambda g: g[0] - g[1])[:top])
    return {
        "span_ms": round((busy_until - start) / 1e3, 3),
        "idle_ms": round(sum(end - begin for begin, end, _ in gaps) / 1e3, 3),
        "before_first_kernel_ms": round(first / 1e3, 3),
        "gaps": [described(g) for g in longest],
    }


# ---------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    keep_freed_host_memory()  # as train.py does; the --peer block runs in this process too
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.threads is not None:
        if args.threads < 1:
            fail(f"--threads={args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.peer and world > 1:
        fail("--peer runs single-process only (the Mixtral block has no expert parallelism); drop torchrun")
    if args.compile and (world > 1 or args.dtype != "bf16"):
        fail(
            f"--compile={args.compile} compiles the single-process block in bf16 only: at ep > 1 the "
            "dispatch syncs the host for the all-to-all sizes, and torch's grouped GEMM traces only in bf16; "
            "use --dtype bf16 without torchrun"
        )
    if args.tokens % world:
        fail(f"--tokens={args.tokens} is not divisible by the world size {world}")
    from throughput import init_process_group, pick_device

    device = pick_device(args.device, on_error=fail)  # both blocks run there
    try:
        backend = resolve_backend(args.kernels, device.type)
    except (ValueError, RuntimeError) as exc:
        fail(f"--kernels={args.kernels}: {exc}")
    if args.compile and backend == "triton":
        fail(f"--compile={args.compile} traces torch's grouped GEMM; use --kernels torch or auto")
    if backend == CHECKED and args.warmup < 1:
        fail(
            f"--kernels={args.kernels} self-checks each Triton kernel on the first step: "
            "use --warmup >= 1 so that the check is not timed"
        )
    if world > 1:
        init_process_group(device)
    local_tokens = args.tokens // world
    try:
        mesh = build_mesh(ParallelConfig(ep=args.ep, etp=args.etp), device_type=device.type)
        cfg, layer, step = build_meshtron(args, mesh, local_tokens, device, backend)
    except ValueError as exc:
        fail(str(exc))

    peer_info, peer_step = build_peer(args, device) if args.peer else (None, None)

    for i in range(args.warmup):
        step()
        if i == 0 and backend == CHECKED:
            selfcheck.agree(device)  # as the training loop does after its first step
        if peer_step is not None:
            peer_step()
    sync(device)
    from throughput import _host_cpu_seconds, _own_cpu_seconds, host_load

    host0, own0, wall0 = _host_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
    mine, theirs = [], []
    rounds = args.rounds if args.peer else 1
    for _ in range(rounds):
        mine += time_iters(step, args.iters, world, device)
        if peer_step is not None:
            theirs += time_iters(peer_step, args.iters, 1, device)

    wall = time.perf_counter() - wall0
    own = torch.tensor([_own_cpu_seconds() - own0], dtype=torch.float64)
    if world > 1:
        own = own.to(device)
        dist.all_reduce(own)
    host1 = _host_cpu_seconds()
    busy, steal = host_load(host0, host1, float(own.sum()), wall)
    host = {
        "cpus": os.cpu_count(),
        "other_busy_cpus": None if busy is None else round(busy, 3),
        "steal_cpus": None if steal is None else round(steal, 3),
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }

    result_breakdown = ops = peer_ops = None
    if not args.no_profile:
        if world > 1:
            dist.barrier()
        if args.compile:  # the region markers would break the compiled graph: host ops only
            ops = host_ops(step, device)
        else:  # every rank runs it (collectives), rank 0 reports; the same profile counts the host ops
            result_breakdown, events = breakdown(step, layer, device)
            ops = count_host_ops(events, device.type == "cuda")
        peer_ops = host_ops(peer_step, device) if peer_step is not None else None

    # FLOPs the block needs per token, fwd+bwd (peers/README.md's MoE formula, + shared experts).
    mats = 3 if args.activation == "swiglu" else 2
    fwd_flops_tok = (
        2 * args.hidden * args.experts + (args.top_k + args.shared_experts) * 2 * mats * args.hidden * args.ffn
    )
    flops_tok = 3 * fwd_flops_tok

    res = summary(mine, args.tokens)
    result = {
        "bench": "moe_layer",
        "system": "meshtron moe.layer.MoELayer",
        "config": {
            "tokens": args.tokens,
            "hidden": args.hidden,
            "ffn": args.ffn,
            "experts": args.experts,
            "top_k": args.top_k,
            "shared_experts": args.shared_experts,
            "activation": cfg.activation,
            "router": cfg.router_score,
            "renormalize": cfg.router_renormalize,
            "aux_loss_coef": cfg.aux_loss_coef,
            "capacity_factor": cfg.capacity_factor,
            "dtype": args.dtype,
            "kernels": backend,
            "dispatch_chunks": layer.dispatch_chunk_count(local_tokens),
            "timed": "forward + backward (input and all weights; aux-loss term included when coef > 0)",
        },
        "layout": {
            "world": world,
            "ep": mesh.par.ep,
            "etp": mesh.par.etp,
            "edp": mesh.par.edp,
            "tokens_per_rank": local_tokens,
            "processes": "single process"
            if world == 1
            else f"{world} processes (torchrun, {'nccl' if device.type == 'cuda' else 'gloo'})",
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        # kernels: the resolved backend of meshtron's grouped GEMMs (triton_checked = auto on CUDA);
        # grouped_gemm_path: the path they take with it ("torch" also where auto prefers torch's
        # own grouped GEMM, moe/experts.py grouped_backend); kernel_verdicts: the self-check's
        # verdict (False: the torch path ran instead, with a warning).
        "kernels": backend,
        "kernels_requested": args.kernels,
        "compile": args.compile,  # torch.compile mode of both blocks (None: eager)
        "grouped_gemm_path": grouped_backend(
            torch.empty(0, device=device, dtype=DTYPES[args.dtype]), layer.experts.w_up, backend
        ),
        "kernel_verdicts": {k: selfcheck.verdict(k) for k in selfcheck.KERNELS if selfcheck.verdict(k) is not None},
        # fp32 on CUDA: whether torch's matmuls (both blocks) and the Triton GEMMs may round to TF32.
        "tf32": (
            {"torch": torch_allows_tf32(), "triton_fp32_dots": dot_precision(torch.float32)}
            if device.type == "cuda"
            else None
        ),
        "threads": threads,
        "host": host,
        "warmup": args.warmup,
        "rounds": rounds,
        **res,
        "flops_per_token_fwd_bwd": flops_tok,
        "achieved_gflops": round(flops_tok * res["tokens_per_s"] / 1e9, 2),
        "breakdown": result_breakdown,
        "host_ops": ops,
        "torch": torch.__version__,
    }
    if peer_step is not None:
        p = summary(theirs, args.tokens)
        result["peer"] = {**peer_info, **p, "achieved_gflops": round(flops_tok * p["tokens_per_s"] / 1e9, 2)}
        result["ratio_tokens_per_s_vs_peer"] = round(res["tokens_per_s"] / p["tokens_per_s"], 3)
        # On a loaded host the fastest iteration of each side is the least disturbed one.
        result["ratio_vs_peer_by_min_ms"] = round(p["ms"]["min"] / res["ms"]["min"], 3)
        result["peer"]["host_ops"] = peer_ops
        result["peer_note"] = (
            "interleaved: each round times meshtron then the peer, --iters each; medians over "
            "all rounds (ratio_tokens_per_s_vs_peer), and the ratio of the fastest iterations (by_min)"
        )
    if _rank() == 0:
        print(json.dumps(result), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
