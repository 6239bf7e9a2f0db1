"""Rehearse one rank of a layout on this device: `python -m meshtron.rehearse`.

    python -m meshtron.rehearse +model=gpt_1b parallel.tp=4 parallel.ep=8 --world 64 --rank 0
    python -m meshtron.rehearse parallel.tp=2 parallel.pp=2 --world 8 --rank 5 --steps 3 --json r5.json

Rank R of a world of N is built exactly as `train.py` builds it under torchrun (the same
config checks, `Engine.build`: mesh, model chunk, optimizer, ZeRO stage, pipeline schedule;
the same data windows for its dp rank), but on the rehearsal process group
(`mpu/rehearsal_groups.py`), whose collectives complete locally: nothing waits for a peer, no
second process is needed. The rank then trains `--steps` steps for real on this device
(`--warmup` of them, 1 by default, are excluded from the figures: AdamW makes its state in the
first). Reported, as one JSON object (`--json`) and a few lines:

* memory: the step's peak (CUDA: the caching allocator's high-water mark of tensor bytes,
  beside the bytes it reserved; CPU: the model states plus the profiler's high-water mark of
  the step's allocations), split into weights, gradients, optimizer state, other tensors held
  between steps (CUDA) and the rest (activations and working buffers), beside
  `planning.plan.plan_rank`'s figures for the same rank;
* time: seconds per step, and by phase: forward, optimizer, the rest (backward and gradient
  reduction) at pp = 1; every pipeline action (F, B per microbatch and chunk) at pp > 1;
* communication: every collective and point-to-point message of a step (op, the mesh group it
  runs over, bytes, count) with its modelled time on `--interconnect` (the planner's
  alpha-beta presets: `planning.step_time.cluster_preset`);
* the job: its predicted step time and tokens/s (compute measured; communication modelled,
  exposed unless meshtron overlaps it with compute: dp gradient reductions and ZeRO parameter
  gathers; a pipeline adds its schedule's bubble), beside `planning.step_time.step_time`'s.

What the emulated peers deliver (and so what is assumed) is stated in
`mpu/rehearsal_groups.py`: every peer is taken to hold and route what this rank does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.errors import ConfigError, say_one_line
from meshtron.kernels.backend import resolve_backend
from meshtron.kernels.tf32 import set_tf32_mode
from meshtron.mpu import rehearsal_groups, shm_collectives
from meshtron.mpu.mesh import Mesh
from meshtron.observability.memory import PeakMeter, held_state_bytes
from meshtron.planning.flops import model_flops_per_token
from meshtron.planning.peak import peak_flops
from meshtron.planning.plan import plan_rank
from meshtron.planning.step_time import (
    CLUSTER_PRESETS,
    Cluster,
    Layout,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    cluster_preset,
    step_time,
)
from meshtron.textdata.data import build_dataset, document_end_id
from meshtron.training.config import RunConfig
from meshtron.training.distributed import resolve_device
from meshtron.training.engine import Engine, EngineConfig
from meshtron.training.precision import LossScaler, Precision, device_has_fast_bf16
from meshtron.training.reporting import lr_schedule, split_microbatches
from meshtron.training.run_checks import check_run_config

# What meshtron overlaps with compute (the planner's rule, planning/step_time.py): gradient
# reductions over the data-parallel groups run during backward, ZeRO gathers during forward.
OVERLAPPED_GROUPS = ("dp", "dp_cp", "edp", "tp_dp")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m meshtron.rehearse",
        description="Train one rank of a layout on this device, its peers emulated; report its memory, "
        "compute time and traffic beside the planner's.",
    )
    parser.add_argument("--world", type=int, required=True, help="world size of the job to rehearse")
    parser.add_argument("--rank", type=int, default=0, help="the global rank to build and run")
    parser.add_argument("--steps", type=int, default=3, help="training steps, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (torchrun's LOCAL_WORLD_SIZE)")
    parser.add_argument(
        "--interconnect",
        choices=CLUSTER_PRESETS,
        default=None,
        help="the planner preset whose bandwidths and latency model the traffic (default: h100 on CUDA, cpu on CPU)",
    )
    parser.add_argument(
        "--expert-load",
        type=float,
        default=1.0,
        help="MoE: this rank's experts receive this many times the rows its own routing sends them from each peer",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]}; overrides are key=value as for train.py")
    if args.world < 1 or not 0 <= args.rank < args.world:
        raise ConfigError(f"--rank {args.rank} is not a rank of --world {args.world}: give 0 <= rank < world")
    if args.steps <= args.warmup or args.warmup < 0:
        raise ConfigError(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 0): nothing would be measured")
    if not args.expert_load > 0:
        raise ConfigError(f"--expert-load {args.expert_load} must be > 0 (1: every peer routes as this rank)")
    if args.world % args.gpus_per_node and args.world > args.gpus_per_node:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node} does not divide --world {args.world}")
    return args, overrides


# ----------------------------------------------------------------------------- the run


@contextmanager
def rehearsal_world(world: int, rank: int, device: torch.device):
    """The default process group of `world` ranks as `rank` sees it, on the rehearsal backend
    (CUDA: NCCL's code paths; CPU: gloo's through TCP, shared memory off)."""
    rehearsal_groups.register_backends()
    shm_collectives.set_enabled(False)
    backend = rehearsal_groups.REHEARSAL_CUDA if device.type == "cuda" else rehearsal_groups.REHEARSAL_CPU
    dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world)
    try:
        rehearsal_groups.check_routes(device)
        yield
    finally:
        dist.destroy_process_group()
        shm_collectives.set_enabled(None)


@dataclass
class Prepared:
    """A run checked for its world size, as `run_training` checks it before any process group:
    the run (precision resolved, and why), its parallel config, micro batch size and
    microbatches per step, execution, device, dataset and end-of-document id."""

    run: RunConfig
    why: str
    par: object
    micro: int
    n_micro: int
    execution: object
    device: torch.device
    dataset: object
    eos_id: int | None


def prepare(run: RunConfig, world: int, gpus_per_node: int = 8) -> Prepared:
    """`run`'s checks for `world` ranks (`gpus_per_node` per node); ConfigError with one line."""
    device = resolve_device(run.trainer.device, 0)
    run, why = run.with_precision_for(device.type, device_has_fast_bf16(device.type))
    if run.parallel.dp_mode == "ps":
        raise ConfigError("parallel.dp_mode=ps: a rehearsal builds all-reduce data parallelism only; drop dp_mode")
    par, micro, n_micro = check_run_config(run, world, min(world, gpus_per_node))
    try:
        backend = resolve_backend(run.kernels.backend, device.type)
    except (RuntimeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    execution = run.execution(backend)
    set_tf32_mode(run.kernels.tf32)
    eos_id = document_end_id(run.data, run.model.vocab_size)
    try:
        dataset = build_dataset(run.data, run.model.seq_len, run.trainer.seed, run.model.vocab_size)
    except (OSError, ValueError) as err:
        raise ConfigError(f"data: {err}") from err
    return Prepared(run, why, par, micro, n_micro, execution, device, dataset, eos_id)


class PhaseClock:
    """Seconds of this rank's forward passes and optimizer updates within a step: hooks on the
    model chunks and a wrapper around the optimizer's `step`, each span closed by a device
    synchronisation (so CUDA times are the device's)."""

    def __init__(self, engine: Engine):
        self.device = engine.device
        self.spans: dict[str, float] = defaultdict(float)
        self._open: dict[str, float] = {}
        self._handles = []
        if engine.executor is None:  # pp > 1: the executor's timeline has every action
            for chunk in engine.chunks:
                self._handles.append(chunk.register_forward_pre_hook(lambda *_: self.start("forward")))
                self._handles.append(chunk.register_forward_hook(lambda *_: self.stop("forward")))
        step = engine.optimizer.step

        def timed_step(*args, **kwargs):
            self.start("optimizer")
            try:
                return step(*args, **kwargs)
            finally:
                self.stop("optimizer")

        engine.optimizer.step = timed_step
        self._optimizer, self._step = engine.optimizer, step

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, phase: str) -> None:
        self._open[phase] = self.now()

    def stop(self, phase: str) -> None:
        self.spans[phase] += self.now() - self._open.pop(phase)

    def take(self) -> dict[str, float]:
        spans, self.spans = dict(self.spans), defaultdict(float)
        return spans

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._optimizer.step = self._step


def run_steps(engine: Engine, run: RunConfig, dataset, steps: int) -> list[dict]:
    """`steps` training steps of this rank through `engine.step`, each with its data window,
    wall time, phases, pipeline actions, peak memory above the step's start and calls."""
    lr_at = lr_schedule(run)
    clock = PhaseClock(engine)
    if engine.executor is not None:
        engine.executor.device_timed = True
    records = []
    try:
        with PeakMeter(engine.device) as meter:
            for step in range(steps):
                records.append(_measured_step(engine, run, dataset, step, clock, meter, lr_at))
    finally:
        clock.remove()
    for record, above in zip(records, meter.peaks, strict=True):
        record["peak_above_start"] = above
    return records


def _measured_step(engine: Engine, run: RunConfig, dataset, step: int, clock: PhaseClock, meter, lr_at) -> dict:
    """Step `step` of `run_steps`, its peak measured by `meter` (filled in once it ends)."""
    t, mesh = run.trainer, engine.mesh
    inputs, targets = dataset.local_batch_at(
        step * t.global_batch_size, t.global_batch_size, mesh.dp_rank, mesh.dp_size
    )
    micro = split_microbatches(inputs.to(engine.device), targets.to(engine.device), engine.config.micro_batch_size)
    states = held_state_bytes(engine.chunks, engine.reducer, engine.optimizer)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    held = torch.cuda.memory_allocated(engine.device) if cuda else None
    mark = len(rehearsal_groups.CALLS)
    box = {}

    def one_step():
        start = clock.now()
        box["out"] = engine.step(micro, lr_at(step))
        box["seconds"] = clock.now() - start

    meter.measure(one_step)
    out = box["out"]
    return {
        "seconds": box["seconds"],
        "phases": clock.take(),
        "actions": _actions(out.pipeline),
        "states": states,
        "held_at_start": held,  # CUDA: every tensor byte held when the step starts
        "reserved_peak": torch.cuda.max_memory_reserved(engine.device) if cuda else None,
        "calls": [c.as_dict() for c in rehearsal_groups.calls_since(mark)],
        "loss": float(out.loss),
        "skipped": bool(out.skipped),
    }


def _actions(pipeline) -> list[dict]:
    if pipeline is None:
        return []
    return [
        {"name": e.name, "microbatch": e.microbatch, "chunk": e.chunk, "seconds": e.end - e.start}
        for e in pipeline.timeline
    ]


# ----------------------------------------------------------------------------- the report


def group_labels(mesh: Mesh) -> dict[tuple[int, ...], str]:
    """The mesh's groups by their global ranks: {ranks: name}, the first name of the list below
    wins (without cp, dp_cp is dp); the world is 'world' unless a mesh group spans it."""
    labels: dict[tuple[int, ...], str] = {}
    for name in ("tp", "cp", "dp", "pp", "ep", "etp", "edp", "dp_cp", "tp_cp", "tp_dp", "ep_etp", "embedding"):
        group = getattr(mesh, name, None)
        if group is not None:
            labels.setdefault(tuple(dist.get_process_group_ranks(group)), name)
    labels.setdefault(tuple(range(mesh.world_size)), "world")
    return labels


def call_seconds(op: str, send: int, recv: int, n: int, spans_nodes: bool, cluster: Cluster) -> float:
    """Modelled seconds of one call over `n` ranks on `cluster` (alpha-beta, planning/step_time.py)."""
    bw = cluster.inter_bw if spans_nodes else cluster.intra_bw
    lat = cluster.latency_s
    if op == "all_reduce":
        return all_reduce_time(send, n, bw, lat)
    if op == "all_gather":
        return all_gather_time(recv, n, bw, lat)
    if op == "reduce_scatter":
        return all_gather_time(send, n, bw, lat)
    if op == "all_to_all":
        return all_to_all_time(max(send, recv), n, bw, lat)
    if op in ("send", "recv"):
        return lat + (send + recv) / bw
    return (n - 1) * lat  # barrier, broadcast of a few bytes


def traffic(calls: list[dict], mesh: Mesh, cluster: Cluster, gpus_per_node: int) -> list[dict]:
    """One step's calls summed by (group, op, bytes): count and modelled seconds of each kind."""
    labels = group_labels(mesh)
    rows: dict[tuple, dict] = {}
    for c in calls:
        ranks = tuple(c["group"])
        label = labels.get(ranks, "p2p" if c["op"] in ("send", "recv") else "other")
        spans = len({r // gpus_per_node for r in ranks}) > 1
        seconds = call_seconds(c["op"], c["send_bytes"], c["recv_bytes"], len(ranks), spans, cluster)
        key = (label, c["op"], c["send_bytes"], c["recv_bytes"], spans)
        row = rows.setdefault(
            key,
            {
                "group": label,
                "op": c["op"],
                "send_bytes": c["send_bytes"],
                "recv_bytes": c["recv_bytes"],
                "ranks": len(ranks),
                "inter_node": spans,
                "count": 0,
                "seconds": 0.0,
            },
        )
        row["count"] += 1
        row["seconds"] += seconds
    return sorted(rows.values(), key=lambda r: -r["seconds"])


def predicted_job(compute_s: float, rows: list[dict], run: RunConfig, par, n_micro: int) -> dict:
    """The job's step time from this rank: measured compute, modelled communication (exposed
    unless over a data-parallel group), a pipeline's bubble on top; tokens/s of the job."""
    exposed = sum(r["seconds"] for r in rows if r["group"] not in OVERLAPPED_GROUPS)
    hidden = sum(r["seconds"] for r in rows if r["group"] in OVERLAPPED_GROUPS)
    busy = compute_s + exposed
    if par.pp > 1:  # the schedule's critical path: every stage as busy as this one
        idle = (par.pp - 1) / par.vpp
        busy *= (n_micro + idle) / n_micro
    total = max(busy, hidden)
    tokens = run.trainer.global_batch_size * run.model.seq_len
    return {
        "step_s": total,
        "tokens_per_s": tokens / total,
        "compute_s": compute_s,
        "comm_exposed_s": exposed,
        "comm_overlapped_s": hidden,
    }


def planned(run: RunConfig, par, world: int, rank: int, micro: int, execution, cluster: Cluster) -> dict:
    """The planner's memory for this rank and step time for the job (planning/plan.py, step_time.py)."""
    t, o = run.trainer, run.optim
    plan = plan_rank(
        run.model,
        par,
        world,
        rank,
        micro_batch_size=micro,
        global_batch_size=t.global_batch_size,
        precision=t.precision,
        zero=o.zero,
        offload=o.offload,
        param_dtype=o.param_dtype,
        device=cluster.device,
        execution=execution,
    )
    layout = Layout(
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        cp=par.cp,
        ep=par.ep,
        etp=par.etp,
        vpp=par.vpp,
        sp=par.sp,
        cp_comm=par.cp_comm,
        zero=o.zero,
        recompute=t.recompute,
        micro_batch_size=micro,
    )
    modelled = step_time(
        run.model,
        layout,
        cluster,
        global_batch_size=t.global_batch_size,
        grad_elements=plan["params"]["by_replica_group"],
        precision=t.precision,
        param_dtype=o.param_dtype,
    )
    return {
        "memory_bytes": plan["memory"]["bytes"],
        "step_s": modelled.total,
        "tokens_per_s": modelled.tokens_per_s,
        "compute_s": modelled.compute_per_microbatch * modelled.microbatches,
        "optimizer_s": modelled.optimizer,
        "efficiency": cluster.efficiency,
    }


def summarize(records: list[dict], warmup: int, engine: Engine, run: RunConfig, ctx: dict) -> dict:
    """The report of the measured steps (the records after `warmup`)."""
    measured = records[warmup:]
    last = measured[-1]
    memory = _measured_memory(measured)
    peak = memory["total"]
    seconds = sum(r["seconds"] for r in measured) / len(measured)
    phases = _mean_phases(measured, seconds, engine)
    cluster, plan = ctx["cluster"], ctx["plan"]
    rows = traffic(last["calls"], engine.mesh, cluster, ctx["gpus_per_node"])
    compute_s = seconds if engine.executor is None else phases["forward"] + phases["backward"] + phases["optimizer"]
    job = predicted_job(compute_s, rows, run, engine.mesh.par, ctx["n_micro"])
    flops = model_flops_per_token(run.model) * run.trainer.global_batch_size * run.model.seq_len / ctx["world"]
    peak_flops_s, peak_source = peak_flops(
        engine.device, torch.bfloat16 if engine.device.type == "cuda" else torch.float32
    )
    return {
        "rank": ctx["rank"],
        "world": ctx["world"],
        "layout": engine.mesh.describe(),
        "coords": {k: getattr(engine.mesh, f"{k}_rank") for k in ("pp", "dp", "cp", "tp", "edp", "ep", "etp")},
        "device": str(engine.device)
        + (f" ({torch.cuda.get_device_name(engine.device)})" if engine.device.type == "cuda" else ""),
        "precision": run.trainer.precision,
        "precision_why": ctx["why"],
        "steps_measured": len(measured),
        "memory_bytes": memory,
        "planned_memory_bytes": plan["memory_bytes"],
        "memory_ratio": peak / plan["memory_bytes"]["total"] if plan["memory_bytes"]["total"] else None,
        "step_s": seconds,
        "phases_s": dict(phases),
        "actions": last["actions"],
        "rank_mfu": flops / seconds / peak_flops_s if seconds else None,
        "peak_flops": {"per_device": peak_flops_s, "source": peak_source},
        "interconnect": cluster.name,
        "traffic": rows,
        "calls_per_step": len(last["calls"]),
        "calls": last["calls"],
        "job": job,
        "planned_job": {k: plan[k] for k in ("step_s", "tokens_per_s", "compute_s", "optimizer_s")},
        # the preset efficiency that makes the planner's matmul term equal this rank's measured
        # compute (step less optimizer): what a GPU rehearsal corrects planning/step_time.py by
        "implied_efficiency": plan["efficiency"] * plan["compute_s"] / (compute_s - phases.get("optimizer", 0.0))
        if compute_s > phases.get("optimizer", 0.0)
        else None,
        "losses": [r["loss"] for r in records],
        "assumption": "every peer holds and routes what this rank does, its expert traffic scaled by "
        "expert_load (mpu/rehearsal_groups.py)",
    }


def _measured_memory(measured: list[dict]) -> dict:
    """The step's peak memory split into weights, gradients, optimizer state, other tensors held
    between steps and activations (the rest), with its total (and the allocator's reserved peak
    on CUDA), from the measured records (the model states of the last)."""
    last = measured[-1]
    states = last["states"]
    model_states = states["weights"] + states["grads"] + states["optimizer"] + states["main_params"]
    # the step's start: CUDA knows every byte held then (model states and anything else kept
    # between steps: gathered-parameter buffers, caches); the CPU profiler sees only the step,
    # so there the model states stand for it
    held = model_states if last["held_at_start"] is None else last["held_at_start"]
    peak = held + max(r["peak_above_start"] for r in measured)
    memory = {
        "weights": states["weights"],
        "grads": states["grads"],
        "optimizer": states["optimizer"] + states["main_params"],
    }
    memory["other_held"] = held - model_states
    memory["activations"] = peak - held
    memory["total"] = peak
    if last["reserved_peak"] is not None:
        memory["allocator_reserved"] = max(r["reserved_peak"] for r in measured)
    return memory


def _mean_phases(measured: list[dict], seconds: float, engine: Engine) -> defaultdict:
    """Seconds per measured step by phase: the recorded phases, plus backward and reduction (the
    rest of `seconds`) at pp = 1, or the pipeline's forward and backward actions at pp > 1."""
    phases: dict[str, float] = defaultdict(float)
    for r in measured:
        for name, s in r["phases"].items():
            phases[name] += s / len(measured)
    if engine.executor is None:
        phases["backward_and_reduce"] = seconds - sum(phases.values())
    else:
        for r in measured:
            for a in r["actions"]:
                if a["name"] in ("F", "B"):
                    key = "forward" if a["name"] == "F" else "backward"
                    phases[key] += a["seconds"] / len(measured)
    return phases


def measure_rank(
    p: Prepared, world: int, rank: int, *, steps: int = 3, warmup: int = 1, gpus_per_node: int = 8, interconnect=None
) -> dict:
    """Build this process's rank of `p` in the current default process group (a rehearsal's, or
    a real one: the tests' reference runs), train `steps` steps and return the report."""
    run, per_node = p.run, min(world, gpus_per_node)
    name = interconnect or ("h100" if p.device.type == "cuda" else "cpu")
    cluster = cluster_preset(name, world, per_node, precision=run.trainer.precision)
    plan = planned(run, p.par, world, rank, p.micro, p.execution, cluster)
    engine = Engine.build(
        EngineConfig.from_run(run, p.execution, p.micro, p.eos_id),
        p.par,
        p.device,
        ranks_per_node=per_node,
        overlap_param_gather=run.optim.overlap_param_gather,
    )
    try:
        t = run.trainer
        engine.precision = Precision(t.precision, p.device.type, LossScaler(scale=t.initial_loss_scale))
        records = run_steps(engine, run, p.dataset, steps)
        ctx = dict(
            rank=rank, world=world, why=p.why, cluster=cluster, plan=plan, n_micro=p.n_micro, gpus_per_node=per_node
        )
        return summarize(records, warmup, engine, run, ctx)
    finally:
        engine.close()


def rehearse(run: RunConfig, world: int, rank: int, *, gpus_per_node: int = 8, expert_load: float = 1.0, **kw) -> dict:
    """Rank `rank` of a `world`-rank job of `run`, built and trained on this device with its
    peers emulated (module doc; `expert_load`: `rehearsal_groups.EXPERT_LOAD`); keywords as
    `measure_rank`. ConfigError for a bad config."""
    p = prepare(run, world, gpus_per_node)
    rehearsal_groups.EXPERT_LOAD = expert_load
    try:
        with rehearsal_world(world, rank, p.device):
            report = measure_rank(p, world, rank, gpus_per_node=gpus_per_node, **kw)
    finally:
        rehearsal_groups.EXPERT_LOAD = 1.0
    report["expert_load"] = expert_load
    return report


def format_report(r: dict) -> list[str]:
    """The report in a few lines."""
    gib = 1024**3
    m, p = r["memory_bytes"], r["planned_memory_bytes"]
    lines = [
        f"rehearsed rank {r['rank']} of {r['world']} on {r['device']}: {r['layout']}",
        f"memory: peak {m['total'] / gib:.3f} GiB (weights {m['weights'] / gib:.3f}, grads {m['grads'] / gib:.3f}, "
        f"optimizer {m['optimizer'] / gib:.3f}, other held {m['other_held'] / gib:.3f}, "
        f"activations {m['activations'] / gib:.3f}); planned "
        f"{p['total'] / gib:.3f} GiB" + (f" (measured/planned {r['memory_ratio']:.3f})" if r["memory_ratio"] else ""),
        "time: "
        + f"{r['step_s'] * 1e3:.1f} ms/step ("
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["phases_s"].items())
        + ")"
        + (f", rank MFU {r['rank_mfu']:.1%}" if r["rank_mfu"] is not None else ""),
        f"communication per step on {r['interconnect']}: {r['calls_per_step']} calls",
    ]
    for row in r["traffic"][:8]:
        lines.append(
            f"  {row['group']:>9} {row['op']:<14} x{row['count']:<4} {max(row['send_bytes'], row['recv_bytes']) / 2**20:9.2f} MiB "
            f"{row['seconds'] * 1e3:8.3f} ms" + (" (inter-node)" if row["inter_node"] else "")
        )
    j, pj = r["job"], r["planned_job"]
    lines.append(
        f"job: predicted {j['step_s'] * 1e3:.1f} ms/step, {j['tokens_per_s']:,.0f} tokens/s; planner "
        f"{pj['step_s'] * 1e3:.1f} ms/step, {pj['tokens_per_s']:,.0f} tokens/s"
    )
    if r["implied_efficiency"] is not None:
        lines.append(
            f"planner's matmul time {pj['compute_s'] * 1e3:.1f} ms per step vs measured "
            f"{(j['compute_s'] - r['phases_s'].get('optimizer', 0.0)) * 1e3:.1f} ms: "
            f"the {r['interconnect']} preset's efficiency would be {r['implied_efficiency']:.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    """The `python -m meshtron.rehearse` / `meshtron-rehearse` entry: exit 2 on bad input."""
    from meshtron.training.cli import compose_run

    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        run = compose_run(overrides)
        report = rehearse(
            run,
            args.world,
            args.rank,
            steps=args.steps,
            warmup=args.warmup,
            gpus_per_node=args.gpus_per_node,
            interconnect=args.interconnect,
            expert_load=args.expert_load,
        )
    except ConfigError as err:
        say_one_line(f"meshtron rehearse: configuration error: {err}")
        sys.exit(2)
    for line in format_report(report):
        print(line, flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
