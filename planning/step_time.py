"""Step-time model of one layout: how long a training step takes, term by term, from FLOP counts,
message sizes and the cluster's peak FLOP/s and bandwidths. Pure arithmetic, no process group.

A `Cluster` says what one device computes (`peak_flops` at the run's precision times
`efficiency`, the fraction of peak the model's matmuls reach), how fast collectives move bytes
inside a node (`intra_bw`) and across nodes (`inter_bw`), both the *bus bandwidth* a ring
collective reaches per device, what each message of a collective costs before its first
byte (`latency_s`, the alpha of the alpha-beta model: a ring all-reduce over n ranks pays
2(n-1) of them), and how fast the device streams memory (`mem_bw`, for the optimizer step).
`cluster_preset` holds h100 / a100 / h200 (datasheet peaks from `planning.peak`, NVLink and
400/200 Gb/s InfiniBand per GPU) and cpu (calibrated on the 2-core development host, see
`CPU_CALIBRATION`).

`step_time` adds these terms (seconds per step; m microbatches per rank, pp stages, vpp
virtual stages per rank, one rank's microbatch is mbs sequences of s/cp tokens):

* compute: the bottleneck stage's matmul FLOPs (`planning.flops.model_flops_per_token` split
  into L equal layers plus the LM head on the last stage), plus recomputation (selective: the
  attention core's forward, 4*s*a*d per token per layer, a*d = num_heads x head_dim, the
  attention's width: hidden_size unless model.kv_channels; full: each layer's forward again, a
  third of its training FLOPs), divided over the tp*cp ranks of a stage (experts balanced over
  the folded expert mesh, so the same share) at peak_flops*efficiency;
* tensor parallelism: per layer per microbatch 2 exchanges forward and 2 backward of the
  [mbs, s/cp, h] activation, 2 more in the backward under full recompute (the recomputed
  forward), one for the vocab-parallel embedding (first stage) and one for the LM head's
  input (last stage); an exchange is an all-reduce, or under SP an all-gather plus a
  reduce-scatter (the same ring bytes and steps; on one CPU host both through shared memory,
  like the all-reduce); forward ones are exposed, backward
  ones hide behind the weight-gradient GEMM they overlap in meshtron (a third of the layer's
  compute);
* context parallelism: ring: 2*(cp-1) KV chunk passes per layer forward (K and V of one of
  this rank's 2 chunks each: (cp-1) x this rank's K,V bytes) and twice that backward (kv and
  the accumulating dk/dv), batched isend/irecv at `torch_latency_s`, overlapped with the
  attention blocks' compute; a2a: 4 all-to-alls
  (q, k, v, out: q and out a*d wide, k and v num_kv_heads x head_dim) per layer forward and 4
  backward, exposed;
* expert parallelism: per MoE layer per microbatch, dispatch and combine all-to-alls of
  top_k rows of h per token over ep, forward and backward (an upper bound: a token sent to
  one rank for two experts is one row), and under etp an all-gather and a reduce-scatter of
  the rows over etp; exposed (meshtron overlaps the forward ones only with shared experts);
* pipeline: the microbatch time (compute + exposed communication + the p2p send of the
  activation and the receive of its gradient per virtual stage, through torch.distributed)
  times m + (pp-1)/vpp, so the bubble fraction is (pp-1)/(m*vpp + pp-1) ((pp-1)/(m+pp-1) at
  vpp=1);
* data parallelism: gradients (fp32) all-reduced over the replicas of each gradient group
  (dense dp*cp, sequence-parallel replicated tp*dp*cp, experts edp), overlapped with the
  last microbatch's backward; ZeRO's reduce-scatters and gathers at `torch_latency_s`;
  ZeRO-1 all-reduces too and then all-gathers the updated fp32
  parameters, overlapped with the next step's first forward (optim.overlap_param_gather);
  ZeRO-2 reduce-scatters (overlapped) and all-gathers (likewise); ZeRO-3
  all-gathers the parameters twice and reduce-scatters the gradients per microbatch,
  prefetched behind that microbatch's compute;
* overhead: `overhead_s` per layer per microbatch (host work compute does not hide: kernel
  launches of small layers, Python on CPU), so fewer, larger microbatches run faster;
* without `overlap` (CPU: the cores that compute also copy the bytes) every term above that
  is "overlapped" is exposed in full;
* optimizer: AdamW streams 28 bytes per parameter of its share (read weight, gradient and two
  moments, write weight and moments) at `mem_bw`;
* CPU (`cores_per_node` > 0, the processes of a node share its cores): instead of the
  pipeline term and the sum above, the step is the makespan of a processor-sharing
  simulation of the schedule (`shared_core_makespan`): each stage's ranks run its action list
  (`pipeline.schedules`, 1F1B or interleaved), a virtual stage's forward of one
  microbatch costing its layers' forward compute and forward communication (+ a third of
  `overhead_s`, half the p2p, the embedding's or the head's share), its backward twice the
  compute plus recomputation and the backward communication, then every stage's gradient
  reduction and optimizer step (the bottleneck rank's); at any moment the runnable
  processes of a node share its cores equally (each at min(1, cores / runnable) of one), and
  a process blocked on a peer still takes `wait_cpu_share` of a runnable one. pp = 1: all
  ranks busy, work x processes / cores. So a pipeline's bubble costs only where fewer
  processes than cores can run, and the last stage's LM head (2.7 layers' FLOPs on the
  reference shape) delays the stages that wait for it exactly as the schedule does.

Not modelled: kernel launch and host overheads other than `latency_s` and `overhead_s`,
memory-bound elementwise work (norms, activations, softmax: inside `efficiency`), load
imbalance between experts, the optimizer's gradient-norm all-reduce, uneven stage splits
(`stage_layers`); in the CPU simulation, the stages' different parameter counts (every
stage's gradient reduction and optimizer step are the bottleneck rank's), the OS scheduler's
time slices and cache sharing (inside `efficiency` and `wait_cpu_share`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field

import torch

from meshtron.models.config import GPTConfig
from meshtron.mpu.mesh import ParallelConfig, placement
from meshtron.pipeline.schedules import build_all_ranks
from meshtron.planning.flops import (
    attention_core_flops_per_token,
    attention_width,
    model_flops_per_token,
    moe_layer_indices,
)
from meshtron.planning.peak import known_gpu_peak_flops
from meshtron.schema import declared_in

__all__ = [
    "Cluster",
    "Layout",
    "ModelCosts",
    "StepTime",
    "cluster_preset",
    "CLUSTER_PRESETS",
    "CPU_CALIBRATION",
    "step_time",
    "all_reduce_time",
    "all_gather_time",
    "all_to_all_time",
    "bubble_fraction",
    "compute_time",
    "shared_core_makespan",
]

GB = 1e9

# The 2-core development host (Xeon VM, torch 2.13 CPU), from bench/plan_calibration.py runs on
# 2026-11-25. flops_per_core: the bench's one-thread fp32 matmul rate on the quiet host (99.6
# GFLOP/s at 01:42 UTC; 17-49 GFLOP/s under the load of the earlier runs);
# mem_bw: a 64 MiB copy on one thread (read + write; 15-26 GB/s measured); bw and latency_s:
# mpu/shm_collectives (about 0.2 ms per small collective). efficiency, overhead_s (host time
# per layer per microbatch: more, smaller microbatches run slower than their FLOPs say),
# gloo_latency_s (per message of pipeline and ring-CP sends; SP's reduce-scatters went through
# gloo in the fit run and through shared memory since, priced at latency_s) and
# wait_cpu_share (fitted 0: a process blocked in gloo or the shared-memory wait gives its core
# away): grid-fitted (mean absolute error) to the 14 layouts of the 2026-11-25 04:35 UTC run
# (docs/planning.md, "Calibration on this CPU"), with the shared-core simulation.
CPU_CALIBRATION = {
    "flops_per_core": 99.6e9,
    "cores": 2,
    "bw": 2.0e9,
    "latency_s": 1e-4,
    "mem_bw": 2.0e10,
    "efficiency": 0.6,
    "overhead_s": 2e-3,
    "gloo_latency_s": 5e-4,
    "wait_cpu_share": 0.0,
    "date": "2026-11-25",
}

CLUSTER_PRESETS = ("h100", "a100", "h200", "cpu")
# device name matched by planning.peak's datasheet table; bus bandwidths per GPU in bytes/s.
_GPU_PRESETS = {
    # NVLink 4 (900 GB/s bidirectional): NCCL reaches ~360 GB/s bus bandwidth; 400 Gb/s IB per GPU;
    # ~5 us per ring step (NCCL's small-message all-reduce on 8 GPUs is some tens of us).
    "h100": dict(
        device_name="NVIDIA H100 SXM",
        memory=80 * 1024**3,
        intra_bw=360 * GB,
        inter_bw=40 * GB,
        latency_s=5e-6,
        mem_bw=3.35e12,
    ),
    # NVLink 3 (600 GB/s bidirectional): ~230 GB/s bus bandwidth; 200 Gb/s IB per GPU.
    "a100": dict(
        device_name="NVIDIA A100",
        memory=80 * 1024**3,
        intra_bw=230 * GB,
        inter_bw=20 * GB,
        latency_s=5e-6,
        mem_bw=2.0e12,
    ),
    "h200": dict(
        device_name="NVIDIA H200 SXM",
        memory=141 * 10**9,
        intra_bw=360 * GB,
        inter_bw=40 * GB,
        latency_s=5e-6,
        mem_bw=4.8e12,
    ),
}
GPU_EFFICIENCY = 0.5  # fraction of the dense datasheet peak large bf16 GEMMs of a training step reach
GPU_OVERHEAD_S = 2e-5  # launch latency per layer per microbatch a small layer cannot hide
# fp8 is planned at the bf16 rate: only the dense linears run in FP8 (mpu/fp8.py) and their
# speed-up is not measured yet, so the planner does not count it.
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass(frozen=True)
class Cluster:
    """The machines a layout runs on: `gpus` devices, `gpus_per_node` per node (node = rank //
    gpus_per_node, torchrun's order), `gpu_memory_bytes` each, `peak_flops` per device at the
    run's precision, `efficiency` (achieved fraction of it), bus bandwidths `intra_bw` (inside a
    node) and `inter_bw` (across nodes) in bytes/s per device, `latency_s` per collective,
    `mem_bw` (device memory bytes/s), `overlap` (whether communication the model calls
    overlapped can hide behind compute at all: on a CPU the same cores copy the bytes) and
    `overhead_s` (host time per layer per microbatch that compute does not hide) and
    `cores_per_node` (CPU: the processes of a node share that many cores; `peak_flops` and
    `mem_bw` are then one core's), `gloo_latency_s` (CPU: latency per message of what
    meshtron sends through gloo rather than shared memory; None: `latency_s`) and
    `wait_cpu_share` (CPU: the share of a core a process blocked on a peer still takes)."""

    gpus: int
    gpus_per_node: int
    gpu_memory_bytes: int
    peak_flops: float
    intra_bw: float
    inter_bw: float
    efficiency: float
    latency_s: float = 0.0
    mem_bw: float = float("inf")
    overlap: bool = True  # communication runs beside compute (GPU copy engines); CPU cores do both
    overhead_s: float = 0.0  # host time per layer per microbatch (forward + backward) not hidden by compute
    cores_per_node: int = 0  # > 0: a node's processes share this many cores (CPU); 0: one device each
    name: str = "custom"
    device: str = "cuda"  # what the memory planner assumes the run trains on (cpu | cuda)
    gloo_latency_s: float | None = None  # CPU: per message of what goes through gloo; None: latency_s
    wait_cpu_share: float = 0.0  # CPU: share of a core a rank blocked on a peer still takes

    @property
    def torch_latency_s(self) -> float:
        """Latency per message of the collectives meshtron sends through torch.distributed even
        inside one host (pipeline p2p, ZeRO reduce-scatters and gathers, ring-CP sends): gloo's
        on a CPU (`gloo_latency_s`), else `latency_s` (NCCL carries every collective on GPUs)."""
        return self.latency_s if self.gloo_latency_s is None else self.gloo_latency_s

    def __post_init__(self) -> None:
        if not 0.0 <= self.wait_cpu_share <= 1.0:
            raise ValueError(f"cluster {self.name}: wait_cpu_share={self.wait_cpu_share} must be in [0, 1]")
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % self.gpus_per_node:
            raise ValueError(f"--gpus {self.gpus} is not divisible by --gpus-per-node {self.gpus_per_node}")
        if not (0 < self.efficiency <= 1) or self.peak_flops <= 0 or min(self.intra_bw, self.inter_bw) <= 0:
            raise ValueError(f"cluster {self.name}: efficiency in (0, 1], peak FLOP/s and bandwidths > 0 needed")


def cluster_preset(
    name: str, gpus: int, gpus_per_node: int, gpu_memory_bytes: int | None = None, precision: str = "bf16"
) -> Cluster:
    """The `Cluster` of a preset (h100 | a100 | h200 | cpu) for `gpus` devices, `precision`
    fixing the peak (datasheet dense peak of bf16/fp16 tensor cores, plain FP32 for fp32;
    cpu: `CPU_CALIBRATION`, the host's cores shared by the gpus_per_node processes on it).
    ValueError names the known presets."""
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"unknown --gpu {name!r}; use one of {', '.join(CLUSTER_PRESETS)}")
    if precision not in _DTYPES:
        raise ValueError(f"trainer.precision={precision!r} is unknown; use one of {', '.join(_DTYPES)}")
    if name == "cpu":
        c = CPU_CALIBRATION
        # the node's processes share its cores (step_time's processor-sharing simulation)
        return Cluster(
            gpus,
            gpus_per_node,
            gpu_memory_bytes or 16 * 1024**3,
            c["flops_per_core"],
            c["bw"],
            c["bw"],
            c["efficiency"],
            c["latency_s"],
            c["mem_bw"],
            overlap=False,
            overhead_s=c["overhead_s"],
            cores_per_node=c["cores"],
            name="cpu",
            device="cpu",
            gloo_latency_s=c["gloo_latency_s"],
            wait_cpu_share=c["wait_cpu_share"],
        )
    p = _GPU_PRESETS[name]
    peak = known_gpu_peak_flops(p["device_name"], _DTYPES[precision], tf32=False)
    return Cluster(
        gpus,
        gpus_per_node,
        gpu_memory_bytes or p["memory"],
        peak,
        p["intra_bw"],
        p["inter_bw"],
        GPU_EFFICIENCY,
        p["latency_s"],
        p["mem_bw"],
        overhead_s=GPU_OVERHEAD_S,
        name=name,
        device="cuda",
    )


# The parallel sizes a Layout fixes, in its field order.
LAYOUT_SIZES = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "sp", "cp_comm")


def _size_fields() -> list[tuple[str, object, dataclasses.Field]]:
    """Layout's size fields as ParallelConfig declares them (type, default, range, help), for
    `make_dataclass`; dp alone differs: a layout's is resolved, an int (1 by default), where
    ParallelConfig's may be null (world / (tp*cp*pp))."""
    hints = typing.get_type_hints(ParallelConfig)
    resolved_dp = ("dp", int, field(default=1, metadata=ParallelConfig.__dataclass_fields__["dp"].metadata))
    return [
        resolved_dp if name == "dp" else (name, hints[name], declared_in(ParallelConfig, name)) for name in LAYOUT_SIZES
    ]


_LayoutSizes = dataclasses.make_dataclass(
    "_LayoutSizes", _size_fields(), frozen=True, namespace={"__module__": __name__}
)


@dataclass(frozen=True)
class Layout(_LayoutSizes):
    """One candidate: the parallel sizes (`LAYOUT_SIZES`, declared by ParallelConfig, not here:
    dp = world / (tp*cp*pp)), `sp`, `vpp` (interleaved schedule when > 1, else 1f1b),
    `cp_comm`, then `zero` (optim.zero), `recompute` (trainer.recompute) and
    `micro_batch_size`."""

    zero: int = 0
    recompute: str = "none"
    micro_batch_size: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def schedule(self) -> str:
        return "interleaved" if self.vpp > 1 else "1f1b"

    def parallel_config(self) -> ParallelConfig:
        """The `ParallelConfig` (resolved: dp set) of this layout."""
        return ParallelConfig(**{name: getattr(self, name) for name in LAYOUT_SIZES}, schedule=self.schedule)

    def overrides(self) -> str:
        """Ready-to-paste command-line overrides of train.py for this layout."""
        parts = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}"]
        if self.cp > 1:
            parts += [f"parallel.cp={self.cp}", f"parallel.cp_comm={self.cp_comm}"]
        if self.ep > 1 or self.etp > 1:
            parts += [f"parallel.ep={self.ep}", f"parallel.etp={self.etp}"]
        if self.sp:
            parts.append("parallel.sp=true")
        if self.vpp > 1:
            parts += [f"parallel.vpp={self.vpp}", "parallel.schedule=interleaved"]
        parts += [
            f"optim.zero={self.zero}",
            f"trainer.recompute={self.recompute}",
            f"trainer.micro_batch_size={self.micro_batch_size}",
        ]
        return " ".join(parts)


@dataclass
class StepTime:
    """Modelled seconds of one training step by term (see the module docstring), with
    `total`, `tokens_per_s` and `mfu` (model FLOPs per token x tokens/s over world x peak)."""

    microbatches: int
    compute_per_microbatch: float
    tp_per_microbatch: float
    cp_per_microbatch: float
    ep_per_microbatch: float
    p2p_per_microbatch: float
    bubble_fraction: float
    pipeline: float
    dp_exposed: float
    zero_exposed: float
    optimizer: float
    total: float
    tokens_per_s: float
    mfu: float
    terms: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- collectives


def all_reduce_time(nbytes: float, n: int, bw: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks (alpha-beta model: 2(n-1) steps):
    2(n-1) * latency + 2(n-1)/n * nbytes / bw; 0 for n = 1."""
    return 0.0 if n <= 1 else 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / bw


def all_gather_time(nbytes: float, n: int, bw: float, latency_s: float = 0.0) -> float:
    """Ring all-gather (or reduce-scatter) producing (consuming) `nbytes` per rank over `n` ranks:
    (n-1) * latency + (n-1)/n * nbytes / bw; 0 for n = 1."""
    return 0.0 if n <= 1 else (n - 1) * latency_s + (n - 1) / n * nbytes / bw


def all_to_all_time(nbytes: float, n: int, bw: float, latency_s: float = 0.0) -> float:
    """All-to-all of `nbytes` held per rank over `n` ranks: (n-1) messages, (n-1) * latency +
    the (n-1)/n that leaves / bw; 0 for n = 1."""
    return 0.0 if n <= 1 else (n - 1) * latency_s + (n - 1) / n * nbytes / bw


def bubble_fraction(pp: int, microbatches: int, vpp: int = 1) -> float:
    """Idle fraction of a pipelined step: (pp-1) / (m*vpp + pp-1); (pp-1)/(m+pp-1) at vpp = 1."""
    return (pp - 1) / (microbatches * vpp + pp - 1)


def compute_time(flops: float, cluster: Cluster) -> float:
    """Seconds for `flops` at the cluster's peak times its efficiency."""
    return flops / (cluster.peak_flops * cluster.efficiency)


def _count_nodes(first: int, count: int, gpus_per_node: int) -> dict[int, int]:
    """{node: processes} of the global ranks first .. first+count-1 (node = rank // gpus_per_node)."""
    out: dict[int, int] = {}
    for r in range(first, first + count):
        out[r // gpus_per_node] = out.get(r // gpus_per_node, 0) + 1
    return out


def _action_work(
    actions: list, i: int, q: int, pp: int, fwd_work: tuple[float, ...], bwd_work: tuple[float, ...], tail: float
) -> float:
    """Seconds of one core that action `i` of stage q's list `actions` takes: its virtual
    stage's forward or backward work, or the `tail` once the list is done."""
    if i == len(actions):
        return tail
    a = actions[i]
    v = a.chunk * pp + q
    return fwd_work[v] if a.kind == "F" else bwd_work[v]


def _runnable_stages(
    lists: list, pos: list[int], finished: list[bool], done: set[tuple[str, int, int]], pp: int, last: int
) -> list[int]:
    """The stages that can run now: unfinished, and either in their tail (it needs no peer) or
    at an action whose input is done (F(v, j) after F(v-1, j), B(v, j) after B(v+1, j))."""
    runnable = []
    for q in range(pp):
        if finished[q]:
            continue
        if pos[q] == len(lists[q]):
            runnable.append(q)  # the tail needs no peer
            continue
        a = lists[q][pos[q]]
        v = a.chunk * pp + q
        if a.kind == "F":
            ready = v == 0 or ("F", a.microbatch, v - 1) in done
        else:
            ready = v == last or ("B", a.microbatch, v + 1) in done
        if ready:
            runnable.append(q)
    return runnable


def _core_rates(
    runnable: list[int],
    pp: int,
    nodes: tuple[tuple[tuple[int, int], ...], ...],
    cores: int,
    wait_cpu_share: float,
) -> dict[int, float]:
    """{stage: fraction of a core it runs at} of the runnable stages: a node's load is its
    runnable processes plus `wait_cpu_share` times the others, each stage runs at min(1, cores
    / load) of its slowest node."""
    load: dict[int, float] = {}
    running = set(runnable)
    for q in range(pp):
        share = 1.0 if q in running else wait_cpu_share
        for node, procs in nodes[q]:
            load[node] = load.get(node, 0.0) + share * procs
    return {q: min(min(1.0, cores / load[node]) for node, _ in nodes[q]) for q in runnable}


@functools.lru_cache(maxsize=4096)
def shared_core_makespan(
    schedule: str,
    pp: int,
    m: int,
    vpp: int,
    fwd_work: tuple[float, ...],
    bwd_work: tuple[float, ...],
    tail: float,
    nodes: tuple[tuple[tuple[int, int], ...], ...],
    cores: int,
    wait_cpu_share: float = 0.0,
) -> float:
    """Seconds from the step's start until every pipeline stage has run its tasks, when a node's
    runnable processes share its `cores` equally (processor sharing; deterministic, no process
    group).

    Stage q (pipeline rank q, `nodes[q]` = ((node, processes), ...) of its tp*cp*dp ranks, which
    run the same tasks in lockstep) runs `pipeline.schedules.build_all_ranks(schedule, pp,
    m, vpp)[q]` in order, then a `tail` (gradient reduction and optimizer). The forward of
    microbatch j through virtual stage v (= chunk*pp + q) takes `fwd_work[v]` seconds of one
    core, its backward `bwd_work[v]`; F(v, j) starts after F(v-1, j), B(v, j) after B(v+1, j)
    (and after F(v, j), earlier in the same list). At each moment a node's load is its runnable
    processes plus `wait_cpu_share` times its blocked or finished ones, and a runnable stage
    runs at min(1, cores / load) of a core (the slowest of its nodes). pp = 1: all processes
    busy throughout, (sum of work + tail) * max(1, processes / cores).
    """
    lists = build_all_ranks(schedule, pp, m, vpp)
    last = pp * vpp - 1
    pos = [0] * pp
    left = [_action_work(lists[q], 0, q, pp, fwd_work, bwd_work, tail) for q in range(pp)]
    done: set[tuple[str, int, int]] = set()
    clock = 0.0
    finished = [False] * pp
    while not all(finished):
        runnable = _runnable_stages(lists, pos, finished, done, pp, last)
        if not runnable:
            raise RuntimeError(f"{schedule} schedule of pp={pp}, m={m}, vpp={vpp} deadlocks in the model")
        rate = _core_rates(runnable, pp, nodes, cores, wait_cpu_share)
        dt = min(left[q] / rate[q] for q in runnable)
        clock += dt
        for q in runnable:
            if left[q] / rate[q] > dt * (1 + 1e-12):
                left[q] -= rate[q] * dt
                continue
            if pos[q] == len(lists[q]):
                finished[q] = True
                continue
            a = lists[q][pos[q]]
            done.add((a.kind, a.microbatch, a.chunk * pp + q))
            pos[q] += 1
            left[q] = _action_work(lists[q], pos[q], q, pp, fwd_work, bwd_work, tail)
    return clock


# --------------------------------------------------------------------------- the model


@functools.lru_cache(maxsize=4096)
def _bandwidths(tp: int, pp: int, dp: int, cp: int, ep: int, etp: int, cluster: Cluster) -> dict[str, float]:
    """Bus bandwidth of each group kind: intra-node when none of its groups spans nodes (shared
    cached dict: read only)."""
    where = _inter_node(tp, pp, dp, cp, ep, etp, cluster.gpus_per_node)
    return {name: (cluster.inter_bw if spans else cluster.intra_bw) for name, spans in where.items()}


@dataclass(frozen=True)
class ModelCosts:
    """What the step-time model reads from a `GPTConfig` besides its shape, computed once per
    search: training FLOPs per token, the LM head's share of them, and the MoE layer count."""

    per_token: float
    head: float
    moe_layers: int

    @staticmethod
    def of(cfg: GPTConfig) -> ModelCosts:
        return ModelCosts(
            model_flops_per_token(cfg), 3 * 2 * cfg.hidden_size * cfg.padded_vocab_size(1), len(moe_layer_indices(cfg))
        )


@functools.lru_cache(maxsize=4096)
def _inter_node(tp: int, pp: int, dp: int, cp: int, ep: int, etp: int, gpus_per_node: int) -> dict[str, bool]:
    """Whether any group of each kind spans nodes (`mpu.mesh.placement`, plus dp x cp and a stage)."""
    par = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)
    world, gpn = tp * pp * dp * cp, gpus_per_node
    if world % gpn:
        gpn = world  # a layout smaller than a node (tests): one node
    where = placement(par, world, gpn)
    # dp x cp (gradient replicas of dense weights): ranks of one (pp, tp) position
    blocks = torch.arange(world).view(pp, dp * cp, tp).movedim(1, -1)
    out = {name: not p.intra_node for name, p in where.items()}
    out["dp_cp"] = any(len({int(r) // gpn for r in g}) > 1 for g in blocks.reshape(-1, dp * cp).tolist())
    out["tp_dp"] = world // pp > gpn
    return out


def _act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _exposed(comm: float, compute: float, cluster: Cluster) -> float:
    """What of `comm` the overlapped `compute` does not hide (all of it without overlap)."""
    return max(0.0, comm - compute) if cluster.overlap else comm


def _microbatch_count(global_batch_size: int, layout: Layout) -> int:
    """Microbatches per rank; ValueError when the global batch does not split over dp."""
    dp, mbs = layout.dp, layout.micro_batch_size
    if global_batch_size % (dp * mbs):
        raise ValueError(f"global batch {global_batch_size} does not split into dp={dp} x micro batches of {mbs}")
    return global_batch_size // (dp * mbs)


class _Compute(typing.NamedTuple):
    """Compute of one microbatch on one rank (seconds unless said): `stage` the bottleneck
    (last) stage's forward and backward with recomputation and the LM head, `layer` one
    layer's, `layer_fwd` one layer's forward, `head` the LM head's; `core` the attention core's
    forward FLOPs per token, `tokens` a stage's tokens of the microbatch, `stage_layers` L / pp."""

    core: float
    tokens: int
    stage_layers: float
    stage: float
    layer: float
    layer_fwd: float
    head: float


def _compute_times(cfg: GPTConfig, layout: Layout, cluster: Cluster, costs: ModelCosts) -> _Compute:
    """Compute of one microbatch (per rank): a layer's forward, its backward (2x the forward,
    plus recomputation), the LM head on the last stage, split over the tp*cp ranks of a stage."""
    L, s = cfg.num_layers, cfg.seq_len
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    per_token, head = costs.per_token, costs.head
    layer = (per_token - head) / L
    core = attention_core_flops_per_token(cfg)  # 4*s*a*d: a*d = h unless model.kv_channels
    recompute = {"none": 0.0, "selective": core, "full": layer / 3}[layout.recompute]
    tokens = layout.micro_batch_size * s  # one microbatch's tokens of the stage, split over tp*cp ranks
    stage_layers = L / pp
    stage = stage_layers * (layer + recompute) + head  # the last stage (the bottleneck) holds the LM head
    return _Compute(
        core=core,
        tokens=tokens,
        stage_layers=stage_layers,
        stage=compute_time(stage * tokens / (tp * cp), cluster),
        layer=compute_time((layer + recompute) * tokens / (tp * cp), cluster),
        layer_fwd=compute_time(layer / 3 * tokens / (tp * cp), cluster),
        head=compute_time(head * tokens / (tp * cp), cluster),
    )


class _TensorParallel(typing.NamedTuple):
    """Tensor-parallel seconds: `fwd` and `bwd` (exposed) of one layer per microbatch, the
    (forward, backward) exchanges of the first stage's embedding (`first_edge`) and the last
    stage's LM head input (`last_edge`), and `per_microbatch` of the bottleneck stage."""

    fwd: float
    bwd: float
    first_edge: tuple[float, float]
    last_edge: tuple[float, float]
    per_microbatch: float


def _tensor_parallel_times(
    layout: Layout, cluster: Cluster, bw: dict[str, float], act: float, compute: _Compute
) -> _TensorParallel:
    """Tensor-parallel communication per layer per microbatch, forward and backward, of the
    [mbs, s/cp, h] activation (`act` bytes). A TP region's exchange: one all-reduce, or under SP
    an all-gather in and a reduce-scatter out, each with its own latencies (on one CPU host all
    three through shared memory: mpu/shm_collectives)."""
    tp, lat = layout.tp, cluster.latency_s
    ar = all_reduce_time(act, tp, bw["tp"], lat)
    ag = all_gather_time(act, tp, bw["tp"], lat)
    rs = all_gather_time(act, tp, bw["tp"], lat)  # ring reduce-scatter: the all-gather's steps
    region = ag + rs if layout.sp else ar
    wgrad = compute.layer / 3  # the weight-gradient GEMMs the backward collectives overlap
    full = layout.recompute == "full"
    tp_fwd = 2 * region
    tp_bwd = _exposed(2 * region, wgrad, cluster) + (2 * region if full else 0.0)  # recomputed forward's
    # edges: the first stage's vocab-parallel embedding (forward all-reduce; SP: reduce-scatter,
    # its backward an all-gather) and the last stage's LM head input (backward all-reduce of its
    # gradient; SP: all-gather forward, reduce-scatter backward)
    first_edge = (rs, ag) if layout.sp else (ar, 0.0)
    last_edge = (ag, rs) if layout.sp else (0.0, ar)
    tp_edges = sum(last_edge) + (sum(first_edge) if layout.pp == 1 else 0.0)
    tp_mb = compute.stage_layers * (tp_fwd + tp_bwd) + tp_edges
    return _TensorParallel(tp_fwd, tp_bwd, first_edge, last_edge, tp_mb)


def _context_parallel_times(
    cfg: GPTConfig, layout: Layout, cluster: Cluster, bw: dict[str, float], ab: int, compute: _Compute
) -> tuple[float, float]:
    """Exposed context-parallel communication per layer per microbatch, (forward, backward):
    ring KV passes overlapped with the attention core, or a2a's four exposed all-to-alls."""
    mbs, s, tp, cp = layout.micro_batch_size, cfg.seq_len, layout.tp, layout.cp
    kv = 2 * mbs * (s / cp) * cfg.num_kv_heads * cfg.head_dim / tp * ab
    if cp <= 1:
        return 0.0, 0.0
    if layout.cp_comm == "ring":
        chunk = kv / 2  # one of this rank's two load-balanced chunks
        pass_t = chunk / bw["cp"] + cluster.torch_latency_s  # batched isend/irecv (gloo on a CPU)
        fwd, bwd = 2 * (cp - 1) * pass_t, 2 * 2 * (cp - 1) * pass_t
        attn_fwd = compute_time(compute.core * compute.tokens / (tp * cp), cluster)  # the attention core's forward
        return _exposed(fwd, attn_fwd, cluster), _exposed(bwd, 2 * attn_fwd, cluster)
    q = mbs * (s / cp) * attention_width(cfg) / tp * ab  # q and out: a*d wide
    a2a = sum(all_to_all_time(x, cp, bw["cp"], cluster.latency_s) for x in (q, kv / 2, kv / 2, q))
    return a2a, a2a


def _expert_parallel_time(cfg: GPTConfig, layout: Layout, bw: dict[str, float], lat: float, ab: int) -> float:
    """Expert-parallel communication per MoE layer per microbatch in each direction: dispatch
    and combine all-to-alls over ep (+ the etp gather and scatter); 0 without ep or etp."""
    if not (cfg.is_moe and (layout.ep > 1 or layout.etp > 1)):
        return 0.0
    # this rank's tokens' (token, choice) rows
    rows = layout.micro_batch_size * (cfg.seq_len / layout.cp) / layout.tp * cfg.top_k * cfg.hidden_size * ab
    a2a = all_to_all_time(rows, layout.ep, bw["ep"], lat)
    etp_t = all_gather_time(rows * layout.etp, layout.etp, bw["etp"], lat)
    return 2 * a2a + 2 * etp_t  # dispatch + combine (+ etp gather/scatter)


def _p2p_time(layout: Layout, act: float, bw: dict[str, float], slow_lat: float) -> float:
    """Pipeline p2p per microbatch: the activation out and its gradient back, per virtual stage."""
    if layout.pp <= 1:
        return 0.0
    boundary = act / (layout.tp if layout.sp else 1)
    return layout.vpp * 2 * (boundary / bw["pp"] + slow_lat)


class _Microbatch(typing.NamedTuple):
    """One microbatch's terms on one rank (seconds): `compute`, tensor parallelism `tp`,
    context parallelism per layer (`cp_fwd`, `cp_bwd`) and per microbatch (`cp`), expert
    parallelism per MoE layer and direction (`ep_dir`, over `moe_layers` MoE layers of a stage)
    and per microbatch (`ep`), and the pipeline's `p2p`."""

    compute: _Compute
    tp: _TensorParallel
    cp_fwd: float
    cp_bwd: float
    cp: float
    moe_layers: float
    ep_dir: float
    ep: float
    p2p: float


def _microbatch_times(
    cfg: GPTConfig, layout: Layout, cluster: Cluster, bw: dict[str, float], costs: ModelCosts, ab: int
) -> _Microbatch:
    """Compute and communication of one microbatch on one rank (`ab` bytes per activation
    element)."""
    compute = _compute_times(cfg, layout, cluster, costs)
    act = layout.micro_batch_size * (cfg.seq_len / layout.cp) * cfg.hidden_size * ab
    tp = _tensor_parallel_times(layout, cluster, bw, act, compute)
    cp_fwd, cp_bwd = _context_parallel_times(cfg, layout, cluster, bw, ab, compute)
    cp_mb = compute.stage_layers * (cp_fwd + cp_bwd)
    moe_layers = costs.moe_layers / layout.pp
    ep_dir = _expert_parallel_time(cfg, layout, bw, cluster.latency_s, ab)
    ep_mb = moe_layers * 2 * ep_dir
    p2p = _p2p_time(layout, act, bw, cluster.torch_latency_s)
    return _Microbatch(compute, tp, cp_fwd, cp_bwd, cp_mb, moe_layers, ep_dir, ep_mb, p2p)


def _grad_replicas(layout: Layout) -> dict[str, int]:
    """Replicas of each gradient-reduction group: dense dp*cp, sequence-parallel replicated
    tp*dp*cp, experts edp."""
    dp, cp, tp = layout.dp, layout.cp, layout.tp
    return {"dp": dp * cp, "tp_dp": tp * dp * cp, "edp": dp * cp * tp // (layout.ep * layout.etp)}


def _grad_collectives(
    layout: Layout,
    cluster: Cluster,
    bw: dict[str, float],
    grad_elements: dict[str, int],
    replicas: dict[str, int],
    param_dtype: str,
) -> tuple[float, float, float]:
    """(gradient reduction, ZeRO-1/2 parameter all-gather, ZeRO-3 parameter gathers per
    microbatch) seconds over each gradient group's replicas (reduce-scatters and gathers
    through torch.distributed)."""
    bws = {"dp": bw["dp_cp"], "tp_dp": bw["tp_dp"], "edp": bw["edp"]}
    pbytes = 2 if param_dtype == "bf16" else 4
    lat, slow_lat = cluster.latency_s, cluster.torch_latency_s
    reduce = gather = zero3 = 0.0
    for g, n in grad_elements.items():
        r = replicas[g]
        if r <= 1 or not n:
            continue
        if layout.zero <= 1:  # plain fp32 all-reduce: shared memory on one CPU host, like TP's
            reduce += all_reduce_time(4 * n, r, bws[g], lat)
        else:
            reduce += all_gather_time(4 * n, r, bws[g], slow_lat)  # reduce-scatter
        if layout.zero in (1, 2):
            gather += all_gather_time(pbytes * n, r, bws[g], slow_lat)
        if layout.zero == 3:
            zero3 += 2 * all_gather_time(pbytes * n, r, bws[g], slow_lat)
    return reduce, gather, zero3


def _exposed_dp_zero(
    layout: Layout, cluster: Cluster, m: int, comp: float, reduce: float, gather: float, zero3: float
) -> tuple[float, float]:
    """(dp_exposed, zero_exposed): what the data-parallel and ZeRO collectives leave exposed."""
    if layout.zero == 3:
        # per microbatch: parameters gathered for forward and backward, gradients reduce-scattered,
        # prefetched behind that microbatch's compute
        return 0.0, m * _exposed(zero3 + reduce, comp, cluster)
    backward_last = comp * 2 / 3
    # optim.overlap_param_gather: each bucket's all-gather runs behind the next forward
    return _exposed(reduce, backward_last, cluster), _exposed(gather, comp / 3, cluster)


def _optimizer_time(layout: Layout, cluster: Cluster, grad_elements: dict[str, int], replicas: dict[str, int]) -> float:
    """AdamW's step: 28 bytes per parameter of this rank's share streamed at `mem_bw`."""
    total_params = sum(grad_elements.values())
    share = total_params if layout.zero == 0 else sum(math.ceil(n / replicas[g]) for g, n in grad_elements.items())
    return 28 * share / cluster.mem_bw


def _virtual_stage_work(
    stages: int,
    nl: float,
    f_layer: float,
    b_layer: float,
    half_p2p: float,
    tp: _TensorParallel,
    head_time: float,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, backward) seconds of one core of each of the `stages` virtual stages for one
    microbatch: `nl` layers, half the p2p, the embedding's edge on the first, the LM head and
    its edge on the last."""
    last = stages - 1
    fwd_work = tuple(
        nl * f_layer
        + half_p2p
        + (tp.first_edge[0] if v == 0 else 0.0)
        + (head_time / 3 + tp.last_edge[0] if v == last else 0.0)
        for v in range(last + 1)
    )
    bwd_work = tuple(
        nl * b_layer
        + half_p2p
        + (tp.first_edge[1] if v == 0 else 0.0)
        + (2 * head_time / 3 + tp.last_edge[1] if v == last else 0.0)
        for v in range(last + 1)
    )
    return fwd_work, bwd_work


def _stage_nodes(layout: Layout, cluster: Cluster) -> tuple[tuple[tuple[int, int], ...], ...]:
    """((node, processes), ...) of each pipeline stage's ranks; stage q holds ranks q*ranks ..
    (q+1)*ranks-1 (a stage's tp*cp*dp ranks)."""
    pp = layout.pp
    ranks = layout.world // pp
    gpn = cluster.gpus_per_node if layout.world % cluster.gpus_per_node == 0 else layout.world
    return tuple(tuple(sorted(_count_nodes(q * ranks, ranks, gpn).items())) for q in range(pp))


def _shared_core_total(cfg: GPTConfig, layout: Layout, cluster: Cluster, m: int, mb: _Microbatch, tail: float) -> float:
    """CPU: the processes of a node share its cores; the step is the makespan of the pipeline
    schedule's tasks run under processor sharing (`shared_core_makespan`), each virtual stage's
    forward and backward of one microbatch priced on one core."""
    pp, vpp, c = layout.pp, layout.vpp, mb.compute
    nl = cfg.num_layers / (pp * vpp)
    ep_layer = mb.moe_layers / c.stage_layers * mb.ep_dir
    f_layer = c.layer_fwd + mb.tp.fwd + mb.cp_fwd + ep_layer + cluster.overhead_s / 3
    b_layer = c.layer - c.layer_fwd + mb.tp.bwd + mb.cp_bwd + ep_layer + 2 * cluster.overhead_s / 3
    fwd_work, bwd_work = _virtual_stage_work(pp * vpp, nl, f_layer, b_layer, mb.p2p / (2 * vpp), mb.tp, c.head)
    nodes = _stage_nodes(layout, cluster)
    return shared_core_makespan(
        layout.schedule, pp, m, vpp, fwd_work, bwd_work, tail, nodes, cluster.cores_per_node, cluster.wait_cpu_share
    )


def _mfu_devices(layout: Layout, cluster: Cluster) -> float:
    """What MFU divides by: the processes, or the cores they share (CPU, more processes than
    cores on a node)."""
    per_node = min(cluster.gpus_per_node, layout.world)
    if cluster.cores_per_node and per_node > cluster.cores_per_node:
        return layout.world * cluster.cores_per_node / per_node
    return layout.world


def step_time(
    cfg: GPTConfig,
    layout: Layout,
    cluster: Cluster,
    *,
    global_batch_size: int,
    grad_elements: dict[str, int],
    precision: str = "fp32",
    param_dtype: str = "fp32",
    costs: ModelCosts | None = None,
) -> StepTime:
    """Modelled time of one training step of `layout` (terms: module docstring).

    `grad_elements`: parameters of the bottleneck (most loaded) rank by gradient-reduction
    group, {"dp": dense, "tp_dp": sequence-parallel replicated, "edp": experts}, as the memory
    planner counts them (`plan_rank(...)["params"]["by_replica_group"]`). `precision` sets the
    activation bytes (fp32: 4, bf16/fp16: 2); gradients are reduced in fp32 and parameters
    gathered in fp32 (bf16 with `param_dtype="bf16"`). `costs`: `ModelCosts.of(cfg)` when the
    caller has it already (a search over many layouts). No communication.
    """
    pp, vpp = layout.pp, layout.vpp
    m = _microbatch_count(global_batch_size, layout)
    bw = _bandwidths(layout.tp, pp, layout.dp, layout.cp, layout.ep, layout.etp, cluster)
    costs = ModelCosts.of(cfg) if costs is None else costs
    mb = _microbatch_times(cfg, layout, cluster, bw, costs, _act_bytes(precision))
    comp, stage_layers = mb.compute.stage, mb.compute.stage_layers
    per_mb = comp + mb.tp.per_microbatch + mb.cp + mb.ep + mb.p2p + stage_layers * cluster.overhead_s
    pipeline = per_mb * (m + (pp - 1) / vpp)
    replicas = _grad_replicas(layout)
    reduce, gather, zero3 = _grad_collectives(layout, cluster, bw, grad_elements, replicas, param_dtype)
    dp_exposed, zero_exposed = _exposed_dp_zero(layout, cluster, m, comp, reduce, gather, zero3)
    optimizer = _optimizer_time(layout, cluster, grad_elements, replicas)
    total = pipeline + dp_exposed + zero_exposed + optimizer
    terms = {"bandwidths": bw, "replicas": replicas, "dp_reduce": reduce, "zero3_per_microbatch": zero3}
    if cluster.cores_per_node:
        terms["dedicated_core_total"] = total
        total = _shared_core_total(cfg, layout, cluster, m, mb, dp_exposed + zero_exposed + optimizer)
    tokens_per_s = global_batch_size * cfg.seq_len / total
    mfu = costs.per_token * tokens_per_s / (_mfu_devices(layout, cluster) * cluster.peak_flops)
    return StepTime(
        microbatches=m,
        compute_per_microbatch=comp,
        tp_per_microbatch=mb.tp.per_microbatch,
        cp_per_microbatch=mb.cp,
        ep_per_microbatch=mb.ep,
        p2p_per_microbatch=mb.p2p,
        bubble_fraction=bubble_fraction(pp, m, vpp),
        pipeline=pipeline,
        dp_exposed=dp_exposed,
        zero_exposed=zero_exposed,
        optimizer=optimizer,
        total=total,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        terms=terms,
    )
