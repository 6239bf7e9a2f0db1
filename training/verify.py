"""The numerics verifier: a parallel layout against one process, step by step, tensor by tensor.

    python -m meshtron.verify +model=gpt_1b parallel.tp=4 parallel.pp=2 [--steps 2] [--tol 1e-5]

What it does (`main`):

1. Composes the run config exactly as train.py does (the same override pre-checks, Hydra's
   composition of `meshtron.configs/train.yaml`, `RunConfig.from_dict`), and checks the user's
   model against the layout (`ParallelConfig.resolved`, `check_model_fits`) for the world size
   the layout needs: tp*cp*pp*dp ranks with dp = parallel.dp, or the smallest dp that lets
   ep*etp divide a stage (override with --world).
2. Shrinks the model keeping its structure (`shrink_model`): family and flavour fields, the
   GQA ratio, experts/top-k/shared experts/moe_every/routing options, the stage split
   (stage_layers divided by their gcd, or the fewest layers per virtual stage), with head
   counts kept divisible by tp (and by cp for cp_comm=a2a), head dim 8, hidden = heads * 8,
   the ffn ratios kept (rounded to multiples of tp / etp), vocabulary 200 (never a multiple
   of 128*tp, so the padded vocabulary is exercised), seq_len 16 rounded to what sp/cp
   need, dropout 0. The families' features are kept, scaled alike: kv_channels as many
   times hidden/heads as it was (!= it when it was), qk_norm / qkv_bias / every other flag
   copied; rope_scaling with original_max_position_embeddings moved to the value nearest its
   share of seq_len at which the shrunk rope dims fall in as many bands as before (`rope_bands`:
   kept, mixed, scaled: llama3's three, yarn's ramp); a sliding window that restricts attention
   stays shorter than the shrunk seq_len (one that does not, stays so); MLA: nope dim 8, the
   rope dim even in the same ratio (>= 8 under rope scaling), v as wide as nope or not, the
   latent ranks scaled (q_lora_rank null stays null); more than max(16, 2 top_k) experts cut to
   that (router_groups and router_topk_groups kept, so top_k // topk_groups too, a multiple of
   ep), shared_ffn_hidden_size scaled (multiple of tp); moe_first_dense / moe_dense_layers
   mapped onto the shrunk layers, layers added until the dense / MoE mix of the original is
   kept; mtp_depths kept up to 2. The shrunk model is printed with them.
3. Runs the layout in `world` gloo processes (this module's `--worker` mode, rendezvous
   through a FileStore in a temporary directory, OMP_NUM_THREADS=1, a gloo timeout on every
   collective and a wall-clock limit on the whole run) and, meanwhile, the serial reference
   in this process (world of one, torch kernels, replicated AdamW, no recomputation). Both
   use the library (build_mesh, init_model_chunks, build_reducer_and_optimizer, train_step /
   pipeline_train_step) on the same synthetic batches: random tokens from trainer.seed and
   the step, micro batch 2, 2 microbatches per rank (2*pp under pipelining), dp rank r
   taking consecutive rows. The serial run takes the microbatches the MoE aux-loss scope
   says it must equal (moe/scope.py): the same ones in order (microbatch, sequence), or
   microbatch j of every dp rank concatenated (global). Synthetic tokens rather than the run's
   text: the shrunk vocabulary is below the byte tokenizer's 256, and no data set is read.
4. Records per step, on every rank: every watched module's forward output per microbatch
   (embed, layers.N.{norm1,attn,norm2,mlp}, layers.N, final_norm, the logits and, with MTP,
   each depth's embedding mtp.K.embed, output mtp.K and norm mtp.K.norm), all-gathered
   over what shards it (the sequence over tp under SP, over cp with context parallelism; the
   logits' vocabulary over tp, padding dropped); the loss (and MoE aux/z-loss, the MTP loss
   and each depth's); every
   parameter's full gradient after the data-parallel reduction and before clipping
   (all-gathered over its `shards`, tp/ep/etp; from the ZeRO-2/3 bucket shards where the
   gradients are sharded); the gradient norm; every full weight after the update (and MoE
   expert biases).
5. Compares every rank's tensors with the serial ones in order, per step: forward
   activations (microbatch by microbatch, module order), loss, gradients in reverse
   parameter order (the order backward produces them), gradient norm, weights. A tensor
   departs when ||got - want|| > tol * ||want|| + atol * sqrt(numel). Prints the per-step
   loss table and PASS, or FAIL with the first departing tensor (step, what, name, rank,
   max abs and relative diff) and a count of the others.

Exit status: 0 PASS, 1 FAIL (a departing tensor, or a rank that raised or hung), 2 bad
configuration (one line, before any process starts).

Fixed by the verifier whatever the config says, because the check is about the layout's
numerics in fp32: trainer.precision=fp32, optim.param_dtype=fp32, optim.grad_comm_dtype=fp32,
dropout 0, CPU processes, a constant learning rate 1e-3 and AdamW eps 1e-4 (Adam divides by
sqrt(v) + eps: at eps=1e-8 gradient elements near fp32 rounding noise, e.g. the
mathematically zero key bias, turn their noise into updates of order lr and weights depart
by ~1e-4 after a few steps even between two serial runs; tests/distributed/dense_cases.py
measured the floors). Kept from the config: the layout (parallel.*), optim.zero, optim.offload,
optim.weight_decay, optim.betas, trainer.max_grad_norm, trainer.seed, trainer.recompute and
kernels.backend (of the parallel run).

Test-only fault injection (`--inject-fault`), applied in the workers only so library code
stays clean: `grad-group` sums the gradients of the norm weights over the stage's tp x dp
ranks instead of their data replicas (patches `dp.grad_reduce.grad_group`; visible at
tp > 1 without SP), `grad-skip` leaves them unreduced over dp (visible at dp > 1; ZeRO 0/1).

Context parallelism: the step takes full sequences and runs each rank's cp shard
(training/packing.py), as in the loop; the recorder restores the sequence order of cp-sharded
activations (`mpu.context_parallel.gather_sequence`). Packed documents (data.reset_at_eos):
the run's eos check applies, and the synthetic sequences get the end-of-document token
PACKED_EOS at two random places each, so the document masks and restarted positions are
compared too.

Not driven (ConfigError, exit 2): parallel.dp_mode=ps (the parameter-server loop) and local
SGD (optim.local_steps > 1 or an outer optimizer), which depart from one process by design.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshtron.dp.param_gather import finish_param_gather
from meshtron.errors import ConfigError, say_one_line
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.fits import check_model_fits
from meshtron.mpu.init import full_tensor
from meshtron.mpu.mappings import gather_from_region
from meshtron.mpu.mesh import (
    Mesh,
    ParallelConfig,
    ParallelConfigError,
    group_size,
    single_process_mesh,
)
from meshtron.training.cli import compose_run
from meshtron.training.engine import Engine, EngineConfig

if TYPE_CHECKING:
    from meshtron.training.config import OptimConfig, RunConfig
    from meshtron.training.step import StepResult

EXIT_PASS, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2
LR = 1e-3
ADAM_EPS = 1e-4
MICRO = 2
SHRUNK_VOCAB = 200
SHRUNK_SEQ = 16
HEAD_DIM = 8
PACKED_EOS = 1
FAULTS = ("grad-group", "grad-skip")
_WATCHED = re.compile(r"^(embed|final_norm|layers\.\d+(\.(norm1|attn|norm2|mlp))?|mtp\.\d+(\.norm)?)$")
_FAULT_TARGET = re.compile(r"norm\d?\.weight$")


# ----------------------------------------------------------------------------- configuration


def layout_world(par: ParallelConfig) -> int:
    """Processes the layout needs: tp*cp*pp*dp with parallel.dp, or the smallest dp for which
    ep*etp divides the ranks of a stage."""
    base = par.tp * par.cp
    dp = par.dp or math.lcm(base, par.ep * par.etp) // base
    return base * par.pp * dp


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _even(n: int) -> int:
    """`n` rounded up to an even number, at least 2 (RoPE turns pairs of dims)."""
    return max(2, n + n % 2)


def _head_changes(cfg: GPTConfig, rope_scaled: bool) -> dict:
    """Head widths beside HEAD_DIM: kv_channels as many times hidden / heads as it was (and
    != it when it was), MLA's nope dim HEAD_DIM, its rope dim even and in the same ratio (at
    least 4 frequencies under rope scaling, so that every band can occur), v as wide as nope
    or not as it was."""
    if cfg.attention == "mla":
        nope = HEAD_DIM
        rope = _even(round(cfg.qk_rope_head_dim / cfg.qk_nope_head_dim * nope))
        if rope_scaled:
            rope = max(rope, HEAD_DIM)
        v = max(1, round(cfg.v_head_dim / cfg.qk_nope_head_dim * nope))
        if v == nope and cfg.v_head_dim != cfg.qk_nope_head_dim:
            v = nope + 2 if cfg.v_head_dim > cfg.qk_nope_head_dim else nope // 2
        return dict(qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
    if cfg.kv_channels is None:
        return {}
    width = cfg.hidden_size / cfg.num_heads
    channels = _even(round(cfg.kv_channels / width * HEAD_DIM))
    if channels == HEAD_DIM and cfg.kv_channels * cfg.num_heads != cfg.hidden_size:
        channels = 2 * HEAD_DIM if cfg.kv_channels > width else HEAD_DIM // 2
    return {"kv_channels": channels}


def rope_bands(cfg: GPTConfig) -> set[str]:
    """Which bands of `cfg.rope_scaling` its rope dims fall in (models/rope.py): "kept" (the
    plain frequency), "scaled" (divided by factor) and "mixed" (between: llama3's smoothed band,
    yarn's ramp). Empty without scaling."""
    from meshtron.models.rope import inverse_frequencies

    if cfg.rope_scaling is None or cfg.position != "rope":
        return set()
    plain = inverse_frequencies(cfg.rope_dim, cfg.rope_theta).double()
    scaled = inverse_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling).double()
    factor = cfg.rope_scaling["factor"]
    bands = set()
    for p, s in zip(plain.tolist(), scaled.tolist()):
        if math.isclose(s, p, rel_tol=1e-6):
            bands.add("kept")
        elif math.isclose(s, p / factor, rel_tol=1e-6):
            bands.add("scaled")
        else:
            bands.add("mixed")
    return bands


def _shrink_rope_scaling(cfg: GPTConfig, small: GPTConfig) -> dict | None:
    """`cfg.rope_scaling` with original_max_position_embeddings scaled to the shrunk model:
    the value nearest (in ratio) to the original's share of seq_len at which the shrunk rope
    dims fall in as many bands as the original's did (all three for the usual configs)."""
    if cfg.rope_scaling is None or cfg.position != "rope":
        return cfg.rope_scaling
    original = cfg.rope_scaling["original_max_position_embeddings"]
    wanted = len(rope_bands(cfg))
    target = max(original * small.seq_len / cfg.seq_len, 1.0)
    candidates = {max(1, round(target))} | {round(2 ** (e / 8)) for e in range(8, 8 * 48)}
    best, best_key = None, None
    for context in sorted(candidates):
        scaling = dict(cfg.rope_scaling, original_max_position_embeddings=context)
        bands = len(rope_bands(dataclasses.replace(small, rope_scaling=scaling)))
        key = (-min(bands, wanted), abs(math.log(context / target)))
        if best_key is None or key < best_key:
            best, best_key = scaling, key
    if not isinstance(original, int):
        best["original_max_position_embeddings"] = float(best["original_max_position_embeddings"])
    return best


def _dense_pattern(cfg: GPTConfig, layers: int) -> dict:
    """moe_first_dense / moe_dense_layers mapped onto `layers` layers (layer i -> i*layers//L;
    a nonzero first-k stays >= 1 and leaves a layer)."""
    out: dict = {}
    if cfg.moe_first_dense:
        out["moe_first_dense"] = max(1, min(layers - 1, round(cfg.moe_first_dense * layers / cfg.num_layers)))
    if cfg.moe_dense_layers is not None:
        out["moe_dense_layers"] = sorted({min(layers - 1, i * layers // cfg.num_layers) for i in cfg.moe_dense_layers})
    return out


def _layer_kinds(cfg: GPTConfig) -> set[bool]:
    return {cfg.is_moe_layer(i) for i in range(cfg.num_layers)}


def _shrink_experts(cfg: GPTConfig, par: ParallelConfig) -> dict:
    """Fewer experts for fine-grained MoE (above max(16, 2 top_k)): top_k kept, router_groups
    and router_topk_groups kept (so top_k // topk_groups too) with fewer experts per group (at
    least top_k // topk_groups, and what top_k needs), the count a multiple of ep."""
    least = max(16, 2 * cfg.top_k)
    if cfg.num_experts <= least:
        return {}
    if cfg.router_groups:
        groups, top_groups = cfg.router_groups, cfg.router_topk_groups
        per_group = max(-(-least // groups), -(-cfg.top_k // top_groups), cfg.top_k // top_groups, 1)
        per_group = min(per_group, cfg.num_experts // groups)
        step = par.ep // math.gcd(par.ep, groups)
        experts = groups * _round_up(per_group, step)
    else:
        experts = _round_up(least, par.ep)
    return {"num_experts": min(experts, cfg.num_experts)}


def shrink_model(cfg: GPTConfig, par: ParallelConfig) -> tuple[GPTConfig, ParallelConfig]:
    """A small model of the same structure for layout `par` (resolved), and `par` with its
    stage_layers scaled alike (module doc, step 2)."""
    changes = _shrunk_shape(cfg, par)
    changes.update(_shrunk_features(cfg, par, changes))
    small, stage_layers = _shrunk_layers(cfg, par, changes)
    small = dataclasses.replace(small, rope_scaling=_shrink_rope_scaling(cfg, small))
    return small, dataclasses.replace(par, stage_layers=stage_layers)


def _shrunk_shape(cfg: GPTConfig, par: ParallelConfig) -> dict:
    """The shrunk model's shape fields for layout `par`: kv heads a multiple of tp (the GQA
    ratio kept; cp | heads per tp rank under cp_comm=a2a), hidden = heads * HEAD_DIM, the ffn
    ratio kept (a multiple of tp), the vocabulary and seq_len (module doc, step 2), dropout 0,
    MTP depths up to 2 and the head-dim fields (`_head_changes`)."""
    tp, cp = par.tp, par.cp
    ratio = cfg.num_heads // cfg.num_kv_heads
    m = 1  # kv heads = tp * m: tp divides them; a2a also needs cp | heads per tp rank = m * ratio
    while tp * m < min(cfg.num_kv_heads, 2) or (cp > 1 and par.cp_comm == "a2a" and (m * ratio) % cp):
        m += 1
    kv = tp * m
    heads = kv * ratio
    hidden = heads * HEAD_DIM
    width = hidden / cfg.hidden_size
    ffn = _round_up(max(1, round(cfg.ffn_hidden_size * width)), tp)
    vocab = min(cfg.vocab_size, SHRUNK_VOCAB)
    if vocab % 128 == 0:  # keep vocab % (128*tp) != 0: the padded rows must be exercised
        vocab -= 1
    seq_multiple = math.lcm(tp if par.sp else 1, 2 * cp if cp > 1 else 1)
    seq = _round_up(min(cfg.seq_len, SHRUNK_SEQ), seq_multiple)
    return dict(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_len=seq,
        dropout=0.0,
        attention_dropout=None,
        hf_router_fields=None,
        mtp_depths=min(cfg.mtp_depths, 2),
        **_head_changes(cfg, cfg.rope_scaling is not None),
    )


def _shrunk_features(cfg: GPTConfig, par: ParallelConfig, shape: dict) -> dict:
    """The feature fields scaled to the shrunk `shape` (`_shrunk_shape`'s): MLA latent ranks,
    a sliding window (shorter than seq_len when it restricts attention), MoE expert and shared
    widths (multiples of etp / tp) and the expert count (`_shrink_experts`)."""
    width = shape["hidden_size"] / cfg.hidden_size
    seq = shape["seq_len"]
    changes = {}
    if cfg.attention == "mla":
        changes["kv_lora_rank"] = max(HEAD_DIM, round(cfg.kv_lora_rank * width))
        if cfg.q_lora_rank is not None:
            changes["q_lora_rank"] = max(HEAD_DIM, round(cfg.q_lora_rank * width))
    if cfg.attention_window is not None:  # a window that restricts attention stays shorter than seq_len
        changes["sliding_window"] = max(2, min(seq - 1, round(cfg.sliding_window * seq / cfg.seq_len)))
    elif cfg.sliding_window is not None:
        changes["sliding_window"] = seq
    if cfg.is_moe:
        multiple = math.lcm(par.etp, par.tp) if cfg.shared_experts else par.etp
        changes["moe_ffn_hidden_size"] = _round_up(max(1, round(cfg.moe_ffn_hidden_size * width)), multiple)
        if cfg.shared_ffn_hidden_size is not None:
            changes["shared_ffn_hidden_size"] = _round_up(max(1, round(cfg.shared_ffn_hidden_size * width)), par.tp)
        changes.update(_shrink_experts(cfg, par))
    return changes


def _shrunk_layers(cfg: GPTConfig, par: ParallelConfig, changes: dict) -> tuple[GPTConfig, list[int] | None]:
    """`cfg` with `changes` on the fewest layers that keep the MoE / dense mix (moe_every,
    moe_first_dense, moe_dense_layers) on whole stages, and the shrunk stage_layers (None when
    `par` gives none): given stage_layers are divided by their gcd, then multiplied until the
    mix is kept."""
    stages = par.pp * par.vpp
    kinds = _layer_kinds(cfg)
    wanted = min(cfg.num_layers, max(2, cfg.moe_every if cfg.is_moe else 1))
    base = None if par.stage_layers is None else [n // math.gcd(*par.stage_layers) for n in par.stage_layers]
    for grow in range(1, cfg.num_layers + 1):
        if base is not None:
            stage_layers = [n * grow for n in base]
            layers = sum(stage_layers)
        else:
            stage_layers = None
            layers = stages * -(-(wanted + grow - 1) // stages)
        small = dataclasses.replace(cfg, num_layers=layers, **changes, **_dense_pattern(cfg, layers))
        if _layer_kinds(small) >= kinds:
            break
    return small, stage_layers


def describe_model(cfg: GPTConfig, par: ParallelConfig) -> str:
    """One line of the shrunk model's shape, with every structural feature it kept."""
    features = []
    if cfg.attention == "mla":
        features.append(
            f"mla (q_lora_rank={cfg.q_lora_rank} kv_lora_rank={cfg.kv_lora_rank} qk_nope={cfg.qk_nope_head_dim} "
            f"qk_rope={cfg.qk_rope_head_dim} v={cfg.v_head_dim})"
        )
    elif cfg.kv_channels is not None:
        features.append(f"kv_channels={cfg.kv_channels} (hidden/heads={cfg.hidden_size // cfg.num_heads})")
    if cfg.qk_norm:
        features.append("qk_norm")
    if cfg.qkv_bias != cfg.bias:
        features.append(f"qkv_bias={cfg.qkv_bias}")
    if cfg.rope_scaling is not None:
        bands = ", ".join(sorted(rope_bands(cfg)))
        features.append(f"rope_scaling={cfg.rope_scaling} (bands: {bands})")
    if cfg.sliding_window is not None:
        features.append(f"sliding_window={cfg.sliding_window}")
    if cfg.mtp_depths:
        features.append(f"mtp_depths={cfg.mtp_depths} mtp_loss_weight={cfg.mtp_loss_weight}")
    moe = " dense"
    if cfg.is_moe:
        pattern = "".join("E" if cfg.is_moe_layer(i) else "D" for i in range(cfg.num_layers))
        routing = [f"score={cfg.router_score}"]
        if cfg.router_groups:
            routing.append(f"groups={cfg.router_groups} topk_groups={cfg.router_topk_groups}")
        if cfg.router_scaling_factor != 1.0:
            routing.append(f"scaling={cfg.router_scaling_factor}")
        if cfg.router_bias_update_rate:
            routing.append(f"bias_rate={cfg.router_bias_update_rate}")
        shared = f"shared_experts={cfg.shared_experts}"
        if cfg.shared_experts and cfg.shared_ffn_hidden_size is not None:
            shared += f" shared_ffn={cfg.shared_ffn_hidden_size}"
        if cfg.shared_expert_gate:
            shared += " gated"
        moe = (
            f" experts={cfg.num_experts} top_k={cfg.top_k} moe_every={cfg.moe_every} layers {pattern}"
            f" (E: MoE, D: dense) moe_ffn={cfg.moe_ffn_hidden_size} {shared} {' '.join(routing)}"
            f" scope={cfg.aux_loss_scope}"
        )
    stages = (
        f" stages {par.stage_layers}"
        if par.stage_layers
        else (f" ({par.pp * par.vpp} virtual stages)" if par.pp > 1 else "")
    )
    return (
        f"{cfg.arch} ({cfg.norm}, {cfg.activation}, {cfg.position} positions, bias={cfg.bias}, "
        f"tied={cfg.tie_embeddings}) layers={cfg.num_layers}{stages} hidden={cfg.hidden_size} "
        f"heads={cfg.num_heads} kv_heads={cfg.num_kv_heads} (GQA {cfg.num_heads // cfg.num_kv_heads}:1) "
        + "".join(f"{f} " for f in features)
        + f"ffn={cfg.ffn_hidden_size}{moe} vocab={cfg.vocab_size} (padded to {cfg.padded_vocab_size(par.tp)} "
        f"at tp={par.tp}) seq={cfg.seq_len} dropout=0 fp32"
    )


@dataclasses.dataclass
class VerifyJob:
    """Everything a worker (or the serial run) needs; pickled to the workers."""

    model: GPTConfig
    par: ParallelConfig  # resolved for `world`
    optim: OptimConfig  # of the parallel run
    world: int
    steps: int
    seed: int
    max_grad_norm: float
    recompute: str
    recompute_layers: int | None
    kernel_backend: str
    micro: int
    n_micro: int  # microbatches per rank
    fault: str | None = None
    store: str = ""
    out: str = ""
    collective_timeout_s: float = 60.0
    eos_id: int | None = None  # data.reset_at_eos: packed documents end at this token

    @property
    def global_batch(self) -> int:
        return self.par.dp * self.n_micro * self.micro


def make_job(run: RunConfig, world: int | None, steps: int, fault: str | None) -> VerifyJob:
    """Check the user's model against the layout, shrink it, fix the run's numerics (module
    doc). Raises ConfigError (one line)."""
    from meshtron.kernels.backend import resolve_backend
    from meshtron.rules import batch_checks, raise_first

    _refuse_other_loops(run)
    world = world or layout_world(run.parallel)
    model, small_par = _shrunk_layout(run, world)
    try:
        backend = resolve_backend(run.kernels.backend, "cpu")
    except (RuntimeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    _check_fault(run, fault)
    optim = dataclasses.replace(run.optim, lr=LR, eps=ADAM_EPS, grad_comm_dtype="fp32", param_dtype="fp32")
    n_micro = 2 * small_par.pp if small_par.pp > 1 else 2
    eos_id = _packed_eos_id(run)
    job = VerifyJob(
        model=model,
        par=small_par,
        optim=optim,
        world=world,
        steps=steps,
        seed=run.trainer.seed,
        max_grad_norm=run.trainer.max_grad_norm,
        recompute=run.trainer.recompute,
        recompute_layers=run.trainer.recompute_layers,
        kernel_backend=backend,
        micro=MICRO,
        n_micro=n_micro,
        fault=fault,
        eos_id=eos_id,
    )
    raise_first(
        batch_checks(job.global_batch, MICRO, small_par.dp, pp=small_par.pp, schedule=small_par.schedule), ConfigError
    )
    return job


def _refuse_other_loops(run: RunConfig) -> None:
    """Raise ConfigError (one line) for the loops other than the all-reduce step, which depart
    from one process by design or are not driven here."""
    from meshtron.rules import raise_first

    # (getattr: keys newer than this module read as their defaults when absent).
    raise_first(
        [
            (
                getattr(run.parallel, "dp_mode", "allreduce") == "allreduce",
                f"parallel.dp_mode={getattr(run.parallel, 'dp_mode', None)}: the verifier drives the all-reduce training "
                "step (training/step.py), not the parameter-server loop; verify the layout with parallel.dp_mode=allreduce",
            ),
            (
                getattr(run.optim, "local_steps", 1) == 1 and getattr(run.optim, "outer_optimizer", "none") == "none",
                "optim.local_steps/outer_optimizer: local SGD lets each data replica step alone, which departs from one "
                "process by design; verify the layout with optim.local_steps=1 optim.outer_optimizer=none",
            ),
        ],
        ConfigError,
    )


def _shrunk_layout(run: RunConfig, world: int) -> tuple[GPTConfig, ParallelConfig]:
    """The shrunk model and its layout (`shrink_model`) after checking the user's model against
    the layout resolved for `world`, and the shrunk model against the shrunk layout. Raises
    ConfigError (one line)."""
    try:
        par = run.parallel.resolved(world)
        check_model_fits(par, run.model)
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from err
    model, small_par = shrink_model(run.model, par)
    try:
        check_model_fits(small_par, model)
    except ParallelConfigError as err:  # a shrink rule missed a constraint: say so, do not guess
        raise ConfigError(
            f"the shrunk model does not fit the layout ({err}); run the verifier on a smaller model config"
        ) from err
    return model, small_par


def _check_fault(run: RunConfig, fault: str | None) -> None:
    """Raise ConfigError (one line) for an unknown `--inject-fault`, or grad-skip on sharded gradients."""
    if fault is not None and fault not in FAULTS:
        raise ConfigError(f"--inject-fault {fault}: choose one of {', '.join(FAULTS)}")
    if fault == "grad-skip" and run.optim.zero >= 2:
        raise ConfigError("--inject-fault grad-skip works on unsharded gradients: use optim.zero<=1")


def _packed_eos_id(run: RunConfig) -> int | None:
    """PACKED_EOS under data.reset_at_eos (after the run's own end-of-document check, which may
    raise ConfigError), else None."""
    if not getattr(run.data, "reset_at_eos", False):
        return None
    from meshtron.textdata.data import document_end_id

    document_end_id(run.data, run.model.vocab_size)  # the run's own check (ConfigError)
    return PACKED_EOS  # in the shrunk vocabulary; step_batches places it in every sequence


# ------------------------------------------------------------------------------- recording


def _trim_vocab(name: str, t: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    return t[: cfg.vocab_size] if name in ("embed.weight", "head.weight") else t


class Recorder:
    """Tensors of one run, in recording order: (key, batch slice or None, tensor). Keys are
    ("act", step, module, serial microbatch), ("loss"|"grad"|"grad_norm"|"weight", step, name)."""

    def __init__(self, chunks, mesh: Mesh, job: VerifyJob, where):
        self.chunks, self.mesh, self.job, self.where = chunks, mesh, job, where
        self.cfg = job.model
        self.step = 0
        self.calls: dict[str, int] = defaultdict(int)
        self.records: list[tuple[tuple, tuple | None, torch.Tensor]] = []
        self.handles = []
        # Multi-token prediction embeds shifted tokens with the chunk's `embed` after the final
        # norm (models/gpt.py): the j-th such call of a forward is recorded as mtp.j.embed, so
        # that `embed` stays one call per microbatch on every layout (under pp the last stage's
        # embedding copy serves only the depths).
        self.mtp_embeds: dict[int, int | None] = {}
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if _WATCHED.match(name):
                    self.handles.append(module.register_forward_hook(self._hook(name, chunk)))
            if chunk.post_process:
                self.handles.append(chunk.logits_out.register_forward_hook(self._hook("logits")))
            if getattr(chunk, "mtp", None) is not None:
                self.handles.append(chunk.register_forward_pre_hook(partial(self._mtp_phase, chunk, None)))
                self.handles.append(chunk.final_norm.register_forward_hook(partial(self._mtp_phase, chunk, 0)))

    def start_step(self, step: int) -> None:
        self.step = step
        self.calls.clear()

    def _mtp_phase(self, chunk, value, *_) -> None:
        """A chunk's forward starts (None) or passes its final norm (0: the MTP embeddings follow)."""
        self.mtp_embeds[id(chunk)] = value

    def _hook(self, name: str, chunk=None):
        from meshtron.mpu.recompute import is_replaying

        def hook(module, args, output):
            if isinstance(output, tuple) and name.endswith("norm2"):
                output = output[1]  # the block's norm2 adds the residual: (stream, normed) -> normed
            # Recomputation replays forwards inside backward: only the first forward counts.
            if is_replaying() or torch._C._current_graph_task_id() != -1 or not torch.is_tensor(output):
                return
            key = name
            depth = self.mtp_embeds.get(id(chunk)) if name == "embed" else None
            if depth is not None:
                key = f"mtp.{depth}.embed"
                self.mtp_embeds[id(chunk)] = depth + 1
            index = self.calls[key]
            self.calls[key] += 1
            microbatch, rows = self.where(index)
            self.records.append((("act", self.step, key, microbatch), rows, self._full_activation(key, output)))

        return hook

    def _full_activation(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """The microbatch's full activation: logits [b, s, vocab] (vocabulary gathered over tp,
        padding dropped), hidden states [s, b, h] (sequence gathered over tp under SP)."""
        from meshtron.mpu.context_parallel import gather_sequence

        mesh, x = self.mesh, out.detach().float()
        seq_dim = 1 if name == "logits" else 0
        if name == "logits":
            x = gather_from_region(x, -1, mesh.tp)[..., : self.cfg.vocab_size]
        elif mesh.sequence_parallel and x.shape[0] * mesh.tp_size * mesh.cp_size == self.cfg.seq_len:
            x = gather_from_region(x, 0, mesh.tp)
        if mesh.cp_size > 1:
            x = gather_sequence(x, seq_dim, mesh.cp)
        return x.clone()

    def named_parameters(self):
        return [(n, p) for chunk in self.chunks for n, p in chunk.named_parameters() if p.requires_grad]

    def record_gradients(self, optimizer) -> None:
        """Every parameter's full reduced gradient (before clipping; a collective over tp/ep/etp
        and, for ZeRO-2/3 bucket shards, over each bucket's replica group)."""
        from meshtron.mpu.mappings import all_gather_stats

        reducer = optimizer.grad_shards_of
        grads: dict[int, torch.Tensor] = {}
        if reducer is not None:  # ZeRO-2/3: the reduced gradients are this rank's bucket shards
            for bucket in reducer.buckets:
                flat = (
                    all_gather_stats(bucket.shard, bucket.group).reshape(-1)
                    if group_size(bucket.group) > 1
                    else bucket.shard
                )
                offset = 0
                for p in bucket.params:
                    grads[id(p)] = flat[offset : offset + p.numel()].view(p.shape)
                    offset += p.numel()
        for name, p in self.named_parameters():
            g = grads.get(id(p), p.grad)
            if g is None:
                g = torch.zeros(p.shape)
            full = _trim_vocab(name, full_tensor(g, p.shards, self.mesh), self.cfg)
            self.records.append((("grad", self.step, name), None, full.float().clone()))

    def record_step(self, out: StepResult) -> None:
        """Loss terms (aux and z-loss: MoE only; the MTP loss and each depth's), gradient norm and every full weight (and expert
        bias) after the update."""
        from meshtron.dp import zero3

        for key, value in (
            ("loss", out.loss),
            ("aux_loss", out.aux_loss),
            ("z_loss", out.z_loss),
            ("mtp_loss", getattr(out, "mtp_loss", None)),
            ("mtp_depth_losses", getattr(out, "mtp_depth_losses", None)),
        ):
            if value is not None:
                self.records.append((("loss", self.step, key), None, value.detach().float().reshape(-1).clone()))
        self.records.append(
            (("grad_norm", self.step, "grad_norm"), None, out.grad_norm.detach().float().reshape(1).clone())
        )
        finish_param_gather(self.chunks)  # ZeRO-1/2 overlapped gathers: the updated weights, not stale ones
        with zero3.gathered(self.chunks):
            for name, p in self.named_parameters():
                full = _trim_vocab(name, full_tensor(p, p.shards, self.mesh), self.cfg)
                self.records.append((("weight", self.step, name), None, full.float().clone()))
            for chunk in self.chunks:
                for name, b in chunk.named_buffers():
                    if name.endswith("expert_bias"):
                        self.records.append((("weight", self.step, name), None, b.detach().float().clone()))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def step_batches(job: VerifyJob, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: random tokens of the shrunk vocabulary (inputs, targets)."""
    gen = torch.Generator().manual_seed(job.seed * 1000 + step)
    tokens = torch.randint(0, job.model.vocab_size, (job.global_batch, job.model.seq_len + 1), generator=gen)
    if job.eos_id is not None:  # packed documents: two document ends at random places in every sequence
        ends = torch.randint(1, job.model.seq_len, (job.global_batch, 2), generator=gen)
        tokens.scatter_(1, ends, job.eos_id)
    return tokens[:, :-1], tokens[:, 1:]


def rank_microbatches(job: VerifyJob, step: int, dp_rank: int) -> list:
    """Microbatches of data-parallel rank `dp_rank`: its consecutive rows, `micro` at a time."""
    inputs, targets = step_batches(job, step)
    per_rank = job.n_micro * job.micro
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    inputs, targets = inputs[rows], targets[rows]
    return [(inputs[i : i + job.micro], targets[i : i + job.micro]) for i in range(0, per_rank, job.micro)]


def serial_microbatches(job: VerifyJob, step: int) -> list:
    """What one process must take to equal the layout (moe/scope.py invariances)."""
    per_rank = [rank_microbatches(job, step, r) for r in range(job.par.dp)]
    if job.model.is_moe and job.model.aux_loss_scope == "global":
        return [
            tuple(torch.cat([per_rank[r][j][i] for r in range(job.par.dp)]) for i in range(2))
            for j in range(job.n_micro)
        ]
    return [mb for rank in per_rank for mb in rank]


def run_layout(job: VerifyJob, serial: bool = False) -> list:
    """Train `job.steps` steps of the layout (this process's rank; or the serial reference
    with `serial`) and return its Recorder records. Communicates over the world's groups."""
    engine = Engine.build(
        _engine_config(job, serial),
        single_process_mesh() if serial else job.par,
        "cpu",
        adjust_model=None if serial or not job.fault else partial(_inject_fault, job.fault),
    )
    if job.fault == "grad-skip" and not serial:
        _skip_reduction(engine.reducer, engine.chunks)
    recorder = Recorder(engine.chunks, engine.mesh, job, _serial_index(job, engine.mesh.dp_rank, serial))
    clip = engine.optimizer.clip_grad_norm

    def recording_clip(chunks_, max_norm, mesh_):
        recorder.record_gradients(engine.optimizer)
        return clip(chunks_, max_norm, mesh_)

    engine.optimizer.clip_grad_norm = recording_clip
    try:
        for step in range(job.steps):
            recorder.start_step(step)
            mine = serial_microbatches(job, step) if serial else rank_microbatches(job, step, engine.mesh.dp_rank)
            recorder.record_step(engine.step(mine, LR))
    finally:
        recorder.close()
        engine.close()
    return recorder.records


def _engine_config(job: VerifyJob, serial: bool) -> EngineConfig:
    """The layout's engine config, or the serial reference's (replicated AdamW, no
    recomputation, torch kernels). Both build whole logits (trainer.fused_lm_loss=false) so the
    last chunk's output can be compared as logits; the fused loss equals the unfused one
    (tests/test_linear_cross_entropy.py and every layout case of the test suite)."""
    if serial:
        execution = ExecutionConfig(fused_lm_loss=False)
        optim = dataclasses.replace(job.optim, zero=0, offload=False)
    else:
        execution = ExecutionConfig(
            recompute=job.recompute,
            recompute_layers=job.recompute_layers,
            kernel_backend=job.kernel_backend,
            fused_lm_loss=False,
        )
        optim = job.optim
    return EngineConfig(
        model=job.model,
        micro_batch_size=job.micro,
        seed=job.seed,
        execution=execution,
        optim=optim,
        max_grad_norm=job.max_grad_norm,
        eos_id=job.eos_id,
    )


def _serial_index(job: VerifyJob, dp_rank: int, serial: bool):
    """where(index): (serial microbatch, rows of it) of this rank's forward number `index` in a step."""
    cfg, n_micro, micro = job.model, job.n_micro, job.micro
    global_scope = cfg.is_moe and cfg.aux_loss_scope == "global"

    def where(index: int):
        if serial:
            return index, None
        if global_scope:
            return index, (dp_rank * micro, (dp_rank + 1) * micro)
        return dp_rank * n_micro + index, None

    return where


def _inject_fault(fault: str, chunks) -> None:
    """Mark the norm weights as the fault's target; `grad-group` routes their gradient to the
    wrong replica group (the stage's tp x dp ranks) by patching grad_reduce.grad_group."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if _FAULT_TARGET.search(name):
                p.verify_fault = True
    if fault == "grad-group":
        from meshtron.dp import grad_reduce

        correct = grad_reduce.grad_group

        def wrong_group(p: nn.Parameter) -> str:
            key = correct(p)
            return "tp_dp" if getattr(p, "verify_fault", False) and key == "dp" else key

        grad_reduce.grad_group = wrong_group


def _skip_reduction(reducer, chunks) -> None:
    """`grad-skip`: the marked parameters keep this rank's unreduced gradient after finish()."""
    targets = [p for chunk in chunks for p in chunk.parameters() if getattr(p, "verify_fault", False)]
    finish = reducer.finish

    def unreduced_finish():
        local = [p.grad.clone() for p in targets]
        finish()
        for p, g in zip(targets, local):
            p.grad.copy_(g)

    reducer.finish = unreduced_finish


# ------------------------------------------------------------------------------ comparison


@dataclasses.dataclass
class Departure:
    step: int
    what: str
    name: str
    rank: int | None
    max_abs: float
    rel: float
    note: str = ""

    def describe(self) -> str:
        what = {
            "act": f"forward activation {self.name}",
            "loss": self.name,
            "grad": f"gradient of {self.name}",
            "grad_norm": "gradient norm",
            "weight": f"weight {self.name} after the update",
        }[self.what]
        where = f" on rank {self.rank}" if self.rank is not None else ""
        if self.note:
            return f"step {self.step + 1}: {what}{where}: {self.note}"
        return f"step {self.step + 1}: {what}{where}: max abs diff {self.max_abs:.3e}, relative diff {self.rel:.3e}"


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """(max abs diff, ||got-want|| / ||want||, ||got-want||) in float64."""
    d = got.double() - want.double()
    norm = d.norm().item()
    return d.abs().max().item() if d.numel() else 0.0, norm / max(want.double().norm().item(), 1e-30), norm


def compare(serial: list, ranks: dict[int, list], tol: float, atol: float) -> tuple[list[Departure], dict]:
    """Every rank's tensors against the serial ones, in check order (module doc, step 5).
    Returns the departures in that order and per step {checked, worst relative diff}."""
    order = {"act": 0, "loss": 1, "grad": 2, "grad_norm": 3, "weight": 4}
    want: dict[tuple, torch.Tensor] = {}
    position: dict[tuple, tuple] = {}
    for index, (key, _, tensor) in enumerate(serial):
        want[key] = tensor
        kind, step = key[0], key[1]
        position[key] = (step, order[kind], -index if kind == "grad" else index)
    found: dict[tuple, list] = defaultdict(list)
    for rank, records in sorted(ranks.items()):
        for key, rows, tensor in records:
            found[key].append((rank, rows, tensor))
    departures: list[tuple[tuple, Departure]] = []
    stats: dict[int, dict] = defaultdict(lambda: {"checked": 0, "worst": 0.0})
    for key in sorted(want, key=position.get):
        kind, step, name = key[0], key[1], key[2]
        label = name if kind != "act" else f"{name} (microbatch {key[3]})"
        if not found.get(key):
            departures.append(
                (
                    position[key],
                    Departure(step, kind, label, None, math.nan, math.nan, "produced by no rank of the layout"),
                )
            )
            continue
        for rank, rows, got in found[key]:
            ref = want[key]
            if rows is not None:
                ref = ref.narrow(0 if name == "logits" else 1, rows[0], rows[1] - rows[0])
            stats[step]["checked"] += 1
            if got.shape != ref.shape:
                departures.append(
                    (
                        position[key],
                        Departure(
                            step,
                            kind,
                            label,
                            rank,
                            math.nan,
                            math.nan,
                            f"shape {tuple(got.shape)} != serial {tuple(ref.shape)}",
                        ),
                    )
                )
                continue
            max_abs, rel, norm = _diff(got, ref)
            stats[step]["worst"] = max(stats[step]["worst"], rel if ref.double().norm() > 0 else 0.0)
            if not norm <= tol * ref.double().norm().item() + atol * math.sqrt(max(ref.numel(), 1)):
                departures.append((position[key], Departure(step, kind, label, rank, max_abs, rel)))
    departures.sort(key=lambda item: (item[0], item[1].rank if item[1].rank is not None else -1))
    return [d for _, d in departures], dict(stats)


def loss_table(serial: list, ranks: dict[int, list], stats: dict, steps: int) -> list[str]:
    """Per step: serial and parallel loss (the first rank holding it), |diff|, tensors checked
    and the worst relative difference."""

    def losses(records):
        return {key[1]: t.item() for key, _, t in records if key[0] == "loss" and key[2] == "loss"}

    serial_loss = losses(serial)
    parallel_loss: dict[int, float] = {}
    for rank in sorted(ranks):
        for step, value in losses(ranks[rank]).items():
            parallel_loss.setdefault(step, value)
    head = ("step", "serial loss", "parallel loss", "|diff|", "tensors", "worst rel")
    lines = ["  ".join(f"{h:>{w}}" for h, w in zip(head, (4, 14, 14, 9, 7, 9)))]
    for step in range(steps):
        s, p = serial_loss.get(step, math.nan), parallel_loss.get(step, math.nan)
        st = stats.get(step, {"checked": 0, "worst": 0.0})
        lines.append(
            f"{step + 1:>4}  {s:>14.8f}  {p:>14.8f}  {abs(s - p):>9.2e}  {st['checked']:>7}  {st['worst']:>9.2e}"
        )
    return lines


# ---------------------------------------------------------------------------------- running


def _spawn_workers(job: VerifyJob, tmp: Path) -> list:
    job.store, job.out = str(tmp / "store"), str(tmp)
    spec = tmp / "job.pkl"
    spec.write_bytes(pickle.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = []
    for rank in range(job.world):
        log = open(tmp / f"rank{rank}.log", "w")
        cmd = [sys.executable, "-m", "meshtron.training.verify", "--worker", str(spec), "--rank", str(rank)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp), log))
    return procs


def _wait_workers(procs, deadline: float) -> bool:
    """Wait for every worker until `deadline` (monotonic); kill all on timeout. True if in time."""
    in_time = True
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            in_time = False
            break
    if not in_time:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in procs:
        proc.wait()
        log.close()
    return in_time


def worker_main(spec: str, rank: int) -> int:
    """One rank of the layout: join the gloo world through the FileStore, run, save records."""
    from meshtron.mpu import shm_collectives
    from meshtron.training.distributed import teardown_distributed

    job: VerifyJob = pickle.loads(Path(spec).read_bytes())
    out = Path(job.out)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{job.store}",
            rank=rank,
            world_size=job.world,
            timeout=datetime.timedelta(seconds=job.collective_timeout_s),
        )
        shm_collectives.set_timeout(job.collective_timeout_s)
        records = run_layout(job)
        torch.save(records, out / f"rank{rank}.pt")
        return 0
    except Exception:  # noqa: BLE001 - reported by the parent, which names the rank
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        return 1
    finally:
        teardown_distributed()


def _rank_failure(tmp: Path, world: int, in_time: bool, timeout_s: float) -> str | None:
    """The first rank's error (last traceback line) or the hang, or None if all ranks saved."""
    for rank in range(world):
        err = tmp / f"rank{rank}.err"
        if err.exists():
            lines = [ln for ln in err.read_text().strip().splitlines() if ln.strip()]
            return f"rank {rank} raised: {lines[-1] if lines else '?'}\n{err.read_text()}"
    if not in_time:
        return f"the layout did not finish within --timeout {timeout_s:g} s (a hang?)"
    for rank in range(world):
        if not (tmp / f"rank{rank}.pt").exists():
            tail = (tmp / f"rank{rank}.log").read_text()[-2000:]
            return f"rank {rank} died without a result; its log ends:\n{tail}"
    return None


def verify(
    overrides: list[str],
    *,
    steps: int = 2,
    tol: float = 1e-5,
    atol: float = 1e-9,
    world: int | None = None,
    timeout_s: float = 300.0,
    fault: str | None = None,
) -> int:
    """Run the verifier (module doc); prints the report and returns the exit status."""

    try:
        if steps < 1:
            raise ConfigError(f"--steps {steps}: verify at least one step")
        job = make_job(compose_run(overrides), world, steps, fault)
    except ConfigError as err:
        say_one_line(f"meshtron verify: configuration error: {err}")
        return EXIT_CONFIG
    _print_plan(job, steps, tol, atol, fault)
    start = time.monotonic()
    results = _run_layouts(job, start, timeout_s)
    if results is None:
        return EXIT_FAIL
    serial, ranks = results
    departures, stats = compare(serial, ranks, tol, atol)
    print("\n".join(loss_table(serial, ranks, stats, steps)), flush=True)
    elapsed = time.monotonic() - start
    if departures:
        _print_departures(departures, tol, elapsed)
        return EXIT_FAIL
    checked = sum(s["checked"] for s in stats.values())
    print(
        f"PASS: {checked} tensors (activations, loss, gradients, weights; every rank) within tolerance of the "
        f"serial run over {steps} step(s) ({elapsed:.1f} s)",
        flush=True,
    )
    return EXIT_PASS


def _print_plan(job: VerifyJob, steps: int, tol: float, atol: float, fault: str | None) -> None:
    """The report's first lines: the layout and its processes, the shrunk model, the batch,
    steps and tolerance."""
    p = job.par
    print(
        f"meshtron verify: layout tp={p.tp} cp={p.cp} pp={p.pp} dp={p.dp} ep={p.ep} etp={p.etp} sp={p.sp} "
        f"vpp={p.vpp} schedule={p.schedule} zero={job.optim.zero} on {job.world} gloo processes vs 1 serial "
        f"process{'; injected fault: ' + fault if fault else ''}",
        flush=True,
    )
    print(f"shrunk model: {describe_model(job.model, p)}", flush=True)
    print(
        f"batch: {job.n_micro} microbatches of {job.micro} x dp {p.dp} = {job.global_batch} sequences per step; "
        f"{steps} step(s); tolerance ||diff|| <= {tol:g} ||serial|| + {atol:g} sqrt(numel)"
        + (
            f"; packed documents (data.reset_at_eos): token {job.eos_id} ends documents at 2 random places per sequence"
            if job.eos_id is not None
            else ""
        ),
        flush=True,
    )


def _run_layouts(job: VerifyJob, start: float, timeout_s: float) -> tuple[list, dict] | None:
    """Run the layout in `job.world` worker processes (which communicate among themselves over
    their own gloo world, rendezvous through a FileStore in a temporary directory) and,
    meanwhile, the serial reference in this process (a world of one); returns (serial records,
    {rank: records}), or None after printing FAIL when a rank raised, hung past `start +
    timeout_s` or died without a result."""
    with tempfile.TemporaryDirectory(prefix="meshtron-verify-") as tmpdir:
        tmp = Path(tmpdir)
        procs = _spawn_workers(job, tmp)
        try:
            torch.set_num_threads(1)
            serial = run_layout(job, serial=True)
        except BaseException:
            _wait_workers(procs, time.monotonic())
            raise
        in_time = _wait_workers(procs, start + timeout_s)
        failure = _rank_failure(tmp, job.world, in_time, timeout_s)
        if failure is not None:
            print(f"FAIL: {failure}", flush=True)
            return None
        ranks = {r: torch.load(tmp / f"rank{r}.pt") for r in range(job.world)}
    return serial, ranks


def _print_departures(departures: list, tol: float, elapsed: float) -> None:
    """The FAIL report: the first departing tensor, the count of all, then up to 5 more
    departing tensors (one line per tensor, not per rank holding it)."""
    first = departures[0]
    print(
        f"FAIL: first departure at {first.describe()} (tolerance {tol:g}); "
        f"{len(departures)} tensor(s) departed in all ({elapsed:.1f} s)",
        flush=True,
    )
    shown = {(first.step, first.what, first.name)}
    for d in departures[1:]:
        if len(shown) > 5:
            break
        if (d.step, d.what, d.name) not in shown:  # one line per tensor, not per rank holding it
            shown.add((d.step, d.what, d.name))
            print(f"  then {d.describe()}", flush=True)


def _bad_argument(args) -> str | None:
    """What is wrong with verify's own options (counts positive, tolerances >= 0 and finite), or None."""
    if args.steps < 1:
        return f"--steps {args.steps}: give at least 1 training step to compare"
    if args.world is not None and args.world < 1:
        return f"--world {args.world}: the layout needs at least 1 process (leave --world out to use tp*cp*pp*dp)"
    for name, value in (("--tol", args.tol), ("--atol", args.atol)):
        if not math.isfinite(value) or value < 0:
            return f"{name} {value:g}: a tolerance must be a finite number >= 0"
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        return f"--timeout {args.timeout:g}: give a positive number of seconds"
    return None


def main(argv: list[str] | None = None) -> None:
    """`python -m meshtron.verify <train.py overrides> [--steps N] [--tol X] ...`; exits with
    verify's status (0 PASS, 1 FAIL, 2 bad configuration)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", required=True)
        parser.add_argument("--rank", type=int, required=True)
        args = parser.parse_args(argv)
        from meshtron.training.distributed import release_process_groups

        status = worker_main(args.worker, args.rank)
        release_process_groups()  # gloo's workers end before the interpreter's shutdown
        sys.exit(status)
    parser = argparse.ArgumentParser(
        prog="python -m meshtron.verify",
        description="Run a parallel layout of a shrunk copy of the model beside one process and compare "
        "activations, gradients and weights step by step.",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps to compare (default 2)")
    parser.add_argument("--tol", type=float, default=1e-5, help="relative tolerance per tensor (default 1e-5)")
    parser.add_argument(
        "--atol",
        type=float,
        default=1e-9,
        help="absolute floor per element (RMS), for tensors that are ~0 (default 1e-9)",
    )
    parser.add_argument(
        "--world",
        type=int,
        default=None,
        help="processes (default: tp*cp*pp*dp, dp = parallel.dp or the least ep*etp needs)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="wall-clock limit of the layout's run, s")
    parser.add_argument("--inject-fault", choices=FAULTS, default=None, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    flags = [o for o in overrides if o.startswith("--")]
    if flags:
        say_one_line(
            f"meshtron verify: configuration error: unknown option {flags[0]}; options: --steps, --tol, "
            "--atol, --world, --timeout (the rest are train.py overrides)"
        )
        sys.exit(EXIT_CONFIG)
    bad = _bad_argument(args)
    if bad:
        say_one_line(f"meshtron verify: configuration error: {bad}")
        sys.exit(EXIT_CONFIG)
    sys.exit(
        verify(
            overrides,
            steps=args.steps,
            tol=args.tol,
            atol=args.atol,
            world=args.world,
            timeout_s=args.timeout,
            fault=args.inject_fault,
        )
    )


if __name__ == "__main__":
    main()
