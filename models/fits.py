"""Whether a layout can split a model: the model-shape rules of every parallel dimension, as
(holds, message) pairs whose messages name the numbers and the key to change.

They belong to the model (its heads, widths, layers and experts), not to the mesh: `build_mesh`
asks the config (`GPTConfig.layout_checks`, the `mpu.mesh.FitsLayout` protocol) and the
planner, the verifier and the run checks call `check_model_fits`.
"""

from __future__ import annotations

from typing import Protocol

from meshtron.mpu.mesh import ParallelConfig, ParallelConfigError, expert_shard_checks
from meshtron.rules import Check, raise_first


class ModelShape(Protocol):
    """What these rules read of a model config (models/config.py's GPTConfig, which imports
    this module: typed here by the fields, not by the class)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    seq_len: int
    num_experts: int
    moe_ffn_hidden_size: int
    shared_experts: int
    aux_loss_layers: str

    @property
    def attention_dropout_p(self) -> float: ...


def tensor_shard_checks(cfg: ModelShape, tp: int) -> list[Check]:
    """How the dense layers split over tp: attention heads, KV heads and the MLP's ffn dim."""
    return [
        (cfg.num_heads % tp == 0, f"tp={tp} does not divide num_heads={cfg.num_heads}; choose parallel.tp dividing it"),
        (
            cfg.num_kv_heads % tp == 0,
            f"tp={tp} does not divide num_kv_heads={cfg.num_kv_heads}; choose parallel.tp "
            "dividing it (or raise model.num_kv_heads)",
        ),
        (
            cfg.ffn_hidden_size % tp == 0,
            f"tp={tp} does not divide ffn_hidden_size={cfg.ffn_hidden_size}; choose parallel.tp dividing it",
        ),
    ]


def context_parallel_checks(par: ParallelConfig, cfg: ModelShape) -> list[Check]:
    """How a sequence splits over cp (x tp under SP): 2*cp load-balanced chunks (each cut into
    tp pieces under SP), heads for the all-to-all, and what context-parallel attention does
    not offer (attention dropout)."""
    if par.cp == 1:
        return []
    cp, tp = par.cp, par.tp
    split = 2 * cp * (tp if par.sp and tp > 1 else 1)
    heads = cfg.num_heads // tp if cfg.num_heads % tp == 0 else cfg.num_heads
    return [
        (
            cfg.seq_len % split == 0,
            f"parallel.cp={cp} needs model.seq_len={cfg.seq_len} divisible by 2*cp"
            + (
                f"*tp = {split} (sequence parallelism cuts each cp shard over tp={tp})"
                if split != 2 * cp
                else f" = {split}"
            )
            + "; change model.seq_len or parallel.cp",
        ),
        (
            par.cp_comm != "a2a" or heads % cp == 0,
            f"parallel.cp_comm=a2a needs the attention heads per tensor-parallel rank (num_heads/tp = {heads}) "
            f"divisible by cp={cp}; use parallel.cp_comm=ring or change parallel.cp",
        ),
        (
            cfg.attention_dropout_p == 0,
            f"parallel.cp={cp} with attention dropout {cfg.attention_dropout_p} (model.attention_dropout, which "
            "defaults to model.dropout): context-parallel attention has no attention dropout; set "
            "model.attention_dropout=0 (hidden dropout, model.dropout, stays)",
        ),
    ]


def pipeline_checks(par: ParallelConfig, cfg: ModelShape) -> list[Check]:
    """How the layers split into pp x vpp virtual stages (evenly, or as parallel.stage_layers lists)."""
    stages = par.pp * par.vpp
    if par.stage_layers is not None:
        listed = list(par.stage_layers)
        fits = len(listed) == stages and all(n >= 1 for n in listed) and sum(listed) == cfg.num_layers
        return [
            (
                fits,
                f"parallel.stage_layers={listed} must list {stages} positive layer counts "
                f"(pp*vpp={par.pp}*{par.vpp} virtual stages) summing to num_layers={cfg.num_layers}",
            )
        ]
    return [
        (
            par.pp == 1 or cfg.num_layers % stages == 0,
            f"pp*vpp={par.pp}*{par.vpp} does not divide num_layers={cfg.num_layers}; choose parallel.pp (and "
            "parallel.vpp) dividing it, or list layers per stage in parallel.stage_layers",
        ),
    ]


def expert_checks(par: ParallelConfig, cfg: ModelShape) -> list[Check]:
    """How the MoE layers split over ep, etp and pp (a non-MoE model takes ep = etp = 1)."""
    if not cfg.num_experts:
        return [
            (
                par.ep == 1 and par.etp == 1,
                f"parallel.ep={par.ep}/etp={par.etp} need an MoE model (model.num_experts > 0); set them to 1",
            )
        ]
    return [
        (
            cfg.aux_loss_layers != "pooled" or par.pp == 1,
            "model.aux_loss_layers=pooled pools the routing statistics of every MoE layer into one "
            f"loss, which parallel.pp={par.pp} stages do not share; use parallel.pp=1 or aux_loss_layers=sum",
        ),
        *expert_shard_checks(
            cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.shared_experts, ep=par.ep, etp=par.etp, tp=par.tp
        ),
    ]


def layout_checks(par: ParallelConfig, cfg: ModelShape) -> list[Check]:
    """Every rule the resolved layout `par` must meet to split `cfg`, in the order reported."""
    return [
        *tensor_shard_checks(cfg, par.tp),
        *context_parallel_checks(par, cfg),
        (
            not (par.sp and par.tp > 1) or cfg.seq_len % par.tp == 0,
            f"sequence parallelism needs tp={par.tp} to divide seq_len={cfg.seq_len}; change model.seq_len or parallel.tp",
        ),
        *pipeline_checks(par, cfg),
        (par.vpp == 1 or par.pp > 1, f"parallel.vpp={par.vpp} needs pipeline parallelism (parallel.pp > 1)"),
        *expert_checks(par, cfg),
    ]


def check_model_fits(par: ParallelConfig, cfg: ModelShape) -> None:
    """Raise ParallelConfigError (the first rule broken) when `par` cannot split `cfg`."""
    raise_first(layout_checks(par, cfg), ParallelConfigError)
