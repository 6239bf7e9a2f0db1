"""Parallel == serial cases for multi-head latent attention (models/mla.py, model.attention=mla),
run inside one gloo world by the harness, as dense_cases' `check_layout`: the parallel model
and the serial one (world of one) get the same global batch; logits, loss, every gradient
(all-gathered to full shape) after the first step and every weight after 3 AdamW steps agree
to 1e-5 (relative, tensor-level).

The model: Llama-shaped, 2 layers, hidden 64, 4 heads, q rank 24 (or a plain q), kv rank 16,
nope 8, rope 4, v 12, YaRN with mscale (so the softmax scale is not the default one). At tp=2
the heads split 2 + 2, and the replicated down projections and latent norms get partial
gradients per rank that must be summed over tp (planted: dropping that tag fails the grads).
"""

from __future__ import annotations

from meshtron.models.config import GPTConfig
from tests.distributed.dense_cases import check_layout

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.8}


def mla_model_config(q_lora_rank: int | None = 24) -> GPTConfig:
    return GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        ffn_hidden_size=48,
        vocab_size=200,
        seq_len=16,
        tie_embeddings=False,
        attention="mla",
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        rope_theta=100.0,
        rope_scaling=YARN,
    )


def check_mla_layout(tp: int, sp: bool, micro: int = 1, q_lora_rank: int | None = 24, recompute: str = "none") -> None:
    """One layout (dp = world / tp) against the serial model, dense_cases.check_layout's checks."""
    check_layout("mla", tp, sp, micro, cfg=mla_model_config(q_lora_rank), recompute=recompute)


def mla_tp2_nosp() -> None:
    check_mla_layout(2, False)


def mla_tp2_sp() -> None:
    check_mla_layout(2, True)


def mla_tp2_sp_mb2_plain_q() -> None:
    check_mla_layout(2, True, micro=2, q_lora_rank=None)


def mla_tp2_sp_selective() -> None:
    check_mla_layout(2, True, recompute="selective")


def mla_tp2_nosp_full() -> None:
    check_mla_layout(2, False, recompute="full")


def mla_tp1_dp2() -> None:
    check_mla_layout(1, False)


def cases_for_world(world_size: int) -> list[str]:
    if world_size != 2:
        return []
    return [
        "mla_tp2_nosp",
        "mla_tp2_sp",
        "mla_tp2_sp_mb2_plain_q",
        "mla_tp2_sp_selective",
        "mla_tp2_nosp_full",
        "mla_tp1_dp2",
    ]
