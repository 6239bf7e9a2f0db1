"""Dry-run planner (`trainer.dry_run=true`): what each rank would hold and compute, no training.

A plan is pure arithmetic plus meta tensors: no process group, no collective, no real
allocation, so every rank can compute the plan of every other rank locally (and a laptop can
plan a 64-GPU layout).

* Parameters: this rank's model chunks (`models.gpt.build_model_chunks`) are built on the
  ``meta`` device (shapes only; `mpu.init.initialize_parameters` is never called) over a
  `virtual_mesh` and their parameters counted (a tied embedding once), split by the replica
  group their gradients are reduced over (dense: dp; sequence-parallel replicated: tp x dp;
  experts: edp) and by use (matrices that run in a matmul get a 16-bit autocast copy). For
  pp = 1 the count is cross-checked against the analytic `planning.flops.params_per_rank`; a
  disagreement raises RuntimeError, because it means the planner or the model is wrong.
* Model states (`model_state_bytes`): fp32 weights, fp32 gradients, AdamW state, under
  ZeRO 0/1/2 and CPU offload, plus the 16-bit weight copies autocast holds under bf16/fp16.
* Activations (`chunk_activations`, `activation_estimate`): the tensors autograd saves for
  backward, measured by tracing the real modules on meta-backed fake tensors with saved-tensor
  hooks (`planning.activations`: one block per kind, scaled by the layer count), and the
  transient buffers alive at the step's peak (the
  logits the step holds, the cross-entropy's gradient, a recomputed layer, the backward's
  working set), combined over the microbatches the pipeline schedule keeps in flight by
  replaying this rank's action list (`pipeline.schedules.build_schedule`).
* FLOPs: `planning.flops.model_flops_per_token` (forward + backward matmuls, the figure MFU is
  computed from) times the tokens of one global step; a rank's share is that divided evenly by
  the world size.

`bench/memory.py` measures a layout's peak memory per rank and prints it beside this plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshtron.dp.grad_reduce import bucket_layout, grad_group
from meshtron.dp.zero3 import unit_of
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.fits import check_model_fits
from meshtron.mpu.attention_blocks import TILE_SCORE_BYTES
from meshtron.mpu.mesh import ParallelConfig, virtual_mesh
from meshtron.pipeline.schedules import build_schedule
from meshtron.planning.activations import SavedTrace, etp_row_bytes, trace_layer, trace_post, trace_pre
from meshtron.planning.flops import model_flops_per_token, param_count, params_per_rank
from meshtron.rules import (
    PRECISIONS,
    batch_checks,
    compute_precision_check,
    microbatches,
    param_dtype_checks,
    raise_first,
)

__all__ = [
    "plan_rank",
    "plan_all_ranks",
    "format_rank_line",
    "format_plan",
    "write_plan",
    "meta_param_counts",
    "model_state_bytes",
    "chunk_activations",
    "activation_estimate",
    "ChunkActivations",
    "PRECISIONS",
    "DEVICES",
]

GIB = 1024**3
DEVICES = ("cpu", "cuda")

FLOPS_CONVENTION = (
    "model FLOPs (planning.flops.model_flops_per_token: forward + backward matmuls, 3x forward, "
    "attention over the full s x s square, LM head over the tp=1 padded vocabulary) times the "
    "tokens of one global step (global_batch_size * seq_len); per rank = global / world_size, "
    "the even share MFU is measured against, not the work this rank actually executes"
)


def _gib(n: int | float) -> float:
    return n / GIB


# --------------------------------------------------------------------------- parameters


def _matmul_param_ids(chunks) -> set[int]:
    """Parameters used as matmul operands (autocast keeps a 16-bit copy of each): linear
    weights and biases, expert and shared-expert matrices, routers, and the LM head (the tied
    embedding on a chunk with the head) unless the loss is fused with it. Not: norms, position
    embeddings, an untied input embedding (a lookup)."""
    from meshtron.moe.experts import GroupedExperts
    from meshtron.moe.layer import SharedExperts
    from meshtron.moe.router import TopKRouter
    from meshtron.mpu.layers import ColumnParallelLinear, RowParallelLinear

    kinds = (ColumnParallelLinear, RowParallelLinear, GroupedExperts, SharedExperts, TopKRouter)
    ids: set[int] = set()
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, kinds):
                ids.update(id(p) for p in module.parameters(recurse=False))
        if chunk.post_process:
            head = chunk.lm_head_weight
            if chunk.execution.fused_lm_loss:  # its 16-bit copy lives only inside the loss's forward
                ids.discard(id(head))
            else:
                ids.add(id(head))
    return ids


def meta_param_counts(
    model_cfg: GPTConfig,
    par: ParallelConfig,
    world_size: int,
    rank: int,
    execution: ExecutionConfig = ExecutionConfig(),
) -> dict[str, Any]:
    """Build `rank`'s model chunks on the meta device and count their parameters.

    Returns unique-parameter counts (a tied embedding counted once):
    * "total", split into "tp_sharded" (`tp_shard_dim` set) and "replicated" (over TP);
    * by gradient-reduction (and ZeRO) replica group, as `dp.grad_reduce` buckets them:
      "group_dp" (dense), "group_tp_dp" (sequence-parallel replicated: norms, row-parallel
      biases and positions under SP, MoE routers at tp > 1), "group_edp"
      (experts);
    * "matmul": parameters autocast copies to 16 bits (see `_matmul_param_ids`);
    * "largest": elements of the largest parameter tensor;
    * "buckets": (replica group, elements) of each gradient bucket, laid out by
      `dp.grad_reduce.bucket_layout` (the reducer's own function);
    * "zero3_gathered": ZeRO-3's most bytes of full parameters gathered at once beyond the
      shards (`zero3_gathered_bytes` of the rank's largest chunk);
    * "zero3_grad_buffers": ZeRO-3's most bytes of full gradient buffers at once
      (`zero3_grad_buffer_bytes`);
    * "zero3_tied_grad_buffers": of those, the tied embedding copies' (pipeline stages keep
      ZeRO-2 style buffers for them from `zero_grad()` on: alive in every phase).
    Nothing is allocated and no parameter is initialized; no communication.
    """
    from meshtron.models.gpt import (
        build_model_chunks,  # the model imports mpu layers; keep the planner importable without them
    )

    mesh = virtual_mesh(par, world_size, rank)
    chunks = build_model_chunks(model_cfg, mesh, device="meta", dtype=torch.float32, execution=execution)
    matmul_ids = _matmul_param_ids(chunks)
    out = dict(total=0, tp_sharded=0, replicated=0, group_dp=0, group_tp_dp=0, group_edp=0, matmul=0, largest=0)
    for name, p in torch.nn.ModuleList(chunks).named_parameters():  # deduplicates tied parameters
        if p.device.type != "meta":
            raise RuntimeError(f"planner bug: parameter {name} was allocated on {p.device}, expected meta")
        n = p.numel()
        out["total"] += n
        out["replicated" if getattr(p, "tp_shard_dim", None) is None else "tp_sharded"] += n
        out["group_" + grad_group(p)] += n
        if id(p) in matmul_ids:
            out["matmul"] += n
        out["largest"] = max(out["largest"], n)
    named = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
    tied_apart = par.pp > 1 and model_cfg.tie_embeddings  # the copies on the first and last stage
    out["buckets"] = [(spec.key, spec.numel) for spec in bucket_layout(named, _replicas(par), tied_apart=tied_apart)]
    # One chunk runs at a time; each frees its units when its forward or backward ends.
    out["zero3_gathered"] = max(zero3_gathered_bytes(chunk, _replicas(par), tied_apart) for chunk in chunks)
    out["zero3_grad_buffers"] = max(zero3_grad_buffer_bytes(chunk, _replicas(par), tied_apart) for chunk in chunks)
    out["zero3_tied_grad_buffers"] = max(_zero3_units(chunk, _replicas(par), tied_apart)[2] for chunk in chunks)
    return out


def _zero3_units(model, replicas: dict[str, int], tied_apart: bool):
    """({unit: fp32 bytes of its buckets sharded over > 1 replica}, the same without the
    tied-embedding buckets of pipeline stages (`tied_apart`: they keep ZeRO-2 gradient buffers),
    those buckets' bytes, {unit: bytes of the sharded bucket holding its first registered
    parameter}, ZeRO-3 unit order)."""
    named = list(model.named_parameters())
    specs = bucket_layout(named, replicas, unit_of=unit_of, tied_apart=tied_apart)
    full: dict[str, int] = {}
    lazy: dict[str, int] = {}
    tied = 0
    bucket_of: dict[str, int] = {}
    for spec in specs:
        if replicas[spec.key] > 1:
            unit, size = unit_of(spec.items[0][0]), 4 * spec.padded_numel
            full[unit] = full.get(unit, 0) + size
            if spec.tied:
                tied += size
                continue
            lazy[unit] = lazy.get(unit, 0) + size
            for name, _ in spec.items:
                bucket_of[name] = size
    first: dict[str, int] = {}
    for name, _ in named:
        first.setdefault(unit_of(name), bucket_of.get(name, 0))
    order = (["embed"] if model.embed is not None else []) + [f"layers.{i}" for i in model.layers]
    return full, lazy, tied, first, order + (["head"] if model.post_process else [])


def zero3_grad_buffer_bytes(model, replicas: dict[str, int], tied_apart: bool = False) -> int:
    """Most bytes of full gradient buffers ZeRO-3's reducer (`unit_buffers`) holds at once: a
    unit's buckets are allocated before its backward, and the previous unit's last bucket (the
    one holding its first registered parameter, whose gradient comes last) is still being
    reduce-scattered; a tied embedding's buffer lives from the head's backward to the end (not
    under pipeline parallelism, where its buckets keep full ZeRO-2 buffers, counted apart)."""
    _, lazy, tied_buckets, first, order = _zero3_units(model, replicas, tied_apart)
    backward = order[::-1]
    tied = model.post_process and model.head is None and not tied_apart
    held = []
    for k, unit in enumerate(backward):
        extra = lazy.get("embed", 0) if tied and unit != "embed" else 0
        held.append(lazy.get(unit, 0) + (first.get(backward[k - 1], 0) if k else 0) + extra)
    return max(held or [0]) + tied_buckets


def zero3_gathered_bytes(model, replicas: dict[str, int], tied_apart: bool = False) -> int:
    """Most bytes of full parameter buffers ZeRO-3 (dp/zero3.py) holds at once beyond the
    shards: two adjacent units (the one running and the prefetched one, in forward or backward
    order: embedding, blocks, head; the head with the tied embedding), each the fp32 bytes of its
    padded buckets over more than one replica, laid out as the ZeRO-3 reducer lays them out
    (`tied_apart`: the tied embedding's copies live on different pipeline stages)."""
    units, _, _, _, order = _zero3_units(model, replicas, tied_apart)
    if not model.pre_process and "embed" in order:
        order.remove("embed")  # the last stage's copy of a tied embedding: gathered with the head only
    sizes = [units.get(u, 0) for u in order]
    if model.post_process and model.head is None:
        sizes[-1] += units.get("embed", 0)
    return max([a + b for a, b in zip(sizes, sizes[1:])] or sizes or [0])


def _replicas(res: ParallelConfig) -> dict[str, int]:
    """Replica count of each gradient group: the ranks one bucket is sharded over under ZeRO."""
    return {"dp": res.dp * res.cp, "tp_dp": res.tp * res.cp * res.dp, "edp": res.edp}


def model_state_bytes(
    counts: dict[str, Any],
    replicas: dict[str, int],
    *,
    zero: int = 0,
    offload: bool = False,
    precision: str = "fp32",
    param_dtype: str = "fp32",
) -> dict[str, int]:
    """Bytes of this rank's model states from `meta_param_counts` and `_replicas`.

    Explicit terms (N = parameters of this rank; N_g and R_g = parameters and replicas of each
    gradient group g in {dp, tp_dp, edp}; share = sum_g N_g / R_g under ZeRO >= 1, else N):
    * weights = 4 N: parameters stay fp32 in every precision (they are the main weights;
      bf16/fp16 compute runs under torch.autocast);
    * ZeRO-3: weights = 4 * sum_g (N_g / R_g if R_g > 1 else N_g) (the shards), and
      weights_gathered = `counts["zero3_gathered"]` (two adjacent units in full, during
      forward/backward: in the peak, not in the persistent states); 0 for ZeRO 0-2;
    * grads (persistent) = 4 N for ZeRO 0/1 (fp32 bucket buffers); ZeRO-2/3 keep only the
      reduce-scattered shards, 4 * sum_g (N_g / R_g if R_g > 1 else N_g);
    * grad_buffers_backward: ZeRO-2's full fp32 buckets (4 N), alive from `zero_grad()` to the
      end of backward (in the peak, not in the persistent states); ZeRO-3's per-unit buffers
      (`counts["zero3_grad_buffers"]`); 0 otherwise;
    * optimizer = AdamW exp_avg + exp_avg_sq, 8 bytes x share; 0 on the device with offload;
    * host (offload only) = 12 bytes x share: AdamW state and fp32 main weights on the host;
    * main_params = 0: fp32 weights are the main weights (kept for the plan's schema);
    * autocast_weight_copies = 2 bytes x matmul parameters under bf16/fp16 (saved by the
      forward's matmuls until their backward), 0 for fp32.
    * `param_dtype="bf16"` (16-bit resident weights, dp/resident.py): weights = 2 N (bf16),
      main_params = 4 bytes x share (fp32 main weights, in the total; 0 on the device with
      offload, where `host` holds them), autocast_weight_copies = 0 (the weights are bf16
      already); under ZeRO-3 the bf16 shards and gathered units are half the fp32 bytes. Per
      parameter at dp = R: 18 (zero=0), 6 + 12/R (zero=1), 2 + 16/R (zero=2), 18/R (zero=3).
    Bucket padding (fewer than R_g elements per bucket) is ignored.
    """
    raise_first([compute_precision_check(precision), *param_dtype_checks(param_dtype, precision, zero)])
    resident = param_dtype == "bf16"
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"optim.zero={zero} must be 0, 1, 2 or 3")
    n = counts["total"]
    groups = {"dp": counts["group_dp"], "tp_dp": counts["group_tp_dp"], "edp": counts["group_edp"]}
    share = n if zero == 0 else sum(math.ceil(v / replicas[g]) for g, v in groups.items())
    grads = 4 * n
    grad_buffers = 0
    sharded = 4 * sum(math.ceil(v / replicas[g]) if replicas[g] > 1 else v for g, v in groups.items())
    if zero >= 2:
        grads = sharded
        grad_buffers = 4 * n if zero == 2 else counts.get("zero3_grad_buffers", 4 * n)
    out = {
        "params": n,
        "optimizer_share_params": share,
        # resident bf16 weights: half the fp32 bytes, shards and gathered units alike
        "weights": (sharded if zero == 3 else 4 * n) // (2 if resident else 1),
        "weights_gathered": counts.get("zero3_gathered", 0) // (2 if resident else 1) if zero == 3 else 0,
        "grads": grads,
        "grad_buffers_backward": grad_buffers,
        "main_params": 4 * share if resident and not offload else 0,
        "optimizer": 0 if offload else 8 * share,
        "host": 12 * share if offload else 0,
        "autocast_weight_copies": 0 if precision == "fp32" or resident else 2 * counts["matmul"],
    }
    # persistent device states
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["main_params"]
    return out


# --------------------------------------------------------------------------- activations


@dataclass
class ChunkActivations:
    """Activation bytes of ONE microbatch through one model chunk on one rank.

    saved: bytes autograd keeps for backward at the end of this chunk's forward (`terms` itemizes
      them), plus the chunk's output the pipeline executor keeps for backward (non-last chunks).
    logits: the logits [b, s, V_pad/tp] of the last chunk without the fused LM loss (0 with it):
      they exist while the loss's forward runs inside the chunk's forward (`train_step` and the
      pipeline get the summed loss, never the logits), beside `forward_extra`.
    forward_extra: buffers alive during the loss's forward beyond `saved` and `logits` (the
      cross-entropy's masked copy of the logits when this vocabulary shard holds padding, the
      fp32 copy of 16-bit logits).
    backward_extra: the largest transient of this chunk's backward beyond what is saved: the
      cross-entropy gradient, the LM head's weight gradient, a recomputed layer and one layer's
      gradient working set (minus what the cross-entropy already freed).
    loss_backward_extra / rest_backward_extra: `backward_extra` split by phase: the cross-entropy's
      own backward (last chunk), and everything after it (LM head, layers, embedding tables);
      ZeRO-3's gathered units and gradient buffers exist only in the second.
    pre / post: the chunk embeds / holds the LM head and loss.
    pipeline_recv: bytes of one activation or gradient message between pipeline stages
      [s (/tp under SP), b, h] fp32 (the received output gradient is alive during a non-last
      chunk's backward; a non-first chunk's input and input gradient stay referenced by the
      pending send).
    """

    saved: int
    logits: int = 0
    forward_extra: int = 0
    backward_extra: int = 0
    loss_backward_extra: int = 0
    rest_backward_extra: int = 0
    pre: bool = False
    post: bool = False
    pipeline_recv: int = 0
    terms: dict[str, int] = field(default_factory=dict)


def _attention_path(cfg: GPTConfig, device: str) -> str:
    """Which scaled_dot_product_attention kernel runs in training: on CPU, dropout on the
    probabilities selects the math path (it materializes softmax, dropout mask and dropped
    probabilities); otherwise a fused kernel (CPU flash, CUDA flash / memory-efficient)."""
    return "math" if device == "cpu" and cfg.attention_dropout_p > 0 else "fused"


def _layer_backward(
    cfg: GPTConfig,
    saved_none: SavedTrace,
    saved_mode: SavedTrace,
    mode: str,
    *,
    is_moe: bool,
    tokens: int,
    tp: int,
    ep: int,
    etp: int,
    precision: str,
    device: str,
    cp: int = 1,
) -> float:
    """Largest transient of one block's backward beyond what it saved, when it is the top of
    the stack (lower layers run with less saved). A step transient, so arithmetic on shapes;
    the saved parts come from the traces (`saved_none`: the block without recompute).

    The incoming residual gradient (fp32, T tokens), then
    * MLP: the down projection's weight gradient (built before AccumulateGrad adds it to the
      bucket) and its input gradient (gelu f; swiglu: the up and gate gradients, 2 f);
      an MoE layer: one expert's hidden gradient rows and the expert weight gradients;
    * attention (after the MLP half's saved tensors were freed): the q/k/v gradients and the
      zero-filled QKV-shaped gradients of the select/slice views (about 3 x the QKV output),
      or on the math path one [a_l, s] probability gradient plus the QKV output.
    Selective recompute replays the attention core (what it did not save) before its
    backward; full recompute replays the whole block first."""
    h, s, a, g, d = cfg.hidden_size, cfg.seq_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    c = 4 if precision == "fp32" else 2
    a_l, g_l = a // tp, g // tp
    qkv_l = (a_l + 2 * g_l) * d
    if cfg.attention == "mla":  # q and k a_l x dq, v a_l x dv (models/mla.py)
        qkv_l = a_l * (2 * d + cfg.v_head_dim)
    T = tokens
    grad_in = T * 4 * h
    mlp_part = saved_none.after_mark
    if not is_moe:
        f_l = cfg.ffn_hidden_size // tp
        ws_mlp = grad_in + 4 * h * f_l + T * c * f_l * (1 if cfg.activation == "gelu" else 2)
    else:
        fm = cfg.moe_ffn_hidden_size
        T_l = T / tp if tp > 1 else T
        ws_mlp = (
            grad_in
            + T_l * cfg.top_k * c * fm * (1 if cfg.activation == "gelu" else 2)
            + 4 * (cfg.num_experts // ep) * h * fm // etp
        )
    if cp > 1:
        # Context-parallel attention (no dropout): the q/k/v gradients, plus one tile of a
        # block pair's fp32 probabilities and their gradient (mpu.attention_blocks: a q chunk of
        # s/(2cp) rows against up to two kv chunks, at most TILE_SCORE_BYTES per tile).
        b = T // (s // cp)
        block = b * a_l * (s // (2 * cp)) * (s // cp) * 4
        ws_attn = grad_in + 3 * T * c * qkv_l + 2 * min(block, TILE_SCORE_BYTES)
    elif _attention_path(cfg, device) == "fused":
        ws_attn = grad_in + 3 * T * c * qkv_l
    else:
        ws_attn = grad_in + T * c * (a_l * s + qkv_l)
    working = max(ws_mlp, ws_attn - mlp_part)
    if mode == "none":
        return working
    if mode == "selective":
        replay = saved_none.total - saved_mode.total
        return max(ws_mlp, replay + ws_attn - mlp_part)
    return saved_none.total + working


def fused_lm_loss_forward_bytes(
    cfg: GPTConfig, tokens: int, tp: int, tp_rank: int, c: int, device: str = "cpu", chunk_rows: int | None = None
) -> int:
    """Transient bytes of the fused LM-head loss's forward (kernels/linear_cross_entropy.py) on TP
    rank `tp_rank`, for `tokens` rows in `c`-byte compute: the batch-major copy of its input,
    16-bit copies of the input and the weight under autocast, and one chunk's fp32 logits,
    overwritten by the exponentials and the gradient (16-bit: plus the 16-bit logits they are
    widened from, or the gradient's 16-bit copy), `chunk_rows` per chunk (None: the device's
    default)."""
    from meshtron.kernels.linear_cross_entropy import chunk_rows_for

    h = cfg.hidden_size
    vocab_l = cfg.padded_vocab_size(tp) // tp
    n_valid = max(0, min(vocab_l, cfg.vocab_size - tp_rank * vocab_l))
    rows = min(tokens, chunk_rows or chunk_rows_for(vocab_l, device))
    casts = (tokens * h + n_valid * h) * c if c != 4 else 0
    chunk = rows * n_valid * (4 + (c if c != 4 else 0))
    return math.ceil(tokens * 4 * h + casts + chunk)


def _check_precision_and_device(precision: str, device: str) -> None:
    """Raise on an unknown compute precision (trainer.precision) or training device."""
    raise_first([compute_precision_check(precision)])
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is unknown; use one of {list(DEVICES)}")


def _add_term(terms: dict[str, float], name: str, value: float) -> None:
    """Add `value` bytes to the activation term `name` (created at 0)."""
    terms[name] = terms.get(name, 0.0) + value


def _add_layer_terms(
    terms: dict[str, float],
    cfg: GPTConfig,
    layers,
    trace: dict[str, Any],
    execution: ExecutionConfig,
    *,
    tokens: int,
    ep: int,
    etp: int,
) -> float:
    """Add the saved bytes of the blocks `layers` (traced with `trace`'s shape: "layer_<part>",
    the MoE rows gathered over etp, "rope_tables") to `terms`; returns the largest transient of
    one block's backward (`_layer_backward`)."""
    layer_backward = 0.0
    for i in layers:
        mode, is_moe = execution.layer_mode(i), cfg.is_moe_layer(i)
        saved_none = trace_layer(cfg, i, "none", **trace)
        saved = trace_layer(cfg, i, mode, **trace)
        for name, value in saved.terms.items():
            _add_term(terms, f"layer_{name}", value)
        if is_moe and etp > 1 and mode != "full":
            rows = etp_row_bytes(
                cfg,
                micro_batch_size=trace["micro_batch_size"],
                tp=trace["tp"],
                etp=etp,
                precision=trace["precision"],
                cp=trace["cp"],
            )
            _add_term(terms, "layer_mlp", rows)
        transient = _layer_backward(
            cfg,
            saved_none,
            saved,
            mode,
            is_moe=is_moe,
            tokens=tokens,
            tp=trace["tp"],
            ep=ep,
            etp=etp,
            precision=trace["precision"],
            device=trace["device"],
            cp=trace["cp"],
        )
        layer_backward = max(layer_backward, transient)
    if len(layers) and cfg.position == "rope":
        _add_term(terms, "rope_tables", trace_layer(cfg, layers[0], execution.layer_mode(layers[0]), **trace).shared)
    return layer_backward


def _saved_terms(
    cfg: GPTConfig,
    layers,
    trace: dict[str, Any],
    execution: ExecutionConfig,
    pre_process: bool,
    post_process: bool,
    tp_rank: int,
    ep: int,
    etp: int,
    tokens: int,
    stage_tokens: float,
) -> tuple[dict[str, float], float, SavedTrace | None]:
    """The chunk's saved bytes by term (unrounded: embedding, layers, final norm + LM head +
    loss, or the stage output of `stage_tokens` rows), the largest transient of one block's
    backward, and the head's trace (None without `post_process`)."""
    terms: dict[str, float] = {}
    if pre_process:
        _add_term(terms, "embedding", trace_pre(cfg, tp_rank=tp_rank, **trace).total)
    layer_backward = _add_layer_terms(terms, cfg, layers, trace, execution, tokens=tokens, ep=ep, etp=etp)
    head_trace = None
    if post_process:
        head_trace = trace_post(cfg, tp_rank=tp_rank, fused_lm_loss=execution.fused_lm_loss, **trace)
        for name, value in head_trace.terms.items():
            _add_term(terms, name, value)
    else:
        _add_term(terms, "stage_output", stage_tokens * 4 * cfg.hidden_size)
    return terms, layer_backward, head_trace


def _last_chunk_transients(
    cfg: GPTConfig,
    execution: ExecutionConfig,
    head_saved: float,
    layer_backward: float,
    tokens: int,
    c: int,
    tp: int,
    tp_rank: int,
    device: str,
    pre_process: bool,
) -> tuple[int, int, float, float]:
    """(logits held, the loss forward's extra buffers, the loss backward's transient, the rest
    of the backward's transient) of the chunk holding the LM head and loss, for `tokens` rows in
    `c`-byte compute (`head_saved`: the saved bytes of the final norm, head and loss)."""
    h, T = cfg.hidden_size, tokens
    vocab_l = cfg.padded_vocab_size(tp) // tp
    # The LM head's backward: the weight gradient [V/tp, h] and the input gradient.
    head = 4 * vocab_l * h + T * 4 * h
    logits = 0
    if execution.fused_lm_loss:
        forward_extra = fused_lm_loss_forward_bytes(cfg, T, tp, tp_rank, c, device, execution.lm_loss_chunk_rows)
        # Both gradients were built in forward; backward scales them: one new copy of each.
        ce_grad = head
    else:
        logits = math.ceil(T * c * vocab_l)
        # The cross-entropy's masked copy (a shard holding vocabulary padding) and the fp32
        # copy of 16-bit logits exist only inside the loss's forward, beside the shifted
        # logits it keeps as its softmax.
        holds_padding = (tp_rank + 1) * vocab_l > cfg.vocab_size
        forward_extra = math.ceil(T * 4 * vocab_l * ((1 if holds_padding else 0) + (1 if c != 4 else 0)))
        # Loss backward: the fp32 gradient (a clone of the softmax, plus its 16-bit cast under
        # autocast); then the LM head's backward holds a contiguous copy of it while the
        # softmax is already freed, and builds `head`.
        ce_grad = T * 4 * vocab_l + (T * c * vocab_l if c != 4 else 0)
    # The layers' backward starts once the loss, LM head and final norm released their saved
    # tensors. A tied embedding used by the head and the lookup of the same chunk gets ONE
    # AccumulateGrad: the head's weight gradient [V/tp, h] waits in autograd's input buffer
    # until the embedding backward adds its own.
    tied_wait = 4 * vocab_l * h if (cfg.tie_embeddings and pre_process) else 0
    rest_backward = max(head, layer_backward - head_saved + tied_wait)
    return logits, forward_extra, ce_grad, rest_backward


def _embedding_backward_bytes(cfg: GPTConfig, terms: dict[str, float], tp: int, post_process: bool) -> float:
    """Transient of the dense embedding's backward beyond the chunk's other saved tensors."""
    # The dense embedding backward builds two [V/tp, h] fp32 tensors (zeros + index_add) before
    # AccumulateGrad, when the chunk's other saved tensors are already freed; with a tied
    # head in the same chunk, the head's weight gradient is still waiting beside them.
    saved_total = sum(terms.values())
    tables = 3 if (cfg.tie_embeddings and post_process) else 2
    return tables * 4 * (cfg.padded_vocab_size(tp) // tp) * cfg.hidden_size - (saved_total - terms["embedding"])


def _chunk_transients(
    cfg: GPTConfig,
    execution: ExecutionConfig,
    terms: dict[str, float],
    layer_backward: float,
    head_trace: SavedTrace | None,
    tokens: int,
    c: int,
    tp: int,
    tp_rank: int,
    device: str,
    pre_process: bool,
) -> dict[str, int]:
    """`ChunkActivations`' step transients (logits, forward_extra, backward_extra,
    loss_backward_extra, rest_backward_extra) of a chunk with saved `terms`; `head_trace`: the
    last chunk's head trace, None on other chunks."""
    logits = forward_extra = ce_grad = 0
    backward_extra = rest_backward = layer_backward
    if head_trace is not None:
        logits, forward_extra, ce_grad, rest_backward = _last_chunk_transients(
            cfg, execution, head_trace.total, layer_backward, tokens, c, tp, tp_rank, device, pre_process
        )
        backward_extra = max(ce_grad, rest_backward)
    if pre_process:
        tables_bytes = _embedding_backward_bytes(cfg, terms, tp, head_trace is not None)
        backward_extra = max(backward_extra, tables_bytes)
        rest_backward = max(rest_backward, tables_bytes)
    return {
        "logits": logits,
        "forward_extra": forward_extra,
        "backward_extra": math.ceil(backward_extra),
        "loss_backward_extra": math.ceil(ce_grad),
        "rest_backward_extra": math.ceil(rest_backward),
    }


def chunk_activations(
    cfg: GPTConfig,
    micro_batch_size: int,
    *,
    layers,
    pre_process: bool,
    post_process: bool,
    tp: int = 1,
    sp: bool = False,
    ep: int = 1,
    etp: int = 1,
    tp_rank: int = 0,
    cp: int = 1,
    cp_comm: str = "ring",
    precision: str = "fp32",
    device: str = "cpu",
    execution: ExecutionConfig = ExecutionConfig(),
) -> ChunkActivations:
    """`ChunkActivations` of one model chunk holding global layer indices `layers` (embeddings
    when `pre_process`, final norm + LM head + loss when `post_process`), for one microbatch.

    Saved bytes are measured, not derived: `planning.activations` traces one block of each
    kind (dense / MoE, recompute mode of the layer) and the embedding and head steps with the
    real modules on meta-backed fake tensors, and the chunk sums them per layer. Terms:
    "embedding"; "layer_<part>" summed over the layers (norm1, attn, norm2, mlp, and "block":
    the block's own ops, i.e. residual dropout masks, or its input under full recompute);
    "rope_tables" (saved once per chunk by every block); "final_norm", "head" (the LM head's
    input) and "loss" (softmax, targets, masks); "stage_output" for a non-last chunk (the
    pipeline executor keeps it for backward). What a trace cannot see is arithmetic, each in
    one place: MoE rows gathered over etp (`planning.activations.etp_row_bytes`), and the step
    transients below (logits held, the loss's copies, backward working sets).
    """
    _check_precision_and_device(precision, device)
    T = cfg.seq_len // cp * micro_batch_size  # this rank's tokens: its cp shard of each sequence
    T_sp = T / tp if sp else T
    trace = dict(
        micro_batch_size=micro_batch_size, tp=tp, sp=sp, precision=precision, device=device, cp=cp, cp_comm=cp_comm
    )
    terms, layer_backward, head_trace = _saved_terms(
        cfg, layers, trace, execution, pre_process, post_process, tp_rank, ep, etp, T, T_sp
    )
    c = 4 if precision == "fp32" else 2
    transients = _chunk_transients(
        cfg, execution, terms, layer_backward, head_trace, T, c, tp, tp_rank, device, pre_process
    )
    rounded = {k: math.ceil(v) for k, v in terms.items()}
    return ChunkActivations(
        saved=sum(rounded.values()),
        **transients,
        pre=pre_process,
        post=post_process,
        pipeline_recv=math.ceil(T_sp * 4 * cfg.hidden_size),
        terms=rounded,
    )


def _chunk_layout(cfg: GPTConfig, res: ParallelConfig, pp_rank: int) -> list[tuple[range, bool, bool]]:
    """(layers, pre_process, post_process) of each model chunk of pipeline rank `pp_rank`, as
    `models.gpt.build_model_chunks` builds them."""
    from meshtron.models.gpt import virtual_stage_layers

    out = []
    for c in range(res.vpp):
        stage = c * res.pp + pp_rank
        layers = virtual_stage_layers(cfg.num_layers, res.pp, res.vpp, stage, res.stage_layers)
        out.append((layers, stage == 0, stage == res.pp * res.vpp - 1))
    return out


def _rank_chunks(
    cfg: GPTConfig,
    res: ParallelConfig,
    micro_batch_size: int,
    *,
    pp_rank: int,
    tp_rank: int,
    precision: str,
    device: str,
    execution: ExecutionConfig,
) -> list[ChunkActivations]:
    """`ChunkActivations` of each model chunk of pipeline rank `pp_rank`, for one microbatch."""
    sp = bool(res.sp and res.tp > 1)
    return [
        chunk_activations(
            cfg,
            micro_batch_size,
            layers=layers,
            pre_process=pre,
            post_process=post,
            tp=res.tp,
            sp=sp,
            ep=res.ep,
            etp=res.etp,
            tp_rank=tp_rank,
            precision=precision,
            device=device,
            execution=execution,
            cp=res.cp,
            cp_comm=res.cp_comm,
        )
        for layers, pre, post in _chunk_layout(cfg, res, pp_rank)
    ]


def _rank_actions(res: ParallelConfig, pp_rank: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, chunk) of each action of this rank's step: its pipeline schedule
    (`build_schedule`), or at pp = 1 the forward and backward of each microbatch."""
    if res.pp == 1:
        return [(kind, m, 0) for m in range(num_microbatches) for kind in ("F", "B")]
    return [
        (a.kind, a.microbatch, a.chunk)
        for a in build_schedule(res.schedule, res.pp, pp_rank, num_microbatches, res.vpp)
    ]


def _backward_candidates(live: int, ch: ChunkActivations, extra: dict[str, int]) -> tuple[int, int]:
    """(bytes with the phase extras, bytes without them) during the backward of chunk `ch`
    with `live` saved bytes: the loss's backward, then the head and layers' (with ZeRO-3's
    buffers) on the last chunk; elsewhere the backward's transient and the received gradient."""
    if ch.post:
        transient = max(ch.loss_backward_extra + extra["loss_backward"], ch.rest_backward_extra + extra["backward"])
        plain = live + ch.backward_extra
    else:
        transient = ch.backward_extra + extra["backward"] + ch.pipeline_recv
        plain = live + ch.backward_extra + ch.pipeline_recv
    return live + transient, plain


def _replay_peak(
    chunks: list[ChunkActivations], actions: list[tuple[str, int, int]], extra: dict[str, int]
) -> tuple[int, int, str, int]:
    """Replay `actions` over `chunks`: a forward adds a chunk's saved bytes, a backward removes
    them. Returns (peak with the phase `extra`s, peak without them, where the first peaks, most
    microbatch-chunks in flight)."""
    live = peak = plain_peak = 0
    in_flight = max_in_flight = 0
    phase = "none"
    for kind, m, c in actions:
        ch = chunks[c]
        if kind == "F":
            live += ch.saved
            in_flight += 1
            # The loss runs inside the last chunk's forward, beside its logits (none when fused).
            plain = live + ch.logits + ch.forward_extra
            now = plain + extra["forward"]
            where = f"forward of microbatch {m}" + (f" chunk {c}" if len(chunks) > 1 else "")
        else:
            now, plain = _backward_candidates(live, ch, extra)
            live -= ch.saved
            if not ch.pre:
                # The input gradient sent to the previous stage, and the input buffer the pending
                # send still references, stay alive until the send completes (the executor polls
                # sends between actions): counted as pending until the end of the step.
                live += 2 * ch.pipeline_recv
            in_flight -= 1
            where = f"backward of microbatch {m}" + (f" chunk {c}" if len(chunks) > 1 else "")
        max_in_flight = max(max_in_flight, in_flight)
        plain_peak = max(plain_peak, plain)
        if now > peak:
            peak, phase = now, where
    return peak, plain_peak, phase, max_in_flight


def activation_estimate(
    cfg: GPTConfig,
    res: ParallelConfig,
    *,
    micro_batch_size: int,
    num_microbatches: int,
    pp_rank: int = 0,
    tp_rank: int = 0,
    precision: str = "fp32",
    device: str = "cpu",
    execution: ExecutionConfig = ExecutionConfig(),
    phase_extras: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Activation memory of one rank over one training step (`res` resolved).

    `phase_extras` {"forward", "loss_backward", "backward"}: bytes beyond the activations that
    exist only in that phase (ZeRO-2's full gradient buckets in all three; ZeRO-3's gathered
    units in forward and backward, its gradient buffers in backward after the loss's); they
    are added to that phase's candidates, so the peak is taken where they really coexist.

    Replays this rank's pipeline action list (`build_schedule`; at pp = 1 the train step's
    forward, backward per microbatch) with the `ChunkActivations` of its chunks:
    a forward adds the chunk's saved bytes, a backward removes them. Candidates for the peak:
    each forward (the loss runs inside it: live saved bytes + logits + `forward_extra`) and each
    backward (live saved bytes + `backward_extra`). 1F1B keeps min(pp - pp_rank, m) microbatches in flight on
    stage pp_rank, GPipe m, interleaved what its warm-up implies, all of which the replay follows.

    Returns {"saved_per_microbatch" (all chunks of this rank, one microbatch), "peak" (largest
    activation-side bytes, phase extras included), "activations_peak" (the same without the
    phase extras), "peak_phase", "max_in_flight", "chunks"}.
    """
    chunks = _rank_chunks(
        cfg,
        res,
        micro_batch_size,
        pp_rank=pp_rank,
        tp_rank=tp_rank,
        precision=precision,
        device=device,
        execution=execution,
    )
    actions = _rank_actions(res, pp_rank, num_microbatches)
    extra = {"forward": 0, "loss_backward": 0, "backward": 0, **(phase_extras or {})}
    peak, plain_peak, phase, max_in_flight = _replay_peak(chunks, actions, extra)
    return {
        "saved_per_microbatch": sum(ch.saved for ch in chunks),
        "peak": peak,
        "activations_peak": plain_peak,
        "peak_phase": phase,
        "max_in_flight": max_in_flight,
        "chunks": [dataclasses.asdict(ch) for ch in chunks],
    }


def _optimizer_transient(
    counts: dict[str, Any], replicas: dict[str, int], zero: int, offload: bool, device: str
) -> int:
    """Temporaries of the AdamW step. CPU (single-tensor AdamW): `exp_avg_sq.sqrt() / bias
    correction` makes two tensors the size of the largest parameter (ZeRO >= 1: of the largest
    bucket shard, `counts["buckets"]` split over its replicas; the all-gather's copy of one
    shard comes after them). CUDA (foreach AdamW): one fp32 temporary per updated element (the
    foreach sqrt), 4 bytes x the optimizer's share. Offload runs the step on the host: 0."""
    if offload:
        return 0
    groups = {"dp": counts["group_dp"], "tp_dp": counts["group_tp_dp"], "edp": counts["group_edp"]}
    if device == "cuda":
        share = counts["total"] if zero == 0 else sum(math.ceil(v / replicas[g]) for g, v in groups.items())
        return 4 * share
    if zero == 0:
        return 8 * counts["largest"]
    shards = [math.ceil(n / replicas[key]) for key, n in counts["buckets"]] or [0]
    return 8 * max(shards)


# --------------------------------------------------------------------------- plans


def _check_batch(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Microbatches per rank; ValueError naming the fields if the batch does not split."""
    if micro_batch_size is None:
        raise ValueError("trainer.micro_batch_size=None: the planner needs the micro batch size")
    raise_first(batch_checks(global_batch_size, micro_batch_size, dp))
    return microbatches(global_batch_size, micro_batch_size, dp)[1]


def _resolve_zero(zero: int | None, zero_dp: int | None) -> int:
    if zero is not None:
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"optim.zero={zero} must be 0, 1, 2 or 3")
        return zero
    # Legacy callers passed the ZeRO-1 data-parallel size (1 = no ZeRO).
    return 1 if zero_dp is not None and zero_dp > 1 else 0


def _check_and_resolve(
    model_cfg: GPTConfig,
    par: ParallelConfig,
    world_size: int,
    rank: int,
    precision: str,
    device: str,
    zero: int | None,
    zero_dp: int | None,
    global_batch_size: int,
    micro_batch_size: int,
):
    """`plan_rank`'s argument checks, in order, and what they resolve: (the ZeRO stage, the
    resolved layout, microbatches per rank, `rank`'s virtual mesh)."""
    _check_precision_and_device(precision, device)
    zero = _resolve_zero(zero, zero_dp)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size {world_size} must be a positive integer")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    res = par.resolved(world_size)
    check_model_fits(res, model_cfg)
    num_microbatches = _check_batch(global_batch_size, micro_batch_size, res.dp)
    return zero, res, num_microbatches, virtual_mesh(res, world_size, rank)


def _plan_params(
    model_cfg: GPTConfig, res: ParallelConfig, world_size: int, rank: int, execution: ExecutionConfig
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(`meta_param_counts` of `rank`, where the count comes from, the plan's "params"); at
    pp = 1 RuntimeError when the meta count disagrees with `params_per_rank`."""
    tp, pp, ep, etp = res.tp, res.pp, res.ep, res.etp
    analytic = params_per_rank(model_cfg, tp=tp, ep=ep, etp=etp, pp=pp)
    meta = meta_param_counts(model_cfg, res, world_size, rank, execution)
    if pp > 1:
        # The analytic count is the most loaded stage's; the meta build is this rank's own
        # (its stage's layers, plus the tied embedding's copy on the last stage).
        source = "meta (this rank's pipeline chunks built on the meta device)"
    else:
        if meta["total"] != analytic:
            raise RuntimeError(
                f"planner bug: rank {rank} builds {meta['total']} parameters on the meta device but "
                f"meshtron.planning.flops.params_per_rank(tp={tp}, ep={ep}, etp={etp}, pp={pp}) says {analytic}; "
                "the model and the analytic count disagree"
            )
        source = "meta (built on the meta device, matches planning.flops.params_per_rank)"
    padded = model_cfg.padded_vocab_size(tp)
    params = {
        "count": meta["total"],
        "analytic": analytic,
        "meta": meta["total"],
        "tp_sharded": meta["tp_sharded"],
        "replicated": meta["replicated"],
        "by_replica_group": {"dp": meta["group_dp"], "tp_dp": meta["group_tp_dp"], "edp": meta["group_edp"]},
        "matmul": meta["matmul"],
        "vocab_size": model_cfg.vocab_size,
        "padded_vocab_size": padded,
        "vocab_per_rank": padded // tp,
    }
    return meta, source, params


def _phase_extras(zero: int, states: dict[str, int], meta: dict[str, Any]) -> dict[str, int]:
    """Bytes beyond the activations in each phase of the step (`activation_estimate`)."""
    # ZeRO-2's full gradient buckets live from zero_grad() to the end of backward; ZeRO-3 gathers
    # units in forward and backward, and its per-unit gradient buffers exist only once the
    # head's backward starts (after the loss's; the tied copies of a pipeline stage throughout).
    if zero == 3:
        tied = meta.get("zero3_tied_grad_buffers", 0)
        return {
            "forward": states["weights_gathered"] + tied,
            "loss_backward": tied,
            "backward": states["weights_gathered"] + states["grad_buffers_backward"],
        }
    return dict.fromkeys(("forward", "loss_backward", "backward"), states["grad_buffers_backward"])


def _activation_note(res: ParallelConfig, pp_rank: int, in_flight: int) -> str:
    """How many microbatches the activation estimate holds at once, in words."""
    if res.pp == 1:
        return "one microbatch in flight (no pipeline parallelism)"
    return f"{res.schedule} schedule replayed for pp_rank {pp_rank}: up to {in_flight} microbatch-chunks in flight"


def _memory_bytes(states: dict[str, int], act: dict[str, Any], opt_tmp: int, total: int) -> dict[str, int]:
    """The plan's memory["bytes"]: model states, activations, transients and the step's peak
    `total` (activations = total - model_states: everything above the persistent states)."""
    return {
        "weights": states["weights"],
        "grads": states["grads"],
        "main_params": states["main_params"],
        "optimizer": states["optimizer"],
        "model_states": states["total"],
        "grad_buffers_backward": states["grad_buffers_backward"],
        "weights_gathered": states["weights_gathered"],
        "autocast_weight_copies": states["autocast_weight_copies"],
        "activations_per_microbatch": act["saved_per_microbatch"],
        "activations_peak": act["activations_peak"],
        "optimizer_transient": opt_tmp,
        "activations": total - states["total"],  # everything above the persistent states at the peak
        "total": total,
        "host": states["host"],
    }


def _plan_memory(
    model_cfg: GPTConfig,
    res: ParallelConfig,
    mesh,
    meta: dict[str, Any],
    batch: dict[str, int],
    precision: str,
    zero: int,
    offload: bool,
    param_dtype: str,
    device: str,
    execution: ExecutionConfig,
) -> dict[str, Any]:
    """The plan's "memory" of the rank at `mesh` (`meta`: its `meta_param_counts`, `batch`: the
    plan's "batch"): model states, activations and the step's peak."""
    replicas = _replicas(res)
    states = model_state_bytes(meta, replicas, zero=zero, offload=offload, precision=precision, param_dtype=param_dtype)
    act = activation_estimate(
        model_cfg,
        res,
        micro_batch_size=batch["micro_batch_size"],
        num_microbatches=batch["num_microbatches"],
        pp_rank=mesh.pp_rank,
        tp_rank=mesh.tp_rank,
        precision=precision,
        device=device,
        execution=execution,
        phase_extras=_phase_extras(zero, states, meta),
    )
    # Peak of the step: during forward/backward (persistent states + autocast's weight copies +
    # activations with each phase's ZeRO extras, `_phase_extras`), or during the optimizer step
    # (states + AdamW temporaries).
    fwd_bwd = states["total"] + states["autocast_weight_copies"] + act["peak"]
    opt_tmp = _optimizer_transient(meta, replicas, zero, offload, device)
    opt_phase = states["total"] + opt_tmp
    mem_bytes = _memory_bytes(states, act, opt_tmp, max(fwd_bwd, opt_phase))
    return {
        "precision": precision,
        "zero": zero,
        "offload": offload,
        "param_dtype": param_dtype,
        "device": device,
        "recompute": execution.recompute,
        "microbatches_in_flight": act["max_in_flight"],
        "activation_note": _activation_note(res, mesh.pp_rank, act["max_in_flight"]),
        "peak_phase": "optimizer step" if opt_phase > fwd_bwd else act["peak_phase"],
        "bytes": mem_bytes,
        "gib": {k: _gib(v) for k, v in mem_bytes.items()},
        "activation_terms": [ch["terms"] for ch in act["chunks"]],
    }


def _plan_flops(model_cfg: GPTConfig, global_batch_size: int, world_size: int) -> dict[str, Any]:
    """The plan's "flops": model FLOPs of one global step and this rank's even share."""
    per_token = model_flops_per_token(model_cfg)
    tokens = global_batch_size * model_cfg.seq_len
    flops_global = per_token * tokens
    flops_rank = flops_global / world_size
    return {
        "convention": FLOPS_CONVENTION,
        "model_flops_per_token": per_token,
        "tokens_per_step": tokens,
        "global_per_step": flops_global,
        "rank_per_step": flops_rank,
        "rank_tflop_per_step": flops_rank / 1e12,
    }


def _plan_batch(
    model_cfg: GPTConfig, global_batch_size: int, micro_batch_size: int, num_microbatches: int
) -> dict[str, int]:
    """The plan's "batch": global and micro batch, microbatches per rank and their tokens."""
    return {
        "global_batch_size": global_batch_size,
        "micro_batch_size": micro_batch_size,
        "num_microbatches": num_microbatches,
        "seq_len": model_cfg.seq_len,
        "tokens_per_microbatch": micro_batch_size * model_cfg.seq_len,
    }


def _coords(mesh) -> dict[str, int]:
    """This rank's coordinates in the dense and the expert mesh."""
    return {
        "pp_rank": mesh.pp_rank,
        "dp_rank": mesh.dp_rank,
        "cp_rank": mesh.cp_rank,
        "tp_rank": mesh.tp_rank,
        "edp_rank": mesh.edp_rank,
        "ep_rank": mesh.ep_rank,
        "etp_rank": mesh.etp_rank,
    }


def plan_rank(
    model_cfg: GPTConfig,
    par: ParallelConfig,
    world_size: int,
    rank: int,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    precision: str = "fp32",
    zero: int | None = None,
    offload: bool = False,
    param_dtype: str = "fp32",
    device: str = "cpu",
    zero_dp: int | None = None,
    execution: ExecutionConfig = ExecutionConfig(),
) -> dict[str, Any]:
    """Plan of one rank: coordinates, parameters, memory and FLOPs per step. No communication.

    `par` may be unresolved (dp=None); it is resolved against `world_size` and checked against
    the model shape (`models.fits.check_model_fits`), raising `ParallelConfigError` with what to
    change. Raises ValueError when the global batch does not split into microbatches over dp,
    and RuntimeError when the meta-built parameter count disagrees with the analytic one.

    `precision` fp32 | bf16 | fp16 (trainer.precision), `zero` 0 | 1 | 2 | 3 (optim.zero),
    `offload` (optim.offload: AdamW state and fp32 main weights on the host), `param_dtype`
    fp32 | bf16 (optim.param_dtype: 16-bit resident weights, `model_state_bytes`), `device` cpu |
    cuda (what the run trains on: selects the attention kernel and dropout-mask size the
    activation estimate assumes). Recompute comes from `execution` (trainer.recompute /
    recompute_layers). `zero_dp` is the legacy argument (> 1 meant ZeRO-1), used only when
    `zero` is None. The activation terms model the torch kernels (kernels.backend=torch, what
    CPU runs use); the fused Triton kernels save less.

    memory["bytes"]: weights, grads (persistent), optimizer, model_states (their sum),
    grad_buffers_backward (ZeRO-2/3), weights_gathered (ZeRO-3), autocast_weight_copies,
    activations_per_microbatch (saved by one microbatch), activations_peak, optimizer_transient, activations (= total -
    model_states: everything above the persistent states at the peak), total (the step's
    peak) and host (offload). `bench/memory.py` measures the same categories.
    """
    zero, res, num_microbatches, mesh = _check_and_resolve(
        model_cfg, par, world_size, rank, precision, device, zero, zero_dp, global_batch_size, micro_batch_size
    )
    meta, source, params = _plan_params(model_cfg, res, world_size, rank, execution)
    batch = _plan_batch(model_cfg, global_batch_size, micro_batch_size, num_microbatches)
    memory = _plan_memory(model_cfg, res, mesh, meta, batch, precision, zero, offload, param_dtype, device, execution)
    return {
        "rank": rank,
        "world_size": world_size,
        "coords": _coords(mesh),
        "layout": _layout(res, world_size),
        "param_source": source,
        "params": params,
        "batch": batch,
        "memory": memory,
        "flops": _plan_flops(model_cfg, global_batch_size, world_size),
    }


def _layout(res: ParallelConfig, world_size: int) -> dict[str, Any]:
    return {
        "world_size": world_size,
        "tp": res.tp,
        "pp": res.pp,
        "dp": res.dp,
        "cp": res.cp,
        "cp_comm": res.cp_comm,
        "ep": res.ep,
        "etp": res.etp,
        "edp": res.edp,
        "sp": bool(res.sp and res.tp > 1),
        "vpp": res.vpp,
        "schedule": res.schedule,
        "dense_mesh": "pp x dp x cp x tp (tp fastest)",
        "expert_mesh": "pp x edp x ep x etp (etp fastest)",
    }


def plan_all_ranks(model_cfg: GPTConfig, par: ParallelConfig, world_size: int, **kw: Any) -> dict[str, Any]:
    """Plans of every rank of the layout (keyword arguments as for `plan_rank`: micro_batch_size,
    global_batch_size, precision, zero, offload, device; legacy zero_dp).

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
            "max_host_gib": max(_gib(p["memory"]["bytes"]["host"]) for p in ranks),
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
    host = f", host {g['host']:.3f}" if m["bytes"]["host"] else ""
    return (
        f"rank {plan['rank']:>3} [pp{c['pp_rank']} dp{c['dp_rank']} "
        + (f"cp{c['cp_rank']} " if plan["layout"].get("cp", 1) > 1 else "")
        + f"tp{c['tp_rank']} | "
        f"edp{c['edp_rank']} ep{c['ep_rank']} etp{c['etp_rank']}]: "
        f"{_human(plan['params']['count'])} params ({src}); GiB: "
        f"weights {g['weights']:.3f} + grads {g['grads']:.3f} + optim {g['optimizer']:.3f} "
        f"= states {g['model_states']:.3f} (zero {m['zero']}, {m['precision']}), {acts}, "
        f"total {g['total']:.3f}{host}; "
        f"{plan['flops']['rank_tflop_per_step']:.3f} TFLOP/step, "
        f"{plan['batch']['num_microbatches']} microbatches of {plan['batch']['micro_batch_size']}"
    )


def format_plan(plan: dict[str, Any]) -> str:
    """Multi-line text of a `plan_all_ranks` result: layout, model totals, one line per rank."""
    lay, mod, s = plan["layout"], plan["model"], plan["summary"]
    head = (
        f"layout: world={lay['world_size']} pp={lay['pp']} dp={lay['dp']} "
        + (f"cp={lay['cp']} ({lay['cp_comm']}) " if lay.get("cp", 1) > 1 else "")
        + f"tp={lay['tp']} sp={lay['sp']} | "
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
