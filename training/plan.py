"""Dry-run planner (`trainer.dry_run=true`): what each rank would hold and compute, no training.

A plan is pure arithmetic plus meta tensors: no process group, no collective, no real
allocation, so every rank can compute the plan of every other rank locally (and a laptop can
plan a 64-GPU layout).

* Parameters: for a dense model with pp=1 this rank's shard of `models.gpt.GPT` is built on the
  ``meta`` device (shapes only; `mpu.init.initialize_parameters` is never called) over a
  `virtual_mesh`, its parameters are counted (a tied embedding once) and cross-checked against
  the analytic `training.flops.params_per_rank`; a disagreement raises RuntimeError, because
  it means the planner or the model is wrong. Pipeline stages (pp > 1) cannot be built yet, so
  their counts come from the analytic formula and `param_source` says so.
* Memory: weights, gradients, fp32 main params (bf16 only) and AdamW state from
  `training.flops.model_state_bytes`, plus activations from
  `training.flops.activation_bytes_per_microbatch` times the microbatches in flight.
* FLOPs: `training.flops.model_flops_per_token` (forward + backward matmuls, the figure MFU is
  computed from) times the tokens of one global step; a rank's share is that divided evenly by
  the world size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from models.config import GPTConfig
from mpu.mesh import ParallelConfig, check_model_fits, virtual_mesh
from training.flops import (
    activation_bytes_per_microbatch,
    model_flops_per_token,
    state_bytes_for,
    param_count,
    params_per_rank,
)

__all__ = ["plan_rank", "plan_all_ranks", "format_rank_line", "format_plan", "write_plan", "meta_param_counts"]

GIB = 1024**3

# Bytes per activation element for each precision (weights/grads/optimizer bytes live in
# training.flops.model_state_bytes).
_ACT_BYTES = {"fp32": 4, "bf16": 2}

FLOPS_CONVENTION = (
    "model FLOPs (training.flops.model_flops_per_token: forward + backward matmuls, 3x forward, "
    "attention over the full s x s square, LM head over the tp=1 padded vocabulary) times the "
    "tokens of one global step (global_batch_size * seq_len); per rank = global / world_size, "
    "the even share MFU is measured against, not the work this rank actually executes"
)


def _gib(n: int | float) -> float:
    return n / GIB


def meta_param_counts(model_cfg: GPTConfig, par: ParallelConfig, world_size: int, rank: int) -> dict[str, int]:
    """Build `rank`'s shard of the dense GPT on the meta device and count its parameters.

    Returns {"total", "tp_sharded", "replicated"}: unique parameters (a tied embedding counted
    once), split into those sharded over TP (`tp_shard_dim` set) and those replicated over TP.
    Nothing is allocated and no parameter is initialized; no communication.
    """
    from models.gpt import build_model_chunks  # the model imports mpu layers; keep the planner importable without them

    mesh = virtual_mesh(par, world_size, rank)
    chunks = build_model_chunks(model_cfg, mesh, device="meta", dtype=torch.float32)
    sharded = replicated = 0
    for name, p in torch.nn.ModuleList(chunks).named_parameters():  # deduplicates tied parameters
        if p.device.type != "meta":
            raise RuntimeError(f"planner bug: parameter {name} was allocated on {p.device}, expected meta")
        if getattr(p, "tp_shard_dim", None) is None:
            replicated += p.numel()
        else:
            sharded += p.numel()
    return {"total": sharded + replicated, "tp_sharded": sharded, "replicated": replicated}


def _check_batch(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"trainer.micro_batch_size={micro_batch_size} must be a positive integer")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"trainer.global_batch_size={global_batch_size} must be a positive integer")
    per_step = dp * micro_batch_size
    if global_batch_size % per_step:
        lower = max(per_step, global_batch_size // per_step * per_step)
        raise ValueError(
            f"trainer.global_batch_size={global_batch_size} is not divisible by "
            f"trainer.micro_batch_size={micro_batch_size} * dp={dp} = {per_step}; "
            f"use a global batch that is a multiple of {per_step} (e.g. {lower} or {lower + per_step}), "
            f"or change trainer.micro_batch_size / parallel.dp"
        )
    return global_batch_size // per_step


def plan_rank(
    model_cfg: GPTConfig,
    par: ParallelConfig,
    world_size: int,
    rank: int,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    precision: str = "fp32",
    zero_dp: int = 1,
) -> dict[str, Any]:
    """Plan of one rank: coordinates, parameters, memory and FLOPs per step. No communication.

    `par` may be unresolved (dp=None); it is resolved against `world_size` and checked against
    the model shape (`mpu.mesh.check_model_fits`), raising `ParallelConfigError` with what to
    change. Raises ValueError when the global batch does not split into microbatches over dp,
    and RuntimeError when the meta-built parameter count disagrees with the analytic one.
    `zero_dp` is the number of ranks the optimizer state and main params are sharded over
    (1 = no ZeRO), as in `training.flops.model_state_bytes`.
    """
    if precision not in _ACT_BYTES:
        raise ValueError(f"trainer.precision={precision!r} is unknown; use one of {sorted(_ACT_BYTES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size {world_size} must be a positive integer")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    res = par.resolved(world_size)
    check_model_fits(res, model_cfg)
    num_microbatches = _check_batch(global_batch_size, micro_batch_size, res.dp)
    mesh = virtual_mesh(res, world_size, rank)
    tp, pp, ep, etp = res.tp, res.pp, res.ep, res.etp

    # ---- parameters
    analytic = params_per_rank(model_cfg, tp=tp, ep=ep, etp=etp, pp=pp)
    meta: dict[str, int] | None = None
    meta = meta_param_counts(model_cfg, res, world_size, rank)
    if pp > 1:
        # The analytic count is the most loaded stage's; the meta build is this rank's own
        # (its stage's layers, plus the tied embedding's copy on the last stage).
        source = "meta (this rank's pipeline chunks built on the meta device)"
    else:
        if meta["total"] != analytic:
            raise RuntimeError(
                f"planner bug: rank {rank} builds {meta['total']} parameters on the meta device but "
                f"training.flops.params_per_rank(tp={tp}, ep={ep}, etp={etp}, pp={pp}) says {analytic}; "
                "the model and the analytic count disagree"
            )
        source = "meta (built on the meta device, matches training.flops.params_per_rank)"
    count = meta["total"] if meta is not None else analytic
    padded = model_cfg.padded_vocab_size(tp)
    params = {
        "count": count,
        "analytic": analytic,
        "meta": None if meta is None else meta["total"],
        "tp_sharded": None if meta is None else meta["tp_sharded"],
        "replicated": None if meta is None else meta["replicated"],
        "vocab_size": model_cfg.vocab_size,
        "padded_vocab_size": padded,
        "vocab_per_rank": padded // tp,
    }

    # ---- memory
    states = state_bytes_for(count, zero_dp=zero_dp, precision=precision)
    act_full = activation_bytes_per_microbatch(
        model_cfg, micro_batch_size, tp, bool(res.sp and tp > 1), bytes_per_elem=_ACT_BYTES[precision]
    )
    if pp == 1:
        act_per_mb, in_flight = act_full, 1
        act_note = "one microbatch in flight (no pipeline parallelism)"
    else:
        act_per_mb, in_flight = math.ceil(act_full / pp), min(pp, num_microbatches)
        act_note = (
            f"estimate for the first pipeline stage under 1F1B: min(pp, microbatches)={in_flight} "
            f"microbatches in flight, each holding about 1/pp of the model's activations"
        )
    activations = act_per_mb * in_flight
    model_states = states["total"]
    total = model_states + activations
    mem_bytes = {
        "weights": states["weights"],
        "grads": states["grads"],
        "main_params": states["main_params"],
        "optimizer": states["optimizer"],
        "model_states": model_states,
        "activations_per_microbatch": act_per_mb,
        "activations": activations,
        "total": total,
    }
    memory = {
        "precision": precision,
        "zero_dp": zero_dp,
        "microbatches_in_flight": in_flight,
        "activation_note": act_note,
        "bytes": mem_bytes,
        "gib": {k: _gib(v) for k, v in mem_bytes.items()},
    }

    # ---- FLOPs
    per_token = model_flops_per_token(model_cfg)
    tokens = global_batch_size * model_cfg.seq_len
    flops_global = per_token * tokens
    flops_rank = flops_global / world_size
    flops = {
        "convention": FLOPS_CONVENTION,
        "model_flops_per_token": per_token,
        "tokens_per_step": tokens,
        "global_per_step": flops_global,
        "rank_per_step": flops_rank,
        "rank_tflop_per_step": flops_rank / 1e12,
    }

    return {
        "rank": rank,
        "world_size": world_size,
        "coords": {
            "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "tp_rank": mesh.tp_rank,
            "edp_rank": mesh.edp_rank, "ep_rank": mesh.ep_rank, "etp_rank": mesh.etp_rank,
        },
        "layout": _layout(res, world_size),
        "param_source": source,
        "params": params,
        "batch": {
            "global_batch_size": global_batch_size,
            "micro_batch_size": micro_batch_size,
            "num_microbatches": num_microbatches,
            "seq_len": model_cfg.seq_len,
            "tokens_per_microbatch": micro_batch_size * model_cfg.seq_len,
        },
        "memory": memory,
        "flops": flops,
    }


def _layout(res: ParallelConfig, world_size: int) -> dict[str, Any]:
    return {
        "world_size": world_size,
        "tp": res.tp, "pp": res.pp, "dp": res.dp,
        "ep": res.ep, "etp": res.etp, "edp": res.edp,
        "sp": bool(res.sp and res.tp > 1), "vpp": res.vpp, "schedule": res.schedule,
        "dense_mesh": "pp x dp x tp (tp fastest)",
        "expert_mesh": "pp x edp x ep x etp (etp fastest)",
    }


def plan_all_ranks(model_cfg: GPTConfig, par: ParallelConfig, world_size: int, **kw: Any) -> dict[str, Any]:
    """Plans of every rank of the layout (keyword arguments as for `plan_rank`).

    Returns {"layout", "model", "ranks", "summary"}: "model" holds the unsharded counts
    (total and active-per-token parameters, FLOPs per token, the config), "ranks" the
    `plan_rank` dicts in rank order, "summary" the most loaded rank's memory. Deterministic
    and communication-free, so every process can compute it locally.
    """
    res = par.resolved(world_size)
    check_model_fits(res, model_cfg)
    counts = param_count(model_cfg)
    ranks = [plan_rank(model_cfg, res, world_size, r, **kw) for r in range(world_size)]
    heaviest = max(ranks, key=lambda p: p["memory"]["bytes"]["total"])
    return {
        "layout": _layout(res, world_size),
        "model": {
            "total_params": counts["total"],
            "active_params_per_token": counts["active_per_token"],
            "embedding_params": counts["embedding"],
            "is_moe": model_cfg.is_moe,
            "model_flops_per_token": model_flops_per_token(model_cfg),
            "config": dataclasses.asdict(model_cfg),
        },
        "ranks": ranks,
        "summary": {
            "max_total_bytes": heaviest["memory"]["bytes"]["total"],
            "max_total_gib": heaviest["memory"]["gib"]["total"],
            "most_loaded_rank": heaviest["rank"],
            "global_tflop_per_step": heaviest["flops"]["global_per_step"] / 1e12,
        },
    }


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_rank_line(plan: dict[str, Any]) -> str:
    """One line for a rank plan: coordinates, params, model-state / activation / total GiB, TFLOP."""
    c, m, g = plan["coords"], plan["memory"], plan["memory"]["gib"]
    src = plan["param_source"].split(" ", 1)[0]
    acts = f"act {g['activations']:.3f}"
    if m["microbatches_in_flight"] != 1:
        acts += f" ({m['microbatches_in_flight']} mb in flight)"
    return (
        f"rank {plan['rank']:>3} [pp{c['pp_rank']} dp{c['dp_rank']} tp{c['tp_rank']} | "
        f"edp{c['edp_rank']} ep{c['ep_rank']} etp{c['etp_rank']}]: "
        f"{_human(plan['params']['count'])} params ({src}); GiB: "
        f"weights {g['weights']:.3f} + grads {g['grads']:.3f} + main {g['main_params']:.3f} "
        f"+ optim {g['optimizer']:.3f} = states {g['model_states']:.3f}, {acts}, total {g['total']:.3f}; "
        f"{plan['flops']['rank_tflop_per_step']:.3f} TFLOP/step, "
        f"{plan['batch']['num_microbatches']} microbatches of {plan['batch']['micro_batch_size']}"
    )


def format_plan(plan: dict[str, Any]) -> str:
    """Multi-line text of a `plan_all_ranks` result: layout, model totals, one line per rank."""
    lay, mod, s = plan["layout"], plan["model"], plan["summary"]
    head = (
        f"layout: world={lay['world_size']} pp={lay['pp']} dp={lay['dp']} tp={lay['tp']} sp={lay['sp']} | "
        f"edp={lay['edp']} ep={lay['ep']} etp={lay['etp']}\n"
        f"model: {_human(mod['total_params'])} params ({_human(mod['active_params_per_token'])} active per token), "
        f"{s['global_tflop_per_step']:.3f} TFLOP per global step; most loaded rank {s['most_loaded_rank']} "
        f"needs {s['max_total_gib']:.3f} GiB"
    )
    return "\n".join([head] + [format_rank_line(r) for r in plan["ranks"]])


def write_plan(path: str | os.PathLike, plan: dict[str, Any]) -> None:
    """Write `plan` as JSON (indent 2) to `path`, creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2) + "\n")
